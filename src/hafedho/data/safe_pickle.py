"""A restricted unpickler for data files (CIFAR batches) and the data package's error type.

``pickle.load`` runs whatever callable a file names, so a downloaded "data set" could run code on load.
:func:`safe_load` resolves only the handful of numpy callables that rebuild arrays, dtypes and scalars;
plain dicts, lists, tuples, strings, bytes and numbers need no imports at all. An allocation the file could not
fill (an array or bytearray declaring more than 64x the file's bytes) and object arrays (allocated before their
contents are checked) are refused before anything is allocated.

:class:`DataError` lives here, the lowest module of the package, so that every reader can raise it without
an import cycle; ``hafedho.data.sources`` re-exports it.
"""

from __future__ import annotations

import importlib
import math
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


# What a pickle may allocate: 64x its own size in bytes (a real array's data is in the file, so at most 1x),
# at least 1 MiB; a file object whose size cannot be measured gets 16 GiB.
_ALLOC_FACTOR, _ALLOC_FLOOR, _ALLOC_UNKNOWN = 64, 2**20, 2**34


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], *, encoding: str, label: str) -> None:
        super().__init__(file, encoding=encoding)
        self._label = label
        self._size = _file_size(file)
        self._limit = _ALLOC_UNKNOWN if self._size is None else max(_ALLOC_FLOOR, _ALLOC_FACTOR * self._size)
        self._claimed = 0

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise DataError(
                f"refusing to unpickle {self._label}: it imports {module}.{name}; only plain containers, "
                "numbers, strings and numpy arrays are allowed"
            )
        obj = _resolve(module, name)
        if name == "_reconstruct":
            return self._reconstruct(obj)
        if (module, name) == ("numpy", "ndarray"):
            return _Guarded(obj, self._ndarray)
        if (module, name) == ("numpy", "dtype"):
            return self._dtype
        if name == "bytearray":
            return self._bytearray
        return obj

    def _claim(self, shape: object, dtype: object) -> None:
        """Count an allocation of ``shape`` x ``dtype`` against the file's budget; refuse one past it."""
        import numpy as np

        try:
            dims = [int(shape)] if isinstance(shape, int) else [int(d) for d in shape]  # type: ignore[union-attr]
            itemsize = np.dtype(dtype).itemsize  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            return  # numpy's own call reports a malformed shape or dtype
        if any(d < 0 for d in dims):
            return
        n = math.prod(dims)
        self._claimed += max(n, n * itemsize)
        if self._claimed > self._limit:
            size = "a file of unknown size" if self._size is None else f"a {self._size:,}-byte file"
            raise DataError(
                f"refusing to unpickle {self._label}: it declares {n:,} elements ({n * itemsize:,} bytes), more "
                f"than {size} could hold; replace the file with a fresh copy"
            )

    def _reconstruct(self, fn: Any) -> Any:
        def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
            self._claim(shape, dtype)
            return fn(subtype.cls if isinstance(subtype, _Guarded) else subtype, shape, dtype)

        return reconstruct

    def _ndarray(self, shape: Any, dtype: Any = float, buffer: Any = None, *args: Any, **kwargs: Any) -> Any:
        import numpy as np

        if buffer is None:  # with a buffer, numpy views it and allocates nothing
            self._claim(shape, dtype)
        return np.ndarray(shape, dtype, buffer, *args, **kwargs)

    def _dtype(self, *args: Any, **kwargs: Any) -> Any:
        import numpy as np

        dt = np.dtype(*args, **kwargs)
        if dt.hasobject:  # numpy allocates an object array before checking its contents against its shape
            raise DataError(
                f"refusing to unpickle {self._label}: it holds a numpy object array (dtype {dt}); only arrays of "
                "numbers, bytes and strings are allowed"
            )
        return dt

    def _bytearray(self, *args: Any) -> bytearray:
        if args and isinstance(args[0], int):
            self._claim((args[0],), "u1")
        return bytearray(*args)


class _Guarded:
    """A callable standing in for a class a pickle names (``numpy.ndarray``): calls go through ``call``, and
    ``_reconstruct`` is handed the class itself."""

    def __init__(self, cls: type, call: Any) -> None:
        self.cls, self._call = cls, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _file_size(f: IO[bytes]) -> int | None:
    """Bytes left in ``f`` from where it stands (a path's file or a tar member), or None if unmeasurable."""
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
        return max(0, end - here)
    except (OSError, AttributeError, ValueError):
        return None


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
    except MemoryError as e:  # a net: every allocation a pickle can declare is bounded above
        raise DataError(f"cannot unpickle {label}: it asks for more memory than there is ({e}); check the file") from e
    except _CORRUPT as e:
        raise DataError(
            f"cannot unpickle {label}: corrupt or truncated ({type(e).__name__}: {e}); replace the file "
            "with a fresh copy"
        ) from e
