"""The device-resident round on the CPU: the batched client store, the on-device aggregation, vmap's automatic
chunking, the incremental checkpoint journal (also under kill -9), and the device and precision settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import SMOKE, no_wall, run_smoke, smoke_config
from torch import nn

from hafedho.config import ConfigError, load_config
from hafedho.core import WeightedMean
from hafedho.core.device import precision, resolve_device, tensor_precision
from hafedho.experiment import build
from hafedho.runfiles import RunDirError, read_metrics
from hafedho.runtime import checkpoint
from hafedho.runtime.store import DEVICE_SHARE, DISK_STORE_ABOVE, ClientStore, placement
from hafedho.runtime.work import CohortStream
from hafedho.sim.engines.make import engine_for
from hafedho.sim.runner import run

leaves_of = torch.utils._pytree.tree_leaves


def template() -> dict:
    return {"g": torch.arange(6.0).view(2, 3), "f": torch.tensor(0.5), "last": torch.tensor(-1, dtype=torch.int64)}


def stacked_states(ids: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = len(ids)
    return {
        "g": torch.randn(c, 2, 3, generator=g),
        "f": torch.randn(c, generator=g),
        "last": torch.tensor(ids, dtype=torch.int64) * 10,
    }


# ----------------------------------------------------------------------------- the batched store


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_gather_many_and_scatter_many_equal_client_by_client(tmp_path: Path, on_disk: bool) -> None:
    path = tmp_path / "s" if on_disk else None
    many, one = ClientStore(template(), 7, path), ClientStore(template(), 7)
    ids, new = [5, 0, 3], stacked_states([5, 0, 3], seed=1)
    many.scatter_many(ids, new)
    for j, cid in enumerate(ids):
        one.scatter(cid, {k: v[j] for k, v in new.items()})
    assert all(torch.equal(a, b) for a, b in zip(many.state_dict(), one.state_dict(), strict=True))
    got = many.gather_many([3, 6, 5])
    for j, cid in enumerate([3, 6, 5]):
        ref = one.gather(cid)
        assert all(torch.equal(got[k][j], ref[k]) for k in ref)
    assert many.take_dirty().tolist() == [0, 3, 5] and many.take_dirty().tolist() == []
    assert torch.equal(many.state_dict()[0][6], template()["g"])  # untouched rows keep the template


def test_a_state_of_the_wrong_shape_is_one_line() -> None:
    store = ClientStore(template(), 4)
    bad = {**stacked_states([1, 2], seed=0), "g": torch.zeros(2, 3, 2)}
    with pytest.raises(ValueError, match=r"tensor 0 has shape \(2, 3, 2\), expected \(2, 2, 3\)"):
        store.scatter_many([1, 2], bad)
    with pytest.raises(ValueError, match="same structure"):
        store.scatter(1, {"g": torch.zeros(2, 3)})


def test_placement_rule() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert placement("auto", 10, gpu, free=100) == "device"  # at most DEVICE_SHARE of the free memory
    assert placement("auto", int(DEVICE_SHARE * 100) + 1, gpu, free=100) == "memory"
    assert placement("auto", DISK_STORE_ABOVE + 1, gpu, free=100) == "disk"
    assert placement("auto", 10, cpu, free=0) == "memory" and placement("auto", DISK_STORE_ABOVE + 1, cpu, 0) == "disk"
    assert placement("device", 10, cpu, free=0) == "memory"  # the CPU's device is its RAM
    assert placement("disk", 10, gpu, free=100) == "disk" and placement("memory", 10**12, gpu, 100) == "memory"


# ----------------------------------------------------------------------------- the on-device aggregation


def test_add_stacked_equals_adding_one_client_at_a_time() -> None:
    """One float64 reduction per leaf over a stacked cohort, in blocks, gives the bits of c sequential adds
    (float32 uploads spanning 1e-6..1e2, integer weights: every float64 sum is exact) and the same metrics."""
    g = torch.Generator().manual_seed(0)
    c = 37
    uploads = {"w": torch.randn(c, 50, 3, generator=g) * torch.logspace(-6, 2, 50).view(1, 50, 1), "b": torch.randn(c)}
    weights = torch.randint(1, 500, (c,), generator=g).float()
    metrics = {"train/loss": torch.rand(c, generator=g) * 3}
    seq, stacked = WeightedMean(), WeightedMean()
    for j in range(c):
        seq.add({k: v[j] for k, v in uploads.items()}, weights[j])
    stacked.add_stacked({k: v[:20] for k, v in uploads.items()}, weights[:20])  # two chunks, as vmap runs them
    stacked.add_stacked({k: v[20:] for k, v in uploads.items()}, weights[20:])
    a, b = seq.result(), stacked.result()
    assert all(torch.equal(a[k], b[k]) for k in a) and stacked.count == c
    s1, s2 = (
        CohortStream(SimpleNamespace(new_aggregator=WeightedMean), c),
        CohortStream(SimpleNamespace(new_aggregator=WeightedMean), c),
    )
    for j in range(c):
        s1.add({k: v[j] for k, v in uploads.items()}, weights[j], {"train/loss": metrics["train/loss"][j]})
    s2.add_stacked(uploads, weights, metrics)
    r1, r2 = s1.result(), s2.result()
    assert r1.metrics == r2.metrics and r1.bytes_up == r2.bytes_up


def test_block_size_does_not_change_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    import hafedho.core.aggregate as agg

    u, w = {"w": torch.randn(9, 100)}, torch.arange(1.0, 10.0)
    one = WeightedMean()
    one.add_stacked(u, w)
    monkeypatch.setattr(agg, "BLOCK_ELEMENTS", 150)  # one client per block
    blocks = WeightedMean()
    blocks.add_stacked(u, w)
    assert torch.equal(one.result()["w"], blocks.result()["w"])


# ----------------------------------------------------------------------------- vmap's automatic chunking


def test_vmap_halves_a_chunk_that_runs_out_of_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cohort that does not fit in one call is halved until it does (one warning), never an error; the run
    equals the one chunked by hand."""
    from hafedho.sim.engines import vmap

    real, calls = vmap.VmapEngine._chunk, []

    def small_memory(self, fn, work, part, k, store):  # a device that fits 2 clients at once
        calls.append(len(part))
        if len(part) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, fn, work, part, k, store)

    monkeypatch.setattr(vmap.VmapEngine, "_chunk", small_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    warned: list[str] = []
    engine = vmap.VmapEngine(warn=warned.append)
    exp = build(smoke_config(tmp_path, "sampling.cohort_size=5", "rounds=2"))
    monkeypatch.setattr("hafedho.sim.runner.engine_for", lambda cfg, device: engine)
    run(exp, tmp_path / "auto", progress=False)
    assert calls[:3] == [5, 2, 2] and len(warned) == 1 and "chunks of 2" in warned[0]
    assert engine.fits is None  # closed with the run
    monkeypatch.undo()
    ref = build(smoke_config(tmp_path, "sampling.cohort_size=5", "rounds=2", "engine=vmap", "vmap_chunk=2"))
    run(ref, tmp_path / "manual", progress=False)
    assert no_wall(read_metrics(tmp_path / "auto")) == no_wall(read_metrics(tmp_path / "manual"))


def test_a_run_that_does_not_fit_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With vmap_chunk set, nothing is halved: the out-of-memory error ends the run in one line naming the fixes."""
    from hafedho.sim.engines import vmap

    def no_memory(self, fn, work, part, k, store):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    monkeypatch.setattr(vmap.VmapEngine, "_chunk", no_memory)
    cfg = smoke_config(tmp_path, "engine=vmap", "vmap_chunk=3")
    with pytest.raises(ConfigError, match=r"out of GPU memory on cpu: run fewer runs .*sweep --jobs.*vmap_chunk"):
        run(build(cfg), tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()  # a run that never logged a row leaves no directory


# ----------------------------------------------------------------------------- the checkpoint journal

JOURNAL = ("rounds=8", "checkpoint_every=2", "data.num_clients=10", "sampling.cohort_size=2", "--quiet")


def run_dir_of(out: Path) -> Path:
    (d,) = [p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return d


def test_a_checkpoint_writes_only_the_clients_that_trained(tmp_path: Path) -> None:
    """Deltas hold the rows scattered since the last checkpoint; once they would exceed N rows, a base (a full
    copy) replaces them; files no checkpoint names are removed; the store read back is the run's."""
    assert run_smoke(tmp_path, "rounds=4", *JOURNAL[1:]) == 0
    d = run_dir_of(tmp_path)
    ckpt = torch.load(d / "checkpoint.pt", weights_only=True)
    journal = ckpt["extra"]["store_journal"]
    assert journal == {"base": None, "deltas": ["delta_r2.pt", "delta_r4.pt"], "rows": journal["rows"]}
    exp = build(load_config(SMOKE, [a for a in JOURNAL if a != "--quiet"]))
    for name, rounds in (("delta_r2.pt", (1, 2)), ("delta_r4.pt", (3, 4))):
        ids = torch.load(d / "store" / name, weights_only=True)["ids"].tolist()
        assert ids == sorted({int(c) for t in rounds for c in exp.cohort(t)})  # the cohorts', nothing else
    assert journal["rows"] <= 8
    assert run_smoke(tmp_path, "rounds=8", *JOURNAL[1:], "--resume") == 0
    journal = torch.load(d / "checkpoint.pt", weights_only=True)["extra"]["store_journal"]
    assert journal["base"] is not None and journal["rows"] <= 10  # compacted once the deltas passed N rows
    assert sorted(p.name for p in (d / "store").iterdir()) == sorted([journal["base"], *journal["deltas"]])
    assert run_smoke(tmp_path / "ref", *JOURNAL) == 0  # uninterrupted, same store
    ref = run_dir_of(tmp_path / "ref")
    for a, b in zip(checkpoint.stored_clients(ref), checkpoint.stored_clients(d), strict=True):
        assert torch.equal(a, b)


def test_a_corrupt_or_linked_journal_is_one_line(tmp_path: Path) -> None:
    assert run_smoke(tmp_path, "rounds=4", *JOURNAL[1:]) == 0
    d = run_dir_of(tmp_path)
    delta = d / "store" / "delta_r4.pt"
    good = delta.read_bytes()
    delta.write_bytes(good[: len(good) // 2])  # torn
    with pytest.raises(RunDirError, match=r"delta_r4.pt: client-store file missing or corrupt.*--force"):
        checkpoint.stored_clients(d)
    payload = torch.load(d / "store" / "delta_r2.pt", weights_only=True)
    payload["ids"] = payload["ids"] + 100  # clients this run does not have
    torch.save(payload, delta)
    with pytest.raises(RunDirError, match="not a client-store file of this run"):
        checkpoint.stored_clients(d)
    delta.write_bytes(good)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (d / "store").rename(outside / "store")
    (d / "store").symlink_to(outside / "store")
    with pytest.raises(RunDirError, match="is a link or a file"):
        checkpoint.capture(d, 6, {}, ClientStore(template(), 3), checkpoint.Journal(), {})


KILLER = """
import os, sys
from hafedho.runtime import checkpoint
calls, kill_at = [0], int(sys.argv[1])
real = checkpoint.os.replace
def replace(a, b):
    calls[0] += 1
    if calls[0] == kill_at:
        os._exit(9)  # as kill -9 here: between a file written in full and its rename into place
    return real(a, b)
checkpoint.os.replace = replace
import hafedho.runfiles as runfiles
runfiles.os.replace = replace  # checkpoint.pt and every other atomic write of the run
from hafedho.cli import main
sys.exit(main(["run", "smoke", *sys.argv[2:]]))
"""


# os.replace calls: 1-4 the run's files (config, env, partition, run.json); then per round a delta and checkpoint.pt
# (5 and 6 in round 1, 4 + 2t - 1 and 4 + 2t in round t); round 6 writes a base instead of a delta (15).
@pytest.mark.parametrize("kill_at", [5, 8, 15], ids=["first-delta", "checkpoint-after-delta", "base"])
def test_kill_9_inside_a_checkpoint_then_resume_is_bit_identical(tmp_path: Path, kill_at: int) -> None:
    """The process dies between a journal or checkpoint file being written and being renamed into place (the
    riskiest moments: a delta without its checkpoint, a base without its checkpoint, a checkpoint without its
    predecessor's files pruned); --resume then ends exactly where an uninterrupted run ends."""
    args = [*JOURNAL, "checkpoint_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = tmp_path / "killer.py"
    script.write_text(textwrap.dedent(KILLER))
    out = ["--out", str(tmp_path / "b")]
    killed = subprocess.run([sys.executable, str(script), str(kill_at), *args, *out], env=env, capture_output=True)
    assert killed.returncode == 9
    resumed = subprocess.run([sys.executable, str(script), "0", *args, *out, "--resume"], env=env, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert run_smoke(tmp_path / "a", *args) == 0
    a, b = run_dir_of(tmp_path / "a"), run_dir_of(tmp_path / "b")
    assert no_wall(read_metrics(a)) == no_wall(read_metrics(b))
    sa, sb = (torch.load(x / "checkpoint.pt", weights_only=True)["server"] for x in (a, b))
    assert all(torch.equal(x, y) for x, y in zip(sa, sb, strict=True))
    for x, y in zip(checkpoint.stored_clients(a), checkpoint.stored_clients(b), strict=True):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- device, engine and precision


def test_device_settings_are_checked_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"device='gpu': choose auto, cpu, cuda or cuda:N"):
        load_config(SMOKE, ["device=gpu"])
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda:1")
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            run(build(smoke_config(tmp_path, "device=cuda")), tmp_path / "r", progress=False)
        assert not (tmp_path / "r").exists()


def test_an_unset_engine_is_the_devices_and_process_stays_on_the_cpu() -> None:
    cfg = load_config(SMOKE, [])
    assert cfg.engine is None and engine_for(cfg).name == "loop"
    assert engine_for(cfg, torch.device("cuda", 0)).name == "vmap"
    cfg = load_config(SMOKE, ["engine=process"])
    with pytest.raises(ConfigError, match="engine='process' runs its workers on the CPU"):
        engine_for(cfg, torch.device("cuda", 0))


class FlagProbe(nn.Module):
    """A linear model that records the TF32 flags each forward runs under."""

    seen: typing.ClassVar[set[tuple[bool, bool]]] = set()

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FlagProbe.seen.add((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return self.fc(x.flatten(1))


@pytest.mark.parametrize(("policy", "flags"), [("fp32", (False, False)), ("tf32", (True, True))])
def test_precision_sets_the_flags_for_the_run_and_restores_them(tmp_path: Path, policy: str, flags: tuple) -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    cfg = smoke_config(tmp_path, f"precision={policy}", "rounds=1")
    exp = build(cfg, module=FlagProbe)
    FlagProbe.seen = set()  # the run's forwards, not build's check of the model's output (before any precision)
    run(exp, tmp_path / "r", progress=False)
    assert FlagProbe.seen == {flags}  # every forward: steps, evaluation, the start-loss guard
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    assert json.loads((tmp_path / "r" / "run.json").read_text())["precision"] == policy
    with precision("tf32"):
        assert tensor_precision() == "tf32"
    assert tensor_precision() == ("tf32" if any(before) else "fp32")


def test_precision_is_part_of_the_identity_only_when_not_the_default() -> None:
    plain, fp32, tf32 = (load_config(SMOKE, o) for o in ([], ["precision=fp32"], ["precision=tf32"]))
    assert plain.run_name == fp32.run_name != tf32.run_name  # committed fp32 runs keep their names
    with pytest.raises(ConfigError, match="precision='bf16'"):
        load_config(SMOKE, ["precision=bf16"])


def test_the_first_line_says_where_the_run_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hafedho.cli import main

    assert main(["run", "smoke", "rounds=1", "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().out.strip().splitlines()[0]
    name = load_config(SMOKE, ["rounds=1"]).run_name
    assert first.startswith(f"{name}: device cpu, engine loop, precision fp32, client store ")
    facts = json.loads((tmp_path / name / "run.json").read_text())
    assert (facts["device"], facts["engine"], facts["client_store"]) == ("cpu", "loop", "memory")


def test_a_run_resumed_from_a_checkpoint_without_a_journal(tmp_path: Path) -> None:
    """Checkpoints of earlier versions hold the whole store inline: resume reads them, and the next checkpoint
    writes a base (the journal has nothing yet)."""
    assert run_smoke(tmp_path / "a", *JOURNAL) == 0
    assert run_smoke(tmp_path / "b", "rounds=4", *JOURNAL[1:]) == 0
    d = run_dir_of(tmp_path / "b")
    payload = torch.load(d / "checkpoint.pt", weights_only=True)
    store = checkpoint.stored_clients(d)
    extra = {k: v for k, v in payload["extra"].items() if not k.startswith("store_")}
    torch.save(
        {"round": payload["round"], "server": payload["server"], "store": store, "extra": extra}, d / "checkpoint.pt"
    )
    for p in (d / "store").iterdir():
        p.unlink()
    assert run_smoke(tmp_path / "b", *JOURNAL, "--resume") == 0
    assert no_wall(read_metrics(run_dir_of(tmp_path / "a"))) == no_wall(read_metrics(d))
    a = checkpoint.stored_clients(run_dir_of(tmp_path / "a"))
    assert all(torch.equal(x, y) for x, y in zip(a, checkpoint.stored_clients(d), strict=True))
    assert np.all([p.name.startswith(("base_r", "delta_r")) for p in (d / "store").iterdir()])
