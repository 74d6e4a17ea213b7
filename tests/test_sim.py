"""Simulator: cohort sampling, client store, batch plans, the round loop, resume, divergence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMOKE, no_wall, smoke_config

from hafedho.config import load_config
from hafedho.core.sampling import bernoulli_cohort, fixed_cohort
from hafedho.data.federated import BatchPlan, plan_indices
from hafedho.experiment import build
from hafedho.runfiles import RunDirError, read_metrics
from hafedho.runtime import checkpoint
from hafedho.runtime.checkpoint import stored_clients
from hafedho.runtime.store import ClientStore
from hafedho.sim.runner import Divergence, run


def test_fixed_cohorts_are_pure_functions_of_seed_and_round() -> None:
    a = fixed_cohort(0, 3, 100, 10)
    assert np.array_equal(a, fixed_cohort(0, 3, 100, 10))
    assert len(set(a.tolist())) == 10 and np.all(np.diff(a) > 0)
    assert not np.array_equal(a, fixed_cohort(0, 4, 100, 10))
    assert not np.array_equal(a, fixed_cohort(1, 3, 100, 10))


def test_bernoulli_participation_rate_and_empty_rounds() -> None:
    sizes = [len(bernoulli_cohort(0, t, 1000, 0.05)) for t in range(1, 201)]
    assert 45 < np.mean(sizes) < 55
    assert any(len(bernoulli_cohort(0, t, 10, 0.01)) == 0 for t in range(1, 20))


@pytest.mark.parametrize("on_disk", [False, True])
def test_store_gathers_and_scatters_only_the_cohort(tmp_path: Path, on_disk: bool) -> None:
    template = ({"w": torch.zeros(3)}, torch.tensor(-1))
    store = ClientStore(template, 5, tmp_path / "store" if on_disk else None)
    store.scatter(2, ({"w": torch.ones(3)}, torch.tensor(7)))
    g, r = store.gather(2)
    assert torch.equal(g["w"], torch.ones(3)) and int(r) == 7
    g["w"].add_(5)  # a gathered state is a copy: mutating it leaves the store untouched
    assert torch.equal(store.gather(2)[0]["w"], torch.ones(3))
    for other in (0, 1, 3, 4):
        assert torch.equal(store.gather(other)[0]["w"], torch.zeros(3)) and int(store.gather(other)[1]) == -1
    if on_disk:
        assert (tmp_path / "store" / "leaf0.npy").stat().st_size >= 5 * 3 * 4


def test_batch_plan_steps_mode_covers_each_example_once_per_pass() -> None:
    pos, mask = plan_indices(np.random.default_rng(0), 20, BatchPlan(local_steps=4, batch_size=5))
    assert pos.shape == (4, 5) and mask.all()
    assert sorted(pos.ravel().tolist()) == list(range(20))


def test_batch_plan_small_client_is_padded_and_masked() -> None:
    pos, mask = plan_indices(np.random.default_rng(0), 3, BatchPlan(local_steps=2, batch_size=5))
    assert pos.shape == (2, 5)
    assert mask.sum(1).tolist() == [3.0, 3.0] and mask[:, 3:].sum() == 0
    assert sorted(pos[0, :3].tolist()) == [0, 1, 2]


def test_batch_plan_epochs_mode() -> None:
    pos, mask = plan_indices(np.random.default_rng(0), 7, BatchPlan(local_steps=1, batch_size=3, local_epochs=2))
    assert pos.shape == (6, 3) and mask.sum() == 14
    for e in range(2):
        seen = pos[3 * e : 3 * e + 3][mask[3 * e : 3 * e + 3] > 0]
        assert sorted(seen.tolist()) == list(range(7))


RESUMABLE = ("rounds=6", "checkpoint_every=1")  # the smoke config, six rounds, a checkpoint after each


@pytest.mark.parametrize("alg", ["hafedho", "fedavg"])
def test_resume_after_stop_is_bit_identical(tmp_path: Path, alg: str) -> None:
    full = smoke_config(tmp_path / "a", *RESUMABLE, f"algorithm.name={alg}")
    run(build(full), tmp_path / "a" / "run", progress=False)
    part = smoke_config(tmp_path / "b", *RESUMABLE, f"algorithm.name={alg}", "rounds=3")
    run(build(part), tmp_path / "b" / "run", progress=False)
    rest = smoke_config(tmp_path / "b", *RESUMABLE, f"algorithm.name={alg}")
    run(build(rest), tmp_path / "b" / "run", resume=True, progress=False)
    assert no_wall(read_metrics(tmp_path / "a" / "run")) == no_wall(read_metrics(tmp_path / "b" / "run"))
    a, b = (final_state(tmp_path / x / "run") for x in "ab")
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_resume_after_sigkill_is_bit_identical(tmp_path: Path) -> None:
    """A real process is killed mid-run (SIGKILL, no cleanup) and resumed from its last checkpoint."""
    args = ["smoke", "rounds=40", "checkpoint_every=3", "--quiet"]
    cli = [sys.executable, "-m", "hafedho.cli", "run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cli, *args, "--out", str(tmp_path / "a")], check=True, env=env, capture_output=True)
    proc = subprocess.Popen([*cli, *args, "--out", str(tmp_path / "b")], env=env, stderr=subprocess.DEVNULL)
    name = load_config(SMOKE, args[1:3]).run_name
    metrics = tmp_path / "b" / name / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 8):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "b" / name / "done").exists(), "the run finished before it was killed"
    subprocess.run([*cli, *args, "--out", str(tmp_path / "b"), "--resume"], check=True, env=env, capture_output=True)
    a = no_wall(read_metrics(tmp_path / "a" / name))
    b = no_wall(read_metrics(tmp_path / "b" / name))
    assert len(a) == 40 and a == b


def test_divergence_stops_with_message_and_keeps_last_checkpoint(tmp_path: Path) -> None:
    """lambda*mu = 3 * 50 >> 1: the literal HaFedHo recursion explodes after a good round (caught by the early
    blow-up guard or as non-finite, whichever comes first)."""
    cfg = smoke_config(tmp_path, *RESUMABLE, "rounds=40", "algorithm.hafedho.mu=50.0")
    exp = build(cfg)
    with pytest.raises(Divergence) as err:
        run(exp, tmp_path / "run", progress=False)
    msg = str(err.value)
    bad = int(msg.split("round ")[1].split(":")[0])
    assert bad >= 2 and f"last good checkpoint: round {bad - 1} in" in msg and "\n" not in msg
    assert (tmp_path / "run" / "diverged").exists() and not (tmp_path / "run" / "done").exists()
    done_round, server, _, _ = checkpoint.load(
        tmp_path / "run" / "checkpoint.pt", exp.alg.init_server(exp.model.params())
    )
    assert done_round == bad - 1 and all(torch.isfinite(v).all() for v in server.params.values())
    assert len(read_metrics(tmp_path / "run")) == bad - 1
    assert "lambda*mu = 3*50.0 = 150 >= 1" in json.loads((tmp_path / "run" / "run.json").read_text())["warnings"][0]


def test_an_early_blow_up_is_diverged_naming_the_lr(tmp_path: Path) -> None:
    """lr = 10 on the smoke logreg: round 1's mean local loss (13.2) is finite but over 2x the initial model's
    (2.40, ln 10 = 2.30), so the run stops there as diverged and the one line names the lr; lr = 0.1 passes."""
    from hafedho.runtime.rounds import BLOWUP_FACTOR, BLOWUP_ROUNDS, ServerRounds

    cfg = smoke_config(tmp_path, *RESUMABLE, "rounds=3", "algorithm.name=fedavg", "algorithm.lr=10.0")
    exp = build(cfg)
    with pytest.raises(Divergence) as err:
        run(exp, tmp_path / "run", progress=False)
    msg = str(err.value)
    assert msg.startswith("run diverged at round 1: the mean local loss ") and "\n" not in msg
    assert "algorithm.lr = 10, or a coefficient of the algorithm, is too large here: lower it" in msg
    assert "last good checkpoint: none" in msg
    assert (tmp_path / "run" / "diverged").read_text().strip() == msg and len(read_metrics(tmp_path / "run")) == 0
    start = ServerRounds(exp, exp.alg.init_server(exp.model.params()), None).start_loss()
    assert 2.0 < start < 3.0  # a fresh 10-class classifier: about ln 10
    assert BLOWUP_FACTOR == 2.0 and BLOWUP_ROUNDS == 10  # the documented rule (README, Running experiments)
    ok = smoke_config(tmp_path, *RESUMABLE, "rounds=3", "algorithm.name=fedavg")
    assert run(build(ok), tmp_path / "ok", progress=False)["round"] == 3


def test_existing_run_dir_needs_resume_or_force(tmp_path: Path) -> None:
    cfg = smoke_config(tmp_path, *RESUMABLE, "rounds=1")
    run(build(cfg), tmp_path / "run", progress=False)
    with pytest.raises(RunDirError, match="holds a finished run; pass --resume to continue it or --force"):
        run(build(cfg), tmp_path / "run", progress=False)
    other = smoke_config(tmp_path, *RESUMABLE, "rounds=1", "algorithm.hafedho.mu=0.5")
    with pytest.raises(RunDirError, match=r"holds another experiment \(differs in: algorithm.mu\)"):
        run(build(other), tmp_path / "run", resume=True, progress=False)
    run(build(other), tmp_path / "run", force=True, progress=False)


def test_empty_bernoulli_round_is_logged_and_changes_nothing(tmp_path: Path) -> None:
    cfg = smoke_config(tmp_path, *RESUMABLE, "rounds=3", "sampling.mode='bernoulli'", "sampling.prob=0.0001")
    run(build(cfg), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["cohort_size"] for r in rows] == [0, 0, 0]
    assert rows[0]["test/acc"] == rows[-1]["test/acc"] and rows[0]["bytes_up"] == 0


def test_run_directory_contents(tmp_path: Path) -> None:
    cfg = smoke_config(tmp_path, *RESUMABLE, "rounds=2")
    run(build(cfg), tmp_path / "run", progress=False)
    d = tmp_path / "run"
    for name in ("config.toml", "env.json", "metrics.jsonl", "partition.json", "run.json", "checkpoint.pt", "done"):
        assert (d / name).exists(), name
    part = json.loads((d / "partition.json").read_text())
    assert len(part["hash"]) == 16 and sum(part["sizes"]) == 1437 and part["num_clients"] == 10
    row = read_metrics(d)[-1]
    for key in ("round", "test/acc", "test/loss", "train/loss", "wall_s", "bytes_up", "bytes_down", "cohort_size"):
        assert key in row
    assert json.loads((d / "run.json").read_text())["notes"]["lambda_mu"] == pytest.approx(0.03)


def final_state(run_dir: Path) -> list[torch.Tensor]:
    """The server state and the whole client store of the checkpoint in ``run_dir``."""
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    return [*ckpt["server"], *stored_clients(run_dir)]


def test_disk_client_store_resume_is_bit_identical(tmp_path: Path) -> None:
    """Per-client state memory-mapped on disk (the 3,400-client FEMNIST path), journaled at checkpoints."""
    run(
        build(smoke_config(tmp_path / "a", *RESUMABLE, "client_store='memory'")), tmp_path / "a" / "run", progress=False
    )
    run(
        build(smoke_config(tmp_path / "b", *RESUMABLE, "client_store='disk'", "rounds=4")),
        tmp_path / "b" / "run",
        progress=False,
    )
    b = tmp_path / "b" / "run"
    assert (b / "client_store" / "leaf0.npy").exists() and any((b / "store").iterdir())
    run(build(smoke_config(tmp_path / "b", *RESUMABLE, "client_store='disk'")), b, resume=True, progress=False)
    assert no_wall(read_metrics(tmp_path / "a" / "run")) == no_wall(read_metrics(b))
    a, b = final_state(tmp_path / "a" / "run"), final_state(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_client_without_samples_is_a_config_error() -> None:
    from hafedho.config import ConfigError
    from hafedho.data.federated import FederatedData

    x, y = np.zeros((4, 2), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ConfigError, match="client 1 has no training samples"):
        FederatedData(x, y, x, y, [np.arange(4), np.array([], dtype=np.int64)])


def test_any_user_module_runs_in_the_reference_engine(tmp_path: Path) -> None:
    """A plain nn.Module (no return_features, BatchNorm included) passed through the Python API."""
    from torch import nn

    def module() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    exp = build(smoke_config(tmp_path, *RESUMABLE, "rounds=2", "algorithm.name=fedavg"), module=module)
    last = run(exp, tmp_path / "run", progress=False)
    assert last["round"] == 2 and 0.0 <= last["test/acc"] <= 1.0
