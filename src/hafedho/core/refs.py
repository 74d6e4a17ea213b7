"""References ``"package.module:Name"``: a user's algorithm, model or data source, named where a built-in name goes
(``algorithm.name``, ``model.name``, ``data.source``) and imported on demand.

The module must be importable where the run happens: installed, or on ``PYTHONPATH`` (``python -m hafedho`` also
puts the working directory there; the ``hafedho`` command does not, so a folder's stray ``.py`` file is never
imported by accident). Spawned workers (sweeps with ``--jobs``) inherit this process's ``sys.path``, forked ones
(the process engine) its imported modules, so a reference that resolves here resolves there. Plain standard
library: every registry (algorithms, models, data) uses it.

Trust: a reference runs code, as a Python script does. So before anything it names is called, it must name the
user's own code, never the standard library's or a builtin (``os:system`` is refused; each caller then checks the
kind its key asks for), and a reference read from a results folder (``hafedho report``) is imported only from
``hafedho``, an installed plugin, or a package the user allows (``trusting``).

This is the one spelling of user code in a config. The one other name with a colon is a record, never typed:
``USER_MODULE``, what a run built from a module passed in Python writes as its ``model.name``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = [
    "USER_MODULE",
    "file_name",
    "import_reference",
    "is_reference",
    "not_standard_library",
    "trusting",
    "user_module_name",
]

USER_MODULE = "custom:"  # model.name of a module passed in Python: "custom:<module>.<Class>", a record

FIX = "make its package importable: pip install it, add its folder to PYTHONPATH, or run python -m hafedho from there"
OWN_CODE = "a reference must name your own code, not the standard library's"
ALLOW = "--allow-code"  # hafedho report's flag (cli.py): the packages a results folder may import beyond plugins


def is_reference(name: object) -> bool:
    """True for ``"package.module:Name"`` (a name with a colon); built-in and registered names have none, and a
    ``USER_MODULE`` record is none either."""
    return isinstance(name, str) and ":" in name and not name.startswith(USER_MODULE)


def user_module_name(cls: type) -> str:
    """The ``model.name`` a run records for a module passed in Python (``experiment.build(cfg, module=...)``,
    ``hafedho.run(..., module=...)``): ``"custom:<module>.<Class>"``. Not a reference: the run cannot be rebuilt
    from it by name (it needs the module passed again), hence its own spelling, which those runs' names hash, so
    it stays as it is."""
    return f"{USER_MODULE}{cls.__module__}.{cls.__qualname__}"


def file_name(name: str) -> str:
    """A name as part of a folder name: a reference's ``:`` becomes ``.`` (no colon in paths, e.g. on Windows)."""
    return name.replace(":", ".")


def import_reference(key: str, ref: str, error: type[Exception], *, from_folder: bool = False) -> object:
    """The object ``ref`` = ``"package.module:Name"`` names (``Name`` may be dotted: ``Outer.Inner``), never one of
    the standard library or builtins (``not_standard_library``); the caller checks its kind before calling it.

    ``from_folder``: ``ref`` was read from a results folder, not typed by the user (a sweep index's ``[report]``),
    so it is imported only from trusted packages (``trusting``); inside ``trusting`` every reference is.
    Every failure raises ``error`` (the caller's one-line error type) as ``KEY='REF': what is wrong; the fix``:
    a malformed reference, an untrusted one, a module that is not found, one whose import fails, an attribute it
    lacks.
    """
    module, _, attr = ref.partition(":")
    if not (_dotted(module) and _dotted(attr)):
        raise error(f"{key}={ref!r}: a reference reads 'package.module:Name', e.g. {key}='my_pkg.fedadam:FedAdam'")
    if _standard(module):  # refused before importing: importing some (antigravity, this) already acts
        raise error(
            f"{key}={ref!r}: {OWN_CODE} ({module.split('.')[0]!r} is Python's); name a function or class "
            "of your own module"
        )
    _check_trusted(key, ref, module, error, from_folder)
    try:
        mod = _import(module)
    except ModuleNotFoundError as e:
        if _is_missing(e, module):
            raise error(f"{key}={ref!r}: module {e.name!r} not found; {FIX}") from None
        raise error(f"{key}={ref!r}: importing {module!r} failed: {e}; install what it imports") from None
    except Exception as e:  # the user's module raised while importing: say so in one line, never a traceback
        raise error(f"{key}={ref!r}: importing {module!r} raised {type(e).__name__}: {e}; fix that module") from None
    except SystemExit as e:  # sys.exit() at import would end the run with its code and no word
        raise error(f"{key}={ref!r}: importing {module!r} called sys.exit({e.code!r}); fix that module") from None
    obj: object = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{key}={ref!r}: module {module!r} has no attribute {attr!r}; check the name after ':'")
        obj = getattr(obj, part)
    not_standard_library(key, ref, obj, getattr(mod, "__name__", module), error)
    return obj


def not_standard_library(key: str, ref: str, obj: object, found_in: str, error: type[Exception]) -> None:
    """Refuse ``obj`` (found in module ``found_in``) when it is the standard library's or a builtin, even when
    the user's module imported it (``from os import system``): a config must not call what a script of the
    user's would have to ask for. Where it was defined: its ``__module__`` (a class, a function, an instance of
    a class), else ``found_in`` (a plain dict); a C function without one is a builtin."""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        owner = "builtins" if inspect.isbuiltin(obj) or inspect.ismethoddescriptor(obj) else found_in
    if _standard(owner):
        raise error(
            f"{key}={ref!r}: {OWN_CODE} (it is {owner}.{getattr(obj, '__qualname__', type(obj).__name__)}); "
            "name a function or class defined in your own module"
        )


def _standard(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top == "builtins"


@dataclass(frozen=True)
class _Trust:
    folder: str  # where the references come from, as the refusal names it
    allowed: frozenset[str]  # top-level packages the user allows beyond hafedho and the installed plugins
    refused: list[str] = field(default_factory=list)  # each refusal's line, for the caller to show if caught


_TRUST: ContextVar[_Trust | None] = ContextVar("hafedho_trust", default=None)


@contextmanager
def trusting(folder: str | os.PathLike[str], allowed: Iterable[str] = ()) -> Iterator[list[str]]:
    """Within the block, every reference (a results folder's ``[report]`` study, tables and figures, its runs'
    ``algorithm.name``) imports only ``hafedho``, an installed plugin's package, or one of ``allowed`` (top-level
    package names, what ``hafedho report --allow-code`` lists): a results folder is data, and opening it must not
    run code it names (a ``.py`` file shipped beside it). Yields the refusals' lines: one a caller catches (the
    report reads a refused run's algorithm without its defaults) is still for the user to hear."""
    trust = _Trust(f"results folder {str(folder)!r}", frozenset(allowed))
    token = _TRUST.set(trust)
    try:
        yield trust.refused
    finally:
        _TRUST.reset(token)


def _check_trusted(key: str, ref: str, module: str, error: type[Exception], from_folder: bool) -> None:
    trust = _TRUST.get()
    if trust is None and not from_folder:
        return  # typed by the user (a config, an override, a preset they run): their code, as a script is
    trust = trust or _Trust("a results folder", frozenset())
    from hafedho.core.plugins import packages, renamed

    tops = {module.split(".")[0], *(m.split(".")[0] for m in [renamed(module)] if m)}
    if tops & ({__name__.partition(".")[0], *packages()} | trust.allowed):  # this library, plugins, allowed
        return
    top = module.split(".")[0]
    line = (
        f"{key}={ref!r}, named in {trust.folder}: only hafedho's and installed plugins' code is imported from a "
        f"results folder, so {top!r} is not; if you trust it, pass {ALLOW} {top}"
    )
    trust.refused.append(line)
    raise error(line)


def _dotted(text: str) -> bool:
    return bool(text) and all(p.isidentifier() for p in text.split("."))


def _import(module: str) -> object:
    """``importlib.import_module``; a module that is not found is looked for under the name an installed plugin
    says it moved to (``hafedho.core.plugins``: a results folder's index keeps the references it was written
    with). Never the working directory: only what the user put on ``sys.path`` (module docstring)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        from hafedho.core.plugins import renamed  # entry points are read only when a name is missing

        if _is_missing(e, module) and (moved := renamed(module)):
            try:
                return importlib.import_module(moved)
            except ModuleNotFoundError as e2:
                if not _is_missing(e2, moved):
                    raise
                raise e from None  # missing under its new name too: say so under the name the user wrote
        raise


def _is_missing(e: ModuleNotFoundError, module: str) -> bool:
    """Whether ``e`` says ``module`` itself (or a package above it) is missing, not something it imports."""
    return bool(e.name) and (module == e.name or module.startswith(f"{e.name}."))
