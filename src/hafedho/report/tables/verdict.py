"""The verdict table: per column, the study's own method (``[report] own``, ``report.study``) against the best
baseline and its derived row, with one plain verdict.

The rule (docs/results/README.md states it): a difference counts only when it exceeds the larger of the two
standard deviations over at least ``MIN_SEEDS`` seeds. Then

    own beats the best baseline, and also its derived row (or none exists)  -> "holds"
    own beats the best baseline, but not its derived row                    -> "holds, but the NOUN matches it
                                                                               (MATCHES)" (``[report.derived]``)
    no difference counts                                                    -> "tie"
    the best baseline beats own                                             -> "does not hold"

Baselines are the layout's (``Layout.is_baseline``: no reference, no derived row, no row running the own method
under another label); the derived row is the one the sweep made with ``of = OWN``. A label split into several
rows by a hyperparameter (fig3's mu) counts with its best row. A baseline that divergence alone leaves short of
``MIN_SEEDS`` finished seeds (every seed either diverged or finished, fewer than 3 finished) is not a candidate for
the best baseline: it failed in most seeds, and its surviving seed is not its score. One whose seeds have not all
run yet still is, so the verdict waits for them. The paper's study: HaFedHo and its momentum twin.

What is compared is the section's measure, ``[report] verdict``: "final" (default) the final value of the metric,
higher is better; "rounds" the rounds to reach the column's highest target (``to_target.targets_for``; at CPU
scale 100% of FedAvg's final accuracy), fewer is better, over rows whose every ended seed reached it (a row that
some seed never brought there is slower than one that all did). Rounds are kept negated in the ``Stat``, so one
rule, "higher wins by more than the larger std", serves both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hafedho.config import ConfigError
from hafedho.report.layout import Layout, pct
from hafedho.report.stats import Stat, accuracy_stat, rounds_stat
from hafedho.report.study import Study
from hafedho.report.table import Cell, Table
from hafedho.report.tables.to_target import targets_for

MIN_SEEDS = 3

HOLDS = "holds"
MATCHES = "holds, but the derived row matches it"
TIE = "tie"
FAILS = "does not hold"


def beats(a: Stat, b: Stat) -> bool:
    """``a`` is higher than ``b`` by more than the larger of their standard deviations."""
    return a.mean - b.mean > max(a.std, b.std)


def ranks(st: Stat) -> bool:
    """``st`` can be the best baseline: enough finished seeds, or seeds still to come, or no divergence."""
    return st.n >= MIN_SEEDS or not st.diverged or st.n + st.diverged + st.missing < st.total


def matches_text(study: Study) -> str:
    """The verdict where own beats the best baseline but not its derived row, in the study's words."""
    return f"holds, but the {study.derived.noun} matches it ({study.derived.matches})"


def verdict(own: Stat, baseline: Stat, derived: Stat | None, matches: str = MATCHES) -> str:
    """The plain verdict of the module docstring (``matches`` where the derived row ``derived`` matches own); too
    few seeds on either side is said, never judged."""
    n = min(own.n, baseline.n)
    if n < MIN_SEEDS:
        return f"not judged: {n} seed{'s' if n != 1 else ''} (needs {MIN_SEEDS})"
    if beats(own, baseline):
        if derived is not None and derived.n >= MIN_SEEDS and not beats(own, derived):
            return matches
        return HOLDS
    return FAILS if beats(baseline, own) else TIE


@dataclass
class Judged:
    """One column's verdict and what it compares: own, the best baseline (and its label), the derived row."""

    own: Stat
    base: Stat
    base_label: str
    derived: Stat | None
    text: str


def judge(lay: Layout, col: dict) -> Judged | None:
    """The verdict of one column of the layout; None where own or every baseline has no finished seed."""
    s = lay.section
    labels = {r[0] for r in lay.rows}
    base_labels = {r[0] for r in lay.rows if lay.is_baseline(r)}
    derived_label = next((t for t, of in s.derived.items() if of == s.study.own), None)
    best = {lab: best_of(lay, lab, col) for lab in labels}
    own = best.get(s.study.own)
    baselines = [(st, lab) for lab, st in best.items() if lab in base_labels and st is not None and st.n and ranks(st)]
    if own is None or not own.n or not baselines:
        return None
    base, base_label = max(baselines, key=lambda t: t[0].mean)
    derived = best.get(derived_label) if derived_label is not None else None
    derived = derived if derived is not None and derived.n else None
    return Judged(own, base, base_label, derived, verdict(own, base, derived, matches_text(s.study)))


def verdict_table(lay: Layout) -> list[Table]:
    """One row per column of the layout where own and a baseline both have finished seeds."""
    s = lay.section
    study = s.study
    if not study.own or study.own not in {r[0] for r in lay.rows}:
        return []
    header = ["setting", study.own_name, "best baseline", f"{study.derived.noun} ({study.derived.name})", "verdict"]
    rows = []
    for col in lay.columns:
        j = judge(lay, col)
        if j is None:
            continue
        rows.append(
            [
                Cell(lay.col_name(col) if lay.col_keys else s.title),
                Cell(show(lay, j.own)),
                Cell(f"{lay.section.names().get(j.base_label, j.base_label)}: {show(lay, j.base)}"),
                Cell(show(lay, j.derived) if j.derived is not None else "none"),
                Cell(j.text),
            ]
        )
    if not rows:
        return []
    what = f"final {s.metric_label} (%)" if not by_rounds(lay) else f"rounds to the highest target {s.metric_label}"
    note = (
        f"{what}, mean ± std over seeds; a difference counts only when it exceeds the larger "
        f"of the two standard deviations over at least {MIN_SEEDS} seeds; a label with several rows counts with "
        f"its best; a baseline whose divergence leaves it fewer than {MIN_SEEDS} finished seeds is not the best"
    )
    return [Table("verdict", f"Verdict: {s.title}", header, rows, note)]


def by_rounds(lay: Layout) -> bool:
    """The section judges rounds to target (``[report] verdict = "rounds"``), not the final value."""
    how = lay.section.report.get("verdict", "final")
    if how not in ("final", "rounds"):
        raise ConfigError(f'report.verdict: {how!r} is not a measure; use "final" or "rounds"')
    return how == "rounds"


def best_of(lay: Layout, label: str, col: dict) -> Stat | None:
    """``label``'s best row in ``col`` under the section's measure: its final value, or minus its rounds to the
    column's highest target among rows whose every ended seed reached it (None where no row counts)."""
    s = lay.section
    groups = [g for r in lay.rows if r[0] == label and (g := lay.group_at(r, col))]
    if not by_rounds(lay):
        stats = [accuracy_stat(g, s.metric, s.last) for g in groups]
        stats = [st for st in stats if math.isfinite(st.mean)]
    elif groups and (targets := targets_for(lay, col)[0]):
        reached = [st for g in groups if (st := rounds_stat(g, s.metric, targets[-1])).total and st.n == st.total]
        stats = [Stat([-v for v in st.values], st.total, st.diverged) for st in reached]
    else:
        stats = []
    return max(stats, key=lambda st: st.mean) if stats else None


def show(lay: Layout, st: Stat) -> str:
    """A measured value as the verdict table reads it: percent, or rounds."""
    if not by_rounds(lay):
        return pct(st)
    return f"{-st.mean:.1f} ± {st.std:.1f} rounds" if st.n > 1 else f"{-st.mean:.0f} rounds"
