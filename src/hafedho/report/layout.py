"""A section's layout: rows (label + varying hyperparameters) x columns (varying settings), and how values read."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hafedho.report.runs import Group, Section, check_seeds
from hafedho.report.stats import Stat


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

    def is_derived(self, row: tuple[str, tuple]) -> bool:
        return row[0] in self.section.derived

    def is_baseline(self, row: tuple[str, tuple]) -> bool:
        """A competitor the study's own method is judged against: no reference, no derived row, and no row that
        runs the own method itself (its hyperparameter splits, a variant of it under another label)."""
        if self.is_reference(row) or self.is_derived(row):
            return False
        groups = [g for g in self.section.groups if g.runs and g.runs[0].config]
        algs = {
            g.runs[0].config.get("algorithm", {}).get("name")
            for g in groups
            if self.row_key(g, self.row_hyper_keys) == row
        }
        return self.section.study.own not in algs

    def row_name(self, row: tuple[str, tuple]) -> str:
        """The label and its varying hyperparameters; a derived row reads ``[report.derived] name``, its ``value``
        as ``= 0.5`` (the momentum twin: ``FedAvgM, β = λμ = 0.5``). A label's [report.names] entry, if any,
        replaces the label (e.g. converge's ``hafedho-exact``)."""
        names, study = self.section.names(), self.section.study
        label, of = row[0], self.section.derived.get(row[0])
        value = study.derived.value if of is not None else None  # shown as "= 0.5" after the derived row's name
        extra = " ".join(f"= {fmt_value(v)}" if k == value else display(k, v, names, False) for k, v in row[1])
        return f"{names.get(label, label if of is None else study.derived_name(of))} {extra}".strip()

    def col_name(self, col: dict[str, Any]) -> str:
        names = self.section.names()
        parts = [display(k, v, names, k in self.section.named_axes) for k, v in col.items()]
        return ", ".join(parts) or "all runs"

    def columns_without(self, key: str) -> list[dict[str, Any]]:
        """The distinct columns with ``key`` dropped, in column order (a plot's panels, a protocol's settings)."""
        out: list[dict[str, Any]] = []
        for col in self.columns:
            rest = {k: v for k, v in col.items() if k != key}
            if rest not in out:
                out.append(rest)
        return out

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
