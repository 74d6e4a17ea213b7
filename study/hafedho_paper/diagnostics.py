"""HaFedHo's ``[diagnostics]`` tables and figure (Theorem 1 measured): does the estimation error of h decay toward
zero?

The study adds them to the report as the kinds ``"diagnostics"`` (``study.REPORT``'s ``tables`` and ``figures``):
a table builder ``Layout -> list[Table]`` and a figure builder ``(Layout, folder, prefix) -> paths``, drawn where
runs logged the metrics below. HaFedHo names its estimate ``h`` (``Diagnostics.name``), so the simulator's
``[diagnostics]`` pass logs ``diag/h_cos``, ``diag/h_rel_err``, ... (``hafedho.sim.fullgrad``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt
from matplotlib.ticker import MaxNLocator

from hafedho.report.layout import Layout
from hafedho.report.plots import band, finish, row_colors
from hafedho.report.table import Cell, Table

# HaFedHo's diagnostic metrics: the pass's generic names with HaFedHo's estimate name, h
METRIC = "diag/h_rel_err"  # ||h / s - T|| / ||T||, after the steady-state scale s
COS = "diag/h_cos"  # cos(h, T)
SS = "diag/h_ss_rel_err"  # ||h - h^*|| / ||h^*||
DEF1 = "diag/h_def1_abs_err"  # ||mu_t h - T||, Definition 1
FRESH_COS = "diag/fresh_cos"  # round t's fresh aggregate (the h of round t+1) against T
CURVES = ((COS, "cos(h, target)"), (METRIC, "relative error of h / s"))


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
    for r, col, runs in _groups_with(lay, METRIC):
        e0, e1, verdict = _verdict([_early_late(run.evals(METRIC)) for run in runs], against_zero=True)
        cos = [_early_late(run.evals(COS)) for run in runs]
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
    return [Table("diagnostics", f"Estimation error of h: {lay.section.title}", header, rows, note), *_pairings(lay)]


def _groups_with(lay: Layout, metric: str) -> Iterator[tuple[Any, Any, list[Any]]]:
    """``(row, column, finished runs that logged metric)`` for every cell of the layout with such runs, in the
    tables' order (column by column)."""
    for col in lay.columns:
        for r in lay.rows:
            g = lay.group_at(r, col)
            runs = [run for run in (g.finished() if g else []) if run.evals(metric)]
            if runs:
                yield r, col, runs


def _verdict(err: list[tuple[float, float]], against_zero: bool = False) -> tuple[str, str, str]:
    """Early, late (mean ± std over runs) and the decay verdict (``diagnostics_table``); ``against_zero`` adds its
    "decays to no better than h = 0" clause for an error that h = 0 scores 1 on."""
    (e0, m0, s0), (e1, m1, s1) = _pm([e for e, _ in err]), _pm([late for _, late in err])
    margin = max(s0, s1) if len(err) > 1 else 0.1 * abs(m0)
    verdict = "decays" if m1 < m0 - margin else "grows" if m1 > m0 + margin else "flat"
    if against_zero and verdict == "decays" and m1 >= 1 - margin:  # toward 1, the error of h = 0, not toward 0
        verdict = "decays to no better than h = 0"
    return e0, e1, verdict


def _pairings(lay: Layout) -> list[Table]:
    """Where runs logged them: the error against the steady state h^* (which a noise-free,
    full-participation run scores ~0), Definition 1's absolute error, and the cosine of both pairings (the h used
    in round t, and round t's fresh aggregate, each against the target at w_t), early and late."""
    header = ["algorithm", "setting", "seeds", "ss error early", "ss error late", "error"]
    header += ["Def. 1 error early", "Def. 1 error late", "cos used late", "cos fresh early", "cos fresh late"]
    rows = []
    for r, col, runs in _groups_with(lay, SS):
        cells = [lay.row_name(r), lay.col_name(col), str(len(runs))]
        cells += _verdict([_early_late(run.evals(SS)) for run in runs])
        cells += _verdict([_early_late(run.evals(DEF1)) for run in runs])[:2]
        cos = [_early_late(run.evals(COS)) for run in runs]
        fresh = [_early_late(run.evals(FRESH_COS)) for run in runs if run.evals(FRESH_COS)]
        cells.append(_pm([c for _, c in cos])[0])
        cells += [_pm([c for c, _ in fresh])[0], _pm([c for _, c in fresh])[0]] if fresh else ["", ""]
        rows.append([Cell(c) for c in cells])
    if not rows:
        return []
    note = (
        "ss error: ||h - h^*|| / ||h^*||, h^* the steady state of Algorithm 1's recursion at w_t with exact uploads "
        "from every client (0 on a noise-free problem with full participation; docs/algorithms.md, 'Theorem 1 "
        "measured'). Def. 1 error: ||mu h - T||, T the other clients' share at w_t. cos used: the h of round t "
        "(built at w_{t-1}) against T; cos fresh: round t's own aggregate (the h of round t+1) against T. Read each "
        "beside the mu = 0 control row, whose h is FedAvg's own aggregate: only the difference is HaFedHo's."
    )
    return [Table("diagnostics_pairings", f"Both pairings and Definition 1: {lay.section.title}", header, rows, note)]


def diagnostic_figure(lay: Layout, out_dir: Path, prefix: str) -> list[Path]:
    """Theorem 1 measured: cos(h, target) (top) and the relative error after the steady-state scale (bottom) per
    diagnostic round, one panel per setting, one line per row (mean over finished seeds, ±1 std band; rows whose
    every seed diverged dashed up to the divergence). See docs/algorithms.md, "Theorem 1 measured"."""
    if not lay.rows or not any(COS in row for g in lay.section.groups for r in g.runs for row in r.rows):
        return []
    cols = len(lay.columns)
    fig, grid = plt.subplots(2, cols, figsize=(4.2 * cols, 6.4 + 0.8), dpi=110, squeeze=False)
    colors = row_colors(lay.rows)
    axes = []
    for i, (metric, label) in enumerate(CURVES):
        for ax, col in zip(grid[i], lay.columns, strict=True):
            for r in lay.rows:
                g = lay.group_at(r, col)
                if g is None:
                    continue
                band(ax, lay, r, g, metric, colors[r], scale=0.01, marker=".", ms=3)  # band's curves are percent
            if i == 0:
                ax.set_title(lay.col_name(col) if lay.col_keys else lay.section.title, fontsize=9)
            ax.set_ylabel(label, fontsize=8)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.append(ax)
    out = finish(fig, axes, Path(out_dir) / f"{prefix}diagnostics.png", CURVES[0][1])
    return [out] if out is not None else []
