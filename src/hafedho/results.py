"""The run directory: resolved config, environment, partition, metrics, checkpoints, markers.

    RUN/config.toml      the fully resolved config
    RUN/env.json         versions, git hash, hardware
    RUN/partition.json   client sizes and the partition hash
    RUN/run.json         facts logged once per run (e.g. HaFedHo's lambda*mu)
    RUN/metrics.jsonl    one JSON object per round (test/* on evaluated rounds)
    RUN/checkpoint.pt    everything needed to continue bit-identically
    RUN/done             written last; RUN/diverged holds the message of a run stopped by NaN

Every file is written atomically (temporary file + rename), so a killed process never leaves half a file.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


class RunDirError(ValueError):
    """A run directory in a state that does not fit the request (exists, corrupt, other config)."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines; a torn last line (a process killed mid-write) is dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_metrics(run_dir: Path, last_round: int) -> None:
    rows = [r for r in read_metrics(run_dir) if r["round"] <= last_round]
    atomic_write_text(Path(run_dir) / "metrics.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


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
