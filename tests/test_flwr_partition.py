"""data.partition = "flwr:<Partitioner>": our index sets are flwr-datasets' own, reached without our code path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import flwr_datasets.partitioner as fp
import numpy as np
import pytest
from helpers import run_smoke, smoke_config

from hafedho.config import ConfigError, load_config
from hafedho.data.flwr_partition import flwr_partition
from hafedho.data.partition import PartitionError, label_skew, partition_hash

N, SEED = 10, 7
LABELS = np.random.default_rng(3).integers(0, 10, 2000)


def reference(name: str, labels: np.ndarray, seed: int, **options: Any) -> list[set[int]]:
    """flwr-datasets called directly: a labels-only Dataset shuffled as FederatedDataset does, then partitioned."""
    ds = datasets.Dataset.from_dict({"index": list(range(len(labels))), "label": labels.tolist()})
    ds = ds.shuffle(seed=seed)
    cls = getattr(fp, name)
    extra = {"num_partitions": N, "partition_by": "label", "seed": seed}
    p = cls(**{k: v for k, v in extra.items() if k in cls.__init__.__code__.co_varnames}, **options)
    p.dataset = ds
    return [set(p.load_partition(i)[:]["index"]) for i in range(N)]


SLOW = pytest.mark.slow  # more options of a partitioner already covered: `pytest -m slow tests/test_flwr_partition.py`
CASES = [
    pytest.param("DirichletPartitioner", {"alpha": 0.3, "min_partition_size": 10, "self_balancing": False}, id="dir"),
    pytest.param(
        "DirichletPartitioner", {"alpha": 0.3, "min_partition_size": 50, "self_balancing": True}, id="dir-bal"
    ),
    pytest.param(
        "DirichletPartitioner",
        {"alpha": 1.0, "min_partition_size": 0, "self_balancing": True, "shuffle": False},
        id="dir-noshuffle",
        marks=SLOW,
    ),
    pytest.param("IidPartitioner", {}, id="iid"),
    pytest.param("PathologicalPartitioner", {"num_classes_per_partition": 2}, id="patho"),
    pytest.param(
        "PathologicalPartitioner",
        {"num_classes_per_partition": 3, "class_assignment_mode": "first-deterministic"},
        id="patho-first",
        marks=SLOW,
    ),
    pytest.param("ShardPartitioner", {"num_shards_per_partition": 2}, id="shard"),
]


@pytest.mark.parametrize(("name", "options"), CASES)
def test_index_sets_equal_flwr_datasets(name: str, options: dict[str, Any]) -> None:
    ours = flwr_partition(f"flwr:{name}", LABELS, N, SEED, options)
    assert [set(p.tolist()) for p in ours] == reference(name, LABELS, SEED, **options)
    assert all(np.all(np.diff(p) > 0) and p.dtype == np.int64 for p in ours)  # canonical: sorted int64
    other = flwr_partition(f"flwr:{name}", LABELS, N, SEED + 1, options)
    assert partition_hash(other) != partition_hash(ours)  # the seed reaches the shuffle and the partitioner


def test_alpha_and_min_size_default_to_q_and_min_size() -> None:
    ours = flwr_partition("flwr:DirichletPartitioner", LABELS, N, SEED, {}, q=0.2, min_size=30)
    assert [set(p.tolist()) for p in ours] == reference(
        "DirichletPartitioner", LABELS, SEED, alpha=0.2, min_partition_size=30
    )


def test_same_as_federated_dataset(tmp_path: Path, no_network: None) -> None:
    """FederatedDataset itself, on the labels written to a local parquet file (its shuffle, then the partitioner)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from flwr_datasets import FederatedDataset

    path = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"index": np.arange(len(LABELS)), "label": LABELS}), path)
    part = fp.DirichletPartitioner(num_partitions=N, partition_by="label", alpha=0.5, seed=SEED)
    fds = FederatedDataset(
        dataset="parquet", data_files=str(path), partitioners={"train": part}, seed=SEED, cache_dir=str(tmp_path)
    )
    want = [set(fds.load_partition(i)[:]["index"]) for i in range(N)]
    got = flwr_partition("flwr:DirichletPartitioner", LABELS, N, SEED, {"alpha": 0.5})
    assert [set(p.tolist()) for p in got] == want


def test_natural_ids_by_group_equal_our_natural_partition() -> None:
    groups = np.random.default_rng(0).integers(0, 6, len(LABELS))
    got = flwr_partition("flwr:NaturalIdPartitioner", LABELS, 6, SEED, {"partition_by": "group"}, groups=groups)
    assert [p.tolist() for p in got] == [np.flatnonzero(groups == g).tolist() for g in range(6)]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_never_touches_the_network(no_network: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    parts = flwr_partition("flwr:ShardPartitioner", LABELS, N, SEED, {"num_shards_per_partition": 4})  # 40 shards of 50
    assert sum(len(p) for p in parts) == len(LABELS)

    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert datasets.config.HF_HUB_OFFLINE is True


@pytest.mark.parametrize(
    ("name", "options", "n", "message"),
    [
        ("Nope", {}, N, r"unknown partitioner; choose one of .*DirichletPartitioner, .*IidPartitioner"),
        ("Partitioner", {}, N, r"unknown partitioner"),
        ("VerticalEvenPartitioner", {}, N, r"unknown partitioner"),
        (
            "DirichletPartitioner",
            {"alfa": 1},
            N,
            r"^data.partition_options.alfa: DirichletPartitioner has no such "
            r"option; valid: partition_by, alpha, min_partition_size, self_balancing, shuffle$",
        ),
        ("DirichletPartitioner", {"seed": 1}, N, r"^data.partition_options.seed: set by hafedho; use data.partition_"),
        ("IidPartitioner", {"num_partitions": 3}, N, r"use data.num_clients instead$"),
        ("PathologicalPartitioner", {}, N, r"needs data.partition_options.num_classes_per_partition"),
        ("DirichletPartitioner", {"partition_by": "writer"}, N, r"partition_by='writer': use 'label' \(this source"),
        ("DirichletPartitioner", {"alpha": 1e-3, "min_partition_size": 290}, N, r"max number of attempts \(10\)"),
        ("DirichletPartitioner", {"alpha": 1e-3, "min_partition_size": 0}, N, r"left \d+ client\(s\) empty \(first"),
        ("NaturalIdPartitioner", {}, 4, r"this source has no natural client ids .* use data.partition='dirichlet'"),
    ],
)
def test_refusals_are_one_line(name: str, options: dict[str, Any], n: int, message: str) -> None:
    with pytest.raises(PartitionError, match=message) as e:
        flwr_partition(f"flwr:{name}", LABELS, n, SEED, options, q=0.3, min_size=10)
    assert "\n" not in str(e.value)


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)  # import fails as if not installed
    with pytest.raises(PartitionError, match=r"needs flwr-datasets; pip install 'hafedho\[datasets\]'$"):
        flwr_partition("flwr:IidPartitioner", LABELS, N, SEED)


def test_config_accepts_the_prefix_and_keeps_options_to_it() -> None:
    cfg = load_config(None, ["data.partition='flwr:DirichletPartitioner'", "data.partition_options={alpha=0.5}"])
    assert cfg.data.partition == "flwr:DirichletPartitioner" and cfg.data.partition_options == {"alpha": 0.5}
    with pytest.raises(ConfigError, match=r"^data.partition='dirichlet2': choose one of 'dirichlet', 'iid', 'nat"):
        load_config(None, ["data.partition=dirichlet2"])
    with pytest.raises(ConfigError, match=r"^data.partition='flwr:': choose one of"):
        load_config(None, ["data.partition='flwr:'"])
    with pytest.raises(ConfigError, match=r"^data.partition_options: only for data.partition='flwr:<Partitioner>'"):
        load_config(None, ["data.partition_options={alpha=0.5}"])


def test_importing_hafedho_does_not_import_flwr_datasets() -> None:
    code = "import sys, hafedho.experiment, hafedho.cli; assert not {'flwr_datasets', 'datasets'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_smoke_run_writes_hash_and_label_skew(tmp_path: Path) -> None:
    opts = ["data.partition='flwr:DirichletPartitioner'", "data.partition_options={alpha=0.5, self_balancing=true}"]
    assert run_smoke(tmp_path, *opts) == 0
    (path,) = tmp_path.glob("*/partition.json")
    got = json.loads(path.read_text())
    cfg = smoke_config(tmp_path, *opts)
    from hafedho.data.sources import load_dataset

    ds = load_dataset(cfg.data.source, cfg.data.path)
    parts = flwr_partition(
        cfg.data.partition, ds.y_train, cfg.data.num_clients, cfg.seed, {"alpha": 0.5, "self_balancing": True}
    )
    assert got["hash"] == partition_hash(parts)
    assert got["sizes"] == [len(p) for p in parts]
    assert got["label_skew"] == pytest.approx(label_skew(ds.y_train, parts, ds.num_classes), abs=0)
    assert got["label_skew"] > 0.1  # alpha 0.5: clearly skewed, unlike an IID split
