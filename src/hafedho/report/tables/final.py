"""The final and best accuracy tables: mean ± std over seeds, the best competitor bold, HaFedHo's lead."""

from __future__ import annotations

import math
from typing import Any

from hafedho.report.layout import TWIN_NAME, Layout, pct
from hafedho.report.stats import Stat, accuracy_stat, horizon_note, no_data_note
from hafedho.report.table import Cell, Table


def _acc_cell(stat: Stat, seeds: int) -> str:
    if stat.n == 0:
        parts = [
            f"{what} ({k}/{stat.total})" for what, k in (("diverged", stat.diverged), ("no data", stat.missing)) if k
        ]
        return ", ".join(parts) or "—"
    text = pct(stat)
    if stat.n < seeds and not stat.diverged and not stat.missing:
        text += f" (n={stat.n})"
    if stat.missing:
        text += f" ({stat.missing}/{stat.total} no data)"
    if stat.diverged:
        text += f" ({stat.diverged}/{stat.total} diverged)"
    return text


def accuracy_tables(lay: Layout) -> list[Table]:
    """Final and best accuracy: rows x columns, mean ± std over seeds, best competitor per column in bold,
    and HaFedHo's lead over the best baseline. With a single column, one table with a seeds column."""
    s = lay.section
    what = f"{s.metric_label} (%), mean ± std over seeds"
    for extra in (no_data_note(s), horizon_note(s)):
        what += f"; {extra}" if extra else ""
    final_def = f"final = mean of the last {s.last} evaluations"
    twin_note = _twin_note(lay)
    if len(lay.columns) == 1:
        col = lay.columns[0]
        stats = {
            r: (g, accuracy_stat(g, s.metric, s.last), accuracy_stat(g, s.metric, s.last, "best"))
            for r in lay.rows
            if (g := lay.group_at(r, col)) is not None
        }
        best = _best(stats, lay, lambda v: v[1].mean)
        best_b = _best(stats, lay, lambda v: v[2].mean)
        rows = [
            [
                Cell(lay.row_name(r)),
                Cell(str(len(v[0].runs))),
                Cell(_acc_cell(v[1], lay.seeds), r in best),
                Cell(_acc_cell(v[2], lay.seeds), r in best_b),
            ]
            for r, v in stats.items()
        ]
        header = ["algorithm", "seeds", f"final {s.metric_label} (%, mean of last {s.last} evals)", "best (%)"]
        title = f"{s.title}: {lay.col_name(col)}" if lay.col_keys else s.title
        return [Table("final", title, header, rows + _lead_rows(lay, [col], "final"), what + twin_note)]
    tables = []
    for kind, label in (("final", "Final"), ("best", "Best")):
        header = ["algorithm", *(lay.col_name(c) for c in lay.columns)]
        rows = []
        best = {}
        for ci, col in enumerate(lay.columns):
            stats = {r: accuracy_stat(g, s.metric, s.last, kind) for r in lay.rows if (g := lay.group_at(r, col))}
            best[ci] = _best(stats, lay, lambda v: v.mean)
        for r in lay.rows:
            cells = [Cell(lay.row_name(r))]
            for ci, col in enumerate(lay.columns):
                g = lay.group_at(r, col)
                cells.append(
                    Cell(_acc_cell(accuracy_stat(g, s.metric, s.last, kind), lay.seeds), r in best[ci])
                    if g
                    else Cell("")
                )
            rows.append(cells)
        rows += _lead_rows(lay, lay.columns, kind)
        note = f"{what}; {final_def}" if kind == "final" else what
        if hyper_note := lay.column_hyper_note():
            note += f"; {hyper_note}"
        if kind == "final":
            note += twin_note
        tables.append(Table(kind, f"{label} {s.metric_label}: {s.title}", header, rows, note))
    return tables


def _best(stats: dict, lay: Layout, key: Any) -> set:
    """The competitor rows with the highest finite mean (all of them on a tie; references never count)."""
    cands = [(key(v), r) for r, v in stats.items() if not lay.is_reference(r) and math.isfinite(key(v))]
    top = max((c[0] for c in cands), default=None)
    return {r for v, r in cands if v == top}


def _twin_note(lay: Layout) -> str:
    """What a momentum-twin row is, and the sweep's notes (e.g. the cells that have no twin, and why); '' if none."""
    s = lay.section
    lines = []
    if any(lay.is_twin(r) for r in lay.rows):
        lines.append(
            f"{TWIN_NAME}: HaFedHo's momentum twin, FedAvgM with beta = lambda*mu of the HaFedHo run beside it, "
            "uniform weights, server_lr 1 and the same local lr (docs/algorithms.md, HaFedHo's momentum twin)"
        )
    return "".join(f"\n{line}" for line in [*lines, *s.notes])


def _lead_rows(lay: Layout, cols: list[dict[str, Any]], kind: str) -> list[list[Cell]]:
    """HaFedHo minus the best other competitor (momentum twins aside), and minus its twin, in percentage points,
    when both exist."""
    own = ("hafedho", ())
    if own not in lay.rows:
        return []
    baselines = [r for r in lay.rows if r != own and not lay.is_reference(r) and not lay.is_twin(r)]
    twins = [r for r in lay.rows if lay.section.twins.get(r[0]) == "hafedho" and not lay.is_reference(r)]
    out = []
    for name, against in (
        ("HaFedHo lead over best baseline (pp)", baselines),
        ("HaFedHo lead over its twin (pp)", twins),
    ):
        out += _lead_row(lay, cols, kind, name, own, against)
    return out


def _lead_row(
    lay: Layout, cols: list[dict[str, Any]], kind: str, name: str, own: tuple, against: list[tuple]
) -> list[list[Cell]]:
    s = lay.section
    cells, any_value = [Cell(name)], False
    if len(cols) == 1:
        cells += [Cell("")]
    for col in cols:
        g = lay.group_at(own, col)
        others = [accuracy_stat(o, s.metric, s.last, kind).mean for r in against if (o := lay.group_at(r, col))]
        others = [v for v in others if math.isfinite(v)]
        mine = accuracy_stat(g, s.metric, s.last, kind).mean if g else math.nan
        if others and math.isfinite(mine):
            cells.append(Cell(f"{round((mine - max(others)) * 100, 2) + 0.0:+.2f}"))  # + 0.0: no "-0.00"
            any_value = True
        else:
            cells.append(Cell("—"))
    if len(cols) == 1:
        cells.append(Cell(""))
    return [cells] if any_value else []
