"""The final and best accuracy tables: mean ± std over seeds, the best competitor bold, the own method's lead
(``[report] own``, ``report.study``: the paper's, HaFedHo's lead over the best baseline and over its twin)."""

from __future__ import annotations

import math
from typing import Any

from hafedho.config import ConfigError
from hafedho.report.layout import Layout, pct
from hafedho.report.runs import Group, Section
from hafedho.report.stats import FLAT_SLOPE, FLAT_WINDOW, Stat, accuracy_stat, horizon_note, no_data_note, trend
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


def _flattened(s: Section) -> bool:
    """``[report] flattened = true``: the final table gets a "flattened" column after each setting."""
    on = s.report.get("flattened", False)
    if not isinstance(on, bool):
        raise ConfigError(f"{s.name}: report.flattened = {on!r}: must be true or false")
    return on


def _flat_cell(g: Group | None, s: Section) -> Cell:
    """``yes (+0.3 ± 0.4)`` / ``no (+5.1 ± 0.6)``: the slope in points per 100 rounds ± its standard error."""
    tr = trend(g, s.metric) if g is not None else None
    if tr is None:
        return Cell("—")
    return Cell(f"{'yes' if tr.flat else 'no'} ({tr.slope + 0.0:+.1f} ± {tr.se:.1f})")


FLAT_NOTE = (
    f"flattened = |slope| < {FLAT_SLOPE:g} points per 100 rounds, the slope (± its standard error) of a "
    f"least-squares line through the seed-mean curve over the last {FLAT_WINDOW:.0%} of its rounds (— below 3 "
    "evaluations there)"
)


def accuracy_tables(lay: Layout) -> list[Table]:
    """Final and best accuracy: rows x columns, mean ± std over seeds, best competitor per column in bold,
    and the own method's lead over the best baseline. With a single column, one table with a seeds column."""
    s = lay.section
    what = f"{s.metric_label} (%), mean ± std over seeds"
    for extra in (no_data_note(s), horizon_note(s)):
        what += f"; {extra}" if extra else ""
    final_def = f"final = mean of the last {s.last} evaluations"
    derived_note = _derived_note(lay)
    flat = _flattened(s)
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
                *([_flat_cell(v[0], s)] if flat else []),
            ]
            for r, v in stats.items()
        ]
        header = ["algorithm", "seeds", f"final {s.metric_label} (%, mean of last {s.last} evals)", "best (%)"]
        header += ["flattened (slope, pp/100 rounds)"] if flat else []
        # named as the many-column tables are, never the section's title alone (a heading under its own name)
        title = f"Final {s.metric_label}: {s.title}" + (f": {lay.col_name(col)}" if lay.col_keys else "")
        lead = [row + [Cell("")] * flat for row in _lead_rows(lay, [col], "final")]
        note = f"{what}; {FLAT_NOTE}" if flat else what
        return [Table("final", title, header, rows + lead, note + derived_note)]
    tables = []
    for kind, label in (("final", "Final"), ("best", "Best")):
        with_flat = flat and kind == "final"  # after each setting's column: has that curve flattened?
        header = ["algorithm"]
        for c in lay.columns:
            header += [lay.col_name(c), *([f"{lay.col_name(c)}: flattened"] if with_flat else [])]
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
                if with_flat:
                    cells.append(_flat_cell(g, s) if g else Cell(""))
            rows.append(cells)
        for lead in _lead_rows(lay, lay.columns, kind):
            rows.append(_with_blanks(lead, len(lay.columns)) if with_flat else lead)
        note = f"{what}; {final_def}" if kind == "final" else what
        note += f"; {FLAT_NOTE}" if with_flat else ""
        if hyper_note := lay.column_hyper_note():
            note += f"; {hyper_note}"
        if kind == "final":
            note += derived_note
        tables.append(Table(kind, f"{label} {s.metric_label}: {s.title}", header, rows, note))
    return tables


def _with_blanks(row: list[Cell], columns: int) -> list[Cell]:
    """A lead row in a table with a flattened column after each of ``columns`` settings: a blank there."""
    return [row[0], *(c for v in row[1 : columns + 1] for c in (v, Cell("")))]


def _best(stats: dict, lay: Layout, key: Any) -> set:
    """The competitor rows with the highest finite mean (all of them on a tie; references never count)."""
    cands = [(key(v), r) for r, v in stats.items() if not lay.is_reference(r) and math.isfinite(key(v))]
    top = max((c[0] for c in cands), default=None)
    return {r for v, r in cands if v == top}


def _derived_note(lay: Layout) -> str:
    """What a derived row is (``[report.derived] note``), and the sweep's notes (e.g. the cells that have no derived
    run, and why); '' if none."""
    s = lay.section
    derived = s.study.derived
    lines = []
    if derived.note and any(lay.is_derived(r) for r in lay.rows):
        lines.append(f"{derived.name}: {derived.note}")
    return "".join(f"\n{line}" for line in [*lines, *s.notes])


def _lead_rows(lay: Layout, cols: list[dict[str, Any]], kind: str) -> list[list[Cell]]:
    """Own minus the best baseline (``Layout.is_baseline``), and minus its derived row, in percentage points, when
    both exist."""
    study = lay.section.study
    own = (study.own, ())
    if not study.own or own not in lay.rows:
        return []
    baselines = [r for r in lay.rows if lay.is_baseline(r)]
    derived_rows = [r for r in lay.rows if lay.section.derived.get(r[0]) == study.own and not lay.is_reference(r)]
    out = []
    for name, against in (
        (f"{study.own_name} lead over best baseline (pp)", baselines),
        (f"{study.own_name} lead over its {study.derived.noun} (pp)", derived_rows),
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
