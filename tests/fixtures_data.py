"""Builders of tiny data fixtures, in each exact on-disk format, under a test's ``tmp_path``.

Every builder writes files and returns what a correct reader must produce, so tests compare against
known arrays. No binary fixture is ever committed: they are all made at test time.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

# ----------------------------------------------------------------------------- FEMNIST

# Writer -> (train samples, test samples); "w9" is test-only, as 79 writers of the real shard are.
LEAF_WRITERS = {"w2": (3, 1), "w0": (2, 2), "w1": (4, 1), "w9": (0, 2)}


def _writer_pixels(uid: str, split: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic float32 pixels (multiples of 1/255, exact through JSON) and labels in 0..61."""
    seed = int(uid[1:]) * 2 + (split == "test")
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, 256, (n, 784)) / 255).astype(np.float32)
    y = rng.integers(0, 62, n).astype(np.int64)
    return x, y


def leaf_expected() -> dict[str, np.ndarray]:
    """What a FEMNIST reader must return for :func:`make_leaf_dir`: writers sorted by id."""
    out: dict[str, list[np.ndarray]] = {"x_train": [], "y_train": [], "x_test": [], "y_test": [], "groups": []}
    train_writers = sorted(u for u, (ntr, _) in LEAF_WRITERS.items() if ntr)
    for u in sorted(LEAF_WRITERS):
        ntr, nte = LEAF_WRITERS[u]
        for split, n in (("train", ntr), ("test", nte)):
            if n:
                x, y = _writer_pixels(u, split, n)
                out[f"x_{split}"].append(x.reshape(-1, 1, 28, 28))
                out[f"y_{split}"].append(y)
        if ntr:
            out["groups"].append(np.full(ntr, train_writers.index(u), dtype=np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def make_leaf_dir(root: Path, top: str | None = "femnist_leaf") -> Path:
    """LEAF JSON layout ``[top/]{train,test}/*.json``; train split over two shards. Returns the data dir."""
    base = root / top if top else root
    shards = {"train": [["w2", "w0"], ["w1"]], "test": [["w0", "w1", "w9", "w2"]]}
    for split, groups in shards.items():
        (base / split).mkdir(parents=True)
        for i, uids in enumerate(groups):
            doc: dict = {"users": [], "num_samples": [], "user_data": {}}
            for u in uids:
                n = LEAF_WRITERS[u][0 if split == "train" else 1]
                x, y = _writer_pixels(u, split, n)
                doc["users"].append(u)
                doc["num_samples"].append(n)
                doc["user_data"][u] = {"x": x.tolist(), "y": y.tolist()}
            (base / split / f"all_data_{i}_niid_05_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return root


def make_tar_gz(src_dir: Path, out: Path) -> Path:
    """Pack ``src_dir``'s contents into a ``.tar.gz`` (paths relative to ``src_dir``)."""
    with tarfile.open(out, "w:gz") as tf:
        for p in sorted(src_dir.rglob("*")):
            tf.add(p, arcname=p.relative_to(src_dir).as_posix(), recursive=False)
    return out


def make_tff_h5(root: Path) -> Path:
    """TFF's ``fed_emnist_{train,test}.h5`` with the :data:`LEAF_WRITERS` data. Returns the directory."""
    import h5py

    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with h5py.File(root / f"fed_emnist_{split}.h5", "w") as f:
            for u, (ntr, nte) in LEAF_WRITERS.items():
                n = ntr if split == "train" else nte
                if n:
                    x, y = _writer_pixels(u, split, n)
                    f.create_dataset(f"examples/{u}/pixels", data=x.reshape(-1, 28, 28))
                    f.create_dataset(f"examples/{u}/label", data=y.astype(np.int32))
    return root


# ----------------------------------------------------------------------------- CIFAR pickles


def cifar_rows(n: int, seed: int) -> np.ndarray:
    """``n`` random CIFAR rows: uint8 (n, 3072) = R, G, B planes of 32x32."""
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def make_cifar10_pickles(root: Path, per_batch: int = 3, protocol: int = 2) -> Path:
    """``root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``. Returns ``root``."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        data = cifar_rows(per_batch, seed=i)
        batch = {
            "batch_label": f"batch {i}",
            "labels": [(i + j) % 10 for j in range(per_batch)],
            "data": data,
            "filenames": [f"img_{i}_{j}.png" for j in range(per_batch)],
        }
        (base / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]}
    (base / "batches.meta").write_bytes(pickle.dumps(meta, protocol=protocol))
    return root


def make_cifar100_pickles(root: Path, n_train: int = 6, n_test: int = 4) -> Path:
    """``root/cifar-100-python/{train,test,meta}`` with fine labels 0..99 and coarse labels 0..19."""
    base = root / "cifar-100-python"
    base.mkdir(parents=True)
    for seed, (name, n) in enumerate((("train", n_train), ("test", n_test))):
        fine = [(7 * j + seed) % 100 for j in range(n)]
        doc = {"data": cifar_rows(n, seed=10 + seed), "fine_labels": fine, "coarse_labels": [f // 5 for f in fine]}
        (base / name).write_bytes(pickle.dumps(doc, protocol=2))
    (base / "meta").write_bytes(pickle.dumps({"fine_label_names": [str(i) for i in range(100)]}, protocol=2))
    return root


class Exploit:
    """Pickles into a call of ``os.system(command)``: what a hostile "data set" would contain."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


def make_malicious_pickle(path: Path, marker: Path) -> Path:
    """A CIFAR-looking batch whose ``data`` runs ``echo pwned > marker`` when naively unpickled."""
    payload = {"labels": [0], "data": Exploit(f"echo pwned > {marker}")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(payload, protocol=2))
    return path


# ----------------------------------------------------------------------------- image folders


def folder_images(classes: list[str], per_split: dict[str, int], size: tuple[int, int], mode: str = "RGB"):
    """Deterministic images: ``{(split, class): [uint8 arrays of shape (H, W, C) or (H, W)]}``."""
    h, w = size
    out = {}
    for s_i, (split, n) in enumerate(per_split.items()):
        for c_i, c in enumerate(classes):
            rng = np.random.default_rng(100 * s_i + c_i)
            shape = (h, w, 3) if mode == "RGB" else (h, w)
            out[(split, c)] = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]
    return out


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")  # lossless, so pixels round-trip exactly
    return buf.getvalue()


def write_image_folder(
    images: dict, root: Path, *, as_zip: bool = False, top: str | None = None, extra: dict[str, bytes] | None = None
) -> Path:
    """Write ``images`` as ``[top/]split/class/NNNN.png`` to a directory or a zip; ``extra`` adds raw files.

    Returns the directory, or the zip's path.
    """
    files = {}
    for (split, c), arrs in images.items():
        for j, a in enumerate(arrs):
            files[f"{split}/{c}/{j:04d}.png"] = _png(a)
    files.update(extra or {})
    prefix = f"{top}/" if top else ""
    if as_zip:
        out = root.with_suffix(".zip")
        with zipfile.ZipFile(out, "w") as z:
            for name, data in files.items():
                z.writestr(prefix + name, data)
        return out
    for name, data in files.items():
        p = root / (prefix + name)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def expected_folder_arrays(images: dict, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x [N, C, H, W], y [N])`` in reader order: classes sorted, then file name."""
    classes = sorted({c for _, c in images})
    xs, ys = [], []
    for label, c in enumerate(classes):
        for a in images[(split, c)]:
            xs.append(a.transpose(2, 0, 1) if a.ndim == 3 else a[None])
            ys.append(label)
    return np.stack(xs), np.array(ys, dtype=np.int64)


def truncate(path: Path) -> Path:
    """Cut a file's bytes in half, as an interrupted download would."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def edit_leaf_json(data_dir: Path, split: str, edit) -> Path:
    """Apply ``edit(user_data)`` to the first ``split`` JSON of a :func:`make_leaf_dir` tree; returns that file.

    ``json.dumps`` writes float NaN and inf as ``NaN``/``Infinity``, as LEAF's Python writers would.
    """
    f = sorted(data_dir.rglob(f"{split}/*.json"))[0]
    doc = json.loads(f.read_text())
    edit(doc["user_data"])
    f.write_text(json.dumps(doc))
    return f
