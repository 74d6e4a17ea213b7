"""A restricted unpickler for data files (CIFAR batches) and the data package's error type.

``pickle.load`` runs whatever callable a file names, so a downloaded "data set" could run code on load.
:func:`safe_load` resolves only the handful of numpy callables that rebuild arrays, dtypes and scalars;
plain dicts, lists, tuples, strings, bytes and numbers need no imports at all.

:class:`DataError` lives here, the lowest module of the package, so that every reader can raise it without
an import cycle; ``hafedho.data.sources`` re-exports it.
"""

from __future__ import annotations

import importlib
import os
import pickle
from typing import IO, Any

__all__ = ["DataError", "safe_load"]


class DataError(ValueError):
    """One-line, user-facing error: what is wrong, with which file, and the fix."""


# (module, name) pairs a pickle may import. numpy 2 writes ``numpy._core``, numpy 1 and the Python 2 CIFAR
# pickles write ``numpy.core``; ``_codecs.encode`` is how protocol-2 pickles written by Python 3 store bytes.
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(f"numpy.{core}.multiarray", n) for core in ("core", "_core") for n in ("_reconstruct", "scalar")]
    + [(f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")]
    + [(b, n) for b in ("builtins", "__builtin__") for n in ("set", "frozenset", "bytearray", "complex")]
)


def _resolve(module: str, name: str) -> Any:
    # Import ``numpy.core.*`` through its ``numpy._core`` home when it exists: numpy 2 keeps ``numpy.core``
    # only as a shim that emits a DeprecationWarning on every lookup.
    if module.startswith("numpy.core."):
        try:
            return getattr(importlib.import_module("numpy._core." + module[len("numpy.core.") :]), name)
        except (ImportError, AttributeError):
            pass
    if module == "__builtin__":
        module = "builtins"
    return getattr(importlib.import_module(module), name)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], *, encoding: str, label: str) -> None:
        super().__init__(file, encoding=encoding)
        self._label = label

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise DataError(
                f"refusing to unpickle {self._label}: it imports {module}.{name}; only plain containers, "
                "numbers, strings and numpy arrays are allowed"
            )
        return _resolve(module, name)


def safe_load(
    path_or_file: str | os.PathLike[str] | IO[bytes], encoding: str = "latin1", *, name: str | None = None
) -> Any:
    """Unpickle a data file, admitting only containers, numbers, strings and numpy arrays.

    Args:
        path_or_file: A path, or a binary file object (e.g. a member of a tar archive).
        encoding: How to decode Python 2 ``str`` objects; ``latin1`` keeps numpy buffers byte-exact.
        name: Name used in error messages when ``path_or_file`` is a file object.

    Returns:
        The unpickled object.

    Raises:
        DataError: The pickle imports anything else, or is corrupt or truncated.
    """
    if isinstance(path_or_file, str | os.PathLike):
        label = name or os.fspath(path_or_file)
        try:
            with open(path_or_file, "rb") as f:
                return _load(f, encoding, label)
        except OSError as e:
            raise DataError(f"cannot read {label}: {e.strerror or e}; check the path and permissions") from e
    label = name or str(getattr(path_or_file, "name", "<pickle stream>"))
    return _load(path_or_file, encoding, label)


# A truncated or garbled pickle can fail in many ways, all of which mean "bad file" here.
_CORRUPT = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OSError)


def _load(f: IO[bytes], encoding: str, label: str) -> Any:
    try:
        return _RestrictedUnpickler(f, encoding=encoding, label=label).load()
    except DataError:
        raise
    except _CORRUPT as e:
        raise DataError(
            f"cannot unpickle {label}: corrupt or truncated ({type(e).__name__}: {e}); replace the file "
            "with a fresh copy"
        ) from e
