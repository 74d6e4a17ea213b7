"""Your own arrays: an ``.npz`` with ``x_train, y_train, x_test, y_test`` (optional ``groups``), no pickles."""

from __future__ import annotations

import zipfile
import zlib

import numpy as np

from hafedho.data.dataset import (
    MAX_CLASSES,
    Dataset,
    Source,
    existing_path,
    few,
    require_finite,
    require_in_range,
    require_real,
)
from hafedho.data.safe_pickle import DataError

__all__ = ["NPZ"]

_LAYOUTS = ("auto", "NCHW", "NHWC")


def _image_layout(shape: tuple[int, ...], layout: str, where: str) -> str:
    """The layout of a 4-d image array ``[N, ., ., .]``: ``"NCHW"`` or ``"NHWC"``.

    ``auto`` takes NHWC when the last axis has 1 or 3 entries (grey, RGB) and the second has not, NCHW when
    the second axis has 1 or 3 and the last has not, and NCHW (the stored order) when neither has. Both
    having 1 or 3 (``[N, 3, 32, 3]``) is ambiguous and refused rather than guessed.
    """
    if layout != "auto":
        return layout
    first, last = shape[1] in (1, 3), shape[3] in (1, 3)
    if first and last:
        raise DataError(
            f"{where} {shape} reads as {shape[1]} channels of {shape[2]}x{shape[3]} (NCHW) or {shape[3]} channels "
            f"of {shape[1]}x{shape[2]} (NHWC); say which with data.options.layout='NCHW' or 'NHWC'"
        )
    return "NHWC" if last else "NCHW"


def _load_npz(path: str | None = None, *, num_classes: int | None = None, layout: str = "auto") -> Dataset:
    """An ``.npz`` with ``x_train, y_train, x_test, y_test`` (optional ``groups``), no pickles allowed.

    ``x`` is ``[N, D]`` features, ``[N, H, W]`` one-channel images (given the channel axis: ``[N, 1, H, W]``)
    or ``[N, C, H, W]`` / ``[N, H, W, C]`` images; ``layout`` (``auto``, ``NCHW``, ``NHWC``) says which for
    4-d arrays, ``auto`` following :func:`_image_layout`; NHWC is transposed to NCHW. ``num_classes``
    declares the classes (labels ``0..num_classes-1``); without it they are the train split's labels, and
    a label seen only in the test split is an error, since it would silently widen the model.
    """
    p = existing_path("npz", path)
    layout = str(layout).upper() if str(layout).lower() != "auto" else "auto"
    if layout not in _LAYOUTS:
        raise DataError(f"npz: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    if num_classes is not None and (type(num_classes) is not int or num_classes < 1):  # bool is no count
        raise DataError(f"npz: num_classes must be an integer >= 1, got {num_classes!r}")
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic != b"PK":  # else np.load takes any bytes for a pickle, and says so
        raise DataError(f"{p} is not an .npz file (no zip archive); save your arrays with np.savez(path, x_train=...)")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zlib.error, zipfile.BadZipFile) as e:
        # allow_pickle=False makes object arrays fail here too, which is the point.
        raise DataError(f"cannot read npz file {p} ({e}); save it with np.savez from plain numeric arrays") from e
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise DataError(f"npz file {p} lacks {missing}; it needs x_train, y_train, x_test, y_test (groups optional)")
    x = {s: arrays[f"x_{s}"] for s in ("train", "test")}
    y = {s: arrays[f"y_{s}"] for s in ("train", "test")}
    for s in ("train", "test"):
        if x[s].ndim < 2 or not (np.issubdtype(x[s].dtype, np.number) or x[s].dtype == bool):
            raise DataError(f"npz file {p}: x_{s} must be a numeric array [N, ...], got {x[s].dtype} {x[s].shape}")
        require_real(x[s], f"npz file {p}", s)
        if y[s].shape != (len(x[s]),) or not np.issubdtype(y[s].dtype, np.integer):
            raise DataError(f"npz file {p}: y_{s} must be {len(x[s])} integer labels, got {y[s].dtype} {y[s].shape}")
        if len(y[s]) == 0:
            raise DataError(f"npz file {p}: x_{s} has 0 examples; every split needs some (an empty test set reads 0%)")
        if y[s].min() < 0:
            raise DataError(f"npz file {p}: y_{s} has negative labels; labels must be 0..num_classes-1")
    if x["train"].shape[1:] != x["test"].shape[1:]:
        raise DataError(f"npz file {p}: x_train {x['train'].shape[1:]} and x_test {x['test'].shape[1:]} differ")
    if num_classes is None:
        top, rows = int(y["train"].max()), len(y["train"])
        if top >= min(rows, MAX_CLASSES):  # some class of 0..top certainly has no example: a stray label
            raise DataError(
                f"npz file {p}: y_train label {top} makes {top + 1:,} classes, more than its {rows:,} rows "
                f"(at most {MAX_CLASSES:,}); fix the label, or declare the classes with data.options.num_classes=N"
            )
        num_classes = top + 1
        test_only = np.setdiff1d(y["test"], y["train"])
        if test_only.size:
            raise DataError(
                f"npz file {p}: label(s) {few(test_only)} appear only in the test split (y_test), never in y_train; "
                "declare the classes with data.options.num_classes=N, or fix the split"
            )
    for s in ("train", "test"):
        require_in_range(y[s], num_classes, f"npz file {p}", s)
    groups = arrays.get("groups")
    if groups is not None:
        if groups.shape != (len(x["train"]),) or not np.issubdtype(groups.dtype, np.integer):
            raise DataError(f"npz file {p}: groups must be {len(x['train'])} integers, one per train example")
        groups = np.unique(groups, return_inverse=True)[1].astype(np.int64)  # renumber to 0..G-1
    shape, note = x["train"].shape, ""
    if x["train"].ndim == 2 and layout != "auto":
        raise DataError(f"npz file {p}: x_train {shape} holds features, not images; drop data.options.layout")
    if x["train"].ndim == 3:  # [N, H, W]: one channel, as MNIST-style arrays are saved
        x = {s: x[s][:, None] for s in x}
        note = ", [N, H, W] given a channel axis"
    elif x["train"].ndim == 4 and _image_layout(shape, layout, f"npz file {p}: x_train") == "NHWC":
        x = {s: np.ascontiguousarray(x[s].transpose(0, 3, 1, 2)) for s in x}
        note = ", NHWC transposed to NCHW"
    # uint8 stays uint8 (images, normalised at batch time); everything else becomes float32 features.
    with np.errstate(over="ignore"):  # values beyond float32's range become inf, refused just below
        xs = {s: x[s] if x[s].dtype == np.uint8 else x[s].astype(np.float32) for s in x}
    for s in ("train", "test"):
        require_finite(xs[s], f"npz file {p}", s)
    info = f"npz from {p}: {len(y['train'])} train / {len(y['test'])} test, shape {xs['train'].shape[1:]}{note}"
    return Dataset(
        "npz",
        xs["train"],
        y["train"].astype(np.int64),
        xs["test"],
        y["test"].astype(np.int64),
        num_classes,
        groups=groups,
        info=info,
    )


NPZ = Source("npz", "your arrays: .npz with x_train, y_train, x_test, y_test [, groups]", None, _load_npz)
