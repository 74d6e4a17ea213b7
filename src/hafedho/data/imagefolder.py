"""Image folders: ``train/<class>/*``, ``test/<class>/*`` in a directory or a zip, read in place.

Images come out as uint8 ``[N, C, H, W]``; nothing is extracted to disk. :class:`ImageArrays` and
:func:`image_dataset` are shared with the CIFAR reader.
"""

from __future__ import annotations

import re
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from hafedho.data.cache import cached
from hafedho.data.dataset import Dataset, Source, existing_path
from hafedho.data.safe_pickle import DataError

__all__ = ["IMAGEFOLDER", "ImageArrays", "image_dataset", "is_image_folder", "read_image_folder"]


@dataclass(frozen=True)
class ImageArrays:
    """Decoded train/test images: uint8 ``[N, C, H, W]`` and int64 labels, with the class names."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple[str, ...]
    cached: bool = False  # True when the arrays came from the decoded-array cache


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


def _too_large(folder: _Folder, name: str, e: BaseException) -> DataError:
    """PIL's decompression-bomb refusal, as one line naming the file and its pixel count."""
    m = re.search(r"\((\d+) pixels\) exceeds limit of (\d+)", str(e))
    size = f"{int(m[1]):,} pixels, more than PIL's limit of {int(m[2]):,}" if m else str(e)
    return DataError(
        f"{folder.path}: {name} is too large to decode: {size} (PIL.Image.MAX_IMAGE_PIXELS; a decompression "
        "bomb?); remove it or shrink it"
    )


def _open(folder: _Folder, name: str, mode: str) -> Image.Image:
    data = folder.read(name)  # outside the try: a bad zip is reported as such, not as a bad image
    try:
        with warnings.catch_warnings():
            # PIL refuses over twice MAX_IMAGE_PIXELS but only warns over it, then decodes: refuse both.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(BytesIO(data))
        return im if im.mode == mode else im.convert(mode)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(folder, name, e) from e
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


# ----------------------------------------------------------------------------- the imagefolder source


def image_dataset(name: str, p: Path, arrays: ImageArrays, kind: str, **stats: object) -> Dataset:
    """The :class:`Dataset` of decoded images read from ``p``; ``stats`` are its ``mean`` and ``std``."""
    info = (
        f"{name} from {p} ({kind}{', cached' if arrays.cached else ''}): {len(arrays.y_train)} train / "
        f"{len(arrays.y_test)} test, shape {tuple(arrays.x_train.shape[1:])}, {len(arrays.classes)} classes"
    )
    return Dataset(
        name,
        arrays.x_train,
        arrays.y_train,
        arrays.x_test,
        arrays.y_test,
        len(arrays.classes),
        info=info,
        **stats,  # type: ignore[arg-type]
    )


def _load_imagefolder(
    path: str | None = None,
    *,
    mode: str = "RGB",
    size: tuple[int, int] | None = None,
    resize: bool = False,
    cache: bool = True,
) -> Dataset:
    """Any ``train/<class>/*``, ``test/<class>/*`` image folder (directory or zip).

    ``mean``/``std`` are the per-channel statistics of the train images, so normalisation needs no
    configuration.
    """
    p = existing_path("imagefolder", path)
    arrays = read_image_folder(p, mode=mode, size=size, resize=resize, cache=cache)
    mean, std = _channel_stats(arrays.x_train)
    return image_dataset("imagefolder", p, arrays, "image folder", mean=mean, std=std)


def _channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    sums = np.zeros(x.shape[1])
    sq = np.zeros(x.shape[1])
    for start in range(0, len(x), 4096):  # chunked so a float copy of the whole set never exists
        c = x[start : start + 4096].astype(np.float64) / 255.0
        sums += c.sum(axis=(0, 2, 3))
        sq += (c**2).sum(axis=(0, 2, 3))
    n = max(1, len(x) * x.shape[2] * x.shape[3])
    mean = sums / n
    std = np.sqrt(np.maximum(sq / n - mean**2, 0.0))
    return tuple(round(float(m), 4) for m in mean), tuple(round(max(float(s), 1e-3), 4) for s in std)


IMAGEFOLDER = Source(
    "imagefolder",
    "your images: train/<class>/*, test/<class>/* in a directory or .zip",
    None,
    _load_imagefolder,
)
