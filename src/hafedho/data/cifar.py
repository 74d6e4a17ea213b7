"""CIFAR-10 and CIFAR-100: the official python pickles (directory or ``.tar.gz``), or CIFAR-10 as an image folder."""

from __future__ import annotations

import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from hafedho.data.dataset import Dataset, Source, existing_path
from hafedho.data.imagefolder import ImageArrays, image_dataset, is_image_folder, read_image_folder
from hafedho.data.safe_pickle import DataError, safe_load

__all__ = ["CIFAR10", "CIFAR100", "read_cifar_pickles"]

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


# ----------------------------------------------------------------------------- CIFAR pickles

_CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
    "cifar100": ("cifar-100-python", ["train"], ["test"]),
}


def _pickle_members(path: Path, folder: str, wanted: set[str]) -> Iterator[tuple[str, object]]:
    """Yield ``(basename, unpickled)`` for the wanted CIFAR files in a directory or a ``.tar[.gz]``."""
    if path.is_dir():
        base = path / folder if (path / folder).is_dir() else path
        for name in sorted(wanted):
            f = base / name
            if not f.is_file():
                raise DataError(
                    f"CIFAR file {f} not found; point data.path at the {folder}/ folder (or its parent) of the "
                    "official python version"
                )
            yield name, safe_load(f)
        return
    try:
        with tarfile.open(path, "r:*") as tf:
            for member in tf:
                name = PurePosixPath(member.name).name
                if member.isfile() and name in wanted:
                    fobj = tf.extractfile(member)
                    assert fobj is not None  # regular file members always have data
                    yield name, safe_load(fobj, name=f"{path}:{member.name}")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(f"cannot read archive {path}: truncated or corrupt ({e}); re-download it") from e


def _cifar_arrays(obj: object, label_key: str, num_classes: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(obj, dict) or "data" not in obj or label_key not in obj:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{where} is not a CIFAR batch: need 'data' and '{label_key}', found {keys}")
    data, labels = obj["data"], np.asarray(obj[label_key])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(f"{where}: 'data' must be uint8 (N, 3072), got {type(data).__name__} {shape}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{where}: '{label_key}' must hold {len(data)} integer labels, got shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{where}: '{label_key}' must lie in 0..{num_classes - 1}")
    # Each row is 1024 R, then 1024 G, then 1024 B values, each plane 32x32 row-major.
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def read_cifar_pickles(path: Path, variant: str, label: str = "fine") -> ImageArrays:
    """Read the official CIFAR "python version": a directory (or its parent) or the ``.tar.gz`` itself.

    Args:
        path: ``cifar-10-batches-py/`` / ``cifar-100-python/``, a folder holding it, or the original archive.
        variant: ``"cifar10"`` or ``"cifar100"``.
        label: CIFAR-100 only: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
    """
    folder, train_names, test_names = _CIFAR_FILES[variant]
    if variant == "cifar10":
        label_key, num_classes = "labels", 10
    elif label in ("fine", "coarse"):
        label_key, num_classes = f"{label}_labels", 100 if label == "fine" else 20
    else:
        raise DataError(f"cifar100 label must be 'fine' or 'coarse', got {label!r}")
    found = dict(_pickle_members(path, folder, set(train_names + test_names)))
    missing = [n for n in train_names + test_names if n not in found]
    if missing:
        raise DataError(f"{path} lacks CIFAR files {missing}; use the complete official python-version archive")
    parts = {
        n: _cifar_arrays(found[n], label_key, num_classes, f"{path}:{folder}/{n}") for n in train_names + test_names
    }
    x_tr, y_tr = (np.concatenate(a) for a in zip(*(parts[n] for n in train_names), strict=True))
    x_te, y_te = (np.concatenate(a) for a in zip(*(parts[n] for n in test_names), strict=True))
    return ImageArrays(x_tr, y_tr, x_te, y_te, classes=tuple(str(i) for i in range(num_classes)))


# ----------------------------------------------------------------------------- the cifar10 and cifar100 sources


def _load_cifar10(path: str | None = None, *, cache: bool = True) -> Dataset:
    """CIFAR-10 from an image folder (directory or zip) or the official python pickles."""
    p = existing_path("cifar10", path)
    pickles = p.is_dir() and ((p / "data_batch_1").is_file() or (p / "cifar-10-batches-py").is_dir())
    if p.is_dir() and not pickles and not is_image_folder(p):
        raise DataError(
            f"{p} holds neither the CIFAR-10 python pickles (cifar-10-batches-py/) nor an image folder "
            "(train/<class>/, test/<class>/); point data.path at one of them"
        )
    if pickles or (p.is_file() and p.suffix.lower() != ".zip" and not zipfile.is_zipfile(p)):
        arrays, kind = read_cifar_pickles(p, "cifar10"), "python pickles"
    else:
        arrays, kind = read_image_folder(p, mode="RGB", cache=cache), "image folder"
        if len(arrays.classes) != 10 or arrays.x_train.shape[1:] != (3, 32, 32):
            raise DataError(
                f"{p} is not CIFAR-10: found {len(arrays.classes)} classes of {arrays.x_train.shape[1:]} images, "
                "need 10 classes of 32x32 RGB; use the imagefolder source for other data"
            )
    return image_dataset("cifar10", p, arrays, kind, mean=CIFAR10_MEAN, std=CIFAR10_STD)


def _load_cifar100(path: str | None = None, *, label: str = "fine") -> Dataset:
    """CIFAR-100 from the official python pickles; ``label`` is ``"fine"`` (100) or ``"coarse"`` (20)."""
    p = existing_path("cifar100", path)
    arrays = read_cifar_pickles(p, "cifar100", label=label)
    return image_dataset("cifar100", p, arrays, f"python pickles, {label} labels", mean=CIFAR100_MEAN, std=CIFAR100_STD)


CIFAR10 = Source(
    "cifar10",
    "CIFAR-10: image folder (dir/.zip) or official python pickles, 10 classes",
    "../shared/data/cifar10_jpeg.zip",
    _load_cifar10,
)
CIFAR100 = Source(
    "cifar100", "CIFAR-100: official python pickles (cifar-100-python), 100 or 20 classes", None, _load_cifar100
)
