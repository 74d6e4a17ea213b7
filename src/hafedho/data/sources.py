"""Data sources: named loaders that read real on-disk formats into one in-memory :class:`Dataset`.

Each source is a ``load(path, **options) -> Dataset`` function registered in :data:`SOURCES`;
:func:`load_dataset` looks one up, fills in its default path and turns every failure into a one-line
:class:`DataError` that names the file and the fix. Each source family has its own module.

A user's source is named by a reference ``data.source = "package.module:name"`` (a :class:`Source`, or a function
``load(path=None, **options) -> Dataset``; imported on demand by ``hafedho.core.refs``) or registered by
``hafedho.register``.
"""

from __future__ import annotations

import inspect
import types
import typing

from hafedho.data.builtin import DIGITS, SYNTHETIC
from hafedho.data.cifar import CIFAR10, CIFAR100
from hafedho.data.dataset import Dataset, Source, default_data_path
from hafedho.data.femnist import FEMNIST
from hafedho.data.imagefolder import IMAGEFOLDER
from hafedho.data.npz import NPZ
from hafedho.data.safe_pickle import DataError

__all__ = ["SOURCES", "DataError", "Dataset", "Source", "as_source", "load_dataset"]


# The registry: ``hafedho datasets`` lists the sources in this order. A new source is a module declaring its
# ``Source`` plus one entry here.
SOURCES: dict[str, Source] = {s.name: s for s in (DIGITS, SYNTHETIC, FEMNIST, CIFAR10, CIFAR100, IMAGEFOLDER, NPZ)}


def load_dataset(name: str, path: str | None = None, **options: object) -> Dataset:
    """Load a registered source by name.

    Args:
        name: A key of :data:`SOURCES`, or a reference ``"package.module:name"`` (see :func:`as_source`).
        path: File or directory to read, a relative one against the working directory; ``None`` uses the source's
            ``default_path`` (which alone may resolve against the source checkout: :func:`default_data_path`).
        **options: Source-specific options (e.g. ``alpha`` for synthetic, ``label`` for cifar100).

    Raises:
        DataError: Unknown source or option, missing or unreadable data.
    """
    source = SOURCES.get(name)
    if source is None and ":" in name:
        from hafedho.core.refs import import_reference  # stdlib only; lazy: reading built-in data needs no torch

        source = as_source(import_reference("data.source", name, DataError), name, f"data.source={name!r}", True)
    if source is None:
        raise DataError(
            f"unknown data source {name!r}; known sources: {', '.join(SOURCES)}, or name your own by reference, "
            "data.source='package.module:load'"
        )
    if path is None:
        path = default_data_path(source)  # a relative default may fall back to the checkout; a given path never
    try:
        inspect.signature(source.load).bind(path, **options)
    except TypeError as e:
        params = [p for p in inspect.signature(source.load).parameters if p != "path"]
        raise DataError(f"{name}: {e}; its options are: {', '.join(params) or 'none'}") from e
    _check_options(source, options)
    ds = source.load(path, **options)
    if not isinstance(ds, Dataset):
        raise DataError(f"data.source={name!r} returned {type(ds).__name__}, not a hafedho.data.dataset.Dataset")
    return ds


def _check_options(source: Source, options: dict[str, object]) -> None:
    """Each option against the loader's annotation of it (as model options are): plain types and their unions;
    an option the loader leaves unannotated, or annotates with a generic, goes unchecked."""
    try:
        hints = typing.get_type_hints(source.load)
    except Exception:  # a user's annotation that does not resolve
        return
    for key, value in options.items():
        hint = hints.get(key)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        allowed = typing.get_args(hint) if union else (hint,)
        if hint is None or not all(isinstance(a, type) and typing.get_origin(a) is None for a in allowed):
            continue
        ok = any(isinstance(value, a) and not (a in (int, float) and isinstance(value, bool)) for a in allowed)
        if not ok and not (float in allowed and type(value) is int):  # an int is a float, a bool is no number
            names = " or ".join("None" if a is type(None) else a.__name__ for a in allowed)
            raise DataError(
                f"{source.name}: data.options.{key}={value!r}: expected {names}, got {type(value).__name__}"
            )


def as_source(obj: object, name: str, where: str, reference: bool = False) -> Source:
    """A user's data source as a :class:`Source`: one as it is, or a function ``load(path=None, **options)``
    (its docstring's first line is the description; it reads ``data.path``, ``None`` unless given). Named by
    ``reference`` (text, not code), the function must be a ``def`` of the user's and a ``Source``'s loader too,
    never a builtin or the standard library's (``hafedho.core.refs``): ``data.path`` is its argument."""
    if reference:
        from hafedho.core.refs import not_standard_library

        load = obj.load if isinstance(obj, Source) else obj
        not_standard_library("data.source", name, load, getattr(load, "__module__", None) or "builtins", DataError)
        if not (isinstance(obj, Source) or inspect.isfunction(obj)):
            what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
            raise DataError(
                f"{where}: {what} is not a data source; name a hafedho.data.sources.Source or a "
                "function def load(path=None, **options) -> Dataset"
            )
    if isinstance(obj, Source):
        return obj
    try:
        params = list(inspect.signature(obj).parameters.values()) if callable(obj) and not isinstance(obj, type) else []
    except (TypeError, ValueError):  # a callable without a signature
        params = []
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        raise DataError(
            f"{where}: {what} is not a data source; name a hafedho.data.sources.Source or a function "
            "def load(path=None, **options) -> Dataset"
        )
    doc = (inspect.getdoc(obj) or "").strip().splitlines()
    return Source(name, doc[0] if doc else name, None, obj, needs_files=False)
