"""The run directory: what may be continued, what ``--force`` may delete, checkpoints with the client store."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hafedho.config import (
    Config,
    ConfigError,
    config_from_table,
    dump_toml,
    experiment_identity,
    identity_diff,
    read_toml,
)
from hafedho.results import RunDirError, atomic_write_text, read_metrics
from hafedho.sim import checkpoint
from hafedho.sim.store import ClientStore


def save_checkpoint(run_dir: Path, t: int, server: Any, store: ClientStore, wall: float) -> None:
    """Write the checkpoint; a memory-mapped store is snapshotted to ``store_rT/`` first and named in it."""
    extra: dict[str, Any] = {"wall_s": wall}
    if store.path is None:
        checkpoint.save(run_dir / "checkpoint.pt", t, server, store.state_dict(), extra)
        return
    store.snapshot(run_dir / f"store_r{t}")
    checkpoint.save(run_dir / "checkpoint.pt", t, server, [], {**extra, "store_dir": f"store_r{t}"})
    for old in run_dir.glob("store_r*"):  # only after the new checkpoint is in place
        if old.name != f"store_r{t}":
            shutil.rmtree(old, ignore_errors=True)


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
    {"config.toml", "env.json", "partition.json", "run.json", "metrics.jsonl", "checkpoint.pt", "done", "diverged"}
)


def _is_run_entry(name: str) -> bool:
    """A file or folder that a run (simulator or Flower) writes into its directory."""
    if name in RUN_FILES or name == "client_store" or (name.startswith(".") and name.endswith(".tmp")):
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
    """The run in ``run_dir`` has finished exactly ``rounds`` rounds (``--resume`` then has nothing to do)."""
    if not (run_dir / "done").is_file():
        return False
    rows = read_metrics(run_dir) if rows is None else rows
    return bool(rows) and rows[-1]["round"] == rounds


def prepare_run_dir(run_dir: Path, cfg: Config, resume: bool, force: bool) -> bool:
    """Create the run directory, or check that an existing one may be continued.

    Returns True when ``resume`` finds the run finished at ``cfg.rounds``: nothing to do, and nothing is written.
    Every refusal happens before anything in the directory changes.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a run directory; choose another run name or output folder")
    if run_dir.exists() and force:
        _check_deletable(run_dir)
        shutil.rmtree(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not resume:
            state = "finished" if (run_dir / "done").exists() else "interrupted"
            raise RunDirError(f"{run_dir} holds a {state} run; pass --resume to continue it or --force to start over")
        check_same_experiment(run_dir, cfg)
        rows = read_metrics(run_dir)  # a bad line in the middle is an error here, before anything is rewritten
        have = rows[-1]["round"] if rows else 0
        if cfg.rounds < have:
            raise RunDirError(
                f"{run_dir} already holds {have} rounds; --resume with rounds={cfg.rounds} cannot shorten it: "
                f"pass rounds >= {have}, or --force to start over"
            )
        if is_finished(run_dir, cfg.rounds, rows):
            return True
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.toml", dump_toml(cfg.to_dict()))
    return False
