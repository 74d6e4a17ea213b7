"""Experiment tracking ([log]): TensorBoard event files and an offline MLflow store (SQLite) mirror metrics.jsonl
exactly, read back with TensorBoard's event reader and MLflow's client; a resumed run never logs a round twice."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_smoke

from hafedho.runfiles import read_metrics

pytestmark = pytest.mark.skipif(
    find_spec("mlflow") is None or find_spec("tensorboard") is None, reason="needs pip install 'hafedho[track]'"
)

Points = dict[str, list[tuple[int, float]]]


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite store with its tables created (MLflow's first use of a store takes seconds)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def uri(tmp_path: Path, empty_store: Path) -> str:
    """A fresh store of this test's own."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


def run_in(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return run


def expected(run_dir: Path, float32: bool = False) -> Points:
    """metrics.jsonl as ``{key: [(round, value), ...]}``: the numbers of each row but the round."""
    out: Points = {}
    for row in read_metrics(run_dir):
        for k, v in row.items():
            if k != "round" and isinstance(v, int | float) and not isinstance(v, bool):
                out.setdefault(k, []).append((row["round"], float(np.float32(v)) if float32 else float(v)))
    return out


def tensorboard_points(folder: Path) -> tuple[Points, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def mlflow_run(uri: str, run_dir: Path) -> tuple[Any, Any, Points]:
    """The client, the run recorded in the run directory, and its metric histories (in logging order)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(json.loads((run_dir / "tracking.json").read_text())["mlflow"][uri])
    hist = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    return client, run, hist


def by_step(points: Points) -> Points:
    return {k: sorted(v) for k, v in points.items()}


def test_both_trackers_mirror_metrics_jsonl(tmp_path: Path, uri: str) -> None:
    """Every numeric metric of every round, once, equal to metrics.jsonl (TensorBoard: as float32); the config,
    run name, partition and experiment hashes with them. checkpoint_every=2: round 1 waits for round 2's."""
    args = ("rounds=3", "checkpoint_every=2", "log.tensorboard=true", f"log.mlflow={uri}")
    assert run_smoke(tmp_path / "runs", *args) == 0
    run_dir = run_in(tmp_path / "runs")
    want = expected(run_dir)
    assert {"train/loss", "test/acc", "wall_s", "bytes_up"} <= set(want) and len(want["test/acc"]) == 3

    tb, acc = tensorboard_points(run_dir / "tensorboard")
    assert by_step(tb) == expected(run_dir, float32=True)
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert 'mlflow = "sqlite:///' in config and "[algorithm.hafedho]" in config

    client, run, hist = mlflow_run(uri, run_dir)
    assert hist == want  # logged in round order, each round once, float64 as written
    partition = json.loads((run_dir / "partition.json").read_text())["hash"]
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["run_name"] == run_dir.name and run.data.params["partition_hash"] == partition
    assert run.data.params["data.q"] == "0.5" and run.data.params["algorithm.hafedho.mu"] == "0.01"
    assert run.data.tags["hafedho.experiment_hash"] == run_dir.name.split("-")[-2]
    assert run.data.tags["hafedho.partition_hash"] == partition
    assert client.get_experiment(run.info.experiment_id).name == "hafedho-digits"  # the run name's prefix


def test_a_missing_extra_is_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hafedho.tracking as tracking

    monkeypatch.setattr(tracking, "find_spec", lambda name: None)
    assert run_smoke(tmp_path / "runs", "log.mlflow=sqlite:///x.db") == 2
    err = capsys.readouterr().err
    assert (
        err
        == "hafedho: error: log.mlflow needs the mlflow package: pip install 'hafedho[track]' (or set log.mlflow off)\n"
    )
    assert not (tmp_path / "runs").exists() or not any(p for p in (tmp_path / "runs").iterdir() if p.name != ".locks")


def interrupt_at(monkeypatch: pytest.MonkeyPatch, rnd: int) -> None:
    """Ctrl-C while round ``rnd``'s row is written (as tests/test_rundir.py does)."""
    import hafedho.runtime.rundir as rundir

    real = rundir.append_metrics

    def append(run_dir: Path, row: dict[str, Any]) -> None:
        if row["round"] == rnd:
            raise KeyboardInterrupt
        real(run_dir, row)

    monkeypatch.setattr(rundir, "append_metrics", append)


def test_a_resumed_run_logs_every_round_exactly_once(tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted in round 4 with checkpoints every 2 rounds: round 3 is in metrics.jsonl but not checkpointed,
    so no tracker has it; --resume recomputes it, reopens the same MLflow run and continues after round 2."""
    args = ("rounds=6", "checkpoint_every=2", "log.tensorboard=true", f"log.mlflow={uri}")
    interrupt_at(monkeypatch, 4)
    assert run_smoke(tmp_path / "runs", *args) == 130
    run_dir = run_in(tmp_path / "runs")
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3]
    _, run, hist = mlflow_run(uri, run_dir)
    assert {k: [s for s, _ in v] for k, v in hist.items()}["test/acc"] == [1, 2] and run.info.status == "KILLED"
    assert [s for s, _ in tensorboard_points(run_dir / "tensorboard")[0]["test/acc"]] == [1, 2]
    first = run.info.run_id

    monkeypatch.undo()
    assert run_smoke(tmp_path / "runs", *args, "--resume") == 0
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    client, run, hist = mlflow_run(uri, run_dir)
    assert run.info.run_id == first and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert hist == expected(run_dir)  # rounds 1-6 once each, in order; round 3 as recomputed
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # the resumed writer's own event file
    assert by_step(tensorboard_points(run_dir / "tensorboard")[0]) == expected(run_dir, float32=True)


@pytest.mark.slow
def test_trackers_turned_on_at_resume_catch_up_and_a_lagging_record_is_purged(
    tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started without trackers gets its checkpointed rounds on --resume; a TensorBoard frontier recorded
    behind the events (a crash between the write and the record) is purged by the reader, never doubled."""
    tb = tmp_path / "tb"
    interrupt_at(monkeypatch, 4)
    assert run_smoke(tmp_path / "runs", "rounds=5", "checkpoint_every=2") == 130
    monkeypatch.undo()
    args = ("rounds=5", "checkpoint_every=2", f"log.tensorboard={json.dumps(str(tb))}", f"log.mlflow={uri}")
    interrupt_at(monkeypatch, 5)
    assert run_smoke(tmp_path / "runs", *args, "--resume") == 130  # rows 1-4 sent at round 4's checkpoint
    monkeypatch.undo()
    run_dir = run_in(tmp_path / "runs")
    state = json.loads((run_dir / "tracking.json").read_text())
    assert list(state["tensorboard"].values()) == [4]
    state["tensorboard"] = {k: 1 for k in state["tensorboard"]}  # as if the process died before recording 2-4
    (run_dir / "tracking.json").write_text(json.dumps(state))
    assert run_smoke(tmp_path / "runs", *args, "--resume") == 0

    _, _, hist = mlflow_run(uri, run_dir)
    assert hist == expected(run_dir) and [s for s, _ in hist["test/acc"]] == [1, 2, 3, 4, 5]
    assert by_step(tensorboard_points(tb / run_dir.name)[0]) == expected(run_dir, float32=True)


def test_the_flower_server_logs_through_the_same_rows(tmp_path: Path, uri: str) -> None:
    """The Flower strategy commits through ServerRounds/RunDir too: its rows (a dropped client's round
    included: ``sampled`` is a number, ``dropped`` a list and not logged) reach MLflow equal to metrics.jsonl."""
    pytest.importorskip("flwr")
    from test_flower import run_local

    strategy = run_local(
        "fedavg", tmp_path, "data.num_clients=3", "sampling.cohort_size=2", f"log.mlflow={uri}", fail={2: {0}}
    )
    run_dir = strategy.run_dir.path
    rows = read_metrics(run_dir)
    assert rows[1]["dropped"] == [0] and rows[1]["sampled"] == 2
    _, run, hist = mlflow_run(uri, run_dir)
    assert hist == expected(run_dir) and "sampled" in hist and "dropped" not in hist
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_a_parallel_sweep_shares_one_new_store(tmp_path: Path) -> None:
    """Two sweep workers create the store's tables and their runs at once (the store's lock); every run's
    rounds arrive once, in its own MLflow run, under the sweep's rows' prefixes."""
    from test_sweep import tiny

    from hafedho.cli import main

    uri = f"sqlite:///{tmp_path}/sweep.db"
    path = tiny(tmp_path)
    assert main(["sweep", str(path), "--jobs", "2", "--seeds", "2", "--quiet", f"log.mlflow={uri}"]) == 0
    runs = sorted(p.parent for p in (tmp_path / "runs-cpu").glob("*/config.toml"))
    assert len(runs) == 4
    ids = set()
    for run_dir in runs:
        client, run, hist = mlflow_run(uri, run_dir)
        assert hist == expected(run_dir) and run.info.run_name == run_dir.name
        ids.add(run.info.run_id)
    names = {client.get_experiment(client.get_run(i).info.experiment_id).name for i in ids}
    assert len(ids) == 4 and names == {"hafedho-digits", "fedavg-digits"}
