"""The rounds-to-target tables, one per column, and the targets of a column."""

from __future__ import annotations

import math
from typing import Any

from hafedho.report.layout import Layout, fmt_value
from hafedho.report.stats import accuracy_stat, rounds_stat
from hafedho.report.table import Cell, Table


def targets_for(lay: Layout, col: dict[str, Any]) -> tuple[list[float], str]:
    """The column's targets: ``[report] targets`` (a list, or a table keyed by a setting value such as the
    dataset, or data.source), else ``auto_targets`` fractions of ``auto_reference``'s final value (default: the
    study's ``reference``, ``report.study``; the best finished row where that has none)."""
    s = lay.section
    spec = s.report.get("targets")
    if isinstance(spec, list):
        return sorted(float(t) for t in spec), "targets from the preset"
    groups = [g for r in lay.rows if (g := lay.group_at(r, col))]
    if isinstance(spec, dict):
        keys = [fmt_value(v) for v in col.values()] + [
            str(g.runs[0].config.get("data", {}).get("source")) for g in groups
        ]
        for k in [*keys, "default"]:
            if k in spec:
                return sorted(float(t) for t in spec[k]), "targets from the preset"
    fractions = [float(f) for f in s.report.get("auto_targets", [0.8, 0.9, 1.0])]
    ref_label = s.report.get("auto_reference", s.study.reference)
    ref = next((g for g in groups if g.label == ref_label and not g.reference), None)
    stats = {id(g): accuracy_stat(g, s.metric, s.last) for g in groups}
    if ref is None or not math.isfinite(stats[id(ref)].mean):
        finite = [g for g in groups if not g.reference and math.isfinite(stats[id(g)].mean)]
        if not finite:
            return [], "no finished runs"
        ref = max(finite, key=lambda g: stats[id(g)].mean)
    base = stats[id(ref)].mean
    targets = sorted({math.floor(f * base * 1000) / 1000 for f in fractions})
    how = ", ".join(f"{f:.0%}" for f in fractions)
    return targets, f"targets: {how} of {ref.label}'s final {s.metric_label} ({base * 100:.2f}%)"


def to_target_tables(lay: Layout) -> list[Table]:
    """Rounds to reach each target, one table per column: mean ± std over the seeds that reached it, and how
    many of the seeds reached it; the fastest competitor that every seed brought there is bold."""
    s = lay.section
    tables = []
    for ci, col in enumerate(lay.columns):
        targets, how = targets_for(lay, col)
        if not targets:
            continue
        header = ["algorithm", *(f"≥ {t * 100:.1f}%" for t in targets)]
        stats = {r: [rounds_stat(g, s.metric, t) for t in targets] for r in lay.rows if (g := lay.group_at(r, col))}
        best = []
        for ti in range(len(targets)):
            cands = [
                (v[ti].mean, r)
                for r, v in stats.items()
                if not lay.is_reference(r) and v[ti].total and v[ti].n == v[ti].total
            ]
            top = min((c[0] for c in cands), default=None)
            best.append({r for v, r in cands if v == top})
        rows = []
        for r, v in stats.items():
            cells = [Cell(lay.row_name(r))]
            for ti, st in enumerate(v):
                if st.n == 0:
                    text = f"— (0/{st.total})"
                else:
                    text = (
                        f"{st.mean:.1f} ± {st.std:.1f} ({st.n}/{st.total})"
                        if st.n > 1
                        else f"{st.mean:.0f} ({st.n}/{st.total})"
                    )
                cells.append(Cell(text, r in best[ti]))
            rows.append(cells)
        slug = f"rounds_{ci}" if len(lay.columns) > 1 else "rounds"
        title = f"Rounds to target {s.metric_label}: {lay.col_name(col)}"
        note = (
            "first evaluated round at or above the target; mean ± std over the seeds that reached it "
            f"(reached/seeds); {how}"
        )
        tables.append(Table(slug, title, header, rows, note))
    return tables
