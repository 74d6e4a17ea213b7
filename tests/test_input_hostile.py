"""Hostile inputs (issue 33): each is refused in one line, or read back equal, never a silent wrong number."""

from __future__ import annotations

import os
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from hafedho.cli import main
from hafedho.config import load_config
from hafedho.core.algorithm import ConfigError, FedAlgorithm
from hafedho.core.seeds import PURPOSES, seed_for
from hafedho.data import cache
from hafedho.data.safe_pickle import DataError
from hafedho.data.sources import Dataset, load_dataset
from hafedho.runtime.work import CohortStream
from hafedho.toml_io import dump_toml, parse_override


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAFEDHO_CACHE_DIR", str(tmp_path / "cache"))
    cache._MEMO.clear()


# ----------------------------------------------------------------------------- overrides and written configs


@pytest.mark.parametrize("text", ["data.q=0.2\nseed=5", "name=a\x1bb", "seed=1\r", "x\t=1"])
def test_override_with_a_control_character_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"holds control character\(s\)") as e:
        parse_override(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["=3", " =3", "a..b=1", ".a=1"])
def test_override_without_a_key_names_it(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"override {text!r}: no key.*write KEY=VALUE"):
        parse_override(text)


@pytest.mark.parametrize(
    "override", ["name=a\nb", "name=x\x1b[31m", "out=runs\n", "data.path=d\x07.npz", "log.tensorboard=tb\x00"]
)
def test_control_characters_in_names_and_paths_are_refused(override: str) -> None:
    key, value = override.split("=", 1)
    node: dict = {}
    leaf = node
    for part in key.split(".")[:-1]:
        leaf = leaf.setdefault(part, {})
    leaf[key.split(".")[-1]] = value
    from hafedho.config import config_from_table

    with pytest.raises(ConfigError, match=rf"^{key}=.*holds control character\(s\)"):
        config_from_table(node)


def test_written_strings_read_back_equal() -> None:
    odd = 'a\nb\tc\x1b[0m\x00\x7f\x85 \\ " é ☃'
    table = {"name": odd, "data": {"path": odd, "options": {"k": [odd, "plain"]}}, "algorithm": {odd: odd}}
    text = dump_toml(table)
    assert "\x1b" not in text and "\x00" not in text and text.count("\n") < 12
    assert tomllib.loads(text) == table


# ----------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("seed", [0, 5, 2**32 - 1])
def test_seeds_below_two_to_32_keep_their_streams(seed: int) -> None:
    """Committed runs do not move: the words hashed below 2**32 are the ones always hashed."""
    import zlib

    tag = zlib.crc32(b"cohort")
    ss = np.random.SeedSequence([seed, tag, 3])
    assert seed_for(seed, "cohort", 3) == int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


@pytest.mark.parametrize("high", [1, 2, 2**31, 2**32 - 1, 2**32, 2**40])
def test_large_seeds_never_share_a_stream_with_a_smaller_one(high: int) -> None:
    for purpose in PURPOSES:
        for low in (0, 7):
            parts = (1, 2)[: {"cohort": 1}.get(purpose, 2 if purpose in ("batches", "client_torch") else 0)]
            assert seed_for(low + high * 2**32, purpose, *parts) != seed_for(low, purpose, *parts)


def test_sweep_seed_count_is_capped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "table1", "--seeds", "1000000000", "--dry-run"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--seeds 1000000000: at most 10,000" in err and "\n" not in err


# ----------------------------------------------------------------------------- labels and inputs


def _npz(path: Path, x: np.ndarray, y: np.ndarray, xt: np.ndarray | None = None, yt: np.ndarray | None = None) -> str:
    np.savez(path, x_train=x, y_train=y, x_test=x[:4] if xt is None else xt, y_test=y[:4] if yt is None else yt)
    return str(path)


def test_stray_large_label_is_refused_naming_file_and_label(tmp_path: Path) -> None:
    y = np.arange(200) % 10
    y[3] = 99999
    p = _npz(tmp_path / "d.npz", np.zeros((200, 3)), y)
    with pytest.raises(DataError, match=r"d\.npz: y_train label 99999 makes 100,000 classes, more than its 200 rows"):
        load_dataset("npz", p)
    y[3] = 2**40
    p = _npz(tmp_path / "e.npz", np.zeros((200, 3)), y)
    with pytest.raises(DataError, match="label 1099511627776"):
        load_dataset("npz", p)


def test_declared_class_count_beyond_the_bound_is_refused() -> None:
    x, y = np.zeros((4, 2), np.float32), np.array([0, 1, 0, 1])
    with pytest.raises(DataError, match=r"2,000,000 classes .* beyond 1,048,576"):
        Dataset("d", x, y, x, y, 2_000_000)


def test_empty_classes_warn_naming_how_many(tmp_path: Path) -> None:
    y = np.arange(400) % 10
    y[5] = 299
    p = _npz(tmp_path / "d.npz", np.zeros((400, 3)), y)
    with pytest.warns(UserWarning, match=r"289 of 300 classes have no training example"):
        load_dataset("npz", p)


def test_complex_inputs_are_refused(tmp_path: Path) -> None:
    p = _npz(tmp_path / "c.npz", np.ones((8, 3), np.complex64) * 1j, np.arange(8) % 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before NumPy's cast warns
        with pytest.raises(DataError, match=r"c\.npz: the train split's inputs are complex \(complex64\)"):
            load_dataset("npz", p)


def test_one_class_training_data_is_refused(tmp_path: Path) -> None:
    p = _npz(tmp_path / "one.npz", np.zeros((8, 3)), np.full(8, 3), yt=np.array([3, 3, 3, 3]))
    with pytest.raises(DataError, match=r"every training label is 3 \(one class\)"):
        load_dataset("npz", p, num_classes=5)


def test_boolean_leaf_label_is_refused(tmp_path: Path) -> None:
    import json

    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        doc = {"users": ["w"], "user_data": {"w": {"x": [[0.0] * 784] * 3, "y": [0, 1, True]}}}
        (tmp_path / split / "a.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"writer w has a boolean label"):
        load_dataset("femnist", str(tmp_path), cache=False)


# ----------------------------------------------------------------------------- decoded-data cache


def test_cache_serves_new_content_after_an_in_place_edit_keeping_size_and_mtime(tmp_path: Path) -> None:
    """A builder memoised through ``cache.cached``: an edit that keeps size and mtime is decoded afresh."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"a" * 1000)
    st = src.stat()

    def build() -> dict[str, np.ndarray]:
        return {"x": np.frombuffer(src.read_bytes(), np.uint8).copy()}

    first, _ = cache.cached("test", src, "", build)
    assert cache.cached("test", src, "", build)[1]  # a hit
    src.write_bytes(b"b" * 1000)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    second, hit = cache.cached("test", src, "", build)
    assert not hit and first["x"][0] == ord("a") and second["x"][0] == ord("b")


# ----------------------------------------------------------------------------- client weights and uploads


class _Alg(FedAlgorithm):
    pass


def _stream(size: int = 3) -> CohortStream:
    return CohortStream(_Alg(), size)


@pytest.mark.parametrize("weights", [[0.0, 0.0], [1.0, -1.0], [-1.0, -2.0], [1.0, float("nan")]])
def test_bad_client_weights_are_refused(weights: list[float]) -> None:
    s = _stream()
    for w in weights:
        s.add({"w": torch.ones(2)}, torch.tensor(w), {})
    with pytest.raises(ConfigError, match=r"algorithm _Alg: client weights must be finite and non-negative"):
        s.result()


def test_bad_stacked_weights_are_refused() -> None:
    s = _stream()
    s.add_stacked({"w": torch.ones(2, 3)}, torch.tensor([1.0, -1.0]), {})
    with pytest.raises(ConfigError, match="non-negative"):
        s.result()


def test_good_weights_pass() -> None:
    s = _stream()
    s.add({"w": torch.ones(2)}, torch.tensor(0.0), {})
    s.add({"w": torch.full((2,), 3.0)}, torch.tensor(2.0), {})
    torch.testing.assert_close(s.result().aggregate["w"], torch.full((2,), 3.0))


def test_upload_of_another_shape_is_refused() -> None:
    s = CohortStream(_Alg(), 2, like={"w": torch.zeros(10, 64)})
    with pytest.raises(
        ConfigError, match=r"upload leaf \['w'\] is torch.float32\[10, 1\], expected torch.float32\[10, 64\]"
    ):
        s.add({"w": torch.zeros(10, 1)}, torch.tensor(1.0), {})
    s = CohortStream(_Alg(), 2, like={"w": torch.zeros(10, 64)})
    with pytest.raises(ConfigError, match=r"expected torch.float32\[10, 64\]"):
        s.add_stacked({"w": torch.zeros(3, 20, 64)}, torch.ones(3), {})


def test_upload_missing_a_key_is_refused() -> None:
    s = CohortStream(_Alg(), 2, like={"a": torch.zeros(2), "b": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"a client's upload lacks \['b'\]"):
        s.add({"a": torch.zeros(2)}, torch.tensor(1.0), {})


def test_uploads_of_one_round_must_agree_without_a_template() -> None:
    s = _stream()
    s.add({"w": torch.zeros(10, 64)}, torch.tensor(1.0), {})
    with pytest.raises(ConfigError, match=r"is torch.float32\[10, 1\], expected torch.float32\[10, 64\]"):
        s.add({"w": torch.zeros(10, 1)}, torch.tensor(1.0), {})


def test_config_with_large_seed_loads() -> None:
    assert load_config(None, [f"seed={2**40}"]).seed == 2**40


# ----------------------------------------------------------------------------- data readers (issue 33, part 2)


def test_relative_path_missing_in_the_working_directory_is_not_read_from_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative data.path the user typed is relative to the working directory only, never the source checkout."""
    from hafedho.data import dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "root" / "d").mkdir(parents=True)
    _npz(tmp_path / "root" / "d" / "x.npz", np.zeros((8, 3)), np.arange(8) % 2)
    monkeypatch.setattr(dataset, "_REPO_ROOT", tmp_path / "root")  # the file exists relative to the "checkout"
    with pytest.raises(DataError, match=r"^npz data not found: d/x\.npz \(looked for .*/d/x\.npz") as e:
        load_dataset("npz", "d/x.npz")
    assert str(tmp_path / "d" / "x.npz") in str(e.value) and "\n" not in str(e.value)
    monkeypatch.chdir(tmp_path / "root")
    assert load_dataset("npz", "d/x.npz").num_classes == 2  # found where it is given


def test_a_sources_own_default_path_still_falls_back_to_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hafedho.data import dataset
    from hafedho.data.sources import SOURCES, Source

    (tmp_path / "root" / "d").mkdir(parents=True)
    _npz(tmp_path / "root" / "d" / "x.npz", np.zeros((8, 3)), np.arange(8) % 2)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(dataset, "_REPO_ROOT", tmp_path / "root")
    npz = SOURCES["npz"]
    monkeypatch.setitem(SOURCES, "npz", Source("npz", npz.description, "d/x.npz", npz.load))
    assert load_dataset("npz").num_classes == 2
    monkeypatch.setitem(SOURCES, "npz", Source("npz", npz.description, "d/y.npz", npz.load))
    with pytest.raises(DataError, match=r"^npz: its default data d/y\.npz is not here \(looked for .*cwd/d/y\.npz and"):
        load_dataset("npz")


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (IHDR, its CRC fixed) claims ``width`` x ``height``: a decompression bomb's header."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


def test_decompression_bomb_image_is_refused_in_one_line(tmp_path: Path) -> None:
    from fixtures_data import folder_images, write_image_folder

    imgs = folder_images(["a", "b"], {"train": 1, "test": 1}, size=(4, 4))
    path = write_image_folder(imgs, tmp_path / "set", extra={"train/b/bomb.png": _png_claiming(30000, 30000)})
    with pytest.raises(DataError, match=r"train/b/bomb\.png is too large to decode: 900,000,000 pixels") as e:
        load_dataset("imagefolder", str(path), cache=False)
    assert "\n" not in str(e.value)


def test_image_over_pils_warning_limit_is_refused_not_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fixtures_data import folder_images, write_image_folder
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # 16 pixels: over the limit, under twice it: PIL only warns
    path = write_image_folder(folder_images(["a", "b"], {"train": 1, "test": 1}, size=(4, 4)), tmp_path / "set")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match=r"0000\.png is too large to decode: 16 pixels, more than .* 10"):
            load_dataset("imagefolder", str(path), cache=False)


class _Reduce:
    """Pickles as ``fn(*args)``, with ``state`` set on the result: a hand-made hostile pickle."""

    def __init__(self, fn: object, args: tuple, state: object = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self) -> tuple:
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _reconstruct() -> object:
    from numpy._core.multiarray import _reconstruct as r

    return r


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda: _Reduce(_reconstruct(), (np.ndarray, (10**13,), b"b")), id="reconstruct"),
        pytest.param(lambda: _Reduce(np.ndarray, ((10**6, 10**7), "u1")), id="ndarray"),
        pytest.param(lambda: _Reduce(bytearray, (10**13,)), id="bytearray"),
    ],
)
def test_pickle_declaring_a_huge_array_is_refused_before_allocating(tmp_path: Path, payload: object) -> None:
    import pickle

    from hafedho.data.safe_pickle import safe_load

    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({"data": payload()}, protocol=2))
    with pytest.raises(DataError, match=rf"refusing to unpickle {p}: it declares 10,000,000,000,000 .*could hold") as e:
        safe_load(p)
    assert "\n" not in str(e.value)
    with open(p, "rb") as f, pytest.raises(DataError, match=r"in\.tar:x: it declares 10,000,000,000,000"):
        safe_load(f, name="in.tar:x")  # a file object (a tar member): its size is measured too


def test_pickle_with_an_object_array_is_refused(tmp_path: Path) -> None:
    import pickle

    from hafedho.data.safe_pickle import safe_load

    bomb = _Reduce(_reconstruct(), (np.ndarray, (0,), b"b"), (1, (10**13,), np.dtype("O"), False, [1]))
    p = tmp_path / "test_batch"
    p.write_bytes(pickle.dumps({"data": bomb}, protocol=2))
    with pytest.raises(DataError, match=rf"refusing to unpickle {p}: it holds a numpy object array"):
        safe_load(p)


def test_cifar_pickle_bomb_is_one_line_through_the_loader(tmp_path: Path) -> None:
    import pickle

    (tmp_path / "cifar-100-python").mkdir()
    bomb = {"data": _Reduce(_reconstruct(), (np.ndarray, (10**13,), b"b")), "fine_labels": [0]}
    for name in ("train", "test"):
        (tmp_path / "cifar-100-python" / name).write_bytes(pickle.dumps(bomb, protocol=2))
    with pytest.raises(DataError, match=r"cifar-100-python/test: it declares 10,000,000,000,000 elements"):
        load_dataset("cifar100", str(tmp_path))


def test_leaf_json_nested_too_deep_is_one_line(tmp_path: Path) -> None:
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "a.json").write_text('{"user_data": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(DataError, match=r"LEAF JSON file .*a\.json is nested too deeply to read") as e:
        load_dataset("femnist", str(tmp_path), cache=False)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the report's metric values


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ('"high"', r"test/acc at round 2 is 'high', not a number"),
        ("true", r"test/acc at round 2 is True, not a number"),
        ("5.0", r"test/acc 5\.0 at round 2 is outside \[0, 1\]"),
        ("-3.0", r"test/acc -3\.0 at round 2 is outside \[0, 1\]"),
    ],
)
def test_a_run_with_a_bad_metric_value_is_left_out_of_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, why: str
) -> None:
    import re

    from helpers import run_smoke

    runs, rep = tmp_path / "runs", tmp_path / "rep"
    for seed in (0, 1):
        assert run_smoke(runs, f"seed={seed}", "rounds=2", "eval_every=1") == 0
    (bad,) = [p for p in runs.iterdir() if p.name.endswith("-s1")]
    text = (bad / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    assert '"test/acc": ' in lines[1]
    lines[1] = re.sub(r'"test/acc": [^,}]+', f'"test/acc": {value}', lines[1])
    (bad / "metrics.jsonl").write_text("".join(lines))
    capsys.readouterr()
    assert main(["report", str(runs), "--out", str(rep)]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"warning: left out {bad.name}: {bad.name}/metrics\.jsonl: {why}", err), err
    assert "Traceback" not in err
    md = (rep / "results.md").read_text()
    assert "| left out (bad metrics.jsonl) | 1 |" in md and "| done | 1 |" in md


def test_a_loader_returning_lists_is_one_line() -> None:
    """A user loader that builds its Dataset from Python lists gets the field and the fix, not an AttributeError."""
    from hafedho.data.dataset import Dataset
    from hafedho.data.safe_pickle import DataError

    x, y = np.zeros((2, 2), np.float32), np.array([0, 1])
    with pytest.raises(DataError, match=r"^mine: x_train is a list, not a NumPy array; return np\.asarray"):
        Dataset("mine", [[0.0, 1.0], [1.0, 0.0]], y, x, y, 2)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"^mine: y_test is a list"):
        Dataset("mine", x, y, x, [0, 1], 2)  # type: ignore[arg-type]
    assert Dataset("mine", x, y, x, y, 2).num_classes == 2
