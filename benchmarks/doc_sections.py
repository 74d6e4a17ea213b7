"""``docs/benchmarks.md`` is written by several benchmarks: each owns the section between its two markers."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: start -->", f"<!-- {name}: end -->"


def write_section(path: Path, name: str, section: str) -> None:
    """Replace benchmark ``name``'s section of ``path`` (``section`` holds its markers), or append it."""
    start, end = markers(name)
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text if text.endswith("\n") else text + "\n")


def other_sections(path: Path) -> str:
    """Every marked section of ``path`` (from the first marker on), for a benchmark that writes the page's head."""
    text = path.read_text() if path.exists() else ""
    at = text.find("<!-- ")
    return "" if at < 0 else "\n" + text[at:]
