"""Accuracy tables (mean ± std over seeds) from run directories."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from hafedho.config import read_toml
from hafedho.results import read_metrics


def load_runs(root: str | Path) -> list[dict[str, Any]]:
    """Every run directory under ``root`` (a folder with config.toml and metrics.jsonl)."""
    runs = []
    for cfg_path in sorted(Path(root).rglob("config.toml")):
        run_dir = cfg_path.parent
        rows = [r for r in read_metrics(run_dir) if "test/acc" in r]
        if rows:
            cfg = read_toml(cfg_path)
            runs.append({"dir": run_dir, "config": cfg, "evals": rows, "done": (run_dir / "done").exists()})
    return runs


def summarize(evals: list[dict[str, Any]], last: int = 10) -> dict[str, float]:
    """Final accuracy = mean of the last ``last`` evaluations (smooths round-to-round noise); best = max."""
    acc = np.array([r["test/acc"] for r in evals])
    return {"final": float(acc[-last:].mean()), "best": float(acc.max()), "rounds": int(evals[-1]["round"])}


def mean_std(values: list[float]) -> str:
    v = np.array(values) * 100
    return f"{v.mean():.2f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.2f}"


def accuracy_table(runs: list[dict[str, Any]], last: int = 10) -> str:
    """Markdown table: one row per algorithm, final and best test accuracy (%) mean ± std over seeds."""
    by_alg: dict[str, list[dict[str, float]]] = defaultdict(list)
    for run in runs:
        by_alg[run["config"]["algorithm"]["name"]].append(summarize(run["evals"], last))
    lines = [
        f"| algorithm | seeds | final acc (%, mean of last {last} evals) | best acc (%) |",
        "|---|---|---|---|",
    ]
    for name, rows in sorted(by_alg.items()):
        finals = [r["final"] for r in rows]
        bests = [r["best"] for r in rows]
        lines.append(f"| {name} | {len(rows)} | {mean_std(finals)} | {mean_std(bests)} |")
    return "\n".join(lines) + "\n"
