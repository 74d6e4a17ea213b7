"""Data sources: named loaders that read real on-disk formats into one in-memory :class:`Dataset`.

Each source is a ``load(path, **options) -> Dataset`` function registered in :data:`SOURCES`;
:func:`load_dataset` looks one up, fills in its default path and turns every failure into a one-line
:class:`DataError` that names the file and the fix. Each source family has its own module.
"""

from __future__ import annotations

import inspect

from hafedho.data.builtin import _load_digits, _load_synthetic
from hafedho.data.cifar import _load_cifar10, _load_cifar100
from hafedho.data.dataset import Dataset, Source
from hafedho.data.femnist import _load_femnist
from hafedho.data.imagefolder import _load_imagefolder
from hafedho.data.npz import _load_npz
from hafedho.data.safe_pickle import DataError

__all__ = ["SOURCES", "DataError", "Dataset", "Source", "load_dataset"]


# ----------------------------------------------------------------------------- registry

SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "digits",
            "scikit-learn 8x8 digits, 1,797 images, 10 classes (bundled, no files)",
            None,
            _load_digits,
            needs_files=False,
        ),
        Source(
            "synthetic",
            "FedProx Synthetic(alpha, beta), 30 devices, 60 features, 10 classes",
            None,
            _load_synthetic,
            needs_files=False,
        ),
        Source(
            "femnist",
            "FEMNIST by writer: LEAF JSON dir/.tar.gz or TFF fed_emnist_*.h5, 62 classes",
            "../shared/data/femnist_leaf_sf05.tar.gz",
            _load_femnist,
        ),
        Source(
            "cifar10",
            "CIFAR-10: image folder (dir/.zip) or official python pickles, 10 classes",
            "../shared/data/cifar10_jpeg.zip",
            _load_cifar10,
        ),
        Source(
            "cifar100", "CIFAR-100: official python pickles (cifar-100-python), 100 or 20 classes", None, _load_cifar100
        ),
        Source(
            "imagefolder",
            "your images: train/<class>/*, test/<class>/* in a directory or .zip",
            None,
            _load_imagefolder,
        ),
        Source("npz", "your arrays: .npz with x_train, y_train, x_test, y_test [, groups]", None, _load_npz),
    )
}


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
