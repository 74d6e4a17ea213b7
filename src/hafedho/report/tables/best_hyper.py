"""The best-hyperparameters table: per algorithm with a grid, the best value per column."""

from __future__ import annotations

import math

from hafedho.report.layout import Layout, display, pct
from hafedho.report.stats import accuracy_stat
from hafedho.report.table import Cell, Table


def best_hyper_table(lay: Layout) -> list[Table]:
    """Per algorithm with a hyperparameter grid: the best value per column (by final mean)."""
    s = lay.section
    labels = [lab for lab, keys in lay.row_hyper_keys.items() if keys]
    if not labels:
        return []
    header = ["algorithm", *(lay.col_name(c) for c in lay.columns)]
    rows = []
    for lab in labels:
        cells = [Cell(lab)]
        for col in lay.columns:
            cands = []
            for r in lay.rows:
                if r[0] == lab and (g := lay.group_at(r, col)):
                    st = accuracy_stat(g, s.metric, s.last)
                    if math.isfinite(st.mean):
                        cands.append((st.mean, r, st))
            if cands:
                _, r, st = max(cands, key=lambda t: t[0])
                hyper = " ".join(display(k, v, s.names(), False) for k, v in r[1])
                cells.append(Cell(f"{hyper}: {pct(st)}"))
            else:
                cells.append(Cell("—"))
        rows.append(cells)
    note = f"the value with the highest final {s.metric_label} (mean over seeds) of each algorithm's grid"
    return [Table("best_hyper", f"Best hyperparameters: {s.title}", header, rows, note)]
