"""Run directories -> sections of groups (one group = one config over seeds), the input of every table and plot.

A section is one sweep (``OUT/sweeps/PRESET.json`` names its runs, their labels and grid points) or, for run
directories no sweep lists, all of them together. Within a section, runs are grouped by their config minus
``seed``/``name``/``out``. A group's *row* is its label (algorithm, or a variant such as ``centralized``) plus
the hyperparameters that vary between groups of that label; its *setting* (the column) is its grid point minus
the algorithm axes, or for plain runs its flattened config minus the algorithm.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hafedho.config import read_toml
from hafedho.results import read_metrics

# A centralised plain run (one client holding everything) ignores these keys, so it matches every column.
_CENTRAL_FREE = ("data.partition", "data.q", "data.num_clients", "data.min_size", "data.partition_seed")


@dataclass
class Run:
    dir: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    status: str  # done | diverged | incomplete | missing
    message: str = ""
    label: str = ""
    setting: dict[str, Any] = field(default_factory=dict)
    reference: bool = False

    def evals(self, metric: str) -> list[tuple[int, float]]:
        """(round, value) of every evaluated round that has ``metric``."""
        return [(int(r["round"]), float(r[metric])) for r in self.rows if r.get(metric) is not None]


@dataclass
class Group:
    """The runs (seeds) of one configuration."""

    label: str
    setting: dict[str, Any]
    hyper: dict[str, Any]
    reference: bool
    runs: list[Run] = field(default_factory=list)

    def finished(self) -> list[Run]:
        return [r for r in self.runs if r.status == "done"]

    def diverged(self) -> list[Run]:
        return [r for r in self.runs if r.status == "diverged"]

    def ended(self) -> list[Run]:
        """Runs whose curve is complete: finished or stopped by divergence."""
        return [r for r in self.runs if r.status in ("done", "diverged")]


@dataclass
class Section:
    name: str
    title: str
    description: str
    metric: str
    metric_label: str
    last: int
    report: dict[str, Any]
    axes: list[str]
    named_axes: set[str]
    groups: list[Group]
    failed: dict[str, str] = field(default_factory=dict)

    def names(self) -> dict[str, str]:
        return dict(self.report.get("names", {}))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def hyperparameters(config: dict[str, Any]) -> dict[str, Any]:
    """The selected algorithm's effective settings (``hafedho.algorithms.resolve_algorithm``); none for a config
    this version refuses."""
    from hafedho.algorithms import resolve_algorithm
    from hafedho.config import ConfigError

    try:
        return flatten(resolve_algorithm(config.get("algorithm", {}))[1])
    except ConfigError:
        return {}


def read_run(run_dir: Path) -> Run:
    """One run directory; ``missing`` when it has no config yet (a sweep's run that never started)."""
    cfg_path = run_dir / "config.toml"
    if not cfg_path.exists():
        return Run(run_dir, {}, [], "missing")
    rows = read_metrics(run_dir)
    if (run_dir / "done").exists():
        status, message = "done", ""
    elif (run_dir / "diverged").exists():
        status, message = "diverged", (run_dir / "diverged").read_text().strip()
    else:
        status, message = "incomplete", ""
    config = read_toml(cfg_path)
    return Run(run_dir, config, rows, status, message, label=str(config.get("algorithm", {}).get("name", "?")))


def _canonical(config: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in ("seed", "name", "out")}, sort_keys=True)


def _group(runs: list[Run]) -> list[Group]:
    groups: dict[tuple[str, str], Group] = {}
    for run in runs:
        key = (run.label, _canonical(run.config) if run.config else run.dir.name)
        if key not in groups:
            hyper = hyperparameters(run.config) if run.config else {}
            groups[key] = Group(run.label, run.setting, hyper, run.reference)
        groups[key].runs.append(run)
    return list(groups.values())


def _sweep_section(index_path: Path, metric: str | None, last: int | None) -> tuple[Section, set[Path]]:
    index = json.loads(index_path.read_text())
    base = index_path.parent.parent
    report = dict(index.get("report", {}))
    row_axes = set(index.get("row_axes", []))
    axes = [a for a in index.get("axes", []) if a not in row_axes]
    runs, used = [], set()
    for entry in index.get("runs", []):
        run = read_run(base / entry["dir"])
        used.add(run.dir.resolve())
        run.label, run.reference = entry.get("label", run.label), bool(entry.get("reference", False))
        run.setting = {k: v for k, v in entry.get("point", {}).items() if k in axes}
        if run.status == "missing" and entry["dir"] in index.get("failed", {}):
            run.message = index["failed"][entry["dir"]]
        runs.append(run)
    name = str(index.get("preset", index_path.stem))
    scale = index.get("scale")
    section = Section(
        name=name if not scale else f"{name}-{scale}",
        title=str(report.get("title", name)) + (f" ({scale} scale)" if scale else ""),
        description=str(index.get("description", "")),
        metric=metric or str(report.get("metric", "test/acc")),
        metric_label=metric or str(report.get("metric_label", "test accuracy")),
        last=last or int(report.get("last", 10)),
        report=report,
        axes=axes,
        named_axes={a for a in axes if "." not in a},
        groups=_group(runs),
        failed=dict(index.get("failed", {})),
    )
    return section, used


def _plain_section(run_dirs: list[Path], metric: str | None, last: int | None) -> Section:
    runs = [read_run(d) for d in run_dirs]
    for run in runs:
        cfg = run.config
        setting = flatten({k: v for k, v in cfg.items() if k not in ("seed", "name", "out", "algorithm")})
        if cfg.get("data", {}).get("num_clients") == 1:  # one client holding all data: centralised training
            run.label, run.reference = "centralized", True
            setting = {k: v for k, v in setting.items() if k not in _CENTRAL_FREE and not k.startswith("sampling.")}
        run.setting = setting
    axes = sorted({k for r in runs for k in r.setting})
    return Section(
        name="runs",
        title="Runs",
        description="",
        metric=metric or "test/acc",
        metric_label=metric or "test accuracy",
        last=last or 10,
        report={},
        axes=axes,
        named_axes=set(),
        groups=_group(runs),
    )


def load_sections(root: str | Path, metric: str | None = None, last: int | None = None) -> list[Section]:
    """One section per sweep index under ``root``, then one for the run directories no sweep lists."""
    root = Path(root)
    sections, used = [], set()
    for index_path in sorted(root.rglob("sweeps/*.json")):
        section, dirs = _sweep_section(index_path, metric, last)
        sections.append(section)
        used |= dirs
    plain = sorted(
        p.parent for p in root.rglob("config.toml") if p.parent.resolve() not in used and read_metrics(p.parent)
    )
    if plain:
        sections.append(_plain_section(plain, metric, last))
    return sections


# ----------------------------------------------------------------------------- statistics


def final_value(evals: list[tuple[int, float]], last: int) -> float:
    """Mean of the last ``last`` evaluations (smooths round-to-round noise)."""
    return float(np.mean([v for _, v in evals[-last:]]))


def best_value(evals: list[tuple[int, float]]) -> float:
    return float(max(v for _, v in evals))


def rounds_to(evals: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated round whose value reaches ``target``; None if it never does."""
    return next((r for r, v in evals if v >= target), None)


@dataclass
class Stat:
    """mean ± std (ddof 1) over the seeds that count, and how many of how many."""

    values: list[float]
    total: int
    diverged: int = 0

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else 0.0


def accuracy_stat(group: Group, metric: str, last: int, kind: str = "final") -> Stat:
    """Final (or best) value over finished seeds; diverged seeds are counted, never averaged."""
    values = []
    for run in group.finished():
        evals = run.evals(metric)
        if evals:
            values.append(final_value(evals, last) if kind == "final" else best_value(evals))
    return Stat(values, len(group.runs), len(group.diverged()))


def rounds_stat(group: Group, metric: str, target: float) -> Stat:
    """Rounds to ``target`` over seeds that ended (finished or diverged); seeds never reaching it are excluded
    from the mean and counted in ``total``."""
    ended = [r for r in group.ended() if r.evals(metric)]
    hits = [rounds_to(r.evals(metric), target) for r in ended]
    return Stat([float(h) for h in hits if h is not None], len(ended), len(group.diverged()))
