"""The import rules of docs/architecture.md: its layers, bottom to top (``LAYERS``: every import points down the
list, peers never import each other); core imports nothing else of the package; algorithms import only core, and
FedAvg's module (the base class the other algorithms subclass); data does not import the simulator; an engine
imports no other engine nor the registry; Flower and the shared runtime do not import the simulator; no import
cycle anywhere."""

from __future__ import annotations

import ast
import re
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
    allowed = {f"hafedho.data.{r}" for r in DATA_READERS} | {"hafedho.data", "hafedho.core.refs"}  # refs: stdlib only
    assert all(m in allowed for m in imports), imports


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


# ----------------------------------------------------------------------------- the whole package's import graph


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at module level or inside functions alike (a lazy import
    still is a dependency, and a cycle through one fails as soon as the import runs at the wrong moment).
    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(subs if len(subs) == len(node.names) else {*subs, node.module})
    return out - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's ``__init__`` re-exporting its own modules is no edge (Python
    runs the ``__init__`` before any of its modules, so ``from hafedho.core import tree`` in a core module is
    no cycle), but any other import from an ``__init__`` is."""
    graph = {}
    for name, path in MODULES.items():
        own = name + "." if path.name == "__init__.py" else None
        graph[name] = {m for m in imported_modules(path) if own is None or not m.startswith(own)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_data_does_not_import_the_simulator() -> None:
    """Data is below the simulator: it may use core (seeds included), never sim."""
    graph = import_graph()
    bad = {m: sorted(i for i in graph[m] if i.startswith("hafedho.sim")) for m in graph if m.startswith("hafedho.data")}
    assert not any(bad.values()), bad


# The factory beside the engines (make_engine, engine_for, auto): it reads the registry and loads engines by
# name, so it is the one module of sim/engines exempt from the rule below; no engine imports it.
ENGINE_FACTORY = "hafedho.sim.engines.make"


def test_engines_import_no_other_engine_nor_the_registry() -> None:
    """An engine module stands on ``runtime.work`` and imports nothing else of ``sim`` (least of all the registry,
    which names the engines: that edge is the cycle the registry split removed)."""
    graph = import_graph()
    for m in graph:
        if m.startswith("hafedho.sim.engines.") and m != ENGINE_FACTORY:
            bad = {i for i in graph[m] if i.startswith("hafedho.sim") or i == "hafedho.engine_registry"}
            assert not bad, (m, bad)


# docs/architecture.md's order, bottom to top: a module imports only its own group and the layers below; the
# groups of one layer are peers and never import each other.
LAYERS: list[set[str]] = [
    {"core"},
    {"algorithms", "models", "data", "toml_io", "engine_registry", "runfiles"},
    {"config"},
    {"experiment", "tracking"},
    {"runtime"},
    {"sim", "flower"},
    {"sweep"},
    {"report"},
    {"api"},
    {"cli", "hafedho"},  # hafedho: the package's __init__ (hafedho.run, hafedho.register)
    {"console"},  # the `hafedho` command's entry point
    {"__main__"},  # python -m hafedho
]


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_imports_follow_the_documented_layers() -> None:
    """Every import points down docs/architecture.md's list, without exception (the engine registry names its
    engines as strings; ``sim.engines.make`` imports them)."""
    level = {g: i for i, layer in enumerate(LAYERS) for g in layer}
    graph = import_graph()
    assert {group(m) for m in graph} == set(level), sorted({group(m) for m in graph} ^ set(level))
    bad = []
    for m, deps in graph.items():
        for d in deps:
            a, b = group(m), group(d)
            if a == b:
                continue
            if level[b] >= level[a]:
                bad.append(f"{m} -> {d}")
    assert not bad, bad
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text().split("```")[1]
    shown = [g for g in re.findall(r"^(\w+)", doc, flags=re.M)]
    order = [g for layer in LAYERS for g in sorted(layer - {"__main__", "hafedho"}, key=shown.index)]
    assert shown == order, (shown, order)


def test_every_seed_purpose_is_listed_and_used() -> None:
    """``seed_for`` refuses a purpose missing from ``PURPOSES``; here, the other way: none listed is unused."""
    from hafedho.core.seeds import PURPOSES

    used = set()
    for path in MODULES.values():
        used.update(re.findall(r"(?:seed_for|rng_for)\([^,()]+, \"(\w+)\"", path.read_text()))
    assert used == set(PURPOSES), (sorted(used), sorted(PURPOSES))


@pytest.mark.parametrize("path", sorted((SRC / "report").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_report_reads_sweeps_only_through_their_index(path: Path) -> None:
    """The sweep index has one owner (hafedho.sweep.index); the report needs nothing else of the sweep."""
    sweep = {m for m in package_imports(path) if m.startswith("hafedho.sweep")}
    assert sweep <= {"hafedho.sweep.index"}, sweep


@pytest.mark.parametrize("path", sorted((SRC / "sweep").glob("*.py")), ids=lambda p: p.name)
def test_sweep_never_imports_the_report(path: Path) -> None:
    assert not any(m.startswith("hafedho.report") for m in package_imports(path)), package_imports(path)


def imported_names(path: Path) -> set[str]:
    """``package_imports`` plus ``from PACKAGE import MODULE`` spelled as ``PACKAGE.MODULE``."""
    names = package_imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hafedho"):
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


SHARED_BY_RUNTIMES = [*sorted((SRC / "runtime").glob("*.py")), SRC / "experiment.py", SRC / "runfiles.py"]


@pytest.mark.parametrize(
    "path", sorted((SRC / "flower").glob("*.py")) + SHARED_BY_RUNTIMES, ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_flower_and_the_shared_round_code_do_not_import_the_simulator(path: Path) -> None:
    """One round loop: Flower and the simulator stand on ``runtime``/``experiment``; neither those nor Flower
    reach into the simulator (``hafedho.sim``: its runner, engines and full-data passes)."""
    assert not {m for m in imported_names(path) if m.startswith("hafedho.sim")}, imported_names(path)


def test_the_readmes_layout_block_names_every_module() -> None:
    """README.md's Layout block lists every package and top-level module of src/hafedho (``__main__`` aside)."""
    text = (SRC.parents[1] / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n```\n", 2)[1]
    named = set(re.findall(r"src/hafedho/(\w+)", text)) | set(re.findall(r"\b(\w+)\.py:", text))
    modules = {p.stem for p in SRC.glob("*.py") if not p.stem.startswith("_")}
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert modules | packages <= named, sorted((modules | packages) - named)


GENERIC = ("core", "sweep", "report", "runtime", "sim")  # the library's layers: no algorithm named in their logic


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _identifiers(tree: ast.AST) -> list[tuple[int, str]]:
    """Every name ``code`` defines or uses: variables, attributes, functions, classes, arguments, keywords, imports."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.alias):
            out += [(node.lineno, part) for part in (node.asname or node.name).split(".")]
    return out


def named_in_code(code: str, names: list[str], fragments: list[str] = (), package: str = "hafedho") -> list[str]:
    """What a reader of ``code`` (docstrings and comments aside) sees naming one of ``names`` or ``fragments``, as
    ``LINE: what``: an identifier holding a name in any case (``twin_share``); a string literal (f-strings' literal
    parts included) holding a name as a word in any case, or a fragment anywhere (a package-prefixed reference
    ``"hafedho_paper.twin:f"``, a metric key ``"diag/h_cos"``). The package's own name (also its command and its
    modules' prefix) counts in a literal only as the whole literal or spelled otherwise than in lower case."""
    tree = ast.parse(code)
    skip, hits = _docstrings(tree), []
    for line, ident in _identifiers(tree):
        hits += [f"{line}: identifier {ident!r} names {n}" for n in names if n != package and n in ident.lower()]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        hits += [f"{node.lineno}: {text[:60]!r} holds {f}" for f in fragments if f in text]
        for name in names:
            for m in re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text, flags=re.IGNORECASE):
                if name != package or m.group(0) != package or text.lower() == package:
                    hits.append(f"{node.lineno}: {text[:60]!r} names {name}")
    return hits


def study_vocabulary() -> tuple[list[str], list[str]]:
    """What names a method or a study rather than the library: every registered algorithm, each installed
    plugin's word for its derived row (the paper's "twin"); and as fragments, each plugin's package and the
    packages it was known by (``renamed``: ``hafedho.paper``), and every diagnostic metric prefix an algorithm
    names for its estimate (``diag/h_``, ``Diagnostics.name``)."""
    from hafedho.algorithms import REGISTRY
    from hafedho.core import Diagnostics
    from hafedho.core.plugins import packages, plugins
    from hafedho.core.refs import import_reference

    names, fragments = sorted(REGISTRY), [f"{top}." for top in packages()]
    for plugin in plugins().values():
        fragments += [f"{old}." for old in plugin.renamed]
    study = import_reference("test", "hafedho_paper.study:REPORT", ValueError)
    names.append(study["derived"]["noun"])  # type: ignore[index]
    for cls in REGISTRY.values():
        d = Diagnostics.of(cls())
        if d.estimate is not None:
            fragments.append(f"diag/{d.name}_")
    return names, sorted(set(fragments))


def test_the_generic_layers_name_no_method_nor_study() -> None:
    """No module of core/, sweep/, report/, runtime/ or sim/ names a registered algorithm, the study's derived row,
    a plugin's package or an algorithm's diagnostic metrics in its code (identifiers and literals): what belongs to
    one method (the paper's HaFedHo study) is in the study plugin (study/hafedho_paper), behind generic extension
    points."""
    names, fragments = study_vocabulary()
    assert {"hafedho", "twin"} <= set(names) and {"hafedho_paper.", "hafedho.paper.", "diag/h_"} <= set(fragments)
    hits = [
        f"{p.relative_to(SRC)}:{h}"
        for g in GENERIC
        for p in sorted((SRC / g).rglob("*.py"))
        for h in named_in_code(p.read_text(), names, fragments)
    ]
    assert not hits, hits


def test_named_in_code_finds_each_kind() -> None:
    """A planted violation of each kind is found; docstrings, comments and the package's own prefix are not."""
    names, fragments = ["fedavg", "hafedho", "twin"], ["hafedho_paper.", "hafedho.paper.", "diag/h_"]
    code = (
        '"""hafedho, a twin and FedAvg in a docstring."""\nOWN = "hafedho"\nX = f"{a} FedAvg lead"\n'
        'cmd = "hafedho report"  # a twin in a comment\nmod = "hafedho.report.build"\n'
        'ref = "hafedho_paper.twin_rows:t"\nold = "hafedho.paper.study:R"\nkey = "diag/h_cos"\n'
        "def twin_share(x):\n    return x.twin\n"
    )
    lines = sorted({int(h.split(":")[0]) for h in named_in_code(code, names, fragments)})
    assert lines == [2, 3, 6, 7, 8, 9, 10], named_in_code(code, names, fragments)
    assert named_in_code("def f(fedavg_rows): pass\n", names)  # an argument
    assert named_in_code("g(twin=1)\n", names) and named_in_code("from a import twin_b\n", names)


def test_the_library_imports_nothing_of_a_plugin() -> None:
    """``src/hafedho`` never imports the study (nor any installed plugin), at module level or inside functions:
    plugins are loaded through their entry points and named by reference only."""
    _, fragments = study_vocabulary()
    packages = {f.rstrip(".") for f in fragments if not f.startswith("diag/")}
    hits = [
        f"{name}: {m}"
        for name, path in MODULES.items()
        for m in top_level_and_lazy_imports(path)
        if any(m == p or m.startswith(f"{p}.") for p in packages)
    ]
    assert not hits, hits
    assert not (SRC / "paper").exists()


def top_level_and_lazy_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names
