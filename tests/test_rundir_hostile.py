"""Hostile inputs and faults: run directories reached through links, truncated or replaced files,
changed data, user code that exits or breaks the contract, and the one-line messages they end in."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import no_wall, run_smoke
from test_rundir import one_error_line, run_in, snapshot

from hafedho.cli import main
from hafedho.config import ConfigError, load_config
from hafedho.runfiles import RunDirError, RunLock
from hafedho.runtime.store import ClientStore

USER = '''
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from hafedho.algorithms import FedAvg
from hafedho.core import FedAlgorithm
from hafedho.data.dataset import Dataset


def load(path=None, n: int = 200):
    """Unseeded: draws from the global generators."""
    x = (np.random.rand(n, 6) + random.random()).astype(np.float32)
    y = np.arange(n) % 3
    return Dataset("mine", x[: n * 3 // 4], y[: n * 3 // 4], x[n * 3 // 4 :], y[n * 3 // 4 :], 3)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.from_numpy(np.random.rand(3, 6).astype(np.float32)))

    def forward(self, x):
        return self.lin(x)


def make():
    return Net()


@dataclass(frozen=True, kw_only=True)
class Bare(FedAlgorithm):
    name = "bare"


class OneValue(FedAvg):
    def server_update(self, server, agg, rnd):
        return super().server_update(server, agg, rnd)[0]
'''


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's module (a loader, a model, broken algorithms) importable as ``hostile_user``."""
    folder = tmp_path.parent / f"{tmp_path.name}-pkg"  # beside tmp_path: run_in(tmp_path) sees only runs
    folder.mkdir()
    (folder / "hostile_user.py").write_text(USER)
    (folder / "hostile_exit.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(folder))
    for name in ("hostile_user", "hostile_exit"):
        sys.modules.pop(name, None)
    return "hostile_user"


def no_run_left(out: Path) -> None:
    assert not out.exists() or [p.name for p in out.iterdir() if p.name != ".locks"] == []


# ----------------------------------------------------------------------------- 1. one lock per real directory


def test_two_paths_to_one_run_take_one_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path / "a") == 0
    run = run_in(tmp_path / "a")
    (run / "done").unlink()
    (tmp_path / "b").mkdir()
    link = tmp_path / "b" / run.name
    link.symlink_to(run)
    before = snapshot(run)
    capsys.readouterr()
    with RunLock(run) as held:
        assert held
        assert run_smoke(tmp_path / "b", "--resume", "rounds=4") == 2
        one_error_line(capsys.readouterr().err, "is being written by another process")
    assert snapshot(run) == before
    assert RunLock(link).path == RunLock(run).path


# ----------------------------------------------------------------------------- 2. a torn line in a finished run


def test_a_torn_last_line_in_a_finished_run_loses_no_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=4") == 0
    metrics = run_in(out) / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-20])
    before = snapshot(run_in(out))
    capsys.readouterr()
    for extra in (["rounds=4"], ["rounds=6"]):
        assert run_smoke(out, "--resume", *extra) == 2
        one_error_line(capsys.readouterr().err, "is cut short, yet the run is done, so the row after round 3 is lost")
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 2
    one_error_line(capsys.readouterr().err, "is cut short, yet the run is done")
    assert snapshot(run_in(out)) == before
    (run_in(out) / "done").unlink()  # unfinished, yet its checkpoint is of round 4: round 4's row cannot come back
    assert run_smoke(out, "--resume", "rounds=6") == 2
    one_error_line(capsys.readouterr().err, "checkpoint.pt is of round 4 but metrics.jsonl lacks round 4")


# ----------------------------------------------------------------------------- 3. the data and the seeds


def test_resume_on_replaced_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(240, 6)).astype(np.float32), np.arange(240) % 3
    np.savez(data, x_train=x[:200], y_train=y[:200], x_test=x[200:], y_test=y[200:])
    args = ("data.source=npz", f"data.path={data}", "data.num_clients=4", "rounds=2")
    assert run_smoke(tmp_path / "out", *args) == 0
    np.savez(data, x_train=x[:200] + 1, y_train=y[:200], x_test=x[200:], y_test=y[200:])  # same labels and split
    before = snapshot(run_in(tmp_path / "out"))
    capsys.readouterr()
    assert run_smoke(tmp_path / "out", *args[:-1], "rounds=3", "--resume") == 2
    one_error_line(capsys.readouterr().err, "the data changed since the run started (data_hash ")
    assert snapshot(run_in(tmp_path / "out")) == before


def test_unseeded_user_code_gives_the_same_run_every_time(tmp_path: Path, user: str) -> None:
    from hostile_user import make  # type: ignore[import-not-found]

    import hafedho

    runs = []
    for seed in (1, 2):
        np.random.seed(seed)
        random.seed(seed)
        res = hafedho.run("smoke", f"data.source={user}:load", out=tmp_path / "out", force=True, module=make)
        runs.append(no_wall(res.rows))
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------- 4. rows and checkpoint agree


def test_rows_must_cover_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=4") == 0
    (run_in(out) / "done").unlink()
    (run_in(out) / "metrics.jsonl").unlink()
    before = snapshot(run_in(out))
    capsys.readouterr()
    assert run_smoke(out, "rounds=6", "--resume") == 2
    one_error_line(capsys.readouterr().err, "checkpoint.pt is of round 4 but metrics.jsonl lacks 4 rounds (1-4)")
    assert snapshot(run_in(out)) == before


def test_a_done_run_without_rows_is_named_not_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=2", "seed=1") == 0
    emptied = run_in(out)
    (emptied / "metrics.jsonl").write_text("")
    capsys.readouterr()
    assert run_smoke(out, "rounds=3", "seed=1", "--resume") == 2
    one_error_line(capsys.readouterr().err, "lacks 2 rounds (1-2)")
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 2
    one_error_line(capsys.readouterr().err, f"no run has a metrics row yet; left out: {emptied.name}: done, yet")
    assert run_smoke(out, "rounds=2") == 0  # seed 0 beside it: the report names the left-out run
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "results.md").read_text()
    assert "| left out (no metrics row) | 1 |" in md and f"{emptied.name}: left out: done, yet metrics.jsonl" in md


# ----------------------------------------------------------------------------- 5. rows with NaN or missing keys


@pytest.mark.parametrize("bad", ['{"round": 2}', "NaN"])
def test_a_replaced_row_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=3") == 0
    metrics = run_in(out) / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    row = json.loads(lines[1])
    lines[1] = (bad if bad.startswith("{") else json.dumps({**row, "test/acc": float(bad)})) + "\n"
    metrics.write_text("".join(lines))
    capsys.readouterr()
    assert run_smoke(out, "rounds=4", "--resume") == 2
    what = "not a metrics row (no cohort_size" if bad.startswith("{") else "a row with test/acc = nan"
    one_error_line(capsys.readouterr().err, f"line 2 is {what}")


# ----------------------------------------------------------------------------- 6. one name for sweeps and runs


def test_a_sweep_and_a_run_of_a_reference_share_a_directory(tmp_path: Path) -> None:
    from helpers import SMOKE_PRESET_TABLES

    from hafedho.sweep.expand import expand
    from hafedho.sweep.presets import load_preset

    ref = "examples.server_adam.fedadam:FedAdam"
    grid = f'[grid]\n"algorithm.name" = ["{ref}"]\n'
    text = f'seeds = 1\nout = "{tmp_path}"\n[base]\nrounds = 2\n{SMOKE_PRESET_TABLES}\n{grid}'
    (tmp_path / "p.toml").write_text(text)
    (spec,) = expand(load_preset(str(tmp_path / "p.toml")))
    assert spec.name == dataclasses.replace(spec.cfg, name=None).run_name
    assert spec.name.startswith("examples.server_adam.fedadam.FedAdam-digits-")


# ----------------------------------------------------------------------------- 7. silent ends


def test_sys_exit_in_a_user_module_is_one_line(tmp_path: Path, user: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path / "out", "algorithm.name=hostile_exit:X") == 2
    one_error_line(capsys.readouterr().err, "importing 'hostile_exit' called sys.exit(3); fix that module")
    no_run_left(tmp_path / "out")


def test_a_nearly_empty_bernoulli_cohort_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path, "sampling.mode=bernoulli", "sampling.prob=0.001") == 0
    text = "sampling.prob=0.001 with 10 clients: the expected cohort is 0.01 clients, so most rounds train nobody"
    assert text in capsys.readouterr().out
    assert any(text in w for w in json.loads((run_in(tmp_path) / "run.json").read_text())["warnings"])


@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_sweep_jobs_below_one_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str) -> None:
    assert main(["sweep", "synthetic", "--jobs", jobs, "--out", str(tmp_path), "--dry-run"]) == 2
    one_error_line(capsys.readouterr().err, f"--jobs {jobs}: runs in parallel must be at least 1")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 8. tracebacks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["algorithm.name=hostile_user:Bare"], "class Bare does not define init_server, broadcast, client_update, s"),
        (["algorithm.name=hostile_user:OneValue"], "OneValue: server_update returned ServerState; it must return"),
        (["data.source=hostile_user:load", "data.options.n='many'"], "data.options.n='many': expected int, got str"),
    ],
)
def test_broken_user_code_is_one_line_and_leaves_no_directory(
    tmp_path: Path, user: str, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert run_smoke(tmp_path / "out", *args) == 2
    one_error_line(capsys.readouterr().err, message)
    no_run_left(tmp_path / "out")


def test_api_module_that_is_no_factory(tmp_path: Path) -> None:
    import hafedho

    with pytest.raises(ConfigError, match=r"^module=int: pass a factory returning an nn.Module"):
        hafedho.run("smoke", out=tmp_path, module=42)  # type: ignore[arg-type]
    no_run_left(tmp_path)


@pytest.mark.parametrize("kind", ["not a database", "folder"])
def test_mlflow_store_that_is_no_database(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    pytest.importorskip("mlflow")
    store = tmp_path / "store.db"
    store.mkdir() if kind == "folder" else store.write_text("hello, I am a text file\n")
    assert run_smoke(tmp_path / "out", f"log.mlflow=sqlite:///{store}") == 2
    what = "a folder" if kind == "folder" else "a file that is not a SQLite database"
    one_error_line(capsys.readouterr().err, f"{store} is {what}; give the path of a new or existing SQLite store")
    no_run_left(tmp_path / "out")


# ----------------------------------------------------------------------------- 9. messages that say the fix


def test_mlflow_store_in_a_missing_folder_is_refused_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(f"/hafedho-test-{os.getpid()}-nonexistent")
    for db in (root / "x.db", tmp_path / "nope" / "x.db"):
        assert run_smoke(tmp_path / "out", f"log.mlflow=sqlite:///{db}") == 2
        one_error_line(capsys.readouterr().err, f"folder {db.parent} does not exist; create it")
        assert not db.parent.exists()
    no_run_left(tmp_path / "out")


def test_tensorboard_folder_errors_name_log_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert run_smoke(tmp_path / "out", f"log.tensorboard={afile}/tb") == 2
    one_error_line(capsys.readouterr().err, "is a file, not a folder; choose another log.tensorboard folder")


def test_config_files_with_a_bom_or_that_are_folders(tmp_path: Path) -> None:
    bom = tmp_path / "bom.toml"
    bom.write_bytes("\ufeffrounds = 1\n".encode())
    assert load_config(bom).rounds == 1
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is a folder, not a TOML file$"):
        load_config(tmp_path)


def test_force_through_a_symlinked_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path / "a") == 0
    run = run_in(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / run.name).symlink_to(run)
    before = snapshot(tmp_path / "a")
    capsys.readouterr()
    assert run_smoke(tmp_path / "b", "--force") == 2
    one_error_line(capsys.readouterr().err, "is a symbolic link (to ")
    assert snapshot(tmp_path / "a") == before and (tmp_path / "b" / run.name).is_symlink()


def test_a_full_disk_names_the_file_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert run_smoke(tmp_path) == 2
    err = capsys.readouterr().err
    one_error_line(err, "metrics.jsonl: No space left on device; free some space, then continue with the same command")
    assert f"{run_in(tmp_path)}/metrics.jsonl" in err


def test_garbage_npz_and_natural_ids_without_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "g.npz"
    garbage.write_bytes(b"\x00garbage bytes, no archive" * 10)
    assert run_smoke(tmp_path / "out", "data.source=npz", f"data.path={garbage}") == 2
    one_error_line(capsys.readouterr().err, f"{garbage} is not an .npz file (no zip archive); save your arrays")
    pytest.importorskip("flwr_datasets")
    assert run_smoke(tmp_path / "out", "data.partition=flwr:NaturalIdPartitioner") == 2
    one_error_line(capsys.readouterr().err, "this source has no natural client ids (writers, devices) to split by")


def test_a_diverged_marker_names_no_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hafedho.runtime.rounds import ServerRounds

    real = ServerRounds._check_finite

    def check(self: ServerRounds, t: int, row: dict[str, Any]) -> None:
        if t == 2:
            self._diverged(t, "train/loss is nan", "lower algorithm.lr")
        real(self, t, row)

    monkeypatch.setattr(ServerRounds, "_check_finite", check)
    assert run_smoke(tmp_path, "rounds=3") == 1
    text = (run_in(tmp_path) / "diverged").read_text()
    assert f"last good checkpoint: round 1 in {run_in(tmp_path).name}/checkpoint.pt" in text
    assert str(tmp_path) not in text


# ----------------------------------------------------------------------------- 10. docs and words


def test_docs_name_the_folders_sweeps_write_and_headings_are_not_doubled(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    for path in (root / "docs" / "extending.md", root / "examples" / "server_adam" / "compare.toml"):
        text = path.read_text()
        assert "runs/server_adam-cpu" in text and "report runs/server_adam\n" not in text, path
    assert run_smoke(tmp_path / "runs") == 0
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "results.md").read_text()
    assert "## Runs\n" in md and "### Runs\n" not in md


def test_an_existing_run_says_an_interrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path) == 0
    (run_in(tmp_path) / "done").unlink()
    capsys.readouterr()
    assert run_smoke(tmp_path) == 2
    one_error_line(capsys.readouterr().err, "holds an interrupted run; pass --resume")


# ----------------------------------------------------------------------------- 11. nothing written through a link


def outside_file(tmp_path: Path) -> Path:
    """A file outside every run and report folder, that no command may change."""
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"precious: not a lock, not a row\n")
    return precious


def interrupted(out: Path, *args: str) -> Path:
    """A finished smoke run (3 rounds) with its done marker removed: ``--resume rounds=4`` continues it."""
    assert run_smoke(out, "rounds=3", *args) == 0
    run = run_in(out)
    (run / "done").unlink()
    return run


def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, precious = tmp_path / "out", outside_file(tmp_path)
    run = interrupted(out)
    lock = out / ".locks" / f"{run.name}.lock"
    lock.unlink()
    lock.symlink_to(precious)
    before = snapshot(run)
    capsys.readouterr()
    assert run_smoke(out, "--resume", "rounds=4") == 2
    one_error_line(capsys.readouterr().err, f"{lock} is a symbolic link, not a lock file; nothing is written through")
    assert precious.read_bytes() == b"precious: not a lock, not a row\n" and snapshot(run) == before


def test_a_locks_folder_that_is_a_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    run = interrupted(out)
    elsewhere.mkdir()
    (out / ".locks" / f"{run.name}.lock").rename(elsewhere / f"{run.name}.lock")
    (out / ".locks").rmdir()
    (out / ".locks").symlink_to(elsewhere)
    before, theirs = snapshot(run), (elsewhere / f"{run.name}.lock").read_bytes()
    capsys.readouterr()
    assert run_smoke(out, "--resume", "rounds=4") == 2
    one_error_line(capsys.readouterr().err, f"{out / '.locks'} is a symbolic link, not the run lock folder; nothing is")
    assert snapshot(run) == before and (elsewhere / f"{run.name}.lock").read_bytes() == theirs


def test_metrics_that_are_a_link_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, precious = tmp_path / "out", tmp_path / "rows.jsonl"
    run = interrupted(out)
    (run / "metrics.jsonl").rename(precious)
    (run / "metrics.jsonl").symlink_to(precious)
    before, rows = snapshot(run), precious.read_bytes()
    capsys.readouterr()
    assert run_smoke(out, "--resume", "rounds=4") == 2
    one_error_line(capsys.readouterr().err, "metrics.jsonl is a symbolic link")
    assert precious.read_bytes() == rows and snapshot(run) == before


@pytest.mark.parametrize("name", ["checkpoint.pt", "env.json", "store/delta_r3.pt", "client_store/leaf0.npy"])
def test_a_run_file_that_is_a_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Resume refuses a run whose files are links (even those it only reads, or replaces atomically), before
    anything is written: the link's target is untouched and so is the run."""
    out, precious = tmp_path / "out", outside_file(tmp_path)
    run = interrupted(out, "client_store=disk")
    (run / name).unlink()
    (run / name).symlink_to(precious)
    before = snapshot(run)
    capsys.readouterr()
    assert run_smoke(out, "--resume", "rounds=4", "client_store=disk") == 2
    one_error_line(capsys.readouterr().err, f"{run / name} is a symbolic link, not a file of this run; nothing is")
    assert precious.read_bytes() == b"precious: not a lock, not a row\n" and snapshot(run) == before


def test_an_atomic_write_replaces_a_link_never_its_target(tmp_path: Path) -> None:
    """An atomic write (a fresh temporary file, then a rename) onto a link replaces the link by the new file: the
    rename replaces the link itself, so the file it pointed to is untouched."""
    from hafedho.runfiles import write_json

    precious = outside_file(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x.json").symlink_to(precious)
    write_json(tmp_path / "run" / "x.json", {"a": 1})
    assert not (tmp_path / "run" / "x.json").is_symlink() and json.loads((tmp_path / "run" / "x.json").read_text())
    assert precious.read_bytes() == b"precious: not a lock, not a row\n"


def test_the_atomic_writes_temporary_file_is_never_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hafedho import runfiles

    precious = outside_file(tmp_path)
    monkeypatch.setattr(runfiles.secrets, "token_hex", lambda n: "fixed")
    target = tmp_path / "run" / "x.json"
    target.parent.mkdir()
    (target.parent / f".x.json.{os.getpid()}.fixed.tmp").symlink_to(precious)
    with pytest.raises(OSError):
        runfiles.write_json(target, {"a": 1})
    assert precious.read_bytes() == b"precious: not a lock, not a row\n" and not target.exists()


def test_a_client_store_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    out, precious = tmp_path / "out", outside_file(tmp_path)
    run = interrupted(out, "client_store=disk")
    leaf = run / "client_store" / "leaf0.npy"
    leaf.unlink()
    leaf.symlink_to(precious)
    with pytest.raises(
        RunDirError, match=r"leaf0\.npy is a symbolic link, not a client-store file; nothing is written"
    ):
        ClientStore([torch.zeros(3)], 10, run / "client_store")
    assert precious.read_bytes() == b"precious: not a lock, not a row\n"


@pytest.mark.parametrize("name", ["results.md", "status.csv", "accuracy.png", "report.html"])
def test_a_report_never_writes_through_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    precious, rep = outside_file(tmp_path), tmp_path / "rep"
    assert run_smoke(tmp_path / "runs") == 0
    rep.mkdir()
    (rep / name).symlink_to(precious)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--out", str(rep)]) == 2
    one_error_line(
        capsys.readouterr().err, f"{rep / name} is a symbolic link; the report writes no file through one: remove it"
    )
    assert precious.read_bytes() == b"precious: not a lock, not a row\n" and [p.name for p in rep.iterdir()] == [name]


# ----------------------------------------------------------------------------- 12. checkpoints checked field by field


def _edit(payload: dict[str, Any], what: str) -> None:
    """Damage one field of a checkpoint's payload (a 3-round smoke run of 10 clients)."""
    if what.startswith("round"):
        payload["round"] = int(what.split()[1])
    elif what == "shape":
        payload["server"][0] = torch.zeros(*payload["server"][0].shape, 2, dtype=payload["server"][0].dtype)
    elif what == "dtype":
        payload["server"][0] = payload["server"][0].double()
    elif what == "5 clients":
        payload["extra"]["store_clients"] = 5
    elif what == "5 rows inline":  # a checkpoint from before the journal: the whole store inline
        del payload["extra"]["store_journal"]
        payload["store"] = [t.unsqueeze(0).expand(5, *t.shape).clone() for t in payload["store_template"]]
    elif what.startswith("wall"):
        payload["extra"]["wall_s"] = float(what.split()[1])


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("round -1", "corrupt checkpoint (round -1)"),
        ("round 0", "corrupt checkpoint (round 0)"),
        ("round 5", "checkpoint.pt is of round 5 but metrics.jsonl lacks 2 rounds (4-5)"),
        ("shape", "server tensor 0 is torch.float32(10, 64, 2), this run's is torch.float32(10, 64)"),
        ("dtype", "server tensor 0 is torch.float64(10, 64), this run's is torch.float32(10, 64)"),
        ("5 clients", "its client store holds 5 clients, this run has 10"),
        ("5 rows inline", "checkpoint client state has shape (5, 10, 64), expected (10, 10, 64)"),
        ("wall nan", "corrupt checkpoint (wall_s nan)"),
        ("wall -1", "corrupt checkpoint (wall_s -1.0)"),
    ],
)
def test_a_damaged_checkpoint_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str, message: str
) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=3") == 0  # done: a resume to 4 rounds extends it from the checkpoint
    ckpt = run_in(out) / "checkpoint.pt"
    payload = torch.load(ckpt, weights_only=True)
    _edit(payload, what)
    torch.save(payload, ckpt)
    before = snapshot(run_in(out))
    capsys.readouterr()
    assert run_smoke(out, "rounds=4", "--resume") == 2
    one_error_line(capsys.readouterr().err, message)
    assert snapshot(run_in(out)) == before  # metrics.jsonl, done and every other file: same bytes, same time


def test_a_checkpoint_of_another_seed_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=3", "seed=1") == 0
    (seed1,) = [p for p in out.iterdir() if p.name.endswith("-s1")]
    assert run_smoke(out, "rounds=3", "seed=0") == 0
    seed0 = seed1.with_name(seed1.name.removesuffix("-s1") + "-s0")
    (seed0 / "checkpoint.pt").write_bytes((seed1 / "checkpoint.pt").read_bytes())
    before = snapshot(seed0)
    capsys.readouterr()
    assert run_smoke(out, "rounds=4", "seed=0", "--resume") == 2
    experiment = seed1.name.split("-")[-2]
    one_error_line(
        capsys.readouterr().err,
        f"written by another run (experiment {experiment}, seed 1), not by this one (experiment {experiment}, seed 0)",
    )
    assert snapshot(seed0) == before


def test_a_checkpoint_without_identity_still_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_smoke(out, "rounds=3") == 0
    ckpt = run_in(out) / "checkpoint.pt"
    payload = torch.load(ckpt, weights_only=True)
    assert payload["extra"].pop("identity") == {"experiment": run_in(out).name.split("-")[-2], "seed": 0}
    torch.save(payload, ckpt)
    assert run_smoke(out, "rounds=4", "--resume") == 0
    assert [r["round"] for r in map(json.loads, (run_in(out) / "metrics.jsonl").read_text().splitlines())] == [
        1,
        2,
        3,
        4,
    ]


# ----------------------------------------------------------------------------- 13. the report's output folder


@pytest.mark.parametrize("inside", ["", "tables"])
def test_a_report_into_a_run_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inside: str
) -> None:
    runs = tmp_path / "runs"
    assert run_smoke(runs) == 0
    run = run_in(runs)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["report", str(runs), "--out", str(run / inside)]) == 2
    where = "is a run directory" if not inside else f"lies inside {run}, which is a run directory"
    one_error_line(capsys.readouterr().err, f"report folder {run / inside} {where}; a report never writes into one")
    assert snapshot(run) == before and not (run / "tables").exists()
    assert main(["report", str(run)]) == 2  # by default into RUNS_DIR: here the run itself
    one_error_line(capsys.readouterr().err, "is a run directory; a report never writes into one: pass --out")
    assert snapshot(run) == before
    assert run_smoke(runs, "--force") == 0  # the run can still be replaced


def test_a_run_with_a_bad_line_is_left_out_not_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One damaged run is named (status table, stderr) and left out; the others are reported, exit 0 (README)."""
    runs, rep = tmp_path / "runs", tmp_path / "rep"
    for seed in (0, 1, 2):
        assert run_smoke(runs, f"seed={seed}", "rounds=3") == 0
    (bad,) = [p for p in runs.iterdir() if p.name.endswith("-s1")]
    lines = (bad / "metrics.jsonl").read_text().splitlines(keepends=True)
    (bad / "metrics.jsonl").write_text("".join([lines[0], "garbage, not a row\n", *lines[2:]]))
    capsys.readouterr()
    assert main(["report", str(runs), "--out", str(rep)]) == 0
    err = capsys.readouterr().err
    assert f"hafedho: warning: left out {bad.name}: {bad.name}/metrics.jsonl: line 2 is not valid JSON" in err
    md = (rep / "results.md").read_text()
    assert "| left out (bad metrics.jsonl) | 1 |" in md and "| done | 2 |" in md
    assert f"{bad.name}: left out: {bad.name}/metrics.jsonl: line 2 is not valid JSON" in md
    assert str(tmp_path) not in md


def test_an_append_never_follows_a_link(tmp_path: Path) -> None:
    """The second line of defence behind the resume's check: appending a row to a linked metrics.jsonl is refused."""
    from hafedho.runfiles import append_metrics

    precious = outside_file(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(precious)
    with pytest.raises(RunDirError, match=r"metrics\.jsonl is a symbolic link, not the run's metrics; nothing is"):
        append_metrics(tmp_path / "run", {"round": 1})
    assert precious.read_bytes() == b"precious: not a lock, not a row\n"
