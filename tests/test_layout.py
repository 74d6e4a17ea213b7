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


# The data readers: one module per source family on top of dataset.py (the Dataset type and its checks), the
# decoded-array cache and safe_pickle; batching (federated) and partitioning build on them, never the reverse.
DATA_READERS = ("builtin", "cache", "cifar", "dataset", "femnist", "imagefolder", "npz", "safe_pickle", "sources")


@pytest.mark.parametrize("name", DATA_READERS)
def test_data_readers_import_only_data_readers(name: str) -> None:
    imports = package_imports(SRC / "data" / f"{name}.py")
    assert all(m in {f"hafedho.data.{r}" for r in DATA_READERS} | {"hafedho.data"} for m in imports), imports


# Flower's deployment toolkit starts and drives Flower's commands: it imports neither flwr nor torch (it works
# where only the commands are installed) and nothing of hafedho beyond itself.
DEPLOY_TOOLKIT = ("app", "certs", "deploy", "flwr_cli", "procs")


def top_level_modules(path: Path) -> set[str]:
    """Every module a file imports at its top level (not inside functions), hafedho's or not."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("name", DEPLOY_TOOLKIT)
def test_flower_deploy_toolkit_is_self_contained(name: str) -> None:
    path = SRC / "flower" / f"{name}.py"
    assert not {m for m in top_level_modules(path) if m.split(".")[0] in ("flwr", "torch")}
    assert all(m in {f"hafedho.flower.{t}" for t in DEPLOY_TOOLKIT} for m in package_imports(path))
