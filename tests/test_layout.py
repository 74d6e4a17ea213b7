"""The import rule of DESIGN.md: core imports nothing else of the package; algorithms import only core, and
FedAvg's module (algorithms that change only FedAvg's server, FedAvgM and FedLWS, subclass it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hafedho"


def package_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hafedho"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("hafedho"))
    return names


@pytest.mark.parametrize("path", sorted((SRC / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_core(path: Path) -> None:
    assert all(m.startswith("hafedho.core") for m in package_imports(path)), package_imports(path)


@pytest.mark.parametrize("path", sorted((SRC / "algorithms").glob("*.py")), ids=lambda p: p.name)
def test_algorithms_import_only_core(path: Path) -> None:
    allowed = ("hafedho.core", "hafedho.algorithms") if path.name == "__init__.py" else ("hafedho.core",)
    imports = package_imports(path) - {"hafedho.algorithms.fedavg"}  # the one algorithm others may extend
    assert all(m.startswith(allowed) for m in imports), imports


@pytest.mark.parametrize("path", sorted((SRC / "report").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_report_reads_sweeps_only_through_their_index(path: Path) -> None:
    """The sweep index has one owner (hafedho.sweep.index); the report needs nothing else of the sweep."""
    sweep = {m for m in package_imports(path) if m.startswith("hafedho.sweep")}
    assert sweep <= {"hafedho.sweep.index"}, sweep


@pytest.mark.parametrize("path", sorted((SRC / "sweep").glob("*.py")), ids=lambda p: p.name)
def test_sweep_never_imports_the_report(path: Path) -> None:
    assert not any(m.startswith("hafedho.report") for m in package_imports(path)), package_imports(path)
