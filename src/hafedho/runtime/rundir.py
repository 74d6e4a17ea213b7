"""``RunDir``: one run's directory, the one owner of what every runtime (simulator, Flower) writes into it.

What may be continued (``prepare``: same experiment, never shortened), what ``--force`` may delete (only a run
directory), the facts written once (``start``), the metrics rows, checkpoints with the client store, and the
``done``/``diverged`` markers. The file layout, the atomic writes and the one reader of a run's state
(``run_state``) are ``hafedho.runfiles``'.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from hafedho.config import (
    Config,
    ConfigError,
    config_from_table,
    experiment_hash,
    experiment_identity,
    identity_diff,
)
from hafedho.runfiles import (
    DIVERGED,
    DONE,
    RunBusy,
    RunDirError,
    RunLock,
    append_metrics,
    atomic_write_text,
    environment,
    read_metrics,
    refuse_link,
    run_state,
    truncate_metrics,
    write_json,
)
from hafedho.runtime import checkpoint
from hafedho.runtime.store import ClientStore
from hafedho.toml_io import dump_toml, read_toml
from hafedho.tracking import Tracking, trackers_for


def _field(d: Any, key: str) -> str:
    return str(d.get(key, "?")) if isinstance(d, dict) else "?"


def check_same_experiment(run_dir: Path, cfg: Config) -> None:
    """Refuse to continue a run directory that holds another experiment (``experiment_identity``): runtime
    settings (engine, workers, threads, eval and checkpoint cadence) may change on resume, and so may ``rounds``
    (extending a run continues it)."""
    path = run_dir / "config.toml"
    if not path.exists():
        return
    try:
        old = experiment_identity(config_from_table(read_toml(path)))
    except ConfigError as e:
        raise RunDirError(f"{path} cannot be read by this version ({e}); use --force to start over") from None
    diff = identity_diff(old, experiment_identity(cfg))
    if diff:
        raise RunDirError(
            f"{run_dir} holds another experiment (differs in: {', '.join(diff)}); "
            "use another directory, or --force to replace it"
        )


RUN_FILES = frozenset(
    {"config.toml", "env.json", "partition.json", "run.json", "metrics.jsonl", "checkpoint.pt", DONE, DIVERGED}
    | {"tracking.json", "tensorboard"}  # hafedho.tracking's ([log])
)


def _is_run_entry(name: str) -> bool:
    """A file or folder that a run (simulator or Flower) writes into its directory."""
    if name in RUN_FILES or name in ("client_store", checkpoint.JOURNAL_DIR):
        return True
    if name.startswith(".") and name.endswith(".tmp"):
        return True
    return name.startswith("store_r") and name.removeprefix("store_r").removesuffix(".tmp").isdigit()


def _check_deletable(run_dir: Path) -> None:
    """``--force`` deletes only an empty folder or a hafedho run directory: config.toml and nothing foreign."""
    entries = sorted(p.name for p in run_dir.iterdir())
    foreign = [n for n in entries if not _is_run_entry(n)]
    if entries and (foreign or "config.toml" not in entries):
        more = ", ..." if len(foreign) > 3 else ""
        what = f"it holds {', '.join(foreign[:3])}{more}" if foreign else "no config.toml"
        raise RunDirError(
            f"--force: {run_dir} is not a hafedho run directory ({what}); not deleting it: "
            "choose another run name, or remove it yourself"
        )


def is_finished(run_dir: Path, rounds: int, rows: list[dict[str, Any]] | None = None) -> bool:
    """The run in ``run_dir`` has finished exactly ``rounds`` rounds (``--resume`` then has nothing to do): its
    done marker, not only rows that reach ``rounds`` (a run killed before its marker still has to write it)."""
    state = run_state(run_dir, rows=rows)
    return state.status == "done" and state.rounds_done == rounds


def check_same_data(run_dir: Path, partition: dict[str, Any] | None) -> None:
    """Refuse to continue a run on other data: ``partition.json``'s data and partition hashes must be this
    run's (a replaced data file gives the same config, but another experiment)."""
    path = run_dir / "partition.json"
    if partition is None or not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        raise RunDirError(f"{path} is not valid JSON; restore it, or start over with --force") from None
    for key, what in (("data_hash", "data"), ("hash", "partition")):
        if isinstance(old, dict) and key in old and key in partition and old[key] != partition[key]:
            raise RunDirError(
                f"{run_dir}: the {what} changed since the run started ({key} {old[key]} in partition.json, "
                f"{partition[key]} now); resume it on the data it started with, or start over with --force"
            )


def check_rows_cover_checkpoint(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """The rows must hold rounds 1..k of the checkpoint of round k: they cannot be recomputed from it."""
    k = checkpoint.saved_round(run_dir / "checkpoint.pt")
    have = {int(r["round"]) for r in rows}
    missing = [t for t in range(1, k + 1) if t not in have]
    if missing:
        span = f"round {missing[0]}" if len(missing) == 1 else f"{len(missing)} rounds ({missing[0]}-{missing[-1]})"
        raise RunDirError(
            f"{run_dir}: checkpoint.pt is of round {k} but metrics.jsonl lacks {span}, which cannot be recomputed "
            "from it: restore metrics.jsonl, or recompute the run from round 1 with --force"
        )


def check_no_links(run_dir: Path) -> None:
    """Refuse a run directory whose files (or the files in its client-store folders) are symbolic links: a run
    writes nothing through one (it would change a file outside the run), so none is followed on resume."""
    for p in sorted(run_dir.iterdir()):
        if not _is_run_entry(p.name):
            continue
        inner = sorted(p.iterdir()) if p.is_dir() and not p.is_symlink() else []
        for q in [p, *inner]:
            refuse_link(q, "a file of this run", "replace it by the file it points to (or remove it), then --resume")


def _force_delete(run_dir: Path) -> None:
    """``--force``: delete a run directory (``_check_deletable``), never through a symbolic link."""
    if run_dir.is_symlink():
        raise RunDirError(
            f"--force: {run_dir} is a symbolic link (to {run_dir.resolve()}); not deleting through it: "
            "remove the link, or run with --out naming the folder it points into"
        )
    _check_deletable(run_dir)
    shutil.rmtree(run_dir)


def prepare_run_dir(
    run_dir: Path, cfg: Config, resume: bool, force: bool, partition: dict[str, Any] | None = None
) -> bool:
    """Create the run directory, or check that an existing one may be continued (same experiment, same data
    when ``partition`` is given, rows that cover the checkpoint).

    Returns True when ``resume`` finds the run finished at ``cfg.rounds``: nothing to do, and nothing is written.
    Every refusal happens before anything in the directory changes.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a run directory; choose another run name or output folder")
    if (run_dir.exists() or run_dir.is_symlink()) and force:
        _force_delete(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not resume:
            state = "a finished" if run_state(run_dir).status == "done" else "an interrupted"
            raise RunDirError(f"{run_dir} holds {state} run; pass --resume to continue it or --force to start over")
        check_no_links(run_dir)
        check_same_experiment(run_dir, cfg)
        check_same_data(run_dir, partition)
        rows = read_metrics(run_dir)  # a bad line in the middle is an error here, before anything is rewritten
        check_rows_cover_checkpoint(run_dir, rows)
        have = rows[-1]["round"] if rows else 0
        if cfg.rounds < have:
            raise RunDirError(
                f"{run_dir} already holds {have} rounds; --resume with rounds={cfg.rounds} cannot shorten it: "
                f"pass rounds >= {have}, or --force to start over"
            )
        if is_finished(run_dir, cfg.rounds, rows):
            return True
        if have and run_state(run_dir, rows=rows).status == "done" and not (run_dir / "checkpoint.pt").exists():
            # A committed run keeps only its small files: continuing from round 1 would overwrite its metrics.
            raise RunDirError(
                f"{run_dir} finished {have} rounds and has no checkpoint.pt (committed runs keep only their small "
                f"files), so it cannot be extended to {cfg.rounds}: restore its checkpoint.pt, or recompute it "
                "from round 1 with --force (or by deleting the directory)"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.toml").exists():  # a resumed run's is rewritten by ``RunDir.start``, once checked
        atomic_write_text(run_dir / "config.toml", dump_toml(cfg.to_dict()))
    return False


class RunDir:
    """A run directory, written by one process at a time: ``acquire()`` (or ``with RunDir(path):``) takes its
    ``RunLock`` and raises ``RunBusy`` while another writer holds it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoint_path = self.path / "checkpoint.pt"
        self._lock = RunLock(self.path)
        self.resumed_facts: dict[str, Any] = {}  # the runtime facts of the checkpoint ``resume`` continued from
        self.tracking: Tracking | None = None  # [log]'s trackers (``prepare``); they get rows once checkpointed
        self.journal = checkpoint.Journal()  # the client-store files the last checkpoint names
        self._writing: threading.Thread | None = None  # the checkpoint being written (save_checkpoint)
        self._written: int | None = None  # its round, once on disk (for the trackers)
        self._failed: BaseException | None = None
        self.identity: dict[str, Any] | None = None  # the run's experiment hash and seed, saved in each checkpoint
        self._config: str | None = None  # its config.toml (``prepare``), written by ``start``

    def acquire(self) -> None:
        if not self._lock.__enter__():
            raise RunBusy(
                f"{self.path} is being written by another process (pid {self._lock.holder}); wait for it to end"
            )

    def release(self) -> None:
        try:
            self.wait()  # a checkpoint being written is finished before the lock goes
        finally:
            self._release()

    def _release(self) -> None:
        if self.tracking is not None:
            self.tracking.close()
            self.tracking = None
        self._lock.__exit__()

    def __enter__(self) -> RunDir:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def prepare(self, cfg: Config, resume: bool, force: bool, partition: dict[str, Any] | None = None) -> bool:
        """``prepare_run_dir``: True when ``resume`` finds the run finished (then nothing is written)."""
        tracking = trackers_for(cfg, self.path)  # a missing extra is refused before anything is written
        finished = prepare_run_dir(self.path, cfg, resume, force, partition)
        self.identity = {"experiment": experiment_hash(cfg), "seed": cfg.seed}
        self._config = dump_toml(cfg.to_dict())
        self.tracking = None if finished else tracking
        return finished

    def start(self, partition: dict[str, Any], facts: dict[str, Any]) -> None:
        """A run (re)starts: write its config, clear the end markers, write the environment, the partition and
        ``run.json``."""
        if self._config is not None:  # rounds may have changed (an extended run): written once the resume is checked
            atomic_write_text(self.path / "config.toml", self._config)
        (self.path / DONE).unlink(missing_ok=True)
        (self.path / DIVERGED).unlink(missing_ok=True)
        write_json(self.path / "env.json", environment())
        write_json(self.path / "partition.json", partition)
        write_json(self.path / "run.json", facts)

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def append(self, row: dict[str, Any]) -> None:
        append_metrics(self.path, row)
        if self.tracking is not None:
            self.tracking.add(row)

    def truncate(self, last_round: int) -> None:
        truncate_metrics(self.path, last_round)

    def save_checkpoint(self, t: int, server: Any, store: ClientStore | None, extra: dict[str, Any]) -> None:
        """Checkpoint round ``t``: the server state in ``checkpoint.pt`` and, for a store with state, the rows that
        changed since the last checkpoint in its journal, which ``checkpoint.pt`` names (``runtime.checkpoint``).
        Without a store (Flower: the client states live on the nodes) the checkpoint holds the server only.

        The state is taken now (``checkpoint.capture``) and written by a background thread while the run goes on;
        the previous checkpoint's write is waited for first, and so is this one's by the next checkpoint, by
        ``mark_done``, ``wait`` and ``release``. Once written, the rows up to round t are final: the trackers get
        them (``Tracking.publish``) at that wait."""
        self.wait()
        extra = {**extra, "identity": self.identity} if self.identity is not None else extra
        cap = checkpoint.capture(self.path, t, server, store, self.journal, extra)
        self.journal = cap.journal
        self._writing = threading.Thread(target=self._write, args=(cap,), name="hafedho-checkpoint", daemon=True)
        self._writing.start()

    def _write(self, cap: checkpoint.Capture) -> None:
        try:
            checkpoint.write(self.path, self.checkpoint_path, cap)
            for old in self.path.glob("store_r*"):  # snapshots of checkpoints written before the journal
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
            self._written = cap.round
        except BaseException as e:  # handed to the run's thread by wait()
            self._failed = e

    def wait(self) -> None:
        """Wait for the checkpoint being written; re-raise its error; hand its rows to the trackers."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._failed is not None:
            e, self._failed = self._failed, None
            raise e
        if self._written is not None and self.tracking is not None:
            self.tracking.publish(self._written)
        self._written = None

    def resume(self, server: Any, store: ClientStore) -> tuple[int, Any, float]:
        """``(first round to run, server state, wall seconds so far)`` from the checkpoint, the client states
        restored into ``store``; ``(1, server, 0.0)`` when there is none.

        Call it before ``start``: every field of the checkpoint is checked against this run first (its identity,
        its round against the rows, the server tensors, the store's clients, shapes and dtypes, the wall time), so
        a foreign or corrupt checkpoint ends in one line with nothing in the directory changed."""
        if not self.checkpoint_path.exists():
            return 1, server, 0.0
        path = self.checkpoint_path
        done_round, server, payload, extra = checkpoint.load(path, server)
        if not isinstance(extra, dict):
            raise RunDirError(f"{path}: corrupt checkpoint (extra is {type(extra).__name__}); start over with --force")
        saved = extra.get("identity")  # checkpoints written before it carry none: accepted
        if saved is not None and self.identity is not None and saved != self.identity:
            raise RunDirError(
                f"{path}: written by another run (experiment {_field(saved, 'experiment')}, seed "
                f"{_field(saved, 'seed')}), not by this one (experiment {self.identity['experiment']}, seed "
                f"{self.identity['seed']}): restore this run's own checkpoint.pt, or start over with --force"
            )
        rows = self.rows()
        have = int(rows[-1]["round"]) if rows else 0
        if done_round > have:
            raise RunDirError(
                f"{path}: checkpoint of round {done_round}, yet metrics.jsonl ends at round {have}: restore "
                "metrics.jsonl, or recompute the run from round 1 with --force"
            )
        wall = extra.get("wall_s", 0.0)
        if isinstance(wall, bool) or not isinstance(wall, int | float) or not math.isfinite(wall) or wall < 0:
            raise RunDirError(f"{path}: corrupt checkpoint (wall_s {wall!r}); start over with --force")
        clients = extra.get("store_clients", store.num_clients)
        if store.leaves and clients != store.num_clients:
            raise RunDirError(
                f"{path}: its client store holds {clients!r} clients, this run has {store.num_clients}: written by "
                "another experiment; start over with --force"
            )
        if store.leaves:
            self.journal = checkpoint.restore_store(self.path, store, payload, extra)
        self.resumed_facts = extra
        return done_round + 1, server, float(wall)

    def discard_unstarted(self) -> None:
        """Delete the directory of a run this process created that failed before logging a row."""
        rows = self.path / "metrics.jsonl"
        ours = self.path.is_dir() and not self.path.is_symlink() and not (rows.exists() and rows.stat().st_size)
        if ours and all(_is_run_entry(p.name) for p in self.path.iterdir()):
            if self.tracking is not None:
                self.tracking.close()
                self.tracking = None
            shutil.rmtree(self.path, ignore_errors=True)

    def mark_done(self) -> None:
        self.wait()  # the last checkpoint is on disk before the run says it is done
        atomic_write_text(self.path / DONE, "")

    def mark_diverged(self, text: str) -> None:
        atomic_write_text(self.path / DIVERGED, text + "\n")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a run, in either runtime; the message says which round ``--resume`` continues
    from (``interrupted_text``)."""


def interrupted_text(run_dir: Path) -> str:
    """Where a Ctrl-C left the run: the last logged round and the checkpoint ``--resume`` continues from."""
    try:
        rows = read_metrics(run_dir)
    except RunDirError:
        rows = []
    try:
        ckpt = int(torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)["round"])
    except Exception:  # no checkpoint yet, or one being replaced: resume starts over / from the older one
        ckpt = 0
    done = rows[-1]["round"] if rows else 0
    if ckpt >= done:
        how = f"it continues after round {ckpt}" if ckpt else "it starts at round 1"
    elif ckpt:
        redo = f"round {done} is" if done == ckpt + 1 else f"rounds {ckpt + 1}-{done} are"
        how = f"from the checkpoint of round {ckpt}; {redo} recomputed identically"
    else:
        how = "no checkpoint yet: it starts over at round 1"
    return f"{run_dir}: interrupted at round {done}; continue with --resume ({how})"
