"""Statistics over a group's seeds: final, best and rounds to a target, as mean ± std and how many of how many."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hafedho.report.runs import TEST_METRICS, Group, Section


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
    missing: int = 0  # finished runs that recorded no value of the metric (never counted as 0)

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
    """Final (or best) value over finished seeds; diverged seeds and finished ones without the metric are
    counted, never averaged."""
    values, missing = [], 0
    for run in group.finished():
        evals = run.evals(metric)
        if evals:
            values.append(final_value(evals, last) if kind == "final" else best_value(evals))
        else:
            missing += 1
    return Stat(values, len(group.runs), len(group.diverged()), missing)


def horizon_note(section: Section) -> str:
    """Groups whose finished seeds ran different numbers of rounds (``rounds`` is a horizon, not an axis)."""
    parts = []
    for g in section.groups:
        lengths = sorted({int(r.config.get("rounds", 0)) for r in g.finished()})
        if len(lengths) > 1:
            parts.append(f"{g.label} {', '.join(map(str, lengths))}")
    return f"seeds of different lengths pooled (rounds): {'; '.join(parts)}" if parts else ""


def no_data_note(section: Section, show: int = 5) -> str:
    """``"no data = finished runs that recorded no test/acc, never counted as 0: A (empty test set), B"``, the
    first ``show`` of them by name ('' if every finished run recorded it)."""
    bare = [r for g in section.groups for r in g.finished() if not r.evals(section.metric)]
    if not bare:
        return ""
    why = [
        f"{r.dir.name} (empty test set)" if section.metric in TEST_METRICS and r.empty_test else r.dir.name
        for r in bare
    ]
    more = f" and {len(why) - show} more" if len(why) > show else ""
    return (
        f"no data = finished runs that recorded no {section.metric}, never counted as 0: {', '.join(why[:show])}{more}"
    )


def rounds_stat(group: Group, metric: str, target: float) -> Stat:
    """Rounds to ``target`` over seeds that ended (finished or diverged); seeds never reaching it are excluded
    from the mean and counted in ``total``."""
    ended = [r for r in group.ended() if r.evals(metric)]
    hits = [rounds_to(r.evals(metric), target) for r in ended]
    return Stat([float(h) for h in hits if h is not None], len(ended), len(group.diverged()))


# "Has this curve flattened?" (a lead judged before the curves flatten may be a difference in speed only): the
# least-squares slope of the seed-mean curve over the last FLAT_WINDOW of its rounds, in points per 100 rounds;
# flattened when its magnitude is below FLAT_SLOPE.
FLAT_WINDOW = 0.2
FLAT_SLOPE = 1.0


@dataclass
class Trend:
    """Slope (percentage points per 100 rounds) of the seed-mean curve over its last rounds, its standard error,
    and how many evaluations it was fitted on."""

    slope: float
    se: float
    evals: int

    @property
    def flat(self) -> bool:
        return abs(self.slope) < FLAT_SLOPE


def trend(group: Group, metric: str) -> Trend | None:
    """``Trend`` of the mean over finished seeds of ``metric`` (x 100), on the rounds every seed evaluated, fitted
    over rounds ``t > (1 - FLAT_WINDOW) * T`` (T = the last of them); None below 3 evaluations there."""
    series = [dict(r.evals(metric)) for r in group.finished()]
    series = [s for s in series if s]
    if not series:
        return None
    rounds = sorted(set.intersection(*(set(s) for s in series)))
    t = np.array([r for r in rounds if rounds and r > (1 - FLAT_WINDOW) * rounds[-1]], dtype=float)
    if len(t) < 3:
        return None
    y = np.array([np.mean([s[int(r)] for s in series]) for r in t]) * 100
    slope, icept = np.polyfit(t, y, 1)
    resid = y - (slope * t + icept)
    se = math.sqrt(float(resid @ resid) / (len(t) - 2) / float(((t - t.mean()) ** 2).sum()))
    return Trend(float(slope) * 100, se * 100, len(t))
