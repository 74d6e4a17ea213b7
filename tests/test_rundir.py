"""Run directories: nothing lost, ever. Safe names, --force only on a run, one writer, strict metrics, resume
that never shortens or rewrites a finished run, one-line errors and Ctrl-C."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import BASE, no_wall, run_smoke

from hafedho.cli import main
from hafedho.config import ConfigError, config_from_table, load_config
from hafedho.runfiles import RunDirError, RunState, atomic_write_text, read_metrics, run_state


def run_in(out: Path) -> Path:
    """The one run directory in ``out`` (whatever its name)."""
    (run,) = [p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return run


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` but lock files: bytes and modification time (so a same-bytes rewrite shows)."""
    files = [p for p in folder.rglob("*") if p.is_file() and ".locks" not in p.parts]
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def one_error_line(err: str, text: str) -> None:
    assert err.startswith("hafedho: error: ") and err.count("\n") == 1 and text in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- names and --force


@pytest.mark.parametrize("name", [".", "..", "", "a/b", "../x", "a\\b", "-rf", "a\0b", " x"])
def test_a_run_name_is_one_safe_folder_name(name: str) -> None:
    match = r"^name=.*: (a run name must be one folder name.*e\.g\. name=my-run|holds control character.*)$"
    with pytest.raises(ConfigError, match=match):
        config_from_table({"name": name})
    assert config_from_table({"name": "my-run_2.b"}).name == "my-run_2.b"


@pytest.mark.parametrize("name", [".", ".."])
def test_force_with_a_dot_name_destroys_nothing(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out) == 0
    (tmp_path / "keep.txt").write_text("beside the output folder")
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert run_smoke(out, f"name={name}", "--force") == 2
    one_error_line(capsys.readouterr().err, "a run name must be one folder name")
    assert snapshot(tmp_path) == before


def test_force_deletes_only_a_run_directory(tmp_path: Path) -> None:
    """Through the Python API no name check applies: --force itself refuses a folder that is not a run."""
    from hafedho.experiment import build
    from hafedho.sim.runner import run

    out = tmp_path / "out"
    assert run_smoke(out) == 0
    cfg = load_config(None, ["rounds=1"])
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match=r"--force: .*out is not a hafedho run directory \(it holds \.locks, "):
        run(build(cfg), out, force=True, progress=False)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"not a hafedho run directory \(it holds todo\.txt\)"):
        run(build(cfg), tmp_path / "notes", force=True, progress=False)
    assert snapshot(tmp_path) == {
        **before,
        "notes/todo.txt": (b"mine", (tmp_path / "notes/todo.txt").stat().st_mtime_ns),
    }
    assert run_smoke(out, "--force") == 0  # a real run directory is deleted and run again


# ----------------------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real second process holds the run's lock (as a running `hafedho run` or sweep does)."""
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=2") == 0
    (run_in(out) / "done").unlink()  # an interrupted run, as two `--resume` of it would find it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from hafedho.runfiles import RunLock\n"
            "with RunLock(Path(sys.argv[1])) as held:\n    print(held, flush=True); time.sleep(120)",
            str(run_in(out)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        before = snapshot(run_in(out))
        capsys.readouterr()
        for extra in (["--resume", "rounds=4"], ["--force"]):
            assert run_smoke(out, *extra) == 2
            one_error_line(capsys.readouterr().err, f"is being written by another process (pid {holder.pid})")
            assert snapshot(run_in(out)) == before
    finally:
        holder.kill()
        holder.wait()
    assert run_smoke(out, "--resume", "rounds=4") == 0  # the lock went with its holder
    assert [r["round"] for r in read_metrics(run_in(out))] == [1, 2, 3, 4]


def test_temporary_files_are_unique_per_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = os.replace

    def spy(src: Any, dst: Any) -> None:
        seen.append(Path(src).name)
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_write_text(tmp_path / "done", "")
    atomic_write_text(tmp_path / "done", "")
    assert len(set(seen)) == 2 and all(f".{os.getpid()}." in n and n.startswith(".done.") for n in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]


# ----------------------------------------------------------------------------- metrics.jsonl


def rows_text(*rounds: int) -> str:
    return "".join(json.dumps({"round": r, **BASE, "train/loss": 1.0}) + "\n" for r in rounds)


def test_only_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    m.write_text(rows_text(1, 2) + '{"round": 3, "tra')  # killed mid-write
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]
    m.write_text(rows_text(1, 2) + rows_text(3).strip())  # complete, only the newline is missing
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    bad = {
        rows_text(1) + "oops\n" + rows_text(3, 4): r"line 2 is not valid JSON \('oops'\)",
        rows_text(1, 2) + "{}\n": "line 3 is not a metrics row",
        rows_text(1, 2) + "[1]\n" + rows_text(3): "line 3 is not a metrics row",
        rows_text(1, 2) + "\n" + rows_text(3): "line 3 is not valid JSON",
        rows_text(1, 2, 2, 3): "line 3 is round 2 after round 2",
        rows_text(1, 3, 2): "line 3 is round 2 after round 3",
        rows_text(1, 2) + '{"round": 3, "tra\n': "line 3 is not valid JSON",  # ended by a newline: not torn
        rows_text(1, 2) + '{"round": 3}\n': r"line 3 is not a metrics row \(no cohort_size, wall_s, bytes_up",
        rows_text(1) + rows_text(2).replace("1.0", "NaN"): r"line 2 is a row with train/loss = nan",
        rows_text(1)
        + rows_text(2).replace(
            '"cohort_size": 3', '"cohort_size": 1.5'
        ): r"line 2 is not a metrics row \(cohort_size is 1.5\)",
    }
    for text, msg in bad.items():
        m.write_text(text)
        with pytest.raises(RunDirError, match=f"metrics.jsonl: {msg}.*only a torn last line is repaired"):
            read_metrics(tmp_path)


def test_a_bad_middle_line_stops_resume_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=6") == 0
    metrics = run_in(out) / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2]) + lines[2][:20] + "\n" + "".join(lines[3:]))
    before = snapshot(run_in(out))
    capsys.readouterr()
    assert run_smoke(out, "rounds=8", "--resume") == 2
    one_error_line(capsys.readouterr().err, f"{metrics}: line 3 is not valid JSON")
    assert snapshot(run_in(out)) == before  # no row dropped, no done rewritten
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 2
    one_error_line(capsys.readouterr().err, "line 3 is not valid JSON")


# ----------------------------------------------------------------------------- run_state: the one reader


def hand_run(path: Path, rounds: int, marker: str = "", text: str = "", torn: bool = False) -> Path:
    """A run directory as ``RunDir`` leaves it: config.toml, env.json, rows 1..rounds (a last line cut short when
    ``torn``: the process was killed while writing it) and an end marker (``done``, or ``diverged`` with its text)."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text("rounds = 3\n")
    (path / "env.json").write_text("{}\n")
    if rounds or torn:
        (path / "metrics.jsonl").write_text(rows_text(*range(1, rounds + 1)) + ('{"round": 9, "tra' if torn else ""))
    if marker:
        (path / marker).write_text(text)
    return path


def test_run_state_of_real_runs(tmp_path: Path) -> None:
    """What `hafedho run` leaves: done at its rounds, short of a longer horizon, done at a shorter one; diverged
    with its one-line message; interrupted once the done marker is gone."""
    assert run_smoke(tmp_path / "ok", "rounds=3") == 0
    run = run_in(tmp_path / "ok")
    assert run_state(run) == run_state(run, 3) == run_state(run, 2) == RunState("done", 3)
    assert run_state(run, 5) == RunState("short", 3)
    assert run_smoke(tmp_path / "bad", "rounds=3", "algorithm.name=fedavg", "algorithm.lr=10.0") != 0
    bad = run_in(tmp_path / "bad")
    state = run_state(bad, 3)
    assert state == RunState("diverged", 0, (bad / "diverged").read_text().strip())
    assert state.message.startswith("run diverged at round 1: ")
    (run / "done").unlink()
    assert run_state(run) == run_state(run, 5) == RunState("interrupted", 3)


def test_run_state_of_each_state(tmp_path: Path) -> None:
    """Every state from hand-made directories, with and without a horizon; a torn last line is no row."""
    msg = "run diverged at round 3: train/loss is nan"
    assert run_state(tmp_path / "absent") == run_state(tmp_path / "absent", 3) == RunState("new")
    (tmp_path / "empty").mkdir()
    assert run_state(tmp_path / "empty", 3) == RunState("new")
    # started (config.toml, env.json) but no row yet: interrupted, as `hafedho run` (needs --resume) reads it
    assert run_state(hand_run(tmp_path / "config-only", 0), 3) == RunState("interrupted", 0)
    assert run_state(hand_run(tmp_path / "cut", 2), 3) == RunState("interrupted", 2)
    assert run_state(hand_run(tmp_path / "torn", 2, torn=True), 3) == RunState("interrupted", 2)
    assert run_state(hand_run(tmp_path / "done", 3, "done")) == RunState("done", 3)
    assert run_state(tmp_path / "done", 3) == run_state(tmp_path / "done", 2) == RunState("done", 3)
    assert run_state(tmp_path / "done", 4) == RunState("short", 3)
    assert run_state(hand_run(tmp_path / "div", 2, "diverged", msg + "\n"), 3) == RunState("diverged", 2, msg)
    assert run_state(tmp_path / "div") == RunState("diverged", 2, msg)
    # a torn last line in a done run lost a row (read_metrics refuses it): never done at a horizon
    hand_run(tmp_path / "done-torn", 3, "done", torn=True)
    with pytest.raises(RunDirError, match="cut short, yet the run is done"):
        read_metrics(tmp_path / "done-torn")
    assert run_state(tmp_path / "done-torn", 3) == RunState("short", 0)
    # a run that went on past the horizon (extended, then stopped or diverged) is done at it; one that stopped
    # at exactly the horizon without a marker is not (its writer may still be finishing that round)
    assert run_state(tmp_path / "cut", 1) == run_state(tmp_path / "div", 1) == RunState("done", 2)
    assert run_state(tmp_path / "div", 2) == RunState("done", 2)  # diverged in round 3: a diverged round logs no row
    assert run_state(tmp_path / "cut", 2) == RunState("interrupted", 2)


def test_run_state_is_every_callers_reader(tmp_path: Path) -> None:
    """The sweep's results index, the report and the trackers read a run through run_state (their words mapped),
    and no module but runfiles names the end markers."""
    from hafedho.report.runs import read_run
    from hafedho.sweep.browse import WORDS

    msg = "run diverged at round 3: train/loss is nan"
    runs = {
        "cut": hand_run(tmp_path / "cut", 2),
        "done": hand_run(tmp_path / "done", 3, "done"),
        "short": hand_run(tmp_path / "short", 2, "done"),
        "div": hand_run(tmp_path / "div", 2, "diverged", msg),
    }
    report = {k: (read_run(d, 3).status, read_run(d, 3).message) for k, d in runs.items()}
    assert report == {
        "cut": ("incomplete", ""),
        "done": ("done", ""),
        "short": ("incomplete", "done at round 2, short of the sweep's 3"),
        "div": ("diverged", msg),
    }
    assert {k: WORDS[run_state(d, 3).status] for k, d in runs.items()} == {k: v[0] for k, v in report.items()}
    assert read_run(tmp_path / "absent", 3).status == "missing" and WORDS["new"] == "not started"
    src = Path(__file__).resolve().parents[1] / "src" / "hafedho"
    by_hand = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.name != "runfiles.py" and any(f'/ "{m}"' in p.read_text() for m in ("done", "diverged"))
    ]
    assert by_hand == []


# ----------------------------------------------------------------------------- resume of a finished run


def test_resume_never_shortens_and_never_rewrites_a_finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=6") == 0
    before = snapshot(run_in(out))
    capsys.readouterr()
    assert run_smoke(out, "rounds=3", "--resume") == 2
    one_error_line(capsys.readouterr().err, "already holds 6 rounds; --resume with rounds=3 cannot shorten it")
    assert snapshot(run_in(out)) == before
    assert run_smoke(out, "rounds=6", "--resume") == 0
    assert "already finished at round 6 (test/acc 0." in capsys.readouterr().out
    assert snapshot(run_in(out)) == before  # config.toml, env.json, done, metrics: not even rewritten
    assert run_smoke(out, "rounds=8", "--resume") == 0  # extending a finished run continues it
    assert [r["round"] for r in read_metrics(run_in(out))] == list(range(1, 9)) and (run_in(out) / "done").exists()
    assert "round 8, test/acc" in capsys.readouterr().out


# ----------------------------------------------------------------------------- one-line errors


def test_bad_places_and_values_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("")
    assert run_smoke(afile) == 2
    one_error_line(capsys.readouterr().err, f"{afile} is a file, not a folder")
    assert run_smoke(tmp_path, "seed=-1") == 2
    one_error_line(capsys.readouterr().err, "seed=-1: must be >= 0")
    assert main(["demo", "--seeds", "0", "--out", str(tmp_path / "demo")]) == 2
    one_error_line(capsys.readouterr().err, "--seeds 0: give 1 to 10,000")

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *a: Any, **k: Any) -> None:  # root ignores the mode bits; refuse as the OS would
        if ro in self.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        assert run_smoke(ro / "runs") == 2
        one_error_line(capsys.readouterr().err, "Permission denied; choose a writable output folder")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_says_where_to_resume_and_resume_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hafedho.runtime.rundir as rundir

    assert run_smoke(tmp_path / "a", "rounds=6") == 0
    real = rundir.append_metrics

    def append(run_dir: Path, row: dict[str, Any]) -> None:
        if row["round"] == 4:  # Ctrl-C in round 4: rounds 1-3 logged, last checkpoint at round 2
            raise KeyboardInterrupt
        real(run_dir, row)

    monkeypatch.setattr(rundir, "append_metrics", append)
    capsys.readouterr()
    assert run_smoke(tmp_path / "b", "rounds=6", "checkpoint_every=2") == 130
    err = capsys.readouterr().err
    assert err == (
        f"hafedho: {run_in(tmp_path / 'b')}: interrupted at round 3; continue with --resume "
        "(from the checkpoint of round 2; round 3 is recomputed identically)\n"
    )
    monkeypatch.setattr(rundir, "append_metrics", real)
    assert run_smoke(tmp_path / "b", "rounds=6", "checkpoint_every=2", "--resume") == 0

    assert no_wall(read_metrics(run_in(tmp_path / "a"))) == no_wall(read_metrics(run_in(tmp_path / "b")))


@pytest.mark.slow
def test_sigint_ends_a_real_run_with_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hafedho", "run", "smoke", "rounds=5000", "checkpoint_every=3", "--quiet"]
    proc = subprocess.Popen([*cmd, "--out", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and sum(len(m.read_text().splitlines()) for m in tmp_path.glob("*/metrics.jsonl")) < 5:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"hafedho: {run_in(tmp_path)}: interrupted at round ") and "continue with --resume (" in err
    assert not (run_in(tmp_path) / "done").exists()
