"""The in-memory :class:`Dataset` every source returns, the :class:`Source` record, and the checks loaders share."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hafedho.data.safe_pickle import DataError

__all__ = [
    "Dataset",
    "Source",
    "default_data_path",
    "existing_path",
    "few",
    "int_labels",
    "no_path",
    "require_finite",
    "require_in_range",
    "require_real",
]

# More classes than any data set hafedho trains on has (ImageNet-21k: 21,841): a larger count is a stray label,
# and the model's output layer would be sized by it (a label of 2**40 asks for terabytes).
MAX_CLASSES = 2**20

# src/hafedho/data/dataset.py -> the repository root, the fallback base for a source's own relative default path.
_REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True, eq=False)  # eq=False: field-wise == is meaningless (and ambiguous) for arrays
class Dataset:
    """A train/test data set held in memory.

    Attributes:
        x_train: ``[N, ...]``: float32 features ``[N, D]``, uint8 images ``[N, C, H, W]`` (CIFAR, image
            folders) or float32 images ``[N, 1, 28, 28]`` (FEMNIST, values as stored).
        y_train: ``[N]`` int64 labels in ``0..num_classes-1``.
        groups: ``[N]`` int64 natural client (writer, device) of each train example, ids ``0..G-1``.
        mean, std: Per-channel normalisation to apply at batch time, after uint8 -> [0, 1].
        info: One line: where the data was read from, and sizes.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    groups: np.ndarray | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    info: str = ""

    def __post_init__(self) -> None:
        arrays = {"x_train": self.x_train, "y_train": self.y_train, "x_test": self.x_test, "y_test": self.y_test}
        if self.groups is not None:
            arrays["groups"] = self.groups
        for field, value in arrays.items():  # a loader of one's own may hand lists or tensors: say which, in one line
            if not isinstance(value, np.ndarray):
                raise DataError(
                    f"{self.name}: {field} is a {type(value).__name__}, not a NumPy array; return np.asarray(...) "
                    "from the loader (features float32 or uint8, labels int64)"
                )
        n = len(self.x_train)
        if self.y_train.shape != (n,) or self.y_test.shape != (len(self.x_test),):
            raise DataError(f"{self.name}: features and labels disagree in length")
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise DataError(f"{self.name}: train {self.x_train.shape[1:]} and test {self.x_test.shape[1:]} differ")
        if self.groups is not None and self.groups.shape != (n,):
            raise DataError(f"{self.name}: groups must have one entry per train example")
        # The loaders check all of this naming the file; this is the net for every source (and direct use).
        require_class_count(self.num_classes, self.name)
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if len(y) == 0:
                raise DataError(f"{self.name}: the {split} split is empty (0 examples); give it examples")
            require_real(x, self.name, split)
            require_finite(x, self.name, split)
            if not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"{self.name}: {split} labels must be integers, got {y.dtype}")
            require_in_range(y, self.num_classes, self.name, split)
        check_classes(self.y_train, self.num_classes, self.name)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, e.g. ``(64,)`` or ``(3, 32, 32)``."""
        return tuple(self.x_train.shape[1:])


@dataclass(frozen=True)
class Source:
    """A named data loader, as listed by ``hafedho datasets``."""

    name: str
    description: str
    default_path: str | None
    load: Callable[..., Dataset]
    needs_files: bool = True  # False for sources that are bundled or generated


def existing_path(name: str, path: str | Path | None) -> Path:
    """Resolve a data path as given: a relative one against the working directory only (never the checkout)."""
    if path is None:
        raise DataError(f"{name} needs data files; pass data.path=... pointing at your copy")
    p = Path(path).expanduser()
    if p.exists():
        return p
    tried = "" if p.is_absolute() else f" (looked for {Path.cwd() / p})"
    raise DataError(f"{name} data not found: {path}{tried}; pass data.path=... pointing at your copy")


def default_data_path(source: Source) -> str | None:
    """A source's own ``default_path``, resolved: as given if it exists relative to the working directory,
    else relative to the source checkout's root (the built-in defaults name ``../shared/data/...`` beside the
    checkout, so they load from any working directory). Only a source's default gets this fallback; a path the
    user gives is resolved by :func:`existing_path` against the working directory alone."""
    default = source.default_path
    if default is None or not source.needs_files:
        return default
    p = Path(default).expanduser()
    if p.exists() or p.is_absolute():
        return default
    if (_REPO_ROOT / p).exists():
        return str(_REPO_ROOT / p)
    raise DataError(
        f"{source.name}: its default data {default} is not here (looked for {Path.cwd() / p} and {_REPO_ROOT / p}); "
        "pass data.path=... pointing at your copy"
    )


def no_path(name: str, path: str | Path | None) -> None:
    if path is not None:
        raise DataError(f"{name} is generated in memory and reads no files; drop data.path={path}")


def require_finite(x: np.ndarray, where: str, split: str) -> None:
    """Refuse NaN/inf inputs at load: they would surface rounds later as a diverged run blamed on the step size."""
    if np.issubdtype(x.dtype, np.floating):
        bad = x.size - int(np.count_nonzero(np.isfinite(x)))
        if bad:
            raise DataError(
                f"{where}: the {split} split has {bad} non-finite (NaN/inf) input values; replace or drop those "
                "examples"
            )


def require_real(x: np.ndarray, where: str, split: str) -> None:
    """Refuse complex inputs: casting them to float32 drops the imaginary part, with only NumPy's warning."""
    if np.issubdtype(x.dtype, np.complexfloating):
        raise DataError(
            f"{where}: the {split} split's inputs are complex ({x.dtype}); give real values (e.g. np.abs(x), or "
            "the real and imaginary parts as separate features)"
        )


def require_class_count(num_classes: int, where: str) -> None:
    """A class count the model can be built for: 1..``MAX_CLASSES`` (a larger one is a stray label)."""
    if not 1 <= num_classes <= MAX_CLASSES:
        raise DataError(
            f"{where}: {num_classes:,} classes (labels 0..{num_classes - 1}) is beyond {MAX_CLASSES:,}; a stray "
            "label sets the count: fix the labels, or declare the classes (data.options.num_classes=N)"
        )


def check_classes(y_train: np.ndarray, num_classes: int, where: str) -> None:
    """Refuse training labels of a single class (every model reads 100% accuracy: nothing is learnt); warn when
    classes in ``0..num_classes-1`` have no training example (a stray large label widens the model with them)."""
    seen = np.unique(y_train)
    if seen.size == 1:
        raise DataError(
            f"{where}: every training label is {int(seen[0])} (one class): accuracy would read 100% whatever the "
            "model; give data with at least two classes"
        )
    if empty := num_classes - seen.size:
        warnings.warn(
            f"{where}: {empty:,} of {num_classes:,} classes have no training example (labels seen: "
            f"{few(seen)}); if a stray label set the class count, fix it",
            stacklevel=4,  # the loader that built the Dataset (past __post_init__ and the dataclass __init__)
        )


def require_in_range(y: np.ndarray, num_classes: int, where: str, split: str) -> None:
    """Labels must be class indices ``0..num_classes-1``."""
    bad = np.unique(y[(y < 0) | (y >= num_classes)])
    if bad.size:
        raise DataError(
            f"{where}: the {split} split has label(s) {few(bad)} outside 0..{num_classes - 1} "
            f"({num_classes} classes); labels must be class indices"
        )


def few(values: np.ndarray, k: int = 5) -> str:
    """``[a, b, c]`` or ``[a, b, c, ... (12 in all)]``: error messages stay one short line."""
    shown = ", ".join(str(v) for v in values[:k].tolist())
    return f"[{shown}]" if len(values) <= k else f"[{shown}, ... ({len(values)} in all)]"


def int_labels(raw: np.ndarray, where: str, split: str) -> np.ndarray:
    """Labels as int64; a fractional, NaN or non-numeric label is an error, never truncated to an integer."""
    if np.issubdtype(raw.dtype, np.integer):
        return raw.astype(np.int64)
    if np.issubdtype(raw.dtype, np.floating):
        whole = np.isfinite(raw) & (raw == np.round(raw))
        if whole.all():
            return raw.astype(np.int64)
        raise DataError(
            f"{where}: the {split} split has {int((~whole).sum())} non-integer label(s), e.g. {raw[~whole][0]}; "
            "labels must be class indices 0..num_classes-1"
        )
    raise DataError(f"{where}: {split} labels must be integers, got {raw.dtype}")
