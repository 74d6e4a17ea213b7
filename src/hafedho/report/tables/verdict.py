"""The verdict table: per column, HaFedHo against the best baseline and its momentum twin, with one plain verdict.

The rule (docs/results/README.md states it): a difference counts only when it exceeds the larger of the two
standard deviations over at least ``MIN_SEEDS`` seeds. Then

    HaFedHo beats the best baseline, and also its twin (or no twin exists)  -> "holds"
    HaFedHo beats the best baseline, but not its twin                       -> "holds, but the twin matches it
                                                                               (the gain is server momentum)"
    no difference counts                                                    -> "tie"
    the best baseline beats HaFedHo                                         -> "does not hold"

Baselines are the layout's (``Layout.is_baseline``: no reference, no momentum twin, no row running HaFedHo, such
as Proposition 1's ideal); the twin is the row the sweep made with ``twin_of = "hafedho"``. A label split into
several rows by a hyperparameter (fig3's mu) counts with its best row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hafedho.report.layout import Layout, pct
from hafedho.report.stats import Stat, accuracy_stat
from hafedho.report.table import Cell, Table

MIN_SEEDS = 3
OWN = "hafedho"

HOLDS = "holds"
TWIN_MATCHES = "holds, but the twin matches it (the gain is server momentum)"
TIE = "tie"
FAILS = "does not hold"


def beats(a: Stat, b: Stat) -> bool:
    """``a`` is higher than ``b`` by more than the larger of their standard deviations."""
    return a.mean - b.mean > max(a.std, b.std)


def verdict(own: Stat, baseline: Stat, twin: Stat | None) -> str:
    """The plain verdict of the module docstring; too few seeds on either side is said, never judged."""
    n = min(own.n, baseline.n)
    if n < MIN_SEEDS:
        return f"not judged: {n} seed{'s' if n != 1 else ''} (needs {MIN_SEEDS})"
    if beats(own, baseline):
        if twin is not None and twin.n >= MIN_SEEDS and not beats(own, twin):
            return TWIN_MATCHES
        return HOLDS
    return FAILS if beats(baseline, own) else TIE


@dataclass
class Judged:
    """One column's verdict and what it compares: HaFedHo, the best baseline (and its label), the twin."""

    own: Stat
    base: Stat
    base_label: str
    twin: Stat | None
    text: str


def judge(lay: Layout, col: dict) -> Judged | None:
    """The verdict of one column of the layout; None where HaFedHo or every baseline has no finished seed."""
    s = lay.section
    labels = {r[0] for r in lay.rows}
    base_labels = {r[0] for r in lay.rows if lay.is_baseline(r)}
    twin_label = next((t for t, of in s.twins.items() if of == OWN), None)
    best = {lab: best_of(lay, lab, col) for lab in labels}
    own = best.get(OWN)
    baselines = [(st, lab) for lab, st in best.items() if lab in base_labels and st is not None and st.n]
    if own is None or not own.n or not baselines:
        return None
    base, base_label = max(baselines, key=lambda t: t[0].mean)
    twin = best.get(twin_label) if twin_label is not None else None
    twin = twin if twin is not None and twin.n else None
    return Judged(own, base, base_label, twin, verdict(own, base, twin))


def verdict_table(lay: Layout) -> list[Table]:
    """One row per column of the layout where HaFedHo and a baseline both have finished seeds."""
    s = lay.section
    if OWN not in {r[0] for r in lay.rows}:
        return []
    header = ["setting", "HaFedHo", "best baseline", "twin (FedAvgM, β = λμ)", "verdict"]
    rows = []
    for col in lay.columns:
        j = judge(lay, col)
        if j is None:
            continue
        rows.append(
            [
                Cell(lay.col_name(col) if lay.col_keys else s.title),
                Cell(pct(j.own)),
                Cell(f"{lay.section.names().get(j.base_label, j.base_label)}: {pct(j.base)}"),
                Cell(pct(j.twin) if j.twin is not None else "none"),
                Cell(j.text),
            ]
        )
    if not rows:
        return []
    note = (
        f"final {s.metric_label} (%), mean ± std over seeds; a difference counts only when it exceeds the larger "
        f"of the two standard deviations over at least {MIN_SEEDS} seeds; a label with several rows counts with "
        "its best"
    )
    return [Table("verdict", f"Verdict: {s.title}", header, rows, note)]


def best_of(lay: Layout, label: str, col: dict) -> Stat | None:
    s = lay.section
    stats = [accuracy_stat(g, s.metric, s.last) for r in lay.rows if r[0] == label and (g := lay.group_at(r, col))]
    stats = [st for st in stats if math.isfinite(st.mean)]
    return max(stats, key=lambda st: st.mean) if stats else None
