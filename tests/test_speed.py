"""What makes a run cheaper must not change what it computes: the pass sizing rule, chunked evaluation, the
full-data pass's blocks, the runner's threads for its own passes and the in-memory data memo of sweep workers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures_data import make_leaf_dir
from helpers import SMOKE
from tolerance import EPS, LAMBDA
from torch import nn

from hafedho.config import load_config
from hafedho.core import sizing
from hafedho.core.model import FunctionalModel, evaluate
from hafedho.data import cache
from hafedho.models.cnn import LeNet5
from hafedho.sim.engines.loop import LoopEngine
from hafedho.sim.engines.process import ProcessEngine
from hafedho.sim.fullgrad import _block
from hafedho.sim.runner import server_threads
from hafedho.sweep.execute import run_spec


def test_activation_bytes_counts_what_autograd_saves_but_no_parameters() -> None:
    # per row: Linear's input (10 floats) and ReLU's output (20), which is also the module's output (counted once);
    # Linear's weight is saved too, but it is a parameter
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU())
    assert sizing.activation_bytes(model, (10,), torch.float32) == (10 + 20) * 4
    assert sizing.activation_bytes(model.double(), (10,), torch.float64) == (10 + 20) * 8
    frozen = nn.Sequential(nn.Linear(10, 20)).requires_grad_(False)  # nothing saved: only the output counts
    assert sizing.activation_bytes(frozen, (10,), torch.float32) == 20 * 4


def test_rows_per_pass_fits_half_the_last_level_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU())  # 120 bytes a row
    monkeypatch.setattr(sizing, "last_level_cache_bytes", lambda: 2 * 120 * 100)
    assert sizing.rows_per_pass(model, (10,), torch.float32) == 96  # 100 rows, down to a multiple of 8
    monkeypatch.setattr(sizing, "last_level_cache_bytes", lambda: 2 * 120 * 3)
    assert sizing.rows_per_pass(model, (10,), torch.float32) == 8  # never fewer than 8
    monkeypatch.setattr(sizing, "last_level_cache_bytes", lambda: 2**40)
    assert sizing.rows_per_pass(model, (10,), torch.float32) == sizing.MAX_ROWS

    class Picky(nn.Module):  # a user module that refuses the probe's zero rows
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("wants real data")

    assert sizing.rows_per_pass(Picky(), (10,), torch.float32) == sizing.MAX_ROWS


def test_last_level_cache_is_read_or_falls_back() -> None:
    size = sizing.last_level_cache_bytes()
    assert size >= 256 * 1024 and size % 1024 == 0
    assert sizing._bytes("32768K") == 32 * 1024**2 and sizing._bytes("1M") == 1024**2 and sizing._bytes("512") == 512


def test_chunked_evaluation_changes_accuracy_only_at_near_ties_and_loss_within_the_float32_bound() -> None:
    torch.manual_seed(0)
    model = FunctionalModel(LeNet5((1, 28, 28), 62, projection=0))
    params = model.params()
    x, y = torch.randn(1500, 1, 28, 28), torch.randint(0, 62, (1500,))
    with torch.no_grad():
        model.module.eval()
        logits = model.logits(params, x).double()  # one pass, float64 from float32 logits: the reference
    ref_loss = float(F.cross_entropy(logits, y, reduction="sum")) / len(y)
    top2 = logits.topk(2, dim=1).values
    # a near-tie: the top two logits closer than the float32 bound of a logit (a fan-in-400 reduction)
    near = (top2[:, 0] - top2[:, 1]) <= 2 * LAMBDA * EPS * math.sqrt(400) * logits.abs().amax(1)
    ref_correct = logits.argmax(1) == y
    chunk = model.rows_per_pass((1, 28, 28), torch.float32)
    for batch_size in (None, 7, 1024, 1500):
        ev = evaluate(model, params, x, y, batch_size=batch_size)
        assert abs(ev["acc"] - float(ref_correct.double().mean())) * len(y) <= int(near.sum())
        # per-example losses of float32 logits summed in float64: each within the logits' float32 bound
        tol = 2 * LAMBDA * EPS * math.sqrt(400) * float(logits.abs().amax(1).mean()) * 2
        assert abs(ev["loss"] - ref_loss) <= tol, (batch_size, chunk)


def test_full_pass_blocks_are_equal_and_at_most_the_rule() -> None:
    assert [_block(n, 200) for n in (1, 199, 200, 201, 1000, 1001)] == [1, 199, 200, 101, 200, 167]
    for n in range(1, 700, 37):
        b = _block(n, 64)
        assert b <= 64 and math.ceil(n / b) * b - n < math.ceil(n / b)  # padding under one row per block


def test_runner_evaluates_on_the_cores_that_process_workers_leave_idle() -> None:
    before = torch.get_num_threads()
    assert server_threads(LoopEngine()) == before
    cores = len(os.sched_getaffinity(0))
    assert server_threads(ProcessEngine(workers=cores)) == max(before, cores)
    assert server_threads(ProcessEngine(workers=cores + 5)) == max(before, cores)  # never more than there are


def test_memo_serves_read_only_arrays_and_sees_a_replaced_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAFEDHO_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "source.bin"
    src.write_bytes(b"one")
    calls = []

    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"x": np.frombuffer(src.read_bytes(), dtype=np.uint8).copy()}

    first, hit1 = cache.cached("test", src, "", build)
    second, hit2 = cache.cached("test", src, "", build)
    assert (hit1, hit2, len(calls)) == (False, True, 1)
    assert second["x"] is first["x"] and not second["x"].flags.writeable
    with pytest.raises(ValueError):
        second["x"][0] = 0  # no run can change the data another run of the same worker sees
    src.write_bytes(b"two!")
    os.utime(src, ns=(1, 1))
    third, _ = cache.cached("test", src, "", build)
    assert len(calls) == 2 and bytes(third["x"]) == b"two!"


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"} for line in (run_dir / "metrics.jsonl").open()]


def test_a_warm_worker_computes_a_run_as_a_cold_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep worker runs many runs in one process, with the decoded data in memory: a run's metrics are the
    same whether it runs first or after another run (other algorithm, model and engine) in the same process."""
    monkeypatch.setenv("HAFEDHO_CACHE_DIR", str(tmp_path / "cache"))
    data = make_leaf_dir(tmp_path / "leaf")
    monkeypatch.setattr(cache, "_MEMO", type(cache._MEMO)())
    common = [f"data.path={data}", "data.source=femnist", "data.partition=natural", "data.num_clients=0"]
    common += ["model.name=lenet5", "clients.local_steps=2", "clients.batch_size=4", "sampling.cohort_size=2"]
    cfg_b = load_config(SMOKE, [*common, "algorithm.name=hafedho", "algorithm.lr=0.02", "rounds=3"])
    cfg_a = load_config(SMOKE, [*common, "algorithm.name=fedavg", "algorithm.lr=0.05", "rounds=2"])
    assert run_spec(cfg_b, str(tmp_path / "cold")).status == "done"  # first in this process: decodes the data
    assert run_spec(cfg_a, str(tmp_path / "other")).status == "done"
    assert run_spec(dataclasses.replace(cfg_b), str(tmp_path / "warm")).status == "done"  # data from memory
    assert len(cache._MEMO) == 1
    assert _rows(tmp_path / "warm") == _rows(tmp_path / "cold")


def _compile_run(tmp_path: Path, name: str, mode: str) -> Path:
    from hafedho.cli import main

    out = tmp_path / name
    assert main(["run", str(SMOKE), "--out", str(out), "--quiet", f"compile={mode}", "model.name=mlp"]) in (0, None)
    (run_dir,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return run_dir


def test_compile_falls_back_to_eager_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    eager = _compile_run(tmp_path, "eager", "off")

    def unavailable(fn, **kwargs):
        def call(*args):
            raise RuntimeError("InductorError: no working C++ compiler found\nmore lines")

        return call

    monkeypatch.setattr(torch, "compile", unavailable)
    capsys.readouterr()
    fallback = _compile_run(tmp_path, "fallback", "all")
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "warning" in line]
    assert lines == [
        "warning: compile: torch.compile is unavailable here (RuntimeError: InductorError: no working C++ compiler "
        "found); running eager"
    ]
    assert _rows(fallback) == _rows(eager)  # eager from the first call on: the same bits
    assert fallback.name == eager.name  # a runtime setting: never part of the run's identity


@pytest.mark.slow
def test_compiled_local_steps_and_evaluation_agree_with_eager_within_the_float32_bound() -> None:
    """A real torch.compile (minutes on a cold cache): local steps and evaluation of a smoothed LeNet-5."""
    from tolerance import fp32_close, longest_reduction, smooth

    from hafedho.core.local import local_train, plain_objective, sgd
    from hafedho.core.types import ClientData

    torch.manual_seed(0)
    model = FunctionalModel(smooth(LeNet5((1, 28, 28), 62)))
    params = model.params()
    steps, x = 3, torch.randn(3, 20, 1, 28, 28)
    data = ClientData(x, torch.randint(0, 62, (3, 20)), torch.ones(3, 20))
    test_x, test_y = torch.randn(300, 1, 28, 28), torch.randint(0, 62, (300,))
    eager = local_train(plain_objective(model), params, data, sgd(0.1))
    eager_ev = evaluate(model, params, test_x, test_y)
    model.use_compile("all", on_fallback=lambda text: pytest.fail(text))
    compiled = local_train(plain_objective(model), params, data, sgd(0.1))
    compiled_ev = evaluate(model, params, test_x, test_y)
    fp32_close(compiled.params, eager.params, reduction=longest_reduction(model.module, x[0]), steps=steps)
    assert abs(compiled_ev["loss"] - eager_ev["loss"]) <= 1e-5 * eager_ev["loss"]
