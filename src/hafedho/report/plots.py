"""A section's figures: metric per round with a band over seeds; final metric vs settings and hyperparameters; and
the kinds a section's study adds (``FIGURES``, ``hafedho.report.study``).

A figure builder is ``(Layout, out_dir, prefix) -> list[Path]`` (the files it wrote, none where it has nothing to
draw); one of one's own uses ``band``, ``row_colors`` and ``finish`` below as the library's do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from hafedho.config import Config, flatten
from hafedho.core.refs import file_name
from hafedho.report.layout import Layout, display
from hafedho.report.runs import Run
from hafedho.report.stats import accuracy_stat
from hafedho.report.study import load_builder
from hafedho.toml_io import is_number


def _panels(n: int, width: float = 4.2, height: float = 3.2) -> tuple[Any, list[Any]]:
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), dpi=110, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def row_colors(rows: list[Any]) -> dict[Any, Any]:
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    return {r: cmap(i % cmap.N) for i, r in enumerate(rows)}


def finish(fig: Any, axes: list[Any], out: Path, ylabel: str) -> Path | None:
    """Grid, shared legend and file; a figure with nothing drawn is not written (None), a panel with nothing
    drawn says so and adds nothing to the legend."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
        if not ax.has_data():
            ax.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.grid(alpha=0.3)
    if not any(ax.has_data() for ax in axes):
        plt.close(fig)
        return None
    axes[0].set_ylabel(ylabel)
    rows = 0
    if labels:
        ncol = min(len(labels), 5, max(1, int(fig.get_figwidth() / 1.8)))  # as many as fit the figure's width
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        rows = (len(labels) + ncol - 1) // ncol
    fig.tight_layout(rect=(0, 0.04 + 0.035 * rows, 1, 1))
    fig.savefig(out)
    plt.close(fig)
    return out


def _curve(runs: list[Run], metric: str) -> tuple[list[int], np.ndarray] | None:
    series = [dict(r.evals(metric)) for r in runs]
    series = [s for s in series if s]
    if not series:
        return None
    rounds = sorted(set.intersection(*(set(s) for s in series)))
    return rounds, np.array([[s[t] for t in rounds] for s in series]) * 100


def band(ax: Any, lay: Layout, r: tuple, g: Any, metric: str, color: Any, scale: float = 1.0, **kw: Any) -> None:
    """One row's ``metric`` per round in one panel: the mean over its finished seeds with a ±1 std band (``scale``
    times ``_curve``'s percent); a row whose every seed diverged is drawn dashed up to the divergence, a
    reference dotted."""
    runs, style = g.finished(), "-"
    if not runs:
        runs, style = g.diverged(), "--"
    curve = _curve(runs, metric)
    if curve is None or not curve[0]:
        return
    rounds, vals = curve[0], curve[1] * scale
    mean, std = vals.mean(0), vals.std(0)
    name = lay.row_name(r) + (" (diverged)" if style == "--" else "")
    ax.plot(rounds, mean, ":" if lay.is_reference(r) else style, color=color, label=name, lw=1.4, **kw)
    if len(vals) > 1:
        ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.15, lw=0)


def section_curves(lay: Layout, out: str | Path) -> Path | None:
    """Test metric per round, one panel per setting, one line per row: mean over finished seeds with a ±1 std
    band. Rows whose every seed diverged are drawn dashed up to the divergence."""
    s = lay.section
    if not lay.rows:
        return None
    fig, axes = _panels(len(lay.columns))
    colors = row_colors(lay.rows)
    for ax, col in zip(axes, lay.columns, strict=True):
        for r in lay.rows:
            g = lay.group_at(r, col)
            if g is None:
                continue
            band(ax, lay, r, g, s.metric, colors[r])
        ax.set_title(lay.col_name(col) if lay.col_keys else s.title, fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return finish(fig, axes, Path(out), f"{s.metric_label} (%)")


def _xscale(ax: Any, xs: list[float]) -> None:
    pos = [x for x in xs if x > 0]
    if pos and max(pos) / min(pos) >= 20:
        if len(pos) == len(xs):
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=min(pos))


def _mark_diverged(ax: Any, diverged: list[tuple[list[Any], Any, str]]) -> None:
    """x marks at the bottom edge (never at a value such as 0%), once the finished points set the scale."""
    lo, hi = ax.get_ylim()
    for bad, color, name in diverged:
        ax.plot(bad, [lo] * len(bad), "x", color=color, ms=9, mew=2, label=name, clip_on=False)
    ax.set_ylim(lo, hi)


def versus_setting(lay: Layout, key: str, out: str | Path) -> Path | None:
    """Final metric vs a numeric setting (e.g. Dirichlet q), one line per row, one panel per other setting;
    error bars are ±1 std over seeds. References (e.g. centralised) appear as dotted lines."""
    s = lay.section
    panels = lay.columns_without(key)
    xs = sorted({col[key] for col in lay.columns})
    if all(sum(all(col[k] == v for k, v in p.items()) for col in lay.columns) < 2 for p in panels):
        return None  # every panel would hold one point: nothing to read off against the setting
    fig, axes = _panels(len(panels))
    colors = row_colors(lay.rows)
    for ax, panel in zip(axes, panels, strict=True):
        diverged = []
        for r in lay.rows:
            pts, bad = [], []
            for x in xs:
                g = lay.group_at(r, {**panel, key: x})
                if g is None:
                    continue
                st = accuracy_stat(g, s.metric, s.last)
                if st.n:
                    pts.append((x, st.mean * 100, st.std * 100))
                elif st.diverged:
                    bad.append(x)
            if pts:
                x, y, e = zip(*pts, strict=True)
                fmt = "o:" if lay.is_reference(r) else "o-"
                ax.errorbar(x, y, yerr=e, fmt=fmt, color=colors[r], label=lay.row_name(r), capsize=3, ms=4, lw=1.2)
            if bad:
                diverged.append((bad, colors[r], f"{lay.row_name(r)}: diverged"))
        _mark_diverged(ax, diverged)
        _xscale(ax, xs)
        names = s.names()
        ax.set_title(
            ", ".join(display(k, v, names, k in s.named_axes) for k, v in panel.items()) or s.title, fontsize=9
        )
        ax.set_xlabel(key.rsplit(".", 1)[-1])
    return finish(fig, axes, Path(out), f"final {s.metric_label} (%)")


def versus_hyper(lay: Layout, label: str, key: str, out: str | Path) -> Path | None:
    """Final metric vs one hyperparameter of ``label`` (e.g. HaFedHo's mu), one line per combination of its
    other varying hyperparameters (e.g. objective vs gradient rectification), one panel per setting.
    Diverged settings are marked x at the bottom."""
    s = lay.section
    keys = lay.row_hyper_keys.get(label, [])
    rows = [r for r in lay.rows if r[0] == label]
    lines: dict[tuple, list[tuple[str, Any]]] = {}
    for r in rows:
        rest = tuple((k, v) for k, v in r[1] if k != key)
        lines.setdefault(rest, []).append(r)
    if key not in keys:
        return None
    fig, axes = _panels(len(lay.columns))
    colors = row_colors(list(lines))
    names = s.names()
    for ax, col in zip(axes, lay.columns, strict=True):
        xs_all, diverged = [], []
        for rest, members in lines.items():
            pts, bad = [], []
            for r in members:
                x = dict(r[1])[key]
                xs_all.append(x)
                g = lay.group_at(r, col)
                if g is None:
                    continue
                st = accuracy_stat(g, s.metric, s.last)
                if st.n:
                    pts.append((x, st.mean * 100, st.std * 100))
                elif st.diverged:
                    bad.append(x)
            name = " ".join(display(k, v, names, False) for k, v in rest) or label
            if pts:
                pts.sort()
                x, y, e = zip(*pts, strict=True)
                ax.errorbar(x, y, yerr=e, fmt="o-", color=colors[rest], label=name, capsize=3, ms=4, lw=1.2)
            if bad:
                diverged.append((bad, colors[rest], f"{name}: diverged"))
        for name, pts in derived_points(lay, label, key, col).items():  # each derived row at value / divide_by
            x, y, e = zip(*pts, strict=True)
            ax.errorbar(x, y, yerr=e, fmt="s--", color="0.35", label=name, capsize=3, ms=4, lw=1.0)
        _mark_diverged(ax, diverged)
        _xscale(ax, sorted(set(xs_all)))
        ax.set_title(lay.col_name(col) if lay.col_keys else s.title, fontsize=9)
        ax.set_xlabel(f"{label} {key.rsplit('.', 1)[-1]}")
    return finish(fig, axes, Path(out), f"final {s.metric_label} (%)")


def derived_points(
    lay: Layout, label: str, key: str, col: dict[str, Any]
) -> dict[str, list[tuple[float, float, float]]]:
    """For a plot of ``label``'s ``[report.derived] plot_key``: each row derived from ``label`` as points (x = its
    ``value`` / its config's ``divide_by``, mean, std) of its final metric (%) in this column, by the derived row's
    name; {} for any other hyperparameter."""
    s = lay.section
    view = s.study.derived
    if not view.plot_key or key.rsplit(".", 1)[-1] != view.plot_key:
        return {}
    out: dict[str, list[tuple[float, float, float]]] = {}
    for derived in (t for t, of in s.derived.items() if of == label):
        pts = []
        for r in (r for r in lay.rows if r[0] == derived):
            g = lay.group_at(r, col)
            st = accuracy_stat(g, s.metric, s.last) if g is not None else None
            if st is not None and st.n and is_number(g.hyper.get(view.value)):
                pts.append((float(g.hyper[view.value]) / _config_value(g.runs[0].config, view.divide_by), *_pct(st)))
        if pts:
            out[s.study.derived_name(label)] = sorted(pts)
    return out


def _pct(st: Any) -> tuple[float, float]:
    return st.mean * 100, st.std * 100


def _config_value(config: dict[str, Any], key: str) -> float:
    """A run's config value at the dotted ``key`` (its default where the stored config leaves it out; 1 if none)."""
    if not key:
        return 1.0
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        value = flatten(Config().to_dict()).get(key)
    return float(value) if is_number(value) else 1.0


def figure_name(text: str) -> str:
    """A row label or key as part of a file name: a reference's ``:`` as ``.`` (``core.refs.file_name``, as run
    directories are named), other characters than letters, digits, ``.``, ``_`` and ``-`` (a ``/``, a space) as
    ``_``, so a figure's file and its link in results.md are plain."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in file_name(text))


def _curves(lay: Layout, out_dir: Path, prefix: str) -> list[Path]:
    return [p] if (p := section_curves(lay, out_dir / f"{prefix}accuracy.png")) is not None else []


def _settings(lay: Layout, out_dir: Path, prefix: str) -> list[Path]:
    """Final metric vs each numeric setting that varies across the section's columns."""
    made = []
    for key in lay.col_keys:
        values = {col[key] for col in lay.columns}  # hashable: lists and tables are frozen (runs.freeze)
        if len(values) > 1 and all(is_number(v) for v in values):
            short = figure_name(key.rsplit(".", 1)[-1])
            if (p := versus_setting(lay, key, out_dir / f"{prefix}vs_{short}.png")) is not None:
                made.append(p)
    return made


def _hypers(lay: Layout, out_dir: Path, prefix: str) -> list[Path]:
    """Final metric vs each numeric hyperparameter that varies within a row label."""
    made = []
    for label, keys in lay.row_hyper_keys.items():
        for key in keys:
            values = {dict(r[1]).get(key) for r in lay.rows if r[0] == label}
            if len(values) > 1 and all(is_number(v) for v in values):
                name = f"{prefix}{figure_name(label)}_vs_{figure_name(key.rsplit('.', 1)[-1])}.png"
                if (p := versus_hyper(lay, label, key, out_dir / name)) is not None:
                    made.append(p)
    return made


Figure = Callable[[Layout, Path, str], list[Path]]

# kind -> builder, in the order drawn; a section's study adds kinds of its own after these (by reference)
FIGURES: dict[str, Figure] = {"curves": _curves, "settings": _settings, "hypers": _hypers}


def section_plots(lay: Layout, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Every figure a section supports: ``FIGURES``, then its study's kinds (``Study.figures``)."""
    out_dir = Path(out_dir)
    made = []
    for kind, entry in {**FIGURES, **lay.section.study.figures}.items():
        if isinstance(entry, str):
            key = f"report.study figures.{kind}"
            entry = load_builder(key, entry, f"{key}: not a figure builder (Layout, folder, prefix) -> paths")
        made += entry(lay, out_dir, prefix)
    return made
