"""Accuracy-per-round plots with a band over seeds."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt
import numpy as np


def accuracy_curves(runs: list[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """One line per algorithm (mean over seeds) with a ±1 std band; rounds aligned across seeds."""
    curves: dict[str, list[dict[int, float]]] = defaultdict(list)
    for run in runs:
        curves[run["config"]["algorithm"]["name"]].append({r["round"]: r["test/acc"] for r in run["evals"]})
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, seeds in sorted(curves.items()):
        rounds = sorted(set.intersection(*(set(s) for s in seeds)))
        acc = np.array([[s[r] for r in rounds] for s in seeds]) * 100
        mean, std = acc.mean(0), acc.std(0)
        ax.plot(rounds, mean, label=f"{name} ({len(seeds)} seeds)")
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
