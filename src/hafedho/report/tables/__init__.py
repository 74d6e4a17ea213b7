"""Every table of a section: one module per table kind, and the registry that orders them.

A new table is one module with a builder ``Layout -> list[Table]`` plus one line in ``TABLES``; a preset's
``[report] tables = [...]`` names the kinds it wants first, or a builder of one's own by reference
(``"my_pkg.tables:mine"``, ``hafedho.core.refs``). A section's study adds kinds of its own after these
(``hafedho.report.study``: ``tables`` in its dict, by reference, imported on demand). The run-status table always
comes last.
"""

from __future__ import annotations

from collections.abc import Callable

from hafedho.core.refs import is_reference
from hafedho.report.layout import Layout
from hafedho.report.runs import Section
from hafedho.report.study import load_builder
from hafedho.report.table import Table
from hafedho.report.tables.best_hyper import best_hyper_table
from hafedho.report.tables.final import accuracy_tables
from hafedho.report.tables.robustness import robustness_table
from hafedho.report.tables.status import status_table
from hafedho.report.tables.to_target import to_target_tables
from hafedho.report.tables.verdict import verdict_table

Builder = Callable[[Layout], list[Table]]

# kind -> builder, in the default order
TABLES: dict[str, Builder | str] = {
    "final": accuracy_tables,
    "rounds": to_target_tables,
    "best_hyper": best_hyper_table,
    "verdict": verdict_table,
    "robustness": robustness_table,  # only where a preset runs several protocols (a `protocol` axis)
}


def section_tables(section: Section) -> list[Table]:
    """Every table of a section, in ``[report] tables`` order when the preset gives one."""
    lay = Layout.of(section)
    if not lay.rows:
        return [status_table(section)]
    kinds = {**TABLES, **section.study.tables}
    order = list(section.report.get("tables", [])) or list(kinds)
    order += [k for k in kinds if k not in order]
    out: list[Table] = []
    for key in order:
        if key in kinds or is_reference(key):
            out += builder(kinds.get(key, key))(lay)
    return [*out, status_table(section)]


def builder(entry: Builder | str) -> Builder:
    """A ``TABLES`` entry or a ``[report] tables`` reference as the builder it names."""
    if not isinstance(entry, str):
        return entry
    not_one = f"report.tables: {entry!r} is not a table builder (Layout -> list[Table])"
    return load_builder("report.tables", entry, not_one)
