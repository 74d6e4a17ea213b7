"""Long-format numbers for summary.csv and rounds_to_target.csv (one row per group, or per group and target)."""

from __future__ import annotations

from typing import Any

from hafedho.report.layout import Layout
from hafedho.report.runs import Section
from hafedho.report.stats import accuracy_stat, rounds_stat
from hafedho.report.tables.to_target import targets_for


def summary_rows(section: Section) -> list[dict[str, Any]]:
    """Long-format numbers (one row per group) for summary.csv."""
    lay = Layout.of(section)
    rows = []
    for r in lay.rows:
        for col in lay.columns:
            g = lay.group_at(r, col)
            if g is None:
                continue
            fin, best = (
                accuracy_stat(g, section.metric, section.last),
                accuracy_stat(g, section.metric, section.last, "best"),
            )
            rows.append(
                {
                    "section": section.name,
                    "row": lay.row_name(r),
                    "setting": lay.col_name(col),
                    "reference": g.reference,
                    "seeds": len(g.runs),
                    "finished": fin.n,
                    "no_data": fin.missing,
                    "diverged": fin.diverged,
                    "metric": section.metric,
                    "final_mean": fin.mean,
                    "final_std": fin.std,
                    "best_mean": best.mean,
                    "best_std": best.std,
                }
            )
    return rows


def rounds_rows(section: Section) -> list[dict[str, Any]]:
    """Long-format rounds-to-target numbers for rounds_to_target.csv."""
    lay = Layout.of(section)
    rows = []
    for col in lay.columns:
        targets, _ = targets_for(lay, col)
        for r in lay.rows:
            g = lay.group_at(r, col)
            if g is None:
                continue
            for t in targets:
                st = rounds_stat(g, section.metric, t)
                rows.append(
                    {
                        "section": section.name,
                        "row": lay.row_name(r),
                        "setting": lay.col_name(col),
                        "target": t,
                        "reached": st.n,
                        "seeds": st.total,
                        "rounds_mean": st.mean,
                        "rounds_std": st.std,
                    }
                )
    return rows
