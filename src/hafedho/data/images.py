"""Image readers: image folders (directory or zip), CIFAR python pickles, and the decoded-array cache.

Readers return plain arrays; :mod:`hafedho.data.sources` wraps them into ``Dataset`` objects. Images come out
as uint8 ``[N, C, H, W]``. Everything is read in place, straight from the archive, never extracted to disk.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from hafedho.data.safe_pickle import DataError, safe_load

__all__ = [
    "ImageArrays",
    "cache_dir",
    "cached",
    "is_image_folder",
    "read_cifar_pickles",
    "read_image_folder",
]

# Bump when the layout of cached arrays changes, so stale caches are rebuilt rather than misread.
_CACHE_VERSION = 1


@dataclass(frozen=True)
class ImageArrays:
    """Decoded train/test images: uint8 ``[N, C, H, W]`` and int64 labels, with the class names."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple[str, ...]
    cached: bool = False  # True when the arrays came from the decoded-array cache


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where decoded arrays are cached: ``$HAFEDHO_CACHE_DIR`` or ``~/.cache/hafedho``."""
    return Path(os.environ.get("HAFEDHO_CACHE_DIR") or Path.home() / ".cache" / "hafedho")


def _fingerprint(path: Path) -> str:
    """Identity of a file or directory tree: resolved path plus size and mtime of every file."""
    h = hashlib.sha256(str(path.resolve()).encode())
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            st = f.stat()
            h.update(f"\0{f.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    else:
        st = path.stat()
        h.update(f"\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def cached(
    kind: str, path: Path, options: str, build: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], bool]:
    """Return ``build()``'s arrays, memoised as an ``.npz`` under :func:`cache_dir`.

    The key is the source's resolved path, the size and mtime of its file(s), ``options`` and a format
    version, so an edited or replaced source is decoded afresh. The cache is written atomically (temporary
    file, then ``os.replace``); an unreadable cache entry is rebuilt; an unwritable cache dir only costs
    the speed-up.

    Returns:
        The arrays and whether they came from the cache.
    """
    key = hashlib.sha256(f"{_CACHE_VERSION}\0{kind}\0{options}\0{_fingerprint(path)}".encode()).hexdigest()
    target = cache_dir() / f"{kind}-{path.name}-{key[:20]}.npz"
    if target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}, True
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error):
            pass  # corrupt or half-written by a crashed process: rebuild and replace it below
    arrays = build()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".tmp-", suffix=".npz", delete=False) as f:
            tmp = f.name
            np.savez(f, **arrays)
        os.replace(tmp, target)
        tmp = None
    except OSError:
        pass  # read-only home, full disk: the data is still correct, just not cached
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return arrays, False


# ----------------------------------------------------------------------------- image folders


def _hidden(parts: tuple[str, ...]) -> bool:
    # .DS_Store, ._resource forks, __MACOSX/: metadata that archivers add, never data.
    return any(p.startswith(".") or p == "__MACOSX" for p in parts)


class _Folder:
    """Uniform access to an image-folder layout in a directory or a zip archive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip: zipfile.ZipFile | None = None
        if path.is_dir():
            files = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        elif path.suffix.lower() != ".zip" and not zipfile.is_zipfile(path):
            raise DataError(f"{path} is neither a directory nor a .zip; point data.path at an image folder or zip")
        else:
            try:
                self._zip = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise _bad_zip(path, e) from e
            files = [i.filename for i in self._zip.infolist() if not i.is_dir()]
        self.files = sorted(f for f in files if not _hidden(PurePosixPath(f).parts))

    def read(self, name: str) -> bytes:
        if self._zip is None:
            return (self.path / name).read_bytes()
        try:
            return self._zip.read(name)
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise _bad_zip(self.path, e) from e

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def _bad_zip(path: Path, e: BaseException) -> DataError:
    return DataError(f"cannot read zip archive {path}: truncated or corrupt ({e}); re-download or re-create it")


def _split_root(files: list[str]) -> str:
    """The prefix under which ``train/`` and ``test/`` live: ``""`` or a single top-level folder."""
    if any(f.startswith("train/") for f in files):
        return ""
    tops = {f.split("/", 1)[0] for f in files if "/" in f}
    if len(tops) == 1:
        top = tops.pop() + "/"
        if any(f.startswith(top + "train/") for f in files):
            return top
    return "-"  # no layout found


def is_image_folder(path: Path) -> bool:
    """Whether directory ``path`` has a ``train/`` folder, directly or inside one subfolder."""
    return path.is_dir() and (
        (path / "train").is_dir() or any((d / "train").is_dir() for d in path.iterdir() if d.is_dir())
    )


def _list_split(folder: _Folder, root: str, split: str) -> dict[str, list[str]]:
    by_class: dict[str, list[str]] = {}
    prefix = f"{root}{split}/"
    for f in folder.files:
        if not f.startswith(prefix):
            continue
        rel = f[len(prefix) :]
        if "/" not in rel:
            raise DataError(f"{folder.path}: {f} is not inside a class folder; put every image under {split}/<class>/")
        by_class.setdefault(rel.split("/", 1)[0], []).append(f)
    return by_class


def read_image_folder(
    path: Path,
    *,
    mode: str = "RGB",
    size: tuple[int, int] | None = None,
    resize: bool = False,
    cache: bool = True,
) -> ImageArrays:
    """Read ``train/<class>/*`` and ``test/<class>/*`` images from a directory or a zip.

    Classes are the sorted folder names (label = index); the train and test class lists must agree. A
    single top-level folder around ``train/`` and ``test/`` is allowed (as zips of a folder have).

    Args:
        path: Directory or ``.zip``.
        mode: ``"RGB"`` (3 channels) or ``"L"`` (grayscale, 1 channel); images are converted to it.
        size: Required ``(H, W)``; default: the first image's size. Other sizes are an error unless
            ``resize`` is set, which resizes them (bilinear) instead.
        cache: Memoise the decoded arrays (see :func:`cached`).
    """
    if mode not in ("RGB", "L"):
        raise DataError(f"image mode must be 'RGB' or 'L', got {mode!r}")
    if size is not None:
        try:
            size = (int(size[0]), int(size[1]))
        except (TypeError, ValueError, IndexError) as e:
            raise DataError(f"image size must be (height, width), got {size!r}") from e
        if min(size) < 1:
            raise DataError(f"image size must be positive, got {size!r}")

    def build() -> dict[str, np.ndarray]:
        return _decode_folder(path, mode, size, resize)

    if cache:
        arrays, hit = cached("imagefolder", path, f"{mode}\0{size}\0{resize}", build)
    else:
        arrays, hit = build(), False
    return ImageArrays(
        x_train=arrays["x_train"],
        y_train=arrays["y_train"],
        x_test=arrays["x_test"],
        y_test=arrays["y_test"],
        classes=tuple(str(c) for c in arrays["classes"]),
        cached=hit,
    )


def _decode_folder(path: Path, mode: str, size: tuple[int, int] | None, resize: bool) -> dict[str, np.ndarray]:
    folder = _Folder(path)
    try:
        root = _split_root(folder.files)
        if root == "-":
            raise DataError(
                f"no train/ folder in {path}; expected train/<class>/* and test/<class>/* (optionally "
                "inside one top-level folder)"
            )
        train, test = _list_split(folder, root, "train"), _list_split(folder, root, "test")
        if not test:
            raise DataError(f"no test/<class>/ images in {path}; add a test/ folder with the same classes")
        if sorted(train) != sorted(test):
            only_train, only_test = sorted(set(train) - set(test)), sorted(set(test) - set(train))
            raise DataError(
                f"train and test class folders differ in {path}: only in train {only_train}, only in test "
                f"{only_test}; give both splits the same class folders"
            )
        classes = sorted(train)
        if size is None:
            # Fix the size from the first image so every later mismatch is reported, not silently mixed.
            first = train[classes[0]][0]
            w, h = _open(folder, first, mode).size
            size = (h, w)
        out: dict[str, np.ndarray] = {"classes": np.array(classes)}
        for split, by_class in (("train", train), ("test", test)):
            names = [n for c in classes for n in by_class[c]]
            out[f"x_{split}"] = _decode_all(folder, names, mode, size, resize)
            out[f"y_{split}"] = np.repeat(np.arange(len(classes), dtype=np.int64), [len(by_class[c]) for c in classes])
        return out
    finally:
        folder.close()


def _not_image(folder: _Folder, name: str, e: BaseException) -> DataError:
    return DataError(f"{folder.path}: {name} is not a readable image ({e}); remove it or replace it with a valid image")


def _open(folder: _Folder, name: str, mode: str) -> Image.Image:
    data = folder.read(name)  # outside the try: a bad zip is reported as such, not as a bad image
    try:
        im = Image.open(BytesIO(data))
        return im if im.mode == mode else im.convert(mode)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise _not_image(folder, name, e) from e


def _decode_all(folder: _Folder, names: list[str], mode: str, size: tuple[int, int], resize: bool) -> np.ndarray:
    h, w = size
    channels = 3 if mode == "RGB" else 1
    out = np.empty((len(names), channels, h, w), dtype=np.uint8)
    # Serial on purpose: these images are tiny, so decoding is dominated by per-image Python overhead that
    # threads cannot overlap (GIL), and worker processes are fragile to start from arbitrary callers; the
    # decoded arrays are cached instead.
    for i, name in enumerate(names):
        im = _open(folder, name, mode)
        if im.size != (w, h) and not resize:
            raise DataError(
                f"{folder.path}: {name} is {im.size[0]}x{im.size[1]} (WxH), expected {w}x{h}; pass "
                "size=(H, W) with resize=true, or resize the images"
            )
        try:
            if im.size != (w, h):
                im = im.resize((w, h), Image.Resampling.BILINEAR)
            out[i] = np.asarray(im).reshape(h, w, channels).transpose(2, 0, 1)  # HWC -> CHW
        except (OSError, SyntaxError, ValueError) as e:  # a truncated image fails only when decoded
            raise _not_image(folder, name, e) from e
    return out


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
