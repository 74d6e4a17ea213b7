"""The best-hyperparameters table: per algorithm with a grid, the best value per column."""

from __future__ import annotations

import math

from hafedho.report.layout import Layout, display, pct
from hafedho.report.stats import accuracy_stat
from hafedho.report.table import Cell, Table
from hafedho.toml_io import is_number


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
            cands, tried = [], []  # tried: every grid point of this cell, diverged ones included
            for r in lay.rows:
                if r[0] == lab and (g := lay.group_at(r, col)):
                    tried.append(r[1])
                    st = accuracy_stat(g, s.metric, s.last)
                    if math.isfinite(st.mean):
                        cands.append((st.mean, r, st))
            if cands:
                _, r, st = max(cands, key=lambda t: t[0])
                hyper = " ".join(display(k, v, s.names(), False) + _edge(k, v, tried) for k, v in r[1])
                cells.append(Cell(f"{hyper}: {pct(st)}"))
            else:
                cells.append(Cell("—"))
        rows.append(cells)
    note = (
        f"the value with the highest final {s.metric_label} (mean over seeds) of each algorithm's grid; "
        f"{EDGE} = at the edge of its grid (the best value may lie beyond: widen that grid)"
    )
    return [Table("best_hyper", f"Best hyperparameters: {s.title}", header, rows, note)]


EDGE = "*"


def _edge(key: str, value: object, grid: list[tuple[tuple[str, object], ...]]) -> str:
    """``EDGE`` when a numeric ``value`` of ``key`` is the smallest or largest of the values the grid tried for
    it (at least two), else ""."""
    tried = {v for row in grid for k, v in row if k == key and is_number(v)}
    if len(tried) < 2 or not is_number(value):
        return ""
    return EDGE if value in (min(tried), max(tried)) else ""
