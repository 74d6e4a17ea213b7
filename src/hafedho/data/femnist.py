"""FEMNIST by writer: LEAF JSON (a directory or a tar) or TensorFlow Federated's h5 files."""

from __future__ import annotations

import json
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from hafedho.data.cache import cached
from hafedho.data.dataset import Dataset, Source, existing_path, int_labels, require_finite, require_in_range
from hafedho.data.safe_pickle import DataError

__all__ = ["FEMNIST", "FEMNIST_MEAN", "FEMNIST_STD"]

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
    except RecursionError as e:  # arrays nested thousands deep: Python's JSON parser recurses per level
        raise DataError(
            f"LEAF JSON file {where} is nested too deeply to read (LEAF files hold lists of pixel rows); replace it "
            "with a fresh copy"
        ) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("user_data"), dict):
        raise DataError(f"{where} is not a LEAF JSON file (no 'user_data' object); check the data path")
    writers: list[tuple[str, np.ndarray, np.ndarray]] = []
    for uid, ud in doc["user_data"].items():
        try:
            x = np.asarray(ud["x"], dtype=np.float32)
            y = np.asarray(ud["y"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: writer {uid} has malformed 'x'/'y' ({e}); replace the file") from e
        if any(isinstance(v, bool) for v in (ud["y"] if isinstance(ud["y"], list) else ())):
            # JSON's true would read as class 1 (NumPy casts it among ints): a boolean is no class index
            raise DataError(f"{where}: writer {uid} has a boolean label (true/false); labels are class indices")
        if x.shape != (len(y), 784) or y.ndim != 1:
            raise DataError(f"{where}: writer {uid} must have x of shape (n, 784) and n labels, got {x.shape}")
        writers.append((uid, x, int_labels(y, f"{where}: writer {uid}", split)))
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
                    y = int_labels(np.asarray(g["label"]).reshape(-1), f"{f}: client {cid}", split)
                    if x.shape != (len(y), 28, 28):
                        raise DataError(f"{f}: client {cid} pixels must be (n, 28, 28), got {x.shape}")
                    require_finite(x, f"{f}: client {cid}", split)
                    store[cid] = [(x.reshape(-1, 784), y)]
        except (OSError, KeyError, TypeError) as e:
            raise DataError(f"cannot read TFF EMNIST file {f} ({e}); expect /examples/<client>/pixels, label") from e
        stores[split] = store
    return _by_writer(stores["train"], stores["test"])


def _load_femnist(path: str | None = None, *, cache: bool = True) -> Dataset:
    """FEMNIST by writer: LEAF JSON (directory or ``.tar.gz``) or TFF's ``fed_emnist_*.h5``."""
    p = existing_path("femnist", path)
    h5 = p.suffix == ".h5" or (p.is_dir() and (p / "fed_emnist_train.h5").is_file())
    if h5:
        arrays, hit = _read_tff_h5(p), False
    elif cache:
        arrays, hit = cached("femnist", p, "leaf", lambda: _read_leaf(p))
    else:
        arrays, hit = _read_leaf(p), False
    num_classes = 10 if "digitsonly" in p.name else 62
    for split in ("train", "test"):
        require_in_range(arrays[f"y_{split}"], num_classes, f"femnist {p}", split)
        require_finite(arrays[f"x_{split}"], f"femnist {p}", split)  # a cache written before this check existed
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


FEMNIST = Source(
    "femnist",
    "FEMNIST by writer: LEAF JSON dir/.tar.gz or TFF fed_emnist_*.h5, 62 classes",
    "../shared/data/femnist_leaf_sf05.tar.gz",
    _load_femnist,
)
