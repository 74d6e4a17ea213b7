"""Data sources: named loaders that read real on-disk formats into one in-memory :class:`Dataset`.

Each source is a ``load(path, **options) -> Dataset`` function registered in :data:`SOURCES`;
:func:`load_dataset` looks one up, fills in its default path and turns every failure into a one-line
:class:`DataError` that names the file and the fix. Each source family has its own module.
"""

from __future__ import annotations

import inspect

from hafedho.data.builtin import DIGITS, SYNTHETIC
from hafedho.data.cifar import CIFAR10, CIFAR100
from hafedho.data.dataset import Dataset, Source
from hafedho.data.femnist import FEMNIST
from hafedho.data.imagefolder import IMAGEFOLDER
from hafedho.data.npz import NPZ
from hafedho.data.safe_pickle import DataError

__all__ = ["SOURCES", "DataError", "Dataset", "Source", "load_dataset"]


# The registry: ``hafedho datasets`` lists the sources in this order. A new source is a module declaring its
# ``Source`` plus one entry here.
SOURCES: dict[str, Source] = {s.name: s for s in (DIGITS, SYNTHETIC, FEMNIST, CIFAR10, CIFAR100, IMAGEFOLDER, NPZ)}


def load_dataset(name: str, path: str | None = None, **options: object) -> Dataset:
    """Load a registered source by name.

    Args:
        name: A key of :data:`SOURCES`.
        path: File or directory to read; ``None`` uses the source's ``default_path``.
        **options: Source-specific options (e.g. ``alpha`` for synthetic, ``label`` for cifar100).

    Raises:
        DataError: Unknown source or option, missing or unreadable data.
    """
    source = SOURCES.get(name)
    if source is None:
        raise DataError(f"unknown data source {name!r}; known sources: {', '.join(SOURCES)}")
    if path is None:
        path = source.default_path
    try:
        inspect.signature(source.load).bind(path, **options)
    except TypeError as e:
        params = [p for p in inspect.signature(source.load).parameters if p != "path"]
        raise DataError(f"{name}: {e}; its options are: {', '.join(params) or 'none'}") from e
    return source.load(path, **options)
