"""References ``"package.module:Name"``: a user's algorithm, model or data source, named where a built-in name goes
(``algorithm.name``, ``model.name``, ``data.source``) and imported on demand.

The module must be importable where the run happens: installed, on ``PYTHONPATH``, or (searched last, as
``python -m`` does) in the working directory. Spawned workers (sweeps with ``--jobs``) inherit this process's
``sys.path`` and working directory, forked ones (the process engine) its imported modules, so a reference that
resolves here resolves there. Plain standard library: every registry (algorithms, models, data) uses it.

This is the one spelling of user code in a config. The one other name with a colon is a record, never typed:
``USER_MODULE``, what a run built from a module passed in Python writes as its ``model.name``.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["USER_MODULE", "file_name", "import_reference", "is_reference", "user_module_name"]

USER_MODULE = "custom:"  # model.name of a module passed in Python: "custom:<module>.<Class>", a record

FIX = "make its package importable: pip install it, add its folder to PYTHONPATH, or run from the folder holding it"


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


def import_reference(key: str, ref: str, error: type[Exception]) -> object:
    """The object ``ref`` = ``"package.module:Name"`` names (``Name`` may be dotted: ``Outer.Inner``).

    Every failure raises ``error`` (the caller's one-line error type) as ``KEY='REF': what is wrong; the fix``:
    a malformed reference, a module that is not found, one whose import fails, an attribute it lacks.
    """
    module, _, attr = ref.partition(":")
    if not (_dotted(module) and _dotted(attr)):
        raise error(f"{key}={ref!r}: a reference reads 'package.module:Name', e.g. {key}='my_pkg.fedadam:FedAdam'")
    try:
        mod = _import(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(f"{e.name}.")):
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
    return obj


def _dotted(text: str) -> bool:
    return bool(text) and all(p.isidentifier() for p in text.split("."))


def _import(module: str) -> object:
    """``importlib.import_module``; a module that is not found is looked for under the name an installed plugin
    says it moved to (``hafedho.core.plugins``: a results folder's index keeps the references it was written
    with), then, for a top-level package, in the working directory too (the ``hafedho`` command, unlike
    ``python -m hafedho``, does not put it on ``sys.path``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        from hafedho.core.plugins import renamed  # entry points are read only when a name is missing

        if e.name and (module == e.name or module.startswith(f"{e.name}.")) and (moved := renamed(module)):
            try:
                return importlib.import_module(moved)
            except ModuleNotFoundError as e2:
                if not (e2.name and (moved == e2.name or moved.startswith(f"{e2.name}."))):
                    raise
                raise e from None  # missing under its new name too: say so under the name the user wrote
        cwd = os.getcwd()
        if e.name != module.split(".")[0] or cwd in sys.path:
            raise
        sys.path.append(cwd)  # last: never shadows an installed package
        return importlib.import_module(module)
