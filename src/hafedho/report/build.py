"""``hafedho report``: every table, figure and the HTML page from run directories (and sweep indexes) only."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hafedho.config import ConfigError
from hafedho.report.html import SectionPage, page
from hafedho.report.layout import Layout
from hafedho.report.paths import shown_path
from hafedho.report.runs import load_sections
from hafedho.report.summary import rounds_rows, summary_rows
from hafedho.report.table import Table
from hafedho.report.tables import section_tables
from hafedho.runfiles import atomic_write_text


@dataclass
class ReportFiles:
    markdown: Path
    html: Path
    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    text: str = ""
    pages: list[SectionPage] = field(default_factory=list)  # each section's tables and figures, in order
    left_out: dict[str, str] = field(default_factory=dict)  # runs left out for a bad metrics.jsonl -> why


def _csv(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


# A report writes only these: results.md, report.html and its .csv, .tex and .png files (``write_report``)
_REPORT_SUFFIXES = (".csv", ".tex", ".png")
_REPORT_FILES = ("results.md", "report.html")


def _is_run_dir(folder: Path) -> bool:
    """``folder`` holds a run (``runtime.rundir.RUN_FILES``): its config beside another run file, or its rows,
    checkpoint or environment."""
    from hafedho.runtime.rundir import RUN_FILES

    if any((folder / name).exists() for name in ("metrics.jsonl", "checkpoint.pt", "env.json")):
        return True
    return (folder / "config.toml").is_file() and any((folder / n).exists() for n in RUN_FILES - {"config.toml"})


def check_out(out: Path, default: bool) -> None:
    """Refuse, before anything is written, an output folder that is (or lies inside) a run directory (its files
    would make ``--force`` refuse that run, and a figure could replace a run file) and one holding a symbolic link
    at a name the report writes (it would write through it, outside the folder)."""
    for folder in (out.resolve(), *out.resolve().parents):
        if folder.is_dir() and _is_run_dir(folder):
            where = "is" if folder == out.resolve() else f"lies inside {folder}, which is"
            fix = "pass --out naming a folder outside it" if default else "choose an --out outside every run"
            raise ConfigError(f"report folder {out} {where} a run directory; a report never writes into one: {fix}")
    if not out.is_dir():
        return
    for p in sorted(out.iterdir()):
        if p.is_symlink() and (p.name in _REPORT_FILES or p.suffix in _REPORT_SUFFIXES):
            raise ConfigError(
                f"{p} is a symbolic link; the report writes no file through one: remove it, or choose another --out"
            )


def write_report(
    runs_dir: str | Path,
    out: str | Path | None = None,
    metric: str | None = None,
    last: int | None = None,
    title: str | None = None,
) -> ReportFiles:
    """Write results.md, report.html, summary.csv, rounds_to_target.csv, each table as .csv and .tex, and the
    PNG figures into ``out`` (default: ``runs_dir``); report.html references the PNGs beside it. With several
    sections, file names start with the section. An ``out`` that is or lies in a run directory, or holds a link at
    a name the report writes, is refused before anything is written (``check_out``).
    ``title`` heads the page (default: ``Results from `RUNS_DIR` ``)."""
    from hafedho.report.plots import section_plots  # matplotlib only when figures are drawn

    sections = load_sections(runs_dir, metric, last)
    if not sections:
        raise ConfigError(f"{runs_dir}: no run directories with metrics and no sweep index (sweeps/*.json) found")
    check_out(Path(out or runs_dir), default=out is None)
    out = Path(out or runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    shown = shown_path(runs_dir)
    md = [f"# {title or f'Results from `{shown}`'}\n"]
    pages, tables_written, figures = [], [], []
    summary, rounds = [], []
    for section in sections:
        prefix = f"{section.name}_" if len(sections) > 1 else ""
        tables: list[Table] = section_tables(section)
        figs = section_plots(Layout.of(section), out, prefix) if Layout.of(section).rows else []
        md.append(f"## {section.title}\n")
        if section.description:
            md.append(f"{section.description}\n")
        for t in tables:
            md.append(f"### {t.title}\n\n{t.markdown()}")
            if t.note:
                md.append("\n".join(f"> {line}" for line in t.note.splitlines()) + "\n")
            for ext, text in (("csv", t.csv()), ("tex", t.latex())):
                path = out / f"{prefix}{t.slug}.{ext}"
                atomic_write_text(path, text)
                tables_written.append(path)
        md += [f"![{f.stem}]({f.name})\n" for f in figs]
        figures += figs
        pages.append(SectionPage(section.name, section.title, section.description, tables, figs))
        summary += summary_rows(section)
        rounds += rounds_rows(section)
    text = "\n".join(md)
    atomic_write_text(out / "results.md", text)
    for name, rows in (("summary.csv", summary), ("rounds_to_target.csv", rounds)):
        if rows:
            atomic_write_text(out / name, _csv(rows))
    html_path = out / "report.html"  # no build time: the same runs give the same page, byte for byte
    atomic_write_text(html_path, page(title or "hafedho report", pages, out, shown))
    bad = {name: why for s in sections for name, why in s.unreadable.items()}
    return ReportFiles(out / "results.md", html_path, tables_written, figures, text, pages, bad)
