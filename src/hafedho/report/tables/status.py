"""The run-status table: how many runs are done, diverged, incomplete or not started."""

from __future__ import annotations

from collections import Counter

from hafedho.report.runs import Section
from hafedho.report.table import Cell, Table


def status_table(section: Section) -> Table:
    """How many runs are done, diverged, incomplete or not started; diverged, failed and left-out runs (no row, or
    a bad metrics.jsonl: one damaged run never stops the report of the others) by name; and
    how many ran at each precision when any did not run at the default fp32 (``core.device``)."""
    runs = [r for g in section.groups for r in g.runs]
    counts = {k: sum(r.status == k for r in runs) for k in ("done", "diverged", "incomplete", "missing")}
    rows = [[Cell(k if k != "missing" else "not started"), Cell(str(v))] for k, v in counts.items() if v]
    precisions = Counter(str(r.config.get("precision", "fp32")) for r in runs if r.config)
    if set(precisions) - {"fp32"}:
        rows += [[Cell(f"at precision {p}"), Cell(str(n))] for p, n in sorted(precisions.items())]
    if section.failed:
        rows.append([Cell("failed (last sweep)"), Cell(str(len(section.failed)))])
    if section.left_out:
        rows.append([Cell("left out (no metrics row)"), Cell(str(len(section.left_out)))])
    if section.unreadable:
        rows.append([Cell("left out (bad metrics.jsonl)"), Cell(str(len(section.unreadable)))])
    details = [f"{r.dir.name}: {r.message}" for r in runs if r.status == "diverged"]
    details += [f"{name}: failed: {msg}" for name, msg in section.failed.items()]
    details += [f"{name}: left out: {why}" for name, why in section.left_out.items()]
    details += [f"{name}: left out: {why}" for name, why in section.unreadable.items()]
    return Table("status", "Run status", ["status", "runs"], rows, "\n".join(details))
