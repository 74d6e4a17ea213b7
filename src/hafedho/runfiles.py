"""The run directory: resolved config, environment, partition, metrics, checkpoints, markers.

    RUN/config.toml      the fully resolved config
    RUN/env.json         versions, git hash, hardware
    RUN/partition.json   client sizes and the partition hash
    RUN/run.json         facts logged once per run (e.g. HaFedHo's lambda*mu)
    RUN/metrics.jsonl    one JSON object per round (test/* on evaluated rounds)
    RUN/checkpoint.pt    everything needed to continue bit-identically
    RUN/done             written last; RUN/diverged holds the message of a run stopped by NaN

These are the files' formats and primitives; ``hafedho.runtime.rundir.RunDir`` is what runtimes write them through,
and ``run_state`` the one reader of a run's state (new, interrupted, done, short, diverged) that every caller uses.
Every file is written atomically (a temporary file unique to the writer, then a rename), so a killed process
never leaves half a file. One process at a time writes a run: ``RunLock`` (``.locks/NAME.lock`` beside the run
directory's real path, so two paths to one directory, e.g. through a symbolic link, take one lock).
Nothing is written through a symbolic link: appends and the lock open with ``O_NOFOLLOW`` (``open_no_link``), a
temporary file is always created new, and a run directory whose files are links is refused on resume.
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import secrets
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

# The end markers: RunDir writes them (mark_done, mark_diverged), run_state reads them; no other module names them.
DONE = "done"
DIVERGED = "diverged"


class RunDirError(ValueError):
    """A run directory in a state that does not fit the request (exists, corrupt, other config)."""


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 where the platform has none: ``open_no_link`` checks by lstat/fstat


def link_error(path: Path, what: str, fix: str = "remove it, then run again") -> RunDirError:
    """The one line for a symbolic link found where a run writes ``what``."""
    return RunDirError(f"{path} is a symbolic link, not {what}; nothing is written through it: {fix}")


def refuse_link(path: Path, what: str, fix: str = "remove it, then run again") -> None:
    """Refuse a symbolic link at ``path``, to a file or a folder (``link_error``): nothing is written through one,
    so a planted link never sends a write outside the run's folders."""
    if path.is_symlink():
        raise link_error(path, what, fix)


def no_link(path: Path, what: str, fix: str = "remove it, then run again") -> None:
    """``refuse_link``, and refuse anything else but a regular file at ``path`` (a missing one is fine)."""
    refuse_link(path, what, fix)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise RunDirError(f"{path} is not a regular file, not {what}: {fix}")


def open_no_link(path: Path, flags: int, what: str, fix: str = "remove it, then run again") -> int:
    """``os.open(path, flags)`` that never follows a link (``O_NOFOLLOW`` where the platform has it, else an lstat
    before and an identity check after) and opens only a regular file; a refusal is one ``RunDirError`` line."""
    no_link(path, what, fix)
    try:
        fd = os.open(path, flags | NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted after the lstat
            raise link_error(path, what, fix) from None
        raise named(e, path) from None
    st = os.fstat(fd)
    try:
        now = os.lstat(path)
    except OSError:
        now = None
    if not stat.S_ISREG(st.st_mode) or now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise RunDirError(f"{path} is not a regular file, not {what}: {fix}")
    return fd


def named(e: OSError, path: Path) -> OSError:
    """``e`` with ``path`` as its file name when it has none (a failed write, e.g. a full disk, names no file)."""
    if e.filename is None and e.errno is not None:
        return type(e)(e.errno, e.strerror, str(path))
    return e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temporary file beside ``path``, synced, then renamed onto ``path``: a reader (or a run
    killed at any moment) sees the old file or the whole new one, never part of it. The temporary file is created
    new (``O_EXCL``, never through a link); a link at ``path`` is replaced by the file, its target left untouched."""
    # pid + random suffix: two writers (or a writer and a killed one's leftover) never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o666)
    except OSError as e:  # not ours (a planted file or link): left in place
        raise named(e, tmp) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise named(e, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# Every row has these (``runtime.rounds.ServerRounds.finish_round``); its numbers are finite, but for NONFINITE_OK.
REQUIRED_KEYS = ("round", "cohort_size", "wall_s", "bytes_up", "bytes_down")
NONFINITE_OK = frozenset({"test/loss"})  # a finite model can still give an infinite loss on a test example


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics rows, rounds strictly increasing, each with ``REQUIRED_KEYS`` and finite numbers.

    Only a torn last line (a process killed mid-write: no newline and not valid JSON) of an unfinished run is
    dropped. Any other bad line, and a torn one in a finished run (``done``: no writer was killed, so a row is
    lost), raises ``RunDirError`` naming it, so a row is never silently lost.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # after the last newline: b"" when the file ends cleanly, else an unterminated last line
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        rows.append(_metrics_row(path, i, line, rows[-1]["round"] if rows else 0))
    if tail:
        try:
            json.loads(tail)
        except ValueError:
            if (Path(run_dir) / DONE).exists():
                after = f"round {rows[-1]['round']}" if rows else "none"
                raise RunDirError(
                    f"{path}: line {len(lines) + 1} is cut short, yet the run is done, so the row after {after} is "
                    "lost (no killed writer leaves that): restore metrics.jsonl, or recompute the run with --force"
                ) from None
            return rows  # torn: the process died while writing it; the round is recomputed on --resume
        rows.append(_metrics_row(path, len(lines) + 1, tail, rows[-1]["round"] if rows else 0))
    return rows


def _metrics_row(path: Path, lineno: int, line: bytes, prev: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError:
        row, what = None, "not valid JSON"
    else:
        what = _row_problem(row)
    if what is None:
        if row["round"] > prev:
            return row
        what = f"round {row['round']} after round {prev}"
    shown = line[:60].decode(errors="replace")
    raise RunDirError(
        f"{path}: line {lineno} is {what} ({shown!r}); only a torn last line is repaired: "
        "fix or delete that line, or start the run over with --force"
    )


def _row_problem(row: Any) -> str | None:
    """What makes ``row`` no metrics row (a dict with ``REQUIRED_KEYS``, integer counts, finite numbers), or None."""
    if not isinstance(row, dict):
        return "not a metrics row"
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        return f"not a metrics row (no {', '.join(missing)})"
    wrong = [k for k in REQUIRED_KEYS if k != "wall_s" and (type(row[k]) is not int or row[k] < 0)]
    if wrong or isinstance(row["wall_s"], bool) or not isinstance(row["wall_s"], int | float):
        return f"not a metrics row ({(wrong or ['wall_s'])[0]} is {row[(wrong or ['wall_s'])[0]]!r})"
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v) and k not in NONFINITE_OK]
    return f"a row with {bad[0]} = {row[bad[0]]} (a run stops before it logs one)" if bad else None


def append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    path = Path(run_dir) / "metrics.jsonl"
    fd = open_no_link(
        path,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        "the run's metrics",
        "replace it by the file it points to (or remove it), then --resume",
    )
    try:
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise named(e, path) from None


def truncate_metrics(run_dir: Path, last_round: int) -> None:
    rows = [r for r in read_metrics(run_dir) if r["round"] <= last_round]
    atomic_write_text(Path(run_dir) / "metrics.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


class RunBusy(RunDirError):
    """Another process is writing this run directory."""


class RunLock:
    """An advisory lock per run (``.locks/NAME.lock`` beside the run directory's real path) that every writer of
    a run takes through ``runtime.rundir.RunDir`` (the simulator's ``run``, so ``hafedho run``, demos and sweeps;
    the Flower strategy).
    The OS drops it when the holder dies, so a killed process never leaves a stale lock. ``with RunLock(d) as
    held``: ``held`` is False when someone else holds it (even in this process); the holder's pid is then in
    ``holder``. Without ``fcntl`` (Windows) every run counts as unlocked. The lock file (and its ``.locks``
    folder) is never a symbolic link: one is refused, never written through (it would replace a file elsewhere
    with a pid)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir = Path(run_dir).resolve()  # the real path: a symbolic link to a run directory takes its lock
        self.path = run_dir.parent / ".locks" / f"{run_dir.name}.lock"
        self.holder = "?"
        self.file: Any = None

    def __enter__(self) -> bool:
        folder = self.path.parent
        refuse_link(folder, "the run lock folder")
        make_folder(folder)
        try:
            import fcntl
        except ImportError:
            return True
        # not truncated before the lock is ours: it names the holder; never opened through a link
        fd = open_no_link(self.path, os.O_RDWR | os.O_CREAT, "a lock file", "remove it, then run again")
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            self.holder = f.read().strip() or "?"
            f.close()
            return False
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.file = f
        return True

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the lock
            self.file = None


def make_folder(folder: Path, what: str = "output folder (out = ... or --out)") -> None:
    """``mkdir -p`` with one-line errors for a path through a file or a folder we may not write; the fix names
    ``what`` the folder is, and the key that chose it."""
    folder = Path(folder)
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                raise RunDirError(f"{p} is a file, not a folder; choose another {what}")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create {folder}: {e.strerror}; choose a writable {what}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RunDirError(f"cannot write to {folder}: permission denied; choose a writable {what}")


def environment() -> dict[str, Any]:
    try:
        git = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = ""
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "git": git or None,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


@dataclass(frozen=True)
class RunState:
    """What a run directory holds (``run_state``)."""

    status: str  # new | interrupted | done | short | diverged
    rounds_done: int = 0  # the last round metrics.jsonl holds (0: no row, or an unreadable file)
    message: str = ""  # a diverged run's marker text


def run_state(run_dir: Path, rounds: int | None = None, rows: list[dict[str, Any]] | None = None) -> RunState:
    """The state of the run in ``run_dir``, the one reader of what ``RunDir`` writes (its markers, its rows):

        new          nothing of a run: no folder, or one with no config.toml, marker or row
        interrupted  started, no marker: stopped, killed or still running (a caller that tells "busy" apart takes
                     the ``RunLock``). A folder holding only config.toml/env.json is interrupted, not new: its run
                     started (``hafedho run`` refuses it without --resume, a sweep resumes it, the report counts
                     it incomplete)
        done         the done marker, with rows that reach the horizon ``rounds`` when one is given
        short        the done marker, short of ``rounds`` (or with metrics.jsonl unreadable): to be extended
        diverged     the diverged marker; ``message`` holds its text

    Given a horizon ``rounds``, a run that went on past it is done at it, whatever happened after: another preset
    extended it, then it stopped or diverged (its rows up to the horizon are final). A diverged run got past it
    with a row at the horizon (the diverging round logs none); an unmarked one needs a row after it, since at
    exactly the horizon its writer may still be finishing (checkpoint, marker) or was killed doing so.
    ``rows``: the metrics already read; else they are read here, and an unreadable file counts as no row (the
    run's writer names the problem when it resumes it).
    """
    run_dir = Path(run_dir)
    unreadable = False
    if rows is None:
        try:
            rows = read_metrics(run_dir)
        except RunDirError:
            rows, unreadable = [], True
    last = int(rows[-1]["round"]) if rows else 0
    if (run_dir / DONE).exists():
        return RunState("short" if rounds and last < rounds else "done", last)
    diverged = (run_dir / DIVERGED).exists()
    if rounds and (last > rounds or (diverged and last == rounds)):
        return RunState("done", last)
    if diverged:
        return RunState("diverged", last, (run_dir / DIVERGED).read_text().strip())
    if rows or unreadable or (run_dir / "config.toml").exists():
        return RunState("interrupted", last)
    return RunState("new")


def why_no_rows(run_dir: Path) -> str:
    """Why a run directory with no metrics row is left out of the tables (the status table says it)."""
    state = run_state(run_dir, rows=[])
    if state.status == "done":
        return "done, yet metrics.jsonl holds no row (its rows are lost): recompute it with --force"
    if state.status == "diverged":
        return state.message
    return "no round logged: stopped (or still running) before its first round; continue it with --resume"
