"""The table model and its renderers: a title, a header and rows of cells, written as Markdown, CSV, LaTeX, HTML."""

from __future__ import annotations

import csv
import html
import io
from dataclasses import dataclass


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
    text = text.replace("±", "$\\pm$").replace("≥", "$\\geq$").replace("—", "--").replace("~", "\\textasciitilde{}")
    for greek, tex in (("λμ", "$\\lambda\\mu$"), ("β", "$\\beta$"), ("λ", "$\\lambda$"), ("μ", "$\\mu$")):
        text = text.replace(greek, tex)  # the momentum twin's row name, FedAvgM, β = λμ
    return text
