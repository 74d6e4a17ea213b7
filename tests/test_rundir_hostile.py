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
from helpers import no_wall, run_smoke
from test_rundir import one_error_line, run_in, snapshot

from hafedho.cli import main
from hafedho.config import ConfigError, load_config
from hafedho.runfiles import RunLock

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
