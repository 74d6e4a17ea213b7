"""Data sources: every reader on tiny fixtures in its exact format, its errors, and the real shared files."""

from __future__ import annotations

import pickle
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_data import (
    edit_leaf_json,
    expected_folder_arrays,
    folder_images,
    leaf_expected,
    make_cifar10_pickles,
    make_cifar100_pickles,
    make_leaf_dir,
    make_malicious_pickle,
    make_tar_gz,
    make_tff_h5,
    truncate,
    write_image_folder,
)

from hafedho.data import cache, femnist
from hafedho.data.federated import FederatedData
from hafedho.data.safe_pickle import safe_load
from hafedho.data.sources import SOURCES, DataError, Dataset, load_dataset
from hafedho.models import build_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep fixture tests' decoded-array caches out of the user's ~/.cache."""
    monkeypatch.setenv("HAFEDHO_CACHE_DIR", str(tmp_path / "cache"))


def assert_femnist(d: Dataset) -> None:
    exp = leaf_expected()
    for key in ("x_train", "y_train", "x_test", "y_test", "groups"):
        got = getattr(d, key)
        assert got.dtype == exp[key].dtype, key
        np.testing.assert_array_equal(got, exp[key], err_msg=key)
    assert d.x_train.shape == (9, 1, 28, 28) and d.num_classes == 62 and d.input_shape == (1, 28, 28)


# ----------------------------------------------------------------------------- registry and paths


def test_registry_lists_every_source():
    assert list(SOURCES) == ["digits", "synthetic", "femnist", "cifar10", "cifar100", "imagefolder", "npz"]
    assert all(s.description and "\n" not in s.description for s in SOURCES.values())


def test_unknown_source_lists_known_names():
    with pytest.raises(DataError, match=r"unknown data source 'mnist'; known sources: digits, synthetic, femnist"):
        load_dataset("mnist")


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "nope.tar.gz"
    with pytest.raises(DataError, match=rf"femnist data not found: {missing}; pass data.path=\.\.\."):
        load_dataset("femnist", str(missing))


def test_unknown_option_names_valid_ones():
    with pytest.raises(DataError, match=r"synthetic: .*'gamma'.*options are: alpha, beta"):
        load_dataset("synthetic", gamma=1)


def test_generated_source_rejects_a_path():
    with pytest.raises(DataError, match=r"reads no files; drop data\.path"):
        load_dataset("digits", "some/dir")


def test_source_without_default_needs_a_path():
    with pytest.raises(DataError, match=r"cifar100 needs data files; pass data\.path=\.\.\."):
        load_dataset("cifar100")


def test_wrong_kind_of_path(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds neither the CIFAR-10 python pickles .* nor an image folder"):
        load_dataset("cifar10", str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match=r"notes\.txt is neither a directory nor a \.zip"):
        load_dataset("imagefolder", str(tmp_path / "notes.txt"))


# ----------------------------------------------------------------------------- digits, synthetic


def test_digits_fixed_stratified_split():
    d = load_dataset("digits")
    assert (len(d.y_train), len(d.y_test)) == (1437, 360) and len(d.y_train) + len(d.y_test) == 1797
    assert d.x_train.dtype == np.float32 and d.x_train.shape == (1437, 64) and d.y_train.dtype == np.int64
    assert d.x_train.min() >= 0.0 and d.x_train.max() <= 1.0 and d.groups is None and d.num_classes == 10
    # Stratified: each class keeps its share (within one example) in the test set.
    total = np.bincount(d.y_train, minlength=10) + np.bincount(d.y_test, minlength=10)
    assert np.all(np.abs(np.bincount(d.y_test, minlength=10) - total * 0.2) <= 1)
    np.testing.assert_array_equal(load_dataset("digits").x_test, d.x_test)  # the same split every time


def test_synthetic_is_deterministic_per_seed():
    a, b, c = (load_dataset("synthetic", seed=s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)


def test_synthetic_shapes_groups_and_sizes():
    d = load_dataset("synthetic")
    assert d.x_train.dtype == np.float32 and d.input_shape == (60,) and d.num_classes == 10
    assert d.y_train.dtype == np.int64 and d.groups is not None and d.groups.dtype == np.int64
    counts = np.bincount(d.groups)
    assert len(counts) == 30 and counts.min() >= int(0.8 * 50)  # every device had >= 50 samples before the split
    assert min(d.y_train.min(), d.y_test.min()) >= 0 and max(d.y_train.max(), d.y_test.max()) <= 9
    assert len(np.unique(d.y_train)) > 1
    # Each device keeps floor(0.8 n) for train and gives the rest (20%, up to rounding) to the test set.
    total = len(d.y_train) + len(d.y_test)
    assert abs(len(d.y_test) / total - 0.2) <= 30 / total


def test_synthetic_options():
    d = load_dataset("synthetic", num_devices=5, dim=8, num_classes=3, max_samples=60, alpha=0.5, beta=0.5)
    assert d.input_shape == (8,) and d.y_train.max() <= 2
    assert np.bincount(d.groups).max() <= 48 and len(d.y_train) + len(d.y_test) <= 5 * 60


# ----------------------------------------------------------------------------- femnist


def test_femnist_leaf_directory_nested(tmp_path: Path):
    d = load_dataset("femnist", str(make_leaf_dir(tmp_path / "leaf")))
    assert_femnist(d)
    assert d.groups.max() + 1 == 3  # the test-only writer w9 gets no group id
    assert "3 writers, 9 train / 6 test samples" in d.info


def test_femnist_leaf_directory_flat(tmp_path: Path):
    assert_femnist(load_dataset("femnist", str(make_leaf_dir(tmp_path / "leaf", top=None)), cache=False))


def test_femnist_leaf_tar_gz_and_cache(tmp_path: Path):
    archive = make_tar_gz(make_leaf_dir(tmp_path / "leaf"), tmp_path / "femnist.tar.gz")
    first = load_dataset("femnist", str(archive))
    assert_femnist(first)
    again = load_dataset("femnist", str(archive))
    assert_femnist(again)
    assert "(cached)" in again.info and "(cached)" not in first.info


def test_femnist_tff_h5(tmp_path: Path):
    root = make_tff_h5(tmp_path / "tff")
    assert_femnist(load_dataset("femnist", str(root)))
    assert_femnist(load_dataset("femnist", str(root / "fed_emnist_train.h5")))


def test_femnist_corrupt_json(tmp_path: Path):
    root = make_leaf_dir(tmp_path / "leaf")
    bad = root / "femnist_leaf" / "train" / "bad.json"
    bad.write_text('{"users": ["a"], "user_data": {"a": {"x": [[1.0, 0.5')
    with pytest.raises(DataError, match=rf"corrupt LEAF JSON file {bad}: .*; replace it with a fresh copy"):
        load_dataset("femnist", str(root))


def test_femnist_truncated_tar_gz(tmp_path: Path):
    archive = truncate(make_tar_gz(make_leaf_dir(tmp_path / "leaf"), tmp_path / "femnist.tar.gz"))
    with pytest.raises(DataError, match=rf"cannot read archive {archive}: truncated or corrupt .*re-download"):
        load_dataset("femnist", str(archive))


def test_femnist_garbage_tar_gz(tmp_path: Path):
    archive = tmp_path / "femnist.tar.gz"
    archive.write_bytes(b"\x1f\x8b" + b"not really gzip" * 20)
    with pytest.raises(DataError, match=rf"cannot read archive {archive}"):
        load_dataset("femnist", str(archive))


def test_femnist_without_test_split(tmp_path: Path):
    root = make_leaf_dir(tmp_path / "leaf")
    for f in (root / "femnist_leaf" / "test").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=r"no test/\*\.json LEAF files"):
        load_dataset("femnist", str(root), cache=False)


# ----------------------------------------------------------------------------- CIFAR pickles


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10_pickles_plane_layout(tmp_path: Path, protocol: int):
    root = make_cifar10_pickles(tmp_path, per_batch=3, protocol=protocol)
    base = root / "cifar-10-batches-py"
    batch = pickle.loads((base / "data_batch_1").read_bytes())
    k = 5 * 32 + 7  # pixel (row 5, col 7) of each plane
    for d in (load_dataset("cifar10", str(root)), load_dataset("cifar10", str(base))):
        assert d.x_train.shape == (15, 3, 32, 32) and d.x_train.dtype == np.uint8 and d.x_test.shape == (3, 3, 32, 32)
        assert d.y_train.dtype == np.int64 and d.num_classes == 10
        np.testing.assert_array_equal(d.y_train[:3], batch["labels"])
        for c in range(3):
            assert d.x_train[0, c, k // 32, k % 32] == batch["data"][0, c * 1024 + k]
        np.testing.assert_array_equal(d.x_train[:3].reshape(3, -1), batch["data"])
        assert d.mean == (0.4914, 0.4822, 0.4465) and d.std == (0.2470, 0.2435, 0.2616)


def test_cifar10_official_tar_gz(tmp_path: Path):
    archive = make_tar_gz(make_cifar10_pickles(tmp_path / "src"), tmp_path / "cifar-10-python.tar.gz")
    d = load_dataset("cifar10", str(archive))
    assert d.x_train.shape == (15, 3, 32, 32) and len(d.y_test) == 3


def test_cifar10_pickles_missing_batch(tmp_path: Path):
    root = make_cifar10_pickles(tmp_path)
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"data_batch_3 not found"):
        load_dataset("cifar10", str(root))


def test_cifar100_fine_and_coarse(tmp_path: Path):
    root = make_cifar100_pickles(tmp_path)
    doc = pickle.loads((root / "cifar-100-python" / "train").read_bytes())
    fine = load_dataset("cifar100", str(root))
    coarse = load_dataset("cifar100", str(root), label="coarse")
    assert fine.num_classes == 100 and coarse.num_classes == 20 and fine.x_train.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(fine.y_train, doc["fine_labels"])
    np.testing.assert_array_equal(coarse.y_train, doc["coarse_labels"])
    np.testing.assert_array_equal(fine.x_train.reshape(6, -1), doc["data"])
    assert fine.mean == (0.5071, 0.4865, 0.4409)
    with pytest.raises(DataError, match="label must be 'fine' or 'coarse'"):
        load_dataset("cifar100", str(root), label="medium")


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path):
    marker = tmp_path / "pwned.txt"
    root = make_cifar10_pickles(tmp_path / "data")
    batch = make_malicious_pickle(root / "cifar-10-batches-py" / "data_batch_1", marker)
    with pytest.raises(DataError, match=rf"refusing to unpickle {batch}: it imports posix\.system; only plain"):
        load_dataset("cifar10", str(root))
    with pytest.raises(DataError, match=r"refusing to unpickle .*system"):
        safe_load(batch)
    assert not marker.exists()


def test_safe_load_reads_numpy_pickles_in_every_spelling(tmp_path: Path):
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    p2 = pickle.dumps({"data": a, "n": np.int64(3), "s": {1, 2}}, protocol=2)
    # numpy 1 and the Python 2 CIFAR pickles name numpy.core; it must load without deprecation warnings.
    old = p2.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    for blob in (p2, old, pickle.dumps({"data": a}, protocol=5)):
        (tmp_path / "f").write_bytes(blob)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = safe_load(tmp_path / "f")
        np.testing.assert_array_equal(out["data"], a)


def test_safe_load_truncated(tmp_path: Path):
    f = tmp_path / "batch"
    f.write_bytes(pickle.dumps({"data": np.zeros((4, 3072), np.uint8)}, protocol=2))
    truncate(f)
    with pytest.raises(DataError, match=rf"cannot unpickle {f}: corrupt or truncated"):
        safe_load(f)


# ----------------------------------------------------------------------------- image folders


@pytest.mark.parametrize(("as_zip", "top"), [(False, None), (True, None), (True, "my_set"), (False, "my_set")])
def test_imagefolder_round_trip(tmp_path: Path, as_zip: bool, top: str | None):
    imgs = folder_images(["cat", "ant", "bee"], {"train": 3, "test": 2}, size=(5, 4))
    path = write_image_folder(imgs, tmp_path / "set", as_zip=as_zip, top=top, extra={"train/.DS_Store": b"x"})
    d = load_dataset("imagefolder", str(path))
    for split in ("train", "test"):
        x, y = expected_folder_arrays(imgs, split)
        np.testing.assert_array_equal(getattr(d, f"x_{split}"), x)
        np.testing.assert_array_equal(getattr(d, f"y_{split}"), y)
    assert d.x_train.shape == (9, 3, 5, 4) and d.x_train.dtype == np.uint8 and d.num_classes == 3
    assert d.y_train[0] == 0 and len(d.mean) == 3 and all(0 < s < 1 for s in d.std)


def test_imagefolder_grayscale_and_resize(tmp_path: Path):
    imgs = folder_images(["a", "b"], {"train": 2, "test": 1}, size=(6, 6), mode="L")
    path = write_image_folder(imgs, tmp_path / "set")
    d = load_dataset("imagefolder", str(path), mode="L")
    np.testing.assert_array_equal(d.x_train, expected_folder_arrays(imgs, "train")[0])
    assert d.input_shape == (1, 6, 6)
    assert load_dataset("imagefolder", str(path), size=(3, 2), resize=True).input_shape == (3, 3, 2)
    with pytest.raises(DataError, match=r"is 6x6 \(WxH\), expected 2x3; pass size=\(H, W\) with resize=true"):
        load_dataset("imagefolder", str(path), size=(3, 2))


def test_imagefolder_mixed_sizes(tmp_path: Path):
    imgs = folder_images(["a", "b"], {"train": 2, "test": 1}, size=(4, 4))
    imgs[("test", "b")] = [np.zeros((5, 4, 3), np.uint8)]
    path = write_image_folder(imgs, tmp_path / "set", as_zip=True)
    with pytest.raises(DataError, match=rf"{path}: test/b/0000.png is 4x5 \(WxH\), expected 4x4"):
        load_dataset("imagefolder", str(path))


def test_imagefolder_class_lists_differ(tmp_path: Path):
    imgs = folder_images(["a", "b"], {"train": 1, "test": 1}, size=(4, 4))
    imgs[("test", "c")] = imgs.pop(("test", "b"))
    path = write_image_folder(imgs, tmp_path / "set")
    with pytest.raises(DataError, match=r"class folders differ in .*: only in train \['b'\], only in test \['c'\]"):
        load_dataset("imagefolder", str(path))


@pytest.mark.parametrize("as_zip", [False, True])
def test_imagefolder_non_image_file(tmp_path: Path, as_zip: bool):
    imgs = folder_images(["a", "b"], {"train": 1, "test": 1}, size=(4, 4))
    path = write_image_folder(imgs, tmp_path / "set", as_zip=as_zip, extra={"train/b/notes.txt": b"hello"})
    with pytest.raises(DataError, match=r"train/b/notes\.txt is not a readable image .*remove it or replace it"):
        load_dataset("imagefolder", str(path))


def test_imagefolder_truncated_zip(tmp_path: Path):
    imgs = folder_images(["a", "b"], {"train": 4, "test": 2}, size=(8, 8))
    path = truncate(write_image_folder(imgs, tmp_path / "set", as_zip=True))
    with pytest.raises(DataError, match=rf"cannot read zip archive {path}: truncated or corrupt .*re-create it"):
        load_dataset("imagefolder", str(path))


def test_imagefolder_without_layout(tmp_path: Path):
    (tmp_path / "set" / "pics").mkdir(parents=True)
    (tmp_path / "set" / "pics" / "x.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"no train/ folder in .*expected train/<class>/\*"):
        load_dataset("imagefolder", str(tmp_path / "set"))


def test_imagefolder_cache_hit_rebuild_and_invalidation(tmp_path: Path):
    imgs = folder_images(["a", "b"], {"train": 2, "test": 1}, size=(4, 4))
    path = write_image_folder(imgs, tmp_path / "set", as_zip=True)
    first = load_dataset("imagefolder", str(path))
    assert "cached" not in first.info and "cached" in load_dataset("imagefolder", str(path)).info
    (entry,) = cache.cache_dir().glob("imagefolder-*.npz")
    entry.write_bytes(b"garbage")  # a corrupt cache entry is ignored and replaced
    rebuilt = load_dataset("imagefolder", str(path))
    assert "cached" not in rebuilt.info and zipfile.is_zipfile(entry)
    np.testing.assert_array_equal(rebuilt.x_train, first.x_train)
    imgs[("train", "a")][0][:] = 0  # a changed archive is decoded afresh
    write_image_folder(imgs, tmp_path / "set", as_zip=True)
    np.testing.assert_array_equal(load_dataset("imagefolder", str(path)).x_train[0], 0)


def test_cifar10_from_image_folder_zip(tmp_path: Path):
    imgs = folder_images(CIFAR10_CLASSES, {"train": 2, "test": 1}, size=(32, 32))
    path = write_image_folder(imgs, tmp_path / "cifar", as_zip=True, top="cifar10")
    d = load_dataset("cifar10", str(path))
    np.testing.assert_array_equal(d.x_train, expected_folder_arrays(imgs, "train")[0])
    assert d.x_train.shape == (20, 3, 32, 32) and d.mean == (0.4914, 0.4822, 0.4465)
    small = write_image_folder(folder_images(["a", "b"], {"train": 1, "test": 1}, (8, 8)), tmp_path / "s", as_zip=True)
    with pytest.raises(DataError, match=r"is not CIFAR-10: found 2 classes .*use the imagefolder source"):
        load_dataset("cifar10", str(small))


# ----------------------------------------------------------------------------- npz


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def test_npz_round_trip_and_groups(tmp_path: Path):
    rng = np.random.default_rng(0)
    x, xt = rng.random((6, 4)), rng.random((2, 4))
    y, yt = np.array([0, 1, 2, 1, 0, 2]), np.array([1, 0])
    p = _npz(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=yt, groups=np.array([7, 7, 3, 3, 9, 9]))
    d = load_dataset("npz", str(p))
    np.testing.assert_array_equal(d.x_train, x.astype(np.float32))
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64 and d.num_classes == 3
    np.testing.assert_array_equal(d.groups, [1, 1, 0, 0, 2, 2])
    img = np.zeros((2, 1, 2, 2), np.uint8)
    u8 = _npz(tmp_path / "u.npz", x_train=img, y_train=np.array([0, 1]), x_test=img[:1], y_test=np.array([1]))
    assert load_dataset("npz", str(u8), num_classes=5).x_train.dtype == np.uint8


def test_npz_missing_key(tmp_path: Path):
    p = _npz(tmp_path / "d.npz", x_train=np.zeros((2, 3)), y_train=np.array([0, 1]), x_test=np.zeros((1, 3)))
    with pytest.raises(DataError, match=rf"npz file {p} lacks \['y_test'\]; it needs x_train, y_train"):
        load_dataset("npz", str(p))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"y_train": np.array([0, -1])}, "negative labels"),
        ({"y_train": np.array([0.0, 1.0])}, r"y_train must be 2 integer labels"),
        ({"x_test": np.zeros((1, 5))}, r"x_train \(3,\) and x_test \(5,\) differ"),
        ({"groups": np.array([1])}, "groups must be 2 integers"),
        ({"x_train": np.array([[None] * 3] * 2, dtype=object)}, "cannot read npz file"),
    ],
)
def test_npz_validation(tmp_path: Path, change: dict, message: str):
    arrays = {"x_train": np.zeros((2, 3)), "y_train": np.array([0, 1]), "x_test": np.zeros((1, 3)), "y_test": [1]}
    p = _npz(tmp_path / "d.npz", **{**arrays, **change})
    with pytest.raises(DataError, match=message):
        load_dataset("npz", str(p))


# ----------------------------------------------------------------------------- npz image layouts


def _xy(x: np.ndarray, n_test: int = 2) -> dict[str, np.ndarray]:
    y = np.arange(len(x)) % 2
    return {"x_train": x, "y_train": y, "x_test": x[:n_test], "y_test": y[:n_test]}


def _forward(d: Dataset, model: str) -> torch.Tensor:
    """A real zoo model built for the source's input shape, run on preprocessed inputs."""
    fed = FederatedData(d.x_train, d.y_train, d.x_test, d.y_test, [np.arange(len(d.y_train))], d.mean, d.std)
    torch.manual_seed(0)
    return build_model(model, d.input_shape, d.num_classes)(fed.x_test())


def test_npz_nhw_images_get_a_channel_axis_for_femnist_cnn(tmp_path: Path):
    x = np.random.default_rng(0).random((4, 28, 28)).astype(np.float32)  # how MNIST-style arrays are saved
    d = load_dataset("npz", str(_npz(tmp_path / "m.npz", **_xy(x))))
    assert d.input_shape == (1, 28, 28) and "[N, H, W] given a channel axis" in d.info
    np.testing.assert_array_equal(d.x_train, x[:, None])
    assert _forward(d, "femnist_cnn").shape == (2, 2)


def test_npz_nhwc_images_are_transposed_for_cifar_cnn(tmp_path: Path):
    x = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    d = load_dataset("npz", str(_npz(tmp_path / "c.npz", **_xy(x))))
    assert d.input_shape == (3, 32, 32) and d.x_train.dtype == np.uint8 and "NHWC transposed to NCHW" in d.info
    np.testing.assert_array_equal(d.x_train, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(d.x_test, x[:2].transpose(0, 3, 1, 2))
    assert d.x_train.flags.c_contiguous
    assert _forward(d, "cifar_cnn").shape == (2, 2)
    nchw = load_dataset("npz", str(_npz(tmp_path / "n.npz", **_xy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))))))
    np.testing.assert_array_equal(nchw.x_train, d.x_train)  # NCHW is kept as stored


def test_npz_ambiguous_layout_is_refused_unless_stated(tmp_path: Path):
    x = np.random.default_rng(0).random((4, 3, 32, 3)).astype(np.float32)
    p = _npz(tmp_path / "a.npz", **_xy(x))
    with pytest.raises(DataError, match=r"\(4, 3, 32, 3\) reads as .*; say which with data.options.layout='NCHW'"):
        load_dataset("npz", str(p))
    assert load_dataset("npz", str(p), layout="NCHW").input_shape == (3, 32, 3)
    nhwc = load_dataset("npz", str(p), layout="nhwc")
    assert nhwc.input_shape == (3, 3, 32)
    np.testing.assert_array_equal(nhwc.x_train, x.transpose(0, 3, 1, 2))


@pytest.mark.parametrize(
    ("x", "layout", "message"),
    [
        (np.zeros((4, 5)), "NHWC", r"holds features, not images; drop data.options.layout"),
        (np.zeros((4, 1, 8, 8)), "CHW", r"layout must be one of auto, NCHW, NHWC, got 'CHW'"),
    ],
)
def test_npz_layout_option_errors(tmp_path: Path, x: np.ndarray, layout: str, message: str):
    with pytest.raises(DataError, match=message):
        load_dataset("npz", str(_npz(tmp_path / "d.npz", **_xy(x))), layout=layout)


# ----------------------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])  # 1e300: float64 that overflows float32
def test_npz_non_finite_inputs_are_refused(tmp_path: Path, bad: float):
    x = np.ones((4, 3))
    xt = np.ones((2, 3))
    xt[0, :2] = bad
    p = _npz(tmp_path / "d.npz", **{**_xy(x), "x_test": xt})
    with pytest.raises(DataError, match=rf"^npz file {p}: the test split has 2 non-finite \(NaN/inf\) input values"):
        load_dataset("npz", str(p))


def test_leaf_non_finite_pixels_are_refused_naming_the_file(tmp_path: Path):
    def poison(user_data: dict) -> None:
        user_data["w0"]["x"][1][:2] = [float("nan"), float("inf")]
        user_data["w2"]["x"][0][5] = float("nan")

    bad = edit_leaf_json(make_leaf_dir(tmp_path / "leaf"), "train", poison)
    with pytest.raises(DataError, match=rf"^{bad}: the train split has 3 non-finite \(NaN/inf\) pixel values"):
        load_dataset("femnist", str(tmp_path / "leaf"))
    archive = make_tar_gz(tmp_path / "leaf", tmp_path / "leaf.tar.gz")
    with pytest.raises(DataError, match=rf"{archive}:femnist_leaf/train/{bad.name}: the train split has 3 non-"):
        load_dataset("femnist", str(archive))


def test_tff_h5_non_finite_pixels_are_refused(tmp_path: Path):
    import h5py

    root = make_tff_h5(tmp_path / "tff")
    with h5py.File(root / "fed_emnist_test.h5", "r+") as f:
        f["examples/w9/pixels"][0, 0, 0] = np.nan
    with pytest.raises(DataError, match=r"fed_emnist_test.h5: client w9: the test split has 1 non-finite"):
        load_dataset("femnist", str(root))


def test_stale_femnist_cache_with_nan_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    make_leaf_dir(tmp_path / "leaf")
    real = femnist.cached

    def stale(kind, path, options, build):  # as a cache written before the check existed would be read back
        arrays, _ = real(kind, path, options, build)
        arrays = {k: v.copy() for k, v in arrays.items()}  # the memo's arrays are read-only
        arrays["x_test"][0, 0, 0, 0] = np.nan
        return arrays, True

    monkeypatch.setattr(femnist, "cached", stale)
    with pytest.raises(DataError, match=r"^femnist .*leaf: the test split has 1 non-finite"):
        load_dataset("femnist", str(tmp_path / "leaf"))


# ----------------------------------------------------------------------------- labels and empty splits


def test_npz_test_only_label_is_refused_unless_classes_are_declared(tmp_path: Path):
    x = np.zeros((4, 3))
    arrays = {"x_train": x, "y_train": np.array([0, 1, 1, 0]), "x_test": x[:3], "y_test": np.array([0, 2, 5])}
    p = _npz(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError, match=r"label\(s\) \[2, 5\] appear only in the test split .*num_classes=N"):
        load_dataset("npz", str(p))  # before: a 6-class model, two classes never trained
    assert load_dataset("npz", str(p), num_classes=6).num_classes == 6
    with pytest.raises(DataError, match=r"the test split has label\(s\) \[5\] outside 0\.\.4 \(5 classes\)"):
        load_dataset("npz", str(p), num_classes=5)
    with pytest.raises(DataError, match=r"num_classes must be an integer >= 1, got 0"):
        load_dataset("npz", str(p), num_classes=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"y_test": np.array([0, -2])}, r"y_test has negative labels"),
        ({"x_test": np.zeros((0, 3)), "y_test": np.zeros(0, np.int64)}, r"x_test has 0 examples"),
        ({"y_test": np.array([0.5, 1.0])}, r"y_test must be 2 integer labels"),
    ],
)
def test_npz_bad_test_split(tmp_path: Path, change: dict, message: str):
    arrays = {"x_train": np.zeros((2, 3)), "y_train": np.array([0, 1]), "x_test": np.zeros((2, 3)), "y_test": [0, 1]}
    with pytest.raises(DataError, match=message):
        load_dataset("npz", str(_npz(tmp_path / "d.npz", **{**arrays, **change})))


@pytest.mark.parametrize(
    ("label", "message"), [(3.5, r"1 non-integer label\(s\), e\.g\. 3\.5"), (-1, r"label\(s\) \[-1\] outside 0\.\.61")]
)
def test_leaf_bad_labels_are_refused(tmp_path: Path, label: float, message: str):
    def edit(user_data: dict) -> None:
        user_data["w1"]["y"][0] = label

    bad = edit_leaf_json(make_leaf_dir(tmp_path / "leaf"), "test", edit)
    with pytest.raises(DataError, match=message) as e:
        load_dataset("femnist", str(tmp_path / "leaf"), cache=False)
    assert "test split" in str(e.value) and (bad.name in str(e.value) or str(tmp_path / "leaf") in str(e.value))


def test_leaf_whole_float_labels_are_read_as_integers(tmp_path: Path):
    def edit(user_data: dict) -> None:
        user_data["w0"]["y"] = [float(v) for v in user_data["w0"]["y"]]

    edit_leaf_json(make_leaf_dir(tmp_path / "leaf"), "train", edit)
    assert_femnist(load_dataset("femnist", str(tmp_path / "leaf")))


def _dataset(**change: object) -> Dataset:
    x = np.zeros((4, 3), np.float32)
    base = {"x_train": x, "y_train": np.array([0, 1, 0, 1]), "x_test": x[:2], "y_test": np.array([0, 1])}
    return Dataset("mine", **{**base, **change}, num_classes=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x_test": np.zeros((0, 3), np.float32), "y_test": np.zeros(0, np.int64)}, r"mine: the test split is empty"),
        ({"y_test": np.array([0, 2])}, r"mine: the test split has label\(s\) \[2\] outside 0\.\.1"),
        ({"x_train": np.full((4, 3), np.nan, np.float32)}, r"mine: the train split has 12 non-finite"),
    ],
)
def test_dataset_refuses_what_would_give_silently_wrong_results(change: dict, message: str):
    with pytest.raises(DataError, match=message):
        _dataset(**change)


def test_federated_data_refuses_an_empty_test_set():
    x, y = np.zeros((4, 3), np.float32), np.array([0, 1, 0, 1])
    with pytest.raises(DataError, match=r"the test split is empty \(0 examples\)"):
        FederatedData(x, y, x[:0], y[:0], [np.arange(4)])


# ----------------------------------------------------------------------------- the real shared files

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared data not present at {SHARED}")


@needs_shared
def test_real_femnist_tar_gz(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HAFEDHO_CACHE_DIR")  # the real files use the user's cache: warm after the first run
    d = load_dataset("femnist", str(SHARED / "femnist_leaf_sf05.tar.gz"))
    assert (len(d.y_train), len(d.y_test), d.num_classes) == (14708, 4088, 62)
    assert d.groups.max() + 1 == 105 and len(np.unique(d.groups)) == 105
    assert d.x_train.shape == (14708, 1, 28, 28) and d.x_train.dtype == np.float32
    assert d.x_train.min() >= 0.0 and d.x_train.max() == 1.0 and np.median(d.x_train) == 1.0  # 1.0 = background
    assert d.y_train.min() == 0 and d.y_train.max() == 61


@needs_shared
def test_real_cifar10_zip(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HAFEDHO_CACHE_DIR")
    start = time.perf_counter()
    d = load_dataset("cifar10", str(SHARED / "cifar10_jpeg.zip"))
    print(f"cifar10 zip loaded in {time.perf_counter() - start:.1f} s: {d.info}")
    assert d.x_train.shape == (50000, 3, 32, 32) and d.x_test.shape == (10000, 3, 32, 32)
    assert d.x_train.dtype == np.uint8 and d.num_classes == 10
    assert np.bincount(d.y_train).tolist() == [5000] * 10 and np.bincount(d.y_test).tolist() == [1000] * 10
    means = d.x_train[::10].mean(axis=(0, 2, 3)) / 255  # every class: the arrays are sorted by class
    assert np.allclose(means, d.mean, atol=0.02)  # JPEG copy of the set: close to the standard statistics


@needs_shared
def test_default_paths_resolve_from_the_repo_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)  # "../shared/data/..." is not found from here, so the repo root is tried
    monkeypatch.delenv("HAFEDHO_CACHE_DIR")
    assert load_dataset("femnist").num_classes == 62
