"""Accuracy tables (mean ± std over seeds) from sections of run directories."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

from hafedho.report.runs import (
    Group,
    Section,
    Stat,
    accuracy_stat,
    check_seeds,
    horizon_note,
    no_data_note,
    rounds_stat,
)


@dataclass
class Cell:
    text: str
    bold: bool = False


@dataclass
class Table:
    """A rendered table: title, header, rows of cells, an optional note; written as Markdown, CSV, LaTeX, HTML."""

    slug: str
    title: str
    header: list[str]
    rows: list[list[Cell]]
    note: str = ""

    def markdown(self) -> str:
        def fmt(c: Cell) -> str:
            return f"**{c.text}**" if c.bold and c.text else c.text.replace("|", "\\|")

        lines = [f"| {' | '.join(self.header)} |", "|" + "---|" * len(self.header)]
        lines += [f"| {' | '.join(fmt(c) for c in row)} |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.header)
        w.writerows([c.text for c in row] for row in self.rows)
        return buf.getvalue()

    def latex(self) -> str:
        def fmt(c: Cell) -> str:
            t = latex_escape(c.text)
            return f"\\textbf{{{t}}}" if c.bold and c.text else t

        lines = [
            f"% {self.title} (needs \\usepackage{{booktabs}})",
            "\\begin{tabular}{l" + "c" * (len(self.header) - 1) + "}",
            "\\toprule",
            " & ".join(latex_escape(h) for h in self.header) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(fmt(c) for c in row) + " \\\\" for row in self.rows]
        lines += ["\\bottomrule", "\\end{tabular}"]
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        def cell(c: Cell, tag: str = "td") -> str:
            t = html.escape(c.text)
            return f"<{tag}>{f'<b>{t}</b>' if c.bold and c.text else t}</{tag}>"

        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def latex_escape(text: str) -> str:
    text = text.replace("\\", "\\textbackslash{}")
    for ch in "&%$#_{}":
        text = text.replace(ch, f"\\{ch}")
    return text.replace("±", "$\\pm$").replace("≥", "$\\geq$").replace("—", "--").replace("~", "\\textasciitilde{}")


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def display(key: str, value: Any, names: dict[str, str], named: bool) -> str:
    """How a setting or hyperparameter reads in a header: the preset's [report.names] entry, the value of a
    named axis (``cifar10``), else ``short_key=value``."""
    short = key.rsplit(".", 1)[-1]
    for candidate in (f"{key}={fmt_value(value)}", f"{short}={fmt_value(value)}", fmt_value(value)):
        if candidate in names:
            return names[candidate]
    return fmt_value(value) if named else f"{short}={fmt_value(value)}"


def pct(stat: Stat, scale: float = 100.0) -> str:
    if stat.n < 2:  # one seed has no spread to show (a tuning sweep runs one)
        return f"{stat.mean * scale:.2f}"
    return f"{stat.mean * scale:.2f} ± {stat.std * scale:.2f}"


@dataclass
class Layout:
    """Rows (label + varying hyperparameters) x columns (varying settings) of a section, and which group sits where."""

    section: Section
    col_keys: list[str]
    columns: list[dict[str, Any]]
    rows: list[tuple[str, tuple[tuple[str, Any], ...]]]
    row_hyper_keys: dict[str, list[str]]
    column_hyper_keys: dict[str, list[str]] = field(default_factory=dict)  # label -> keys set per column

    @classmethod
    def of(cls, section: Section) -> Layout:
        groups = [g for g in section.groups if g.runs and g.runs[0].config]
        competitors = [g for g in groups if not g.reference] or groups
        col_keys = [
            k for k in section.axes if len({json.dumps(g.setting.get(k), sort_keys=True) for g in competitors}) > 1
        ]
        columns: list[dict[str, Any]] = []
        for g in competitors:
            col = {k: g.setting.get(k) for k in col_keys}
            if col not in columns:
                columns.append(col)
        # A hyperparameter splits a label's row only where it varies within one column (fig3's mu); one that
        # only changes from column to column (a value tuned per dataset) keeps one row and is listed in a note.
        hyper_keys: dict[str, list[str]] = {}
        per_column: dict[str, list[str]] = {}
        for g in groups:
            same = [h for h in groups if h.label == g.label]
            keys = sorted({k for h in same for k in h.hyper})
            varying = [k for k in keys if len({json.dumps(h.hyper.get(k)) for h in same}) > 1]
            by_col: dict[str, list[Group]] = {}
            for h in same:
                by_col.setdefault(json.dumps([h.setting.get(k) for k in col_keys], sort_keys=True), []).append(h)
            within = [
                k for k in varying if any(len({json.dumps(h.hyper.get(k)) for h in c}) > 1 for c in by_col.values())
            ]
            hyper_keys[g.label] = within
            per_column[g.label] = [k for k in varying if k not in within]
        rows: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
        for g in groups:
            key = cls.row_key(g, hyper_keys)
            if key not in rows:
                rows.append(key)
        rows.sort(key=lambda r: any(g.reference for g in groups if g.label == r[0]))  # references last
        return cls(section, col_keys, columns, rows, hyper_keys, per_column)

    @staticmethod
    def row_key(g: Group, hyper_keys: dict[str, list[str]]) -> tuple[str, tuple[tuple[str, Any], ...]]:
        return g.label, tuple((k, g.hyper.get(k)) for k in hyper_keys.get(g.label, []))

    def groups_at(self, row: tuple[str, tuple], col: dict[str, Any]) -> list[Group]:
        """Groups of this row in this column. A reference (e.g. centralised) matches on the keys it has, so it
        fills every column it does not depend on; any other group must match every key (missing = None)."""

        def matches(g: Group) -> bool:
            if g.reference:
                return all(k not in g.setting or g.setting[k] == v for k, v in col.items())
            return all(g.setting.get(k) == v for k, v in col.items())

        return [
            g
            for g in self.section.groups
            if g.runs and g.runs[0].config and self.row_key(g, self.row_hyper_keys) == row and matches(g)
        ]

    def group_at(self, row: tuple[str, tuple], col: dict[str, Any]) -> Group | None:
        found = self.groups_at(row, col)
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        merged = Group(found[0].label, found[0].setting, found[0].hyper, found[0].reference)
        merged.runs = [r for g in found for r in g.runs]  # same row and column, other keys differ: pooled
        check_seeds(merged.runs)  # e.g. centralised runs that differ only in partition keys they ignore
        return merged

    def is_reference(self, row: tuple[str, tuple]) -> bool:
        return any(g.reference for g in self.section.groups if self.row_key(g, self.row_hyper_keys) == row)

    def row_name(self, row: tuple[str, tuple]) -> str:
        names = self.section.names()
        extra = " ".join(display(k, v, names, False) for k, v in row[1])
        return f"{row[0]} {extra}".strip()

    def col_name(self, col: dict[str, Any]) -> str:
        names = self.section.names()
        parts = [display(k, v, names, k in self.section.named_axes) for k, v in col.items()]
        return ", ".join(parts) or "all runs"

    def column_hyper_note(self) -> str:
        """``"fedprox mu: femnist 0.01, cifar10 0.001"`` for hyperparameters set per column ('' if none)."""
        names = self.section.names()
        parts = []
        for label, keys in self.column_hyper_keys.items():
            for k in keys:
                vals = []
                for col in self.columns:
                    found = [g for g in self.section.groups if g.label == label and g.hyper and self._in(g, col)]
                    if found:
                        vals.append(f"{self.col_name(col)}: {fmt_value(found[0].hyper.get(k))}")
                short = display(k, "", names, False).rstrip("=")
                parts.append(f"{label} {short} per column ({'; '.join(vals)})")
        return "; ".join(parts)

    @staticmethod
    def _in(g: Group, col: dict[str, Any]) -> bool:
        return all(g.setting.get(k) == v for k, v in col.items())

    @property
    def seeds(self) -> int:
        return max((len(g.runs) for g in self.section.groups), default=0)


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
        return [Table("final", title, header, rows + _lead_rows(lay, [col], "final"), what)]
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
        tables.append(Table(kind, f"{label} {s.metric_label}: {s.title}", header, rows, note))
    return tables


def _best(stats: dict, lay: Layout, key: Any) -> set:
    """The competitor rows with the highest finite mean (all of them on a tie; references never count)."""
    cands = [(key(v), r) for r, v in stats.items() if not lay.is_reference(r) and math.isfinite(key(v))]
    top = max((c[0] for c in cands), default=None)
    return {r for v, r in cands if v == top}


def _lead_rows(lay: Layout, cols: list[dict[str, Any]], kind: str) -> list[list[Cell]]:
    """HaFedHo minus the best other competitor, in percentage points, when both exist."""
    s = lay.section
    own = ("hafedho", ())
    if own not in lay.rows:
        return []
    cells, any_value = [Cell("HaFedHo lead over best baseline (pp)")], False
    if len(cols) == 1:
        cells += [Cell("")]
    for col in cols:
        g = lay.group_at(own, col)
        others = [
            accuracy_stat(o, s.metric, s.last, kind).mean
            for r in lay.rows
            if r != own and not lay.is_reference(r) and (o := lay.group_at(r, col))
        ]
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


def targets_for(lay: Layout, col: dict[str, Any]) -> tuple[list[float], str]:
    """The column's targets: ``[report] targets`` (a list, or a table keyed by a setting value such as the
    dataset, or data.source), else ``auto_targets`` fractions of ``auto_reference``'s final value."""
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
    ref_label = s.report.get("auto_reference", "fedavg")
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


def rounds_tables(lay: Layout) -> list[Table]:
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


def status_table(section: Section) -> Table:
    """How many runs are done, diverged, incomplete or not started; diverged and failed runs by name."""
    runs = [r for g in section.groups for r in g.runs]
    counts = {k: sum(r.status == k for r in runs) for k in ("done", "diverged", "incomplete", "missing")}
    rows = [[Cell(k if k != "missing" else "not started"), Cell(str(v))] for k, v in counts.items() if v]
    if section.failed:
        rows.append([Cell("failed (last sweep)"), Cell(str(len(section.failed)))])
    details = [f"{r.dir.name}: {r.message}" for r in runs if r.status == "diverged"]
    details += [f"{name}: failed: {msg}" for name, msg in section.failed.items()]
    return Table("status", "Run status", ["status", "runs"], rows, "\n".join(details))


def section_tables(section: Section) -> list[Table]:
    """Every table of a section, in ``[report] tables`` order when the preset gives one."""
    lay = Layout.of(section)
    if not lay.rows:
        return [status_table(section)]
    builders = {
        "final": lambda: accuracy_tables(lay),
        "rounds": lambda: rounds_tables(lay),
        "best_hyper": lambda: best_hyper_table(lay),
    }
    order = list(section.report.get("tables", [])) or ["final", "rounds", "best_hyper"]
    order += [k for k in builders if k not in order]
    out: list[Table] = []
    for key in order:
        if key in builders:
            out += builders[key]()
    return [*out, status_table(section)]


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
