"""Experiment tracking (``[log]``): mirror a run's metrics.jsonl into TensorBoard event files and an MLflow store.

A row reaches the trackers only once a checkpoint covers it: ``RunDir.save_checkpoint`` calls ``publish(t)`` after
the checkpoint of round t is in place, so rows after the last checkpoint (recomputed on ``--resume``) are never
sent. Each tracker continues after the last round it already holds, its frontier, so a resumed run never logs a
round twice (MLflow cannot delete points):

    MLflow        the run's id is kept in RUN/tracking.json (per tracking URI); its frontier is read from the store
                  itself (the largest step of any metric), and each batch of rows is one transaction
    TensorBoard   the frontier is kept in RUN/tracking.json; a reopened writer starts a new event file with a purge
                  at frontier + 1, so points a crash left after the recorded frontier are hidden by TensorBoard

Logged: every numeric metric of a row (step = round; TensorBoard stores float32), the config (TensorBoard: text;
MLflow: params flattened with dotted keys, and the config.toml as the run's description) and the partition hash.
Both are offline (MLflow: a local SQLite store only, telemetry off) and optional extras, imported on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from hafedho.config import Config, ConfigError, experiment_hash, flatten
from hafedho.runfiles import RunDirError, make_folder, read_metrics, run_state, write_json

STATE_FILE = "tracking.json"
EXTRA = "pip install 'hafedho[track]'"
MAX_BATCH = 1000  # MLflow's limit of metrics in one log_batch (one transaction)


def trackers_for(cfg: Config, run_dir: Path) -> Tracking | None:
    """The run's trackers (nothing is opened yet), None when ``[log]`` asks for none. A missing extra is refused
    here, before the run directory changes."""
    log = cfg.log
    for on, module, key in ((log.tensorboard, "tensorboard", "tensorboard"), (log.mlflow, "mlflow", "mlflow")):
        if on and find_spec(module) is None:
            raise ConfigError(f"log.{key} needs the {module} package: {EXTRA} (or set log.{key} off)")
    if log.mlflow:
        check_store(log.mlflow)
    if not log.tensorboard and not log.mlflow:
        return None
    return Tracking(cfg, run_dir)


SQLITE_HEADER = b"SQLite format 3\x00"


def check_store(uri: str) -> None:
    """``log.mlflow``'s SQLite file: in a folder that exists (never created, even at the filesystem's root), and
    a SQLite database if it exists; else one line, before the run directory changes."""
    db = Path(uri.removeprefix("sqlite:///"))
    if not db.parent.is_dir():
        raise ConfigError(
            f"log.mlflow={uri}: folder {db.parent} does not exist; create it, or give a store in an existing folder "
            "(e.g. log.mlflow='sqlite:///mlruns.db')"
        )
    if db.is_dir() or (db.exists() and db.stat().st_size and _head(db) != SQLITE_HEADER):
        what = "a folder" if db.is_dir() else "a file that is not a SQLite database"
        raise ConfigError(f"log.mlflow={uri}: {db} is {what}; give the path of a new or existing SQLite store")


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The row's metrics a tracker holds: its numbers but the round (the step); lists (Flower's ``dropped``) aside."""
    return {
        k: float(v) for k, v in row.items() if k != "round" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def params_of(d: dict[str, Any]) -> dict[str, str]:
    """A config as MLflow params: dotted keys (``config.flatten``), values as text (non-strings as JSON)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(d).items()}


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(len(SQLITE_HEADER))


class Tracking:
    """The trackers of one run directory, fed by ``RunDir``: ``add`` per metrics row, ``publish(t)`` once the
    checkpoint of round t is saved, ``close`` when the writer releases the run."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg, self.path = cfg, Path(run_dir)
        self._sinks: list[_TensorBoard | _MLflow] | None = None  # opened at the first publish
        self._pending: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        if self._sinks is not None:  # before the first publish, metrics.jsonl holds them
            self._pending.append(row)

    def publish(self, t: int) -> None:
        """The rows up to round t are final (its checkpoint is saved): each tracker gets those it lacks."""
        if self._sinks is None:
            self._sinks = self._open()
            self._save_state()  # the MLflow run's id, before any point is sent to it
            self._pending = read_metrics(self.path)  # the rows so far, resumed ones included (a catch-up)
        final = [r for r in self._pending if r["round"] <= t]
        self._pending = [r for r in self._pending if r["round"] > t]
        for sink in self._sinks:
            sink.write(final)
        self._save_state()

    def close(self) -> None:
        """End the trackers; MLflow's run status follows the run directory's marker (done, diverged, else killed)."""
        status = {"done": "FINISHED", "diverged": "FAILED"}.get(run_state(self.path).status, "KILLED")
        for sink in self._sinks or []:
            sink.close(status)
        self._sinks = None

    # ------------------------------------------------------------------ state

    def _state(self) -> dict[str, Any]:
        path = self.path / STATE_FILE
        try:
            state = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            raise RunDirError(f"{path} is not valid JSON; delete it (the trackers then start afresh)") from None
        return {"mlflow": dict(state.get("mlflow", {})), "tensorboard": dict(state.get("tensorboard", {}))}

    def _save_state(self) -> None:
        state = self._state()
        for sink in self._sinks or []:
            sink.record(state)
        write_json(self.path / STATE_FILE, state)

    def _open(self) -> list[_TensorBoard | _MLflow]:
        state, log = self._state(), self.cfg.log
        facts = {
            "run_name": self.cfg.run_name,
            "experiment_hash": experiment_hash(self.cfg),
            "partition_hash": str(json.loads((self.path / "partition.json").read_text()).get("hash", "")),
            "config": (self.path / "config.toml").read_text(),
        }
        sinks: list[_TensorBoard | _MLflow] = []
        if log.tensorboard:
            folder = self.path / "tensorboard" if log.tensorboard is True else Path(log.tensorboard) / facts["run_name"]
            sinks.append(_TensorBoard(folder, int(state["tensorboard"].get(str(folder.resolve()), 0)), facts))
        if log.mlflow:
            name = log.mlflow_experiment or self.cfg.run_prefix
            sinks.append(_MLflow(log.mlflow, name, state["mlflow"].get(log.mlflow), self.cfg, self.path, facts))
        return sinks


class _TensorBoard:
    """Scalars per metric key (step = round, float32), the config and the partition hash as text (step 0)."""

    def __init__(self, folder: Path, frontier: int, facts: dict[str, str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"log.tensorboard needs the tensorboard package: {EXTRA}") from None
        make_folder(folder, "log.tensorboard folder")
        if not any(folder.glob("*tfevents*")):  # the events were deleted: send every row again
            frontier = 0
        self.folder, self.frontier = folder, frontier
        # the purge hides what an earlier writer left after the frontier (a crash between a write and the record)
        self.writer = SummaryWriter(str(folder), purge_step=frontier + 1 if frontier else 0)
        if not frontier:
            self.writer.add_text("config", "    " + facts["config"].replace("\n", "\n    "), 0)  # markdown code
            self.writer.add_text("run", " ".join(f"{k}: {facts[k]}" for k in ("run_name", "partition_hash")), 0)

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["round"] > self.frontier:
                for k, v in numeric(row).items():
                    self.writer.add_scalar(k, v, row["round"])
                self.frontier = row["round"]
        self.writer.flush()

    def record(self, state: dict[str, Any]) -> None:
        state["tensorboard"][str(self.folder.resolve())] = self.frontier

    def close(self, status: str) -> None:
        self.writer.close()


@contextlib.contextmanager
def _store_lock(db: Path) -> Iterator[None]:
    """One writer of a SQLite store at a time across processes (a sweep's jobs; MLflow's first use creates the
    tables, which two processes must not do at once)."""
    try:
        import fcntl
    except ImportError:  # Windows: SQLite's own locking only
        yield
        return
    with open(db.with_name(db.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _MLflow:
    """One MLflow run per run directory in a local SQLite store: params (the config flattened, the run name, the
    partition and experiment hashes), tags, and metrics (step = round, float64 as in metrics.jsonl)."""

    def __init__(
        self, uri: str, experiment: str, run_id: str | None, cfg: Config, run_dir: Path, facts: dict[str, str]
    ) -> None:
        self.uri = uri
        self.db = Path(uri.removeprefix("sqlite:///"))
        check_store(uri)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline: no usage reports (read at import)
        try:
            from mlflow.entities import Metric, Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(f"log.mlflow needs the mlflow package: {EXTRA}") from None
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial tables..." lines
        self.Metric, self.Param, self.MlflowException = Metric, Param, MlflowException
        with self._guard("open"):
            self.client = MlflowClient(tracking_uri=uri)
            run = self._existing(run_id)
            params = self._params(cfg, facts)
            if run is None:
                run = self._create(experiment, run_dir, facts)
                self.run_id, self.frontier = run.info.run_id, 0
            else:  # reopened: params never change in MLflow, so only keys it lacks (a newer hafedho's) are added
                self.run_id, self.frontier = run.info.run_id, self._frontier(run)
                self.client.update_run(self.run_id, status="RUNNING")
                params = {k: v for k, v in params.items() if k not in run.data.params}
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow's limit of params per batch
                self.client.log_batch(self.run_id, params=items[i : i + 100])

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """The store's lock, and an MLflow failure as one line (the rows stay in metrics.jsonl: --resume sends
        what the store lacks)."""
        try:
            with _store_lock(self.db):
                yield
        except self.MlflowException as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RunDirError(
                f"log.mlflow={self.uri}: cannot {what} the MLflow run ({first}); fix the store, then continue "
                "with --resume (rows not yet in it are sent then)"
            ) from None

    def _existing(self, run_id: str | None) -> Any:
        if run_id is None:
            return None
        try:
            run = self.client.get_run(run_id)
        except self.MlflowException:  # gone from the store (a new database): start a new run, send every row
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _params(self, cfg: Config, facts: dict[str, str]) -> dict[str, str]:
        keep = ("run_name", "partition_hash", "experiment_hash")
        params = {**params_of(cfg.to_dict()), **{k: facts[k] for k in keep}}
        return {k: v[:6000] for k, v in params.items()}  # MLflow's longest param; config.toml is the description

    def _create(self, name: str, run_dir: Path, facts: dict[str, str]) -> Any:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None and exp.lifecycle_stage != "active":
            raise ConfigError(
                f"log.mlflow_experiment={name!r} is deleted in {self.uri}; restore it (`mlflow experiments restore`)"
                " or choose another log.mlflow_experiment"
            )
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        tags = {
            "hafedho.run_name": facts["run_name"],
            "hafedho.experiment_hash": facts["experiment_hash"],
            "hafedho.partition_hash": facts["partition_hash"],
            "hafedho.run_dir": str(run_dir.resolve()),
            "mlflow.note.content": f"```toml\n{facts['config'][:7900]}```",  # the config as the run's description
        }
        return self.client.create_run(exp_id, run_name=facts["run_name"], tags=tags)

    def _frontier(self, run: Any) -> int:
        """The last round the store holds: the largest step of any of the run's metrics."""
        steps = (m.step for key in run.data.metrics for m in self.client.get_metric_history(run.info.run_id, key))
        return max(steps, default=0)

    def write(self, rows: list[dict[str, Any]]) -> None:
        rows = [r for r in rows if r["round"] > self.frontier]
        with self._guard("log to"):
            batch: list[Any] = []
            for row in rows:  # whole rows per batch, one transaction each: the store's frontier is a whole row
                ms = int(time.time() * 1000)
                points = [self.Metric(k, v, ms, row["round"]) for k, v in numeric(row).items()]
                if batch and len(batch) + len(points) > MAX_BATCH:
                    self._log_metrics(batch)
                    batch = []
                batch += points
            self._log_metrics(batch)
        if rows:
            self.frontier = rows[-1]["round"]

    def _log_metrics(self, points: list[Any]) -> None:
        for i in range(0, len(points), MAX_BATCH):  # a row of more than MAX_BATCH metrics spans two transactions
            self.client.log_batch(self.run_id, metrics=points[i : i + MAX_BATCH])

    def record(self, state: dict[str, Any]) -> None:
        state["mlflow"][self.uri] = self.run_id

    def close(self, status: str) -> None:
        try:
            with self._guard("end"):
                self.client.set_terminated(self.run_id, status)
        except RunDirError as e:  # cosmetic: the points are in; never mask the error that ends the run
            print(f"hafedho: warning: {e}", file=sys.stderr)
