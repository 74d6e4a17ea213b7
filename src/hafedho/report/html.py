"""One HTML page: every section's tables and its figures, referenced as the PNG files written beside it (never
embedded, so a regenerated page adds no second copy of a figure)."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from hafedho.report.table import Table

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; } h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.5em 0 0.3em; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f3f3f3; }
.note { color: #666; font-size: 0.8em; white-space: pre-wrap; margin-bottom: 1.2em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
nav a { margin-right: 1em; }
"""


@dataclass
class SectionPage:
    name: str
    title: str
    description: str
    tables: list[Table]
    figures: list[Path] = field(default_factory=list)


def image_tag(path: Path, folder: Path) -> str:
    """An ``<img>`` that references ``path`` relative to ``folder``, the one holding the page."""
    src = quote(Path(os.path.relpath(path, folder)).as_posix())
    return f'<img alt="{html.escape(path.stem)}" src="{html.escape(src)}">'


def page(title: str, sections: list[SectionPage], folder: Path, subtitle: str = "") -> str:
    """The page, to be written in ``folder`` (its figures are referenced relative to it)."""
    nav = "".join(f'<a href="#{html.escape(s.name)}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{html.escape(subtitle)}</p>' if subtitle else "",
        f"<nav>{nav}</nav>" if len(sections) > 1 else "",
    ]
    for s in sections:
        parts.append(f'<h2 id="{html.escape(s.name)}">{html.escape(s.title)}</h2>')
        if s.description:
            parts.append(f"<p>{html.escape(s.description)}</p>")
        for t in s.tables:
            parts.append(f"<h3>{html.escape(t.title)}</h3>{t.html()}")
            if t.note:
                parts.append(f'<div class="note">{html.escape(t.note)}</div>')
        parts += [image_tag(f, folder) for f in s.figures]
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p) + "\n"
