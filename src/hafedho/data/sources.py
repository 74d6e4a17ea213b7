"""Data sources: named loaders that read real on-disk formats into one in-memory :class:`Dataset`.

Each source is a ``load(path, **options) -> Dataset`` function registered in :data:`SOURCES`;
:func:`load_dataset` looks one up, fills in its default path and turns every failure into a one-line
:class:`DataError` that names the file and the fix. Image readers live in :mod:`hafedho.data.images`.
"""

from __future__ import annotations

import inspect
import json
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from hafedho.data import images
from hafedho.data.safe_pickle import DataError

__all__ = ["SOURCES", "DataError", "Dataset", "Source", "load_dataset"]

# src/hafedho/data/sources.py -> the repository root, the fallback base for relative default paths.
_REPO_ROOT = Path(__file__).resolve().parents[3]

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


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
        n = len(self.x_train)
        if self.y_train.shape != (n,) or self.y_test.shape != (len(self.x_test),):
            raise DataError(f"{self.name}: features and labels disagree in length")
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise DataError(f"{self.name}: train {self.x_train.shape[1:]} and test {self.x_test.shape[1:]} differ")
        if self.groups is not None and self.groups.shape != (n,):
            raise DataError(f"{self.name}: groups must have one entry per train example")
        # The loaders check all of this naming the file; this is the net for every source (and direct use).
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if len(y) == 0:
                raise DataError(f"{self.name}: the {split} split is empty (0 examples); give it examples")
            _require_finite(x, self.name, split)
            if not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"{self.name}: {split} labels must be integers, got {y.dtype}")
            _require_in_range(y, self.num_classes, self.name, split)

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


def _existing(name: str, path: str | Path | None) -> Path:
    """Resolve a data path: as given (relative to the working directory), else relative to the repo root."""
    if path is None:
        raise DataError(f"{name} needs data files; pass data.path=... pointing at your copy")
    p = Path(path).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and (_REPO_ROOT / p).exists():
        return _REPO_ROOT / p
    raise DataError(f"{name} data not found: {path}; pass data.path=... pointing at your copy")


def _no_path(name: str, path: str | Path | None) -> None:
    if path is not None:
        raise DataError(f"{name} is generated in memory and reads no files; drop data.path={path}")


def _require_finite(x: np.ndarray, where: str, split: str) -> None:
    """Refuse NaN/inf inputs at load: they would surface rounds later as a diverged run blamed on the step size."""
    if np.issubdtype(x.dtype, np.floating):
        bad = x.size - int(np.count_nonzero(np.isfinite(x)))
        if bad:
            raise DataError(
                f"{where}: the {split} split has {bad} non-finite (NaN/inf) input values; replace or drop those "
                "examples"
            )


def _require_in_range(y: np.ndarray, num_classes: int, where: str, split: str) -> None:
    """Labels must be class indices ``0..num_classes-1``."""
    bad = np.unique(y[(y < 0) | (y >= num_classes)])
    if bad.size:
        raise DataError(
            f"{where}: the {split} split has label(s) {_few(bad)} outside 0..{num_classes - 1} "
            f"({num_classes} classes); labels must be class indices"
        )


def _few(values: np.ndarray, k: int = 5) -> str:
    """``[a, b, c]`` or ``[a, b, c, ... (12 in all)]``: error messages stay one short line."""
    shown = ", ".join(str(v) for v in values[:k].tolist())
    return f"[{shown}]" if len(values) <= k else f"[{shown}, ... ({len(values)} in all)]"


def _int_labels(raw: np.ndarray, where: str, split: str) -> np.ndarray:
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


# ----------------------------------------------------------------------------- digits, synthetic


def _load_digits(path: str | None = None) -> Dataset:
    """scikit-learn's bundled 8x8 digits: float32 ``[N, 64]`` in [0, 1], fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    _no_path("digits", path)
    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    # Seed 0 regardless of the run's seed: the test set must be the same in every experiment.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    info = f"digits from scikit-learn: {len(y_tr)} train / {len(y_te)} test, 64 features"
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10, info=info)


def _load_synthetic(
    path: str | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    num_devices: int = 30,
    seed: int = 0,
    dim: int = 60,
    num_classes: int = 10,
    train_fraction: float = 0.8,
    max_samples: int | None = None,
) -> Dataset:
    """FedProx's Synthetic(alpha, beta) (Li et al., arXiv 1812.06127), one device per natural group.

    Follows the authors' ``generate_synthetic.py`` rather than the paper's notation where they differ:
    ``alpha`` and ``beta`` are the standard deviations (``np.random.normal(0, alpha)``) of the scalar
    means u_k (shared by every entry of W_k and b_k) and B_k (of v_k); the paper writes N(0, alpha),
    which reads as a variance. Published results come from the code, and alpha = beta = 1 agree anyway.
    Device sizes are ``int(lognormal(4, 2)) + 50``; ``max_samples`` optionally caps them (default: none).
    Each device's first ``train_fraction`` of samples is train, the rest joins the global test set; the
    samples are i.i.d. within a device, so this equals the reference's shuffle-then-split in distribution
    (the reference keeps 90%; 80% is the split the later LEAF/pFedMe generators and this project use).
    """
    _no_path("synthetic", path)
    if num_devices < 1 or dim < 1 or num_classes < 2 or not 0.0 < train_fraction < 1.0:
        raise DataError("synthetic needs num_devices >= 1, dim >= 1, num_classes >= 2, 0 < train_fraction < 1")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    if max_samples is not None:
        sizes = np.minimum(sizes, int(max_samples))
    mean_w = rng.normal(0, alpha, num_devices)  # u_k; the reference reuses it as the mean of b_k
    mean_x = rng.normal(rng.normal(0, beta, num_devices)[:, None], 1, (num_devices, dim))  # v_k ~ N(B_k, 1)
    std_x = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the covariance diagonal j^-1.2
    parts: dict[str, list[np.ndarray]] = {"xtr": [], "ytr": [], "xte": [], "yte": [], "g": []}
    for k in range(num_devices):
        w = rng.normal(mean_w[k], 1, (dim, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        # Diagonal covariance: mean + std * N(0, 1) equals the reference's multivariate_normal draw.
        x = mean_x[k] + std_x * rng.standard_normal((sizes[k], dim))
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax = argmax of the logits
        cut = int(train_fraction * sizes[k])
        parts["xtr"].append(x[:cut])
        parts["ytr"].append(y[:cut])
        parts["xte"].append(x[cut:])
        parts["yte"].append(y[cut:])
        parts["g"].append(np.full(cut, k))
    x_tr, y_tr, x_te, y_te, groups = (np.concatenate(parts[k]) for k in ("xtr", "ytr", "xte", "yte", "g"))
    info = (
        f"synthetic({alpha}, {beta}) seed {seed}: {num_devices} devices, {len(y_tr)} train / {len(y_te)} test, "
        f"{dim} features"
    )
    return Dataset(
        "synthetic",
        x_tr.astype(np.float32),
        y_tr.astype(np.int64),
        x_te.astype(np.float32),
        y_te.astype(np.int64),
        num_classes,
        groups=groups.astype(np.int64),
        info=info,
    )


# ----------------------------------------------------------------------------- femnist

# Pixel statistics of the LEAF FEMNIST train split (1.0 = background), measured on the 105-writer subset in
# ../shared/data (mean 0.9612, std 0.1656); TFF's h5 files use the same convention. Without normalisation the
# inputs sit near 1 and small models barely learn (an MLP: 5% vs 58% test accuracy after 1,000 steps).
FEMNIST_MEAN = (0.9612,)
FEMNIST_STD = (0.1656,)

_Store = dict[str, list[tuple[np.ndarray, np.ndarray]]]


def _add_leaf(store: _Store, blob: bytes, where: str, split: str) -> None:
    try:
        # JSON's NaN and Infinity extensions parse to floats; they are counted and refused below.
        doc = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt LEAF JSON file {where}: {e}; replace it with a fresh copy") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("user_data"), dict):
        raise DataError(f"{where} is not a LEAF JSON file (no 'user_data' object); check the data path")
    writers: list[tuple[str, np.ndarray, np.ndarray]] = []
    for uid, ud in doc["user_data"].items():
        try:
            x = np.asarray(ud["x"], dtype=np.float32)
            y = np.asarray(ud["y"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: writer {uid} has malformed 'x'/'y' ({e}); replace the file") from e
        if x.shape != (len(y), 784) or y.ndim != 1:
            raise DataError(f"{where}: writer {uid} must have x of shape (n, 784) and n labels, got {x.shape}")
        writers.append((uid, x, _int_labels(y, f"{where}: writer {uid}", split)))
    # One count for the whole file, so the message says how much of it is bad.
    bad = sum(x.size - int(np.count_nonzero(np.isfinite(x))) for _, x, _ in writers)
    if bad:
        raise DataError(
            f"{where}: the {split} split has {bad} non-finite (NaN/inf) pixel values; replace the file with a "
            "clean copy"
        )
    for uid, x, y in writers:
        store.setdefault(uid, []).append((x, y))


def _leaf_blobs(path: Path) -> Iterator[tuple[str, str, bytes]]:
    """Yield ``(split, where, json bytes)`` for ``[top/]{train,test}/*.json`` in a directory or tar."""
    if path.is_dir():
        root = path if (path / "train").is_dir() else None
        nested = [d for d in sorted(path.iterdir()) if (d / "train").is_dir()]
        root = root or (nested[0] if len(nested) == 1 else None)
        if root is None:
            raise DataError(f"no train/ folder in {path}; expected LEAF's train/*.json and test/*.json")
        for split in ("train", "test"):
            for f in sorted((root / split).glob("*.json")):
                yield split, str(f), f.read_bytes()
        return
    try:
        # "r|*" streams the members in archive order: no seeking, no extraction to disk.
        with tarfile.open(path, "r|*") as tf:
            for m in tf:
                parts = PurePosixPath(m.name).parts
                if (
                    m.isfile()
                    and parts[-1].endswith(".json")
                    and len(parts) in (2, 3)
                    and parts[-2] in ("train", "test")
                ):
                    fobj = tf.extractfile(m)
                    assert fobj is not None
                    yield parts[-2], f"{path}:{m.name}", fobj.read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(f"cannot read archive {path}: truncated or corrupt ({e}); re-download it") from e


def _read_leaf(path: Path) -> dict[str, np.ndarray]:
    stores: dict[str, _Store] = {"train": {}, "test": {}}
    for split, where, blob in _leaf_blobs(path):
        _add_leaf(stores[split], blob, where, split)
    for split in ("train", "test"):
        if not stores[split]:
            raise DataError(f"no {split}/*.json LEAF files in {path}; expected femnist train/ and test/ folders")
    return _by_writer(stores["train"], stores["test"])


def _by_writer(train: _Store, test: _Store) -> dict[str, np.ndarray]:
    """Concatenate per-writer samples, writers sorted by id; train writers get group ids 0..G-1."""
    out: dict[str, np.ndarray] = {}
    for split, store in (("train", train), ("test", test)):
        uids = sorted(store)
        xs = [x for u in uids for x, _ in store[u]]
        ys = [y for u in uids for _, y in store[u]]
        out[f"x_{split}"] = np.concatenate(xs).reshape(-1, 1, 28, 28)
        out[f"y_{split}"] = np.concatenate(ys)
        if split == "train":
            counts = [sum(len(y) for _, y in store[u]) for u in uids]
            out["groups"] = np.repeat(np.arange(len(uids), dtype=np.int64), counts)
            out["writers"] = np.array(uids)
    return out


def _read_tff_h5(path: Path) -> dict[str, np.ndarray]:
    """TensorFlow Federated's ``fed_emnist_{train,test}.h5``: ``/examples/<client>/{pixels,label}``."""
    import h5py

    train_file = path / "fed_emnist_train.h5" if path.is_dir() else path
    test_file = train_file.with_name(train_file.name.replace("train", "test"))
    stores: dict[str, _Store] = {}
    for split, f in (("train", train_file), ("test", test_file)):
        if not f.is_file():
            raise DataError(f"femnist {split} file not found: {f}; keep fed_emnist_train.h5 and _test.h5 together")
        store: _Store = {}
        try:
            with h5py.File(f, "r") as h5:
                for cid, g in h5["examples"].items():
                    x = np.asarray(g["pixels"], dtype=np.float32)
                    y = _int_labels(np.asarray(g["label"]).reshape(-1), f"{f}: client {cid}", split)
                    if x.shape != (len(y), 28, 28):
                        raise DataError(f"{f}: client {cid} pixels must be (n, 28, 28), got {x.shape}")
                    _require_finite(x, f"{f}: client {cid}", split)
                    store[cid] = [(x.reshape(-1, 784), y)]
        except (OSError, KeyError, TypeError) as e:
            raise DataError(f"cannot read TFF EMNIST file {f} ({e}); expect /examples/<client>/pixels, label") from e
        stores[split] = store
    return _by_writer(stores["train"], stores["test"])


def _load_femnist(path: str | None = None, *, cache: bool = True) -> Dataset:
    """FEMNIST by writer: LEAF JSON (directory or ``.tar.gz``) or TFF's ``fed_emnist_*.h5``."""
    p = _existing("femnist", path)
    h5 = p.suffix == ".h5" or (p.is_dir() and (p / "fed_emnist_train.h5").is_file())
    if h5:
        arrays, hit = _read_tff_h5(p), False
    elif cache:
        arrays, hit = images.cached("femnist", p, "leaf", lambda: _read_leaf(p))
    else:
        arrays, hit = _read_leaf(p), False
    num_classes = 10 if "digitsonly" in p.name else 62
    for split in ("train", "test"):
        _require_in_range(arrays[f"y_{split}"], num_classes, f"femnist {p}", split)
        _require_finite(arrays[f"x_{split}"], f"femnist {p}", split)  # a cache written before this check existed
    info = (
        f"femnist from {p}{' (cached)' if hit else ''}: {len(arrays['writers'])} writers, "
        f"{len(arrays['y_train'])} train / {len(arrays['y_test'])} test samples"
    )
    return Dataset(
        "femnist",
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_test"],
        arrays["y_test"],
        num_classes,
        groups=arrays["groups"],
        mean=FEMNIST_MEAN,
        std=FEMNIST_STD,
        info=info,
    )


# ----------------------------------------------------------------------------- images


def _image_dataset(name: str, p: Path, arrays: images.ImageArrays, kind: str, **stats: object) -> Dataset:
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


def _load_cifar10(path: str | None = None, *, cache: bool = True) -> Dataset:
    """CIFAR-10 from an image folder (directory or zip) or the official python pickles."""
    p = _existing("cifar10", path)
    pickles = p.is_dir() and ((p / "data_batch_1").is_file() or (p / "cifar-10-batches-py").is_dir())
    if p.is_dir() and not pickles and not images.is_image_folder(p):
        raise DataError(
            f"{p} holds neither the CIFAR-10 python pickles (cifar-10-batches-py/) nor an image folder "
            "(train/<class>/, test/<class>/); point data.path at one of them"
        )
    if pickles or (p.is_file() and p.suffix.lower() != ".zip" and not zipfile.is_zipfile(p)):
        arrays, kind = images.read_cifar_pickles(p, "cifar10"), "python pickles"
    else:
        arrays, kind = images.read_image_folder(p, mode="RGB", cache=cache), "image folder"
        if len(arrays.classes) != 10 or arrays.x_train.shape[1:] != (3, 32, 32):
            raise DataError(
                f"{p} is not CIFAR-10: found {len(arrays.classes)} classes of {arrays.x_train.shape[1:]} images, "
                "need 10 classes of 32x32 RGB; use the imagefolder source for other data"
            )
    return _image_dataset("cifar10", p, arrays, kind, mean=CIFAR10_MEAN, std=CIFAR10_STD)


def _load_cifar100(path: str | None = None, *, label: str = "fine") -> Dataset:
    """CIFAR-100 from the official python pickles; ``label`` is ``"fine"`` (100) or ``"coarse"`` (20)."""
    p = _existing("cifar100", path)
    arrays = images.read_cifar_pickles(p, "cifar100", label=label)
    return _image_dataset(
        "cifar100", p, arrays, f"python pickles, {label} labels", mean=CIFAR100_MEAN, std=CIFAR100_STD
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
    p = _existing("imagefolder", path)
    arrays = images.read_image_folder(p, mode=mode, size=size, resize=resize, cache=cache)
    mean, std = _channel_stats(arrays.x_train)
    return _image_dataset("imagefolder", p, arrays, "image folder", mean=mean, std=std)


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


# ----------------------------------------------------------------------------- npz


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
    p = _existing("npz", path)
    layout = str(layout).upper() if str(layout).lower() != "auto" else "auto"
    if layout not in _LAYOUTS:
        raise DataError(f"npz: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    if num_classes is not None and (type(num_classes) is not int or num_classes < 1):  # bool is no count
        raise DataError(f"npz: num_classes must be an integer >= 1, got {num_classes!r}")
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
        if y[s].shape != (len(x[s]),) or not np.issubdtype(y[s].dtype, np.integer):
            raise DataError(f"npz file {p}: y_{s} must be {len(x[s])} integer labels, got {y[s].dtype} {y[s].shape}")
        if len(y[s]) == 0:
            raise DataError(f"npz file {p}: x_{s} has 0 examples; every split needs some (an empty test set reads 0%)")
        if y[s].min() < 0:
            raise DataError(f"npz file {p}: y_{s} has negative labels; labels must be 0..num_classes-1")
    if x["train"].shape[1:] != x["test"].shape[1:]:
        raise DataError(f"npz file {p}: x_train {x['train'].shape[1:]} and x_test {x['test'].shape[1:]} differ")
    if num_classes is None:
        num_classes = int(y["train"].max()) + 1
        test_only = np.setdiff1d(y["test"], y["train"])
        if test_only.size:
            raise DataError(
                f"npz file {p}: label(s) {_few(test_only)} appear only in the test split (y_test), never in y_train; "
                "declare the classes with data.options.num_classes=N, or fix the split"
            )
    for s in ("train", "test"):
        _require_in_range(y[s], num_classes, f"npz file {p}", s)
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
        _require_finite(xs[s], f"npz file {p}", s)
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
