"""Every table of a section (one module per table)."""

from __future__ import annotations

from hafedho.report.layout import Layout
from hafedho.report.runs import Section
from hafedho.report.table import Table
from hafedho.report.tables.best_hyper import best_hyper_table
from hafedho.report.tables.final import accuracy_tables
from hafedho.report.tables.rounds import rounds_tables
from hafedho.report.tables.status import status_table


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
