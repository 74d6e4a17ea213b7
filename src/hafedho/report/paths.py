"""Paths as a report prints them: relative to the folder reported (or the working directory), never the
absolute path of the machine that wrote a run or the report."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

# An absolute POSIX path inside a message: starts at "/" after a space, quote or the start, ends at white space.
_ABS_PATH = re.compile(r"(?<![^\s'\"`(])/[^\s'\"`()<>,;]+")


def _under(path: Path, root: Path) -> PurePosixPath | None:
    try:
        return PurePosixPath(path.resolve().relative_to(root.resolve()).as_posix())
    except ValueError:
        return None


def relative_paths(text: str, run_dir: Path, root: Path) -> str:
    """``text`` with each absolute path under ``root``, or into the run's own folder, written relative to
    ``root``. The run's folder is also found by its name, so a path written where the folder once lay (another
    machine, another checkout) reads as the same relative path: ``RUN/checkpoint.pt``."""
    run = _under(run_dir, root) or PurePosixPath(run_dir.name)

    def rel(match: re.Match[str]) -> str:
        token = match.group(0).rstrip(".")  # a sentence's full stop is not part of the path
        trail = match.group(0)[len(token) :]
        path = PurePosixPath(token)
        inside = _under(Path(path), root)
        if inside is None and run_dir.name in path.parts:
            at = len(path.parts) - 1 - path.parts[::-1].index(run_dir.name)
            inside = run.joinpath(*path.parts[at + 1 :])
        return match.group(0) if inside is None else f"{inside}{trail}"

    return _ABS_PATH.sub(rel, text)


def shown_path(path: str | Path) -> str:
    """``path`` as a report prints it: relative to the working directory when under it, else the folder's name
    (never the absolute path of the machine that wrote the report)."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.name
