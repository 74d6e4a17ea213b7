"""The ``[diagnostics]`` table (Theorem 1 measured): does the estimation error of h decay toward zero?"""

from __future__ import annotations

import numpy as np

from hafedho.report.layout import Layout
from hafedho.report.table import Cell, Table

METRIC = "diag/h_rel_err"


def _early_late(evals: list[tuple[int, float]]) -> tuple[float, float]:
    """Mean of the first and of the last quarter of a run's diagnostic rounds (at least one round each)."""
    vals = [v for _, v in evals]
    q = max(1, len(vals) // 4)
    return float(np.mean(vals[:q])), float(np.mean(vals[-q:]))


def _pm(values: list[float]) -> tuple[str, float, float]:
    mean = float(np.mean(values))
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return (f"{mean:.3f} ± {std:.3f}" if len(values) > 1 else f"{mean:.3f}"), mean, std


def diagnostics_table(lay: Layout) -> list[Table]:
    """Per row and column that logged diagnostics: the relative error of h (after the steady-state scale) and
    cos(h, target), early (first quarter of the diagnostic rounds) and late (last quarter), mean ± std over the
    finished seeds, and whether the error decays: "decays" / "grows" when early and late differ by more than the
    larger of their two standard deviations (with one seed: by more than 10% of the early value), else "flat";
    "decays to no better than h = 0" when the late error is still within that margin of 1 (or above it), the
    error h = 0 scores, so a decay toward 1 is not read as h learning its target."""
    header = ["algorithm", "setting", "seeds", "rel. error early", "rel. error late", "cos early", "cos late", "error"]
    rows = []
    for col in lay.columns:
        for r in lay.rows:
            g = lay.group_at(r, col)
            runs = [run for run in (g.finished() if g else []) if run.evals(METRIC)]
            if not runs:
                continue
            err = [_early_late(run.evals(METRIC)) for run in runs]
            cos = [_early_late(run.evals("diag/h_cos")) for run in runs]
            (e0, m0, s0), (e1, m1, s1) = _pm([e for e, _ in err]), _pm([late for _, late in err])
            margin = max(s0, s1) if len(runs) > 1 else 0.1 * abs(m0)
            verdict = "decays" if m1 < m0 - margin else "grows" if m1 > m0 + margin else "flat"
            if verdict == "decays" and m1 >= 1 - margin:  # toward 1, the error of h = 0, not toward 0
                verdict = "decays to no better than h = 0"
            c0, c1 = _pm([c for c, _ in cos])[0], _pm([late for _, late in cos])[0]
            rows.append([Cell(lay.row_name(r)), Cell(lay.col_name(col)), Cell(str(len(runs))), Cell(e0), Cell(e1)])
            rows[-1] += [Cell(c0), Cell(c1), Cell(verdict)]
    if not rows:
        return []
    note = (
        "h: what each sampled client uses (after self-correction); target: the exact full-data gradient of the "
        "aggregation, minus the client's own share where h removes it; relative error ||h/s - target|| / ||target|| "
        "with s the steady-state scale (docs/algorithms.md, 'Theorem 1 measured'). Early/late: the first/last "
        "quarter of the diagnostic rounds. A change counts only beyond the larger of the two standard deviations. "
        "h = 0 scores a relative error of exactly 1 (and a cosine of 0), so an error near 1 means no estimate."
    )
    return [Table("diagnostics", f"Estimation error of h: {lay.section.title}", header, rows, note)]
