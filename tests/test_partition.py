"""Tests for hafedho.data.partition and the client facts FederatedData derives from a partition."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hafedho.algorithms.fedavg import FedAvg
from hafedho.core import ClientInfo, FunctionalModel, RoundInfo
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.data.partition import (
    PartitionError,
    dirichlet,
    iid,
    label_skew,
    natural,
    partition_hash,
)
from hafedho.models import build_model
from hafedho.runtime.work import RoundWork

NUM_CLASSES = 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """10 classes x 500 examples, shuffled so class indices interleave."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(NUM_CLASSES), 500))


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64
    assert len(allidx) == n, "some index lost or duplicated"
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "client indices must be strictly increasing"


@pytest.mark.parametrize("q", [0.1, 0.5, 1.0, 100.0])
def test_dirichlet_covers_every_index_once(labels: np.ndarray, q: float) -> None:
    parts = dirichlet(labels, 20, q, seed=0)
    assert len(parts) == 20
    assert_exact_cover(parts, len(labels))


def test_iid_covers_every_index_once_nearly_equal() -> None:
    parts = iid(1003, 10, seed=0)
    assert_exact_cover(parts, 1003)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_natural_covers_and_groups() -> None:
    groups = np.random.default_rng(0).integers(0, 7, size=300)
    groups[:7] = np.arange(7)  # every group non-empty
    parts = natural(groups)
    assert len(parts) == 7
    assert_exact_cover(parts, 300)
    for g, p in enumerate(parts):
        assert np.all(groups[p] == g)


def test_determinism(labels: np.ndarray) -> None:
    a = dirichlet(labels, 20, 0.5, seed=7)
    b = dirichlet(labels, 20, 0.5, seed=7)
    c = dirichlet(labels, 20, 0.5, seed=8)
    assert partition_hash(a) == partition_hash(b)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert partition_hash(a) != partition_hash(c)
    assert partition_hash(iid(500, 5, 1)) == partition_hash(iid(500, 5, 1))
    assert partition_hash(iid(500, 5, 1)) != partition_hash(iid(500, 5, 2))


def test_heterogeneity_falls_as_q_grows(labels: np.ndarray) -> None:
    def mean_skew(q: float) -> float:
        return float(np.mean([label_skew(labels, dirichlet(labels, 20, q, seed=s), NUM_CLASSES) for s in range(4)]))

    low, mid, high = mean_skew(0.1), mean_skew(1.0), mean_skew(100.0)
    assert low > mid > high
    assert high < 0.1  # q = 100 is nearly IID
    assert label_skew(labels, iid(len(labels), 20, 0), NUM_CLASSES) < 0.15


def test_label_skew_extremes() -> None:
    y = np.array([0, 0, 1, 1])
    assert label_skew(y, [np.array([0, 2]), np.array([1, 3])], 2) == pytest.approx(0.0)
    assert label_skew(y, [np.array([0, 1]), np.array([2, 3])], 2) == pytest.approx(0.5)


@pytest.mark.parametrize("q", [0.05, 0.3])
def test_min_size_rule(labels: np.ndarray, q: float) -> None:
    parts = dirichlet(labels, 20, q, seed=3, min_size=50)
    assert min(len(p) for p in parts) >= 50
    assert_exact_cover(parts, len(labels))


def test_bounded_redraws_raise_clearly() -> None:
    # q = 0.001 gives each class to a single client, so at most 10 of 20 clients get
    # data: no draw can reach min_size = 45 (N/n = 50).
    y = np.repeat(np.arange(10), 100)
    start = time.perf_counter()
    with pytest.raises(PartitionError) as err:
        dirichlet(y, 20, 0.001, seed=0, min_size=45, max_redraws=5)
    assert time.perf_counter() - start < 2.0
    msg = str(err.value)
    assert "\n" not in msg
    assert "after 5 draws" in msg and "min_size=45" in msg
    assert "fewer clients" in msg and "data.q" in msg


def test_tiny_q_never_produces_nan_splits() -> None:
    # Shares underflow to exactly 0 at q = 0.001; the partition must stay exact.
    y = np.repeat(np.arange(10), 100)
    for seed in range(20):
        assert_exact_cover(dirichlet(y, 10, 0.001, seed=seed, min_size=0), 1000)


def test_impossible_min_size_fails_before_drawing() -> None:
    with pytest.raises(PartitionError, match="only 100"):
        dirichlet(np.zeros(100, dtype=int), 20, 1.0, seed=0, min_size=10)


@pytest.mark.parametrize("q", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_q(q: float) -> None:
    with pytest.raises(PartitionError, match=r"data\.q must be > 0"):
        dirichlet(np.arange(100) % 2, 2, q, seed=0)


def test_invalid_inputs() -> None:
    with pytest.raises(PartitionError, match="num_clients"):
        dirichlet(np.arange(100) % 2, 0, 1.0, seed=0)
    with pytest.raises(PartitionError, match="1-D integer"):
        dirichlet(np.zeros((10, 2), dtype=int), 2, 1.0, seed=0, min_size=1)
    with pytest.raises(PartitionError, match="1-D integer"):
        dirichlet(np.zeros(100), 2, 1.0, seed=0)
    with pytest.raises(PartitionError, match="empty clients"):
        iid(3, 5, seed=0)


def test_natural_empty_group_raises() -> None:
    with pytest.raises(PartitionError, match=r"group id\(s\) 1 have no examples"):
        natural(np.array([0, 2, 2, 0]))


def test_partition_hash_stable_and_sensitive() -> None:
    parts = [np.array([0, 2, 4]), np.array([1, 3])]
    h = partition_hash(parts)
    assert h == partition_hash([np.array([0, 2, 4], dtype=np.int32), np.array([1, 3])])
    assert len(h) == 16 and int(h, 16) >= 0
    moved = [np.array([0, 2]), np.array([1, 3, 4])]  # one index moved
    assert partition_hash(moved) != h
    assert partition_hash(parts[::-1]) != h  # client order matters


# ----------------------------------------------------------------------------- FederatedData.client_info


def _fed(sizes: list[int], **kw: object) -> FederatedData:
    x = np.random.default_rng(0).random((sum(sizes), 5)).astype(np.float32)
    y = np.arange(sum(sizes)) % 3
    parts = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    return FederatedData(x, y, x[:4], y[:4], parts, **kw)  # type: ignore[arg-type]


SIZES = [3, 7, 11]  # p_i = 3/21, 7/21, 11/21: not exact in binary, so float32 and float64 roundings differ


def test_client_info_is_built_in_the_requested_dtype() -> None:
    fed32, fed64 = _fed(SIZES), _fed(SIZES, dtype=torch.float64)
    for cid, n in enumerate(SIZES):
        p32, p64 = fed32.client_info(cid), fed64.client_info(cid)
        assert p32.weight.dtype == p32.num_examples.dtype == torch.float32  # the CLI pipeline: unchanged
        assert p32.weight.item() == float(np.float32(n / 21))
        assert p64.weight.dtype == p64.num_examples.dtype == torch.float64
        assert p64.weight.item() == n / 21 and p64.num_examples.item() == n  # exactly, in float64
        assert p64.weight.item() != p32.weight.item()
        assert fed32.client_info(cid, dtype=torch.float64).weight.item() == n / 21


def test_float64_model_gets_float64_p_i_and_inputs_through_round_work() -> None:
    seen: list[tuple[ClientInfo, torch.dtype]] = []

    class Spy(FedAvg):
        def client_update(self, msg, state, data, info, rnd, model):  # type: ignore[override]
            seen.append((info, data.x.dtype))
            return super().client_update(msg, state, data, info, rnd, model)

    fed = _fed(SIZES, mean=(0.5,), std=(0.25,), dtype=torch.float64)
    torch.manual_seed(0)
    model = FunctionalModel(build_model("logreg", fed.input_shape, 3).double())
    alg, rnd = Spy(), RoundInfo(1, fed.num_clients, fed.num_clients)
    msg = alg.broadcast(alg.init_server(model.params()), rnd)
    work = RoundWork(alg, msg, fed, BatchPlan(local_steps=2, batch_size=4), model, rnd, 0)
    for cid in range(fed.num_clients):
        res = work.client_update(cid, None)
        assert all(v.dtype == torch.float64 for v in res.upload.delta.values())
    for (info, x_dtype), n in zip(seen, SIZES, strict=True):
        assert info.weight.dtype == torch.float64 and info.weight.item() == n / 21 and x_dtype == torch.float64
    raw = fed.x_train[:4].double()
    torch.testing.assert_close(fed.preprocess(fed.x_train[:4]), (raw - 0.5) / 0.25, rtol=0, atol=0)
