"""The robustness table: per setting, the verdict under each protocol column and whether it survives them all.

A preset with a ``protocol`` axis (``_common.toml``: main, head; ``_tuned_long.toml``: main-long) runs every
setting under each protocol. Per setting (the layout's column minus ``protocol``) this table shows the verdict of
``verdict.judge`` under each protocol, and:

    holds in every protocol column                   -> "holds (robust)"
    anything else (another verdict, or not run yet)  -> "not robust: holds under main; tie under head; ..."

plus, per protocol, the derived row's share of own's gain over the reference (``[report] own``, ``reference``,
``report.study``; the paper's: the twin's share of HaFedHo's gain over FedAvg), (derived - reference) /
(own - reference), from the final means (only where own beats the reference's mean). A last row counts the robust
settings.

A section with no baseline in any column (fig3: HaFedHo against itself, phi against f) has no verdict to carry
across protocols, so it gets no robustness table rather than one that reads "not run" everywhere.
"""

from __future__ import annotations

from typing import Any

from hafedho.report.layout import Layout, display
from hafedho.report.table import Cell, Table
from hafedho.report.tables.verdict import HOLDS, MIN_SEEDS, Judged, best_of, by_rounds, judge

AXIS = "protocol"
ROBUST = "holds (robust)"
NOT_RUN = "not run"


def robust_verdict(verdicts: dict[str, str]) -> str:
    """``ROBUST`` when every protocol's verdict is "holds"; otherwise each protocol's verdict, in order."""
    if verdicts and all(v == HOLDS for v in verdicts.values()):
        return ROBUST
    return "not robust: " + "; ".join(f"{v} under {p}" for p, v in verdicts.items())


def derived_share(lay: Layout, col: dict[str, Any], j: Judged | None) -> str:
    """(derived - reference) / (own - reference) in this column (``j``: its verdict), as a percentage; why not where
    it is undefined."""
    study = lay.section.study
    ref = best_of(lay, study.reference, col) if study.reference else None
    if j is None or j.derived is None or ref is None or not ref.n:
        return "—"
    gain = j.own.mean - ref.mean
    if gain <= 0:
        return f"n/a ({study.own_name} ≤ {study.reference_name})"
    return f"{100 * (j.derived.mean - ref.mean) / gain:.0f}%"


def robustness_table(lay: Layout) -> list[Table]:
    """One row per setting of a section run under several protocols; none for a section without that axis."""
    s = lay.section
    study = s.study
    if AXIS not in lay.col_keys or not study.own or study.own not in {r[0] for r in lay.rows}:
        return []
    protocols = list(dict.fromkeys(str(g.setting[AXIS]) for g in s.groups if g.setting.get(AXIS) is not None))
    names = s.names()
    heads = [display(AXIS, p, names, True) for p in protocols]
    settings = lay.columns_without(AXIS)
    judged = [(c, judge(lay, c)) for c in lay.columns]  # each column judged once
    if not any(j for _, j in judged):  # no baseline anywhere: the study's verdict does not apply
        return []
    rows, robust = [], 0
    for rest in settings:
        verdicts, shares = {}, []
        for p, head in zip(protocols, heads, strict=True):
            col = {**rest, AXIS: p}
            j = next((j for c, j in judged if c == col), None)
            verdicts[head] = j.text if j is not None else NOT_RUN
            shares.append(derived_share(lay, col, j) if j is not None else "—")
        overall = robust_verdict(verdicts)
        robust += overall == ROBUST
        name = lay.col_name(rest) if rest else s.title
        rows.append([Cell(name), *(Cell(v) for v in verdicts.values()), *(Cell(x) for x in shares), Cell(overall)])
    rows.append(
        [Cell("all settings"), *(Cell("") for _ in range(2 * len(heads))), Cell(f"{ROBUST} in {robust} of {len(rows)}")]
    )
    noun, own, ref = study.derived.noun, study.own_name, study.reference_name
    header = ["setting", *heads, *(f"{noun} share, {h}" for h in heads), "across protocols"]
    note = (
        f"the verdict table's rule (>= {MIN_SEEDS} seeds, a difference beyond the larger std) under each protocol; "
        f'"{ROBUST}" only where it holds under every one; {noun} share = ({noun} - {ref}) / ({own} - {ref}) of the '
        f"{'mean rounds to target' if by_rounds(lay) else 'final means'}: how much of {own}'s gain over {ref} "
        f"{study.derived.share}"
    )
    return [Table("robustness", f"Robustness: {s.title}", header, rows, note)]
