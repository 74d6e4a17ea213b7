"""The import rules of DESIGN.md: core imports nothing else of the package; algorithms import only core, and
FedAvg's module (algorithms that change only FedAvg's server, FedAvgM and FedLWS, subclass it); Flower does not
import the simulator's runner."""

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


def imported_names(path: Path) -> set[str]:
    """``package_imports`` plus ``from PACKAGE import MODULE`` spelled as ``PACKAGE.MODULE``."""
    names = package_imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hafedho"):
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


SHARED_BY_RUNTIMES = ("experiment.py", "rounds.py", "rundir.py", "results.py")


@pytest.mark.parametrize(
    "path",
    sorted((SRC / "flower").glob("*.py")) + [SRC / name for name in SHARED_BY_RUNTIMES],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_flower_and_the_shared_round_code_do_not_import_the_simulators_runner(path: Path) -> None:
    """One round loop: Flower and the simulator share ``rounds``/``rundir``/``experiment``; neither those nor
    Flower reach into the simulator's own loop (``hafedho.sim.runner``)."""
    assert "hafedho.sim.runner" not in imported_names(path), imported_names(path)
