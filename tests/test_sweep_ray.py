"""Sweeps on Ray (``hafedho sweep --backend ray``): the same runs, index and metrics as the local backend; the
options refused in one line; a worker node killed mid-sweep on a real two-node cluster on loopback (slow:
``pytest -m slow tests/test_sweep_ray.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import no_wall
from test_sweep import tiny

from hafedho.cli import main
from hafedho.config import ConfigError
from hafedho.flower.procs import Service, descendants, free_port
from hafedho.runfiles import read_metrics
from hafedho.runtime.rundir import RUN_FILES
from hafedho.sweep.execute import run_spec
from hafedho.sweep.expand import expand
from hafedho.sweep.presets import load_preset

pytest.importorskip("ray")


@pytest.fixture
def ray_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short, private temp folder for Ray (its socket paths must stay under 108 characters; /tmp/ray is shared
    with every other Ray on the machine); no RAY_ADDRESS, no usage stats. Afterwards no Ray process that used it
    may be left running."""
    folder = Path(tempfile.mkdtemp(prefix="hfray", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        yield folder
    finally:
        left = _left_after(folder, 30)
        for pid in left:  # ended by pid; the assertion below still fails the test
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        assert not left, f"Ray processes outlived the test: {left}"


def _processes_using(folder: Path) -> list[int]:
    """Pids of the processes that name ``folder`` in their command line (Ray's services) or have it as their
    RAY_TMPDIR (Ray's workers, whose titles like ``ray::IDLE`` replace their command lines)."""
    marks = (str(folder).encode(), f"RAY_TMPDIR={folder}\0".encode())
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
            except OSError:
                continue
            if marks[0] in cmdline or marks[1] in environ:
                out.append(int(entry.name))
    return out


def _left_after(folder: Path, timeout: float) -> list[int]:
    """``_processes_using(folder)`` once they have had ``timeout`` seconds to exit (a stopped Ray's take a moment)."""
    deadline = time.monotonic() + timeout
    while _processes_using(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _processes_using(folder)


def _compare_with_local(local: Path, on_ray: Path, preset: str) -> list[str]:
    """The same run directories, index and metrics (``wall_s`` aside); returns the run names."""
    names = sorted(p.name for p in local.iterdir() if not p.name.startswith(".") and p.name != "sweeps")
    assert names and names == sorted(
        p.name for p in on_ray.iterdir() if not p.name.startswith(".") and p.name != "sweeps"
    )
    assert json.loads((local / "sweeps" / f"{preset}.json").read_text()) == json.loads(
        (on_ray / "sweeps" / f"{preset}.json").read_text()
    )
    for name in names:
        assert no_wall(read_metrics(on_ray / name)) == no_wall(read_metrics(local / name)), name
        assert (on_ray / name / "done").is_file()
        for f in ("partition.json", "run.json"):
            assert (on_ray / name / f).read_text() == (local / name / f).read_text()
    return names


def test_a_ray_sweep_equals_the_local_one(
    tmp_path: Path, ray_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local Ray cluster of 2 CPUs started in-process: the same runs, index and metrics as the local backend,
    one torch thread per run (its one CPU); a second sweep skips every run without starting Ray."""
    import hafedho.sweep.ray_backend as ray_backend

    monkeypatch.setattr(ray_backend, "available_cores", lambda: 2)  # 2 CPUs whatever the machine has
    path = tiny(tmp_path)
    path.write_text(path.read_text().replace("seeds = 2", "seeds = 1"))
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert main(["sweep", str(path), "--quiet", "--out", str(local)]) == 0
    capsys.readouterr()
    assert main(["sweep", str(path), "--backend", "ray", "--quiet", "--out", str(on_ray)]) == 0
    out = capsys.readouterr().out
    assert "sweep tiny (cpu): 2 done" in out and "on a local Ray cluster of 2 CPUs, started for this sweep" in out
    names = _compare_with_local(local, on_ray, "tiny")
    assert all(json.loads((on_ray / n / "env.json").read_text())["torch_threads"] == 1 for n in names)
    assert not _left_after(ray_tmp, 30), "the sweep's local Ray cluster outlived it"
    assert main(["sweep", str(path), "--backend", "ray", "--quiet", "--out", str(on_ray)]) == 0
    out = capsys.readouterr().out
    assert "2 skipped" in out and "Ray" not in out


def test_ray_options_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hafedho.sweep.ray_backend import RayBackend, check_feasible

    path = str(tiny(tmp_path))
    cases = {
        ("--address", "127.0.0.1:1"): "--address: only with --backend ray",
        ("--cpus-per-run", "2", "--gpus-per-run", "1"): "--cpus-per-run, --gpus-per-run: only with --backend ray",
        ("--backend", "ray", "--jobs", "2"): "--jobs is the local backend's",
        ("--backend", "ray", "--cpus-per-run", "0"): "--cpus-per-run 0: need a whole number >= 1",
        ("--backend", "ray", "--gpus-per-run", "-1"): "--gpus-per-run -1.0: need a number >= 0",
    }
    for args, message in cases.items():
        assert main(["sweep", path, "--quiet", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hafedho: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "runs-cpu").exists()  # refused before anything was written
    nodes = [{"Alive": True, "Resources": {"CPU": 4.0}}, {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 1.0}}]
    check_feasible(nodes, 4, 0, "x")
    with pytest.raises(ConfigError, match=r"^no node of x offers 4 CPUs and 1 GPUs .*\(nodes: 4 CPUs/0 GPUs\)"):
        check_feasible(nodes, 4, 1, "x")
    with pytest.raises(ConfigError, match="no node of x offers 5 CPUs"):
        check_feasible(nodes, 5, 0, "x")
    assert RayBackend(cpus_per_run=2, gpus_per_run=0.5).gpus_per_run == 0.5
    port = free_port()  # nothing listens there: refused at once (Ray itself would retry for minutes)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # --address wins over RAY_ADDRESS ...
    assert main(["sweep", path, "--quiet", "--backend", "ray", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hafedho: error: --address 127.0.0.1:{port}: no Ray cluster answers there"), err
    assert err.count("\n") == 1
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # ... which is used without it
    assert main(["sweep", path, "--quiet", "--backend", "ray"]) == 2
    assert capsys.readouterr().err.startswith(f"hafedho: error: RAY_ADDRESS 127.0.0.1:{port}: no Ray cluster answers")


def test_a_missing_ray_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["sweep", str(tiny(tmp_path)), "--backend", "ray", "--quiet"]) == 2
    assert capsys.readouterr().err == "hafedho: error: --backend ray needs Ray: pip install 'hafedho[ray]'\n"


def _src_env() -> dict[str, str]:
    """This environment with the checkout's ``src`` importable (Ray's workers and subprocesses import hafedho)."""
    src = str(Path(__file__).parents[1] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
def test_ctrl_c_cancels_a_ray_sweep(tmp_path: Path, ray_tmp: Path) -> None:
    """Ctrl-C (SIGINT to the process group) while two runs are tasks on the sweep's own local cluster: one line,
    exit 130, the tasks cancelled and the cluster stopped (the fixture checks no Ray process is left), the runs'
    rows one per round, for the same command to continue from their checkpoints."""
    path = tiny(tmp_path).rename(tmp_path / "long.toml")
    path.write_text(path.read_text().replace("rounds = 3\n", "rounds = 5000\n"))
    cmd = [sys.executable, "-m", "hafedho", "sweep", str(path), "--backend", "ray", "--quiet"]
    env = _src_env()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(list((tmp_path / "runs-cpu").glob("*/checkpoint.pt"))) < 2:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "hafedho: sweep interrupted with 0 of 4 runs done; run the same command again to continue "
        "(finished runs are skipped, interrupted ones resume from their last checkpoint)"
    )
    rows = {p.parent.name: read_metrics(p.parent) for p in (tmp_path / "runs-cpu").glob("*/checkpoint.pt")}
    assert len(rows) >= 2 and all(r and [x["round"] for x in r] == list(range(1, len(r) + 1)) for r in rows.values())


# ----------------------------------------------------------------------------- a real cluster on loopback


def _ray_start(name: str, args: list[str], tmp: Path, env: dict[str, str], logs: Path) -> Service:
    """``ray start --block`` (it stays the parent of the node's processes) with its own temp folder."""
    ray = str(Path(sys.executable).parent / "ray")
    argv = [ray, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={tmp}", *args]
    return Service(name, argv, logs / f"{name}.log", {**env, "RAY_TMPDIR": str(tmp)}, cwd=logs)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait(what: str, check: Callable[[], Any], timeout: float, *services: Service) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        for s in services:
            assert s.alive(), f"{s.name} ended: {s.output()[-2000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: " + " | ".join(s.output()[-1500:] for s in services))


@dataclasses.dataclass
class Cluster:
    """A head and a worker node (one CPU each) started by ``ray start`` on loopback."""

    address: str
    head: Service
    worker: Service
    env: dict[str, str]


@pytest.fixture
def loopback_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two Ray nodes on loopback, each with its own temp folder; stopped afterwards, and no Ray process that used
    either folder may be left running."""
    head_tmp, worker_tmp = (Path(tempfile.mkdtemp(prefix=p, dir="/tmp")) for p in ("hfh", "hfw"))
    env = _src_env()
    port = free_port()
    services: list[Service] = []
    try:
        head = _ray_start(
            "head",
            ["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}"],
            head_tmp, env, tmp_path,
        )  # fmt: skip
        services.append(head)
        _wait("the head", lambda: "Ray runtime started" in head.output(), 120, head)
        worker = _ray_start(
            "worker",
            [f"--address=127.0.0.1:{port}", f"--dashboard-agent-listen-port={free_port()}"],
            worker_tmp,
            env,
            tmp_path,
        )
        services.append(worker)
        _wait("the worker node", lambda: "Ray runtime started" in worker.output(), 120, head, worker)
        yield Cluster(f"127.0.0.1:{port}", head, worker, env)
    finally:
        for s in reversed(services):
            s.stop()
        left = [p for folder in (head_tmp, worker_tmp) for p in _processes_using(folder)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        for folder in (head_tmp, worker_tmp):
            shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"Ray processes outlived the test: {left}"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's processes in /proc")
def test_a_worker_node_killed_mid_sweep(tmp_path: Path, loopback_cluster: Cluster) -> None:
    """The sweep joins the two-node cluster with --address. The worker node's raylet is killed (SIGKILL) while a
    run is on it, after that run has checkpointed: the lost run is resubmitted and resumes on the head from its
    checkpoint; every run finishes with one row per round, metrics equal to an uninterrupted run's, the rows before
    the checkpoint not recomputed, runs finished before the kill untouched."""
    rounds = 150  # about 7 s a run: the run on the worker node is still running when its raylet is killed
    path = tiny(tmp_path)
    path.write_text(path.read_text().replace("rounds = 3\n", f"rounds = {rounds}\n"))
    out = tmp_path / "runs-cpu"
    specs = expand(load_preset(str(path)))
    assert len(specs) == 4
    head, worker = loopback_cluster.head, loopback_cluster.worker
    argv = ["sweep", str(path), "--backend", "ray", "--address", loopback_cluster.address]
    cmd = [sys.executable, "-m", "hafedho", *argv]  # not --quiet: the retry line is a per-run line
    log = open(tmp_path / "sweep.log", "w")  # noqa: SIM115 - closed below
    sweep = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=loopback_cluster.env, cwd=tmp_path, start_new_session=True
    )
    try:

        def raylet() -> int | None:
            return next((p for p, _ in descendants(worker.pid) if "raylet/raylet" in _cmdline(p)), None)

        def victim() -> tuple[int, str] | None:
            """(the worker's raylet, the run on the worker node) once that run has checkpointed round 2."""
            r = raylet()
            for pid, _ in descendants(r) if r else ():
                title = _cmdline(pid).strip()
                if title.startswith("ray::hafedho:"):
                    name = title.removeprefix("ray::hafedho:")
                    rows = read_metrics(out / name) if (out / name / "metrics.jsonl").exists() else []
                    if len(rows) >= 3 and (out / name / "checkpoint.pt").exists():
                        return r, name
            return None

        killed_raylet, name = _wait("a run on the worker node", victim, 240, head, worker)
        before = {s.name: (s.run_dir / "metrics.jsonl").read_bytes() for s in specs if (s.run_dir / "done").exists()}
        rows_before = read_metrics(out / name)
        os.kill(killed_raylet, signal.SIGKILL)
        code = sweep.wait(timeout=480)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
        log.close()
    text = (tmp_path / "sweep.log").read_text()
    assert code == 0, text
    assert f"retry    {name}" in text and "sweep tiny (cpu): 4 done" in text, text
    assert "the Ray cluster at 127.0.0.1" in text

    for s in specs:  # one row per round, the done marker, nothing but a run's files (no temporary leftovers)
        rows = read_metrics(s.run_dir)
        assert [r["round"] for r in rows] == list(range(1, rounds + 1)), s.name
        assert (s.run_dir / "done").is_file() and {p.name for p in s.run_dir.iterdir()} <= RUN_FILES, s.name
    for finished, data in before.items():  # finished before the kill: not redone
        assert (out / finished / "metrics.jsonl").read_bytes() == data
    after = read_metrics(out / name)
    assert after[: len(rows_before) - 1] == rows_before[:-1]  # resumed: rows before the checkpoint kept as they were
    index = json.loads((out / "sweeps" / "tiny.json").read_text())
    assert len(index["runs"]) == 4 and index["failed"] == {}

    # the resumed run equals an uninterrupted one (the local backend, another folder)
    spec = next(s for s in specs if s.name == name)
    ref = run_spec(dataclasses.replace(spec.cfg, out=str(tmp_path / "ref")), str(tmp_path / "ref" / name))
    assert ref.status == "done" and no_wall(read_metrics(tmp_path / "ref" / name)) == no_wall(after)
