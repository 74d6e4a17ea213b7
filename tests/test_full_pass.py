"""Full-pass algorithms (MimeLite, SCAFFOLD option I, FedSGD with B = infinity): the runtime hands them each
client's whole local data as ``data.full`` beside the round's batches, and their updates match the papers'
formulas on least-squares problems in float64 for mini-batch plans.

The numpy oracles below are the papers' equations written out directly: MimeLite (arXiv:2008.03606,
Algorithm 1, SGDm base): y <- y - eta ((1-beta) g_i(y; batch) + beta m), m <- (1-beta) sum p_i grad f_i(x) + beta m
with grad f_i the gradient over ALL of client i's data; SCAFFOLD option I (arXiv:1910.06378, Algorithm 1):
c_i+ = grad f_i(x) over all local data; FedSGD (arXiv:1602.05629, Section 2): w <- w - eta sum p_k grad F_k(w).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import stack_data
from quadratic import client_updates

from hafedho.algorithms import REGISTRY
from hafedho.algorithms.fedsgd import FedSGD
from hafedho.algorithms.mimelite import MimeLite
from hafedho.algorithms.scaffold import SCAFFOLD
from hafedho.core import ClientData, FunctionalModel, Params, RoundInfo, WeightedMean, full_gradient
from hafedho.data.federated import BatchPlan, FederatedData, plan_indices
from hafedho.models import build_model
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import RoundWork
from hafedho.sim.engines.loop import loop_engine
from hafedho.sim.engines.process import ProcessEngine
from hafedho.sim.engines.vmap import VmapEngine

# ----------------------------------------------------------------------------- least squares in float64

D = 3  # features; a row is [a (D), b]: f_i(w) = mean over rows 1/2 (a . w - b)^2
SIZES = {0: 7.0, 1: 3.0, 2: 12.0}  # unequal; client 1 is smaller than the batch
COHORTS = [[0, 1, 2], [1, 2], [0, 2]]
PLANS = {
    "steps": BatchPlan(local_steps=3, batch_size=5),  # rows drawn twice, rows never drawn, a padded client
    "epoch": BatchPlan(local_steps=0, batch_size=5, local_epochs=1),  # partial last batches
}


class LeastSquares:
    """The ``Model`` protocol for the masked mean of 1/2 (a . w - b)^2 (float64 when the data and w are)."""

    def loss(self, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per = 0.5 * (x[..., :D] @ params["w"] - x[..., D]) ** 2
        return (per * mask).sum() / mask.sum().clamp(min=1.0)


LSQ = LeastSquares()


def lsq_rows(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = {}
    for i, n in SIZES.items():  # heterogeneous: each client its own true w and offset
        a = rng.normal(size=(int(n), D)) + i
        rows[i] = np.concatenate([a, (a @ rng.normal(size=D) + 2.0 * i)[:, None]], axis=1)
    return rows


def round_data(rows: dict[int, np.ndarray], plan: BatchPlan, t: int) -> dict[int, ClientData]:
    """Each client's batches for round t as the runtime plans them (``plan_indices``), plus its whole data."""
    out = {}
    for i, r in rows.items():
        pos, mask = plan_indices(np.random.default_rng([t, i]), len(r), plan)
        n = len(r)
        full = ClientData(torch.from_numpy(r[None]), torch.zeros(1, n, dtype=torch.long), torch.ones(1, n).double())
        x = torch.from_numpy(r[pos])
        out[i] = ClientData(x, torch.zeros(pos.shape, dtype=torch.long), torch.from_numpy(mask).double(), full)
    return out


def grad(w: np.ndarray, r: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Masked-mean gradient of 1/2 (a . w - b)^2 over rows r."""
    mask = np.ones(len(r)) if mask is None else mask
    return (r[:, :D] * ((r[:, :D] @ w - r[:, D]) * mask)[:, None]).sum(0) / max(mask.sum(), 1.0)


def oracle_rounds(alg: str, rows: dict[int, np.ndarray], plan: BatchPlan, hp: dict) -> list[dict[str, np.ndarray]]:
    """The paper's updates, written out in numpy float64, on the same planned batches as the runtime's."""
    x, m, c = np.zeros(D), np.zeros(D), np.zeros(D)
    c_i = {i: np.zeros(D) for i in rows}
    out = []
    for t, cohort in enumerate(COHORTS, start=1):
        batches = {i: (d.x.numpy(), d.mask.numpy()) for i, d in round_data(rows, plan, t).items()}
        n = np.array([SIZES[i] for i in cohort])
        if alg == "fedsgd":
            x = x - hp["lr"] * sum(SIZES[i] * grad(x, rows[i]) for i in cohort) / n.sum()
            out.append({"params": x})
            continue
        deltas, dcs = [], []
        for i in cohort:
            y, k = x.copy(), 0
            for xb, mb in zip(*batches[i], strict=True):
                if mb.sum() == 0:
                    continue
                g = grad(y, xb, mb)
                if alg == "mimelite":
                    y = y - hp["lr"] * ((1 - hp["beta"]) * g + hp["beta"] * m)
                else:
                    y = y - hp["lr"] * (g - c_i[i] + c)
                k += 1
            deltas.append(y - x)
            if alg == "scaffold" and k > 0:
                new = grad(x, rows[i])  # option I: the gradient at x over all local data
                dcs.append(new - c_i[i])
                c_i[i] = new
        if alg == "mimelite":
            full = sum(SIZES[i] * grad(x, rows[i]) for i in cohort) / n.sum()
            x = x + sum(ni * d for ni, d in zip(n, deltas, strict=True)) / n.sum()
            m = (1 - hp["beta"]) * full + hp["beta"] * m
            out.append({"params": x, "m": m})
        else:
            x = x + sum(deltas) / len(cohort)
            c = c + len(cohort) / len(rows) * sum(dcs) / len(cohort)
            out.append({"params": x, "c": c, **{f"c_{i}": c_i[i] for i in rows}})
    return out


def run_alg(alg, rows: dict[int, np.ndarray], plan: BatchPlan) -> list[dict[str, np.ndarray]]:
    init = {"w": torch.zeros(D, dtype=torch.float64)}
    server = alg.init_server(init)
    states = {i: alg.init_client(init) for i in rows}
    out = []
    for t, cohort in enumerate(COHORTS, start=1):
        r = RoundInfo(t, len(rows), len(cohort))
        results = client_updates(
            alg, alg.broadcast(server, r), states, cohort, r, round_data(rows, plan, t), SIZES, LSQ
        )
        agg = WeightedMean()
        for res in results.values():
            agg.add(res.upload, res.weight)
        server, _ = alg.server_update(server, agg.result(like=res.upload), r)  # float64 out, as the runtime does
        got = {"params": server.params["w"].numpy()}
        if hasattr(server, "m"):
            got["m"] = server.m["w"].numpy()
        if hasattr(server, "c"):
            got["c"] = server.c["w"].numpy()
            got.update({f"c_{i}": s.c_i["w"].numpy() for i, s in states.items()})
        out.append(got)
    return out


def gap(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> float:
    """The largest relative difference over every round and every tensor (relative to the tensor's norm)."""
    return max(
        float(np.linalg.norm(x[k] - y[k]) / max(np.linalg.norm(y[k]), 1e-300))
        for x, y in zip(a, b, strict=True)
        for k in y
    )


CASES = [
    ("mimelite", MimeLite, {"lr": 0.05, "beta": 0.7}),
    ("scaffold", SCAFFOLD, {"lr": 0.05, "control": "option1"}),
    ("fedsgd", FedSGD, {"lr": 0.1}),
]


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize(("name", "cls", "hp"), CASES, ids=[c[0] for c in CASES])
def test_least_squares_float64_matches_the_papers_formula(name: str, cls, hp: dict, plan: str) -> None:
    """Three rounds, unequal clients, partial participation, mini-batch plans: the algorithm's server state (and
    SCAFFOLD's c_i) equal the numpy oracle of the paper's equations to float64 rounding (relative 1e-12)."""
    rows = lsq_rows()
    ref = oracle_rounds(name, rows, PLANS[plan], hp)
    got = run_alg(cls(**hp), rows, PLANS[plan])
    assert gap(got, ref) < 1e-12


@pytest.mark.parametrize(
    ("name", "cls", "hp", "old"),
    [
        ("mimelite", MimeLite, {"lr": 0.05, "beta": 0.7}, {"stats": "batches"}),
        ("fedsgd", FedSGD, {"lr": 0.1}, {"batch": "batches"}),
    ],
    ids=["mimelite", "fedsgd"],
)
def test_sampled_rows_forms_are_not_the_paper_on_step_plans(name: str, cls, hp: dict, old: dict) -> None:
    """The named options that take the gradient over the round's sampled rows differ from the paper's update
    on a steps plan (rows drawn twice, rows never drawn), so the check above can tell them apart."""
    rows = lsq_rows()
    ref = oracle_rounds(name, rows, PLANS["steps"], hp)
    assert gap(run_alg(cls(**hp, **old), rows, PLANS["steps"]), ref) > 1e-3


# ----------------------------------------------------------------------------- the runtime's full data


def vector_fed(sizes: tuple[int, ...] = (9, 3, 14, 6), features: int = 12, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    x = rng.normal(size=(total, features)).astype(np.float32)
    y = rng.integers(0, 3, total)
    bounds = np.cumsum((0, *sizes))
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    return FederatedData(x, y, x[:8], y[:8], parts)


def test_full_data_is_every_local_row_once_in_partition_order() -> None:
    """Blocks of B = 4 rows: client sizes 9, 3, 14, 6 give 3, 1, 4, 2 blocks, the last one padded (masked)."""
    fed = vector_fed()
    plan = BatchPlan(local_steps=2, batch_size=4)
    for cid in range(fed.num_clients):
        rows = torch.from_numpy(fed.parts[cid])
        n, blocks = len(rows), -(-len(rows) // 4)
        full = fed.full_data(cid, 4)
        assert full.x.shape == (blocks, 4, 12) and full.y.shape == full.mask.shape == (blocks, 4) and full.full == ()
        real = full.mask.flatten().bool()
        assert real.tolist() == [True] * n + [False] * (4 * blocks - n)
        assert torch.equal(full.x.flatten(0, 1)[real], fed.preprocess(fed.x_train[rows]))
        assert torch.equal(full.y.flatten()[real], fed.y_train[rows])
        assert torch.equal(full.x.flatten(0, 1)[~real], full.x.flatten(0, 1)[n - 1 : n].expand(4 * blocks - n, 12))
        bare, with_full = fed.client_data(0, 1, cid, plan), fed.client_data(0, 1, cid, plan, full=True)
        assert bare.full == () and torch.equal(with_full.full.x, full.x) and torch.equal(with_full.full.mask, full.mask)
        assert torch.equal(bare.x, with_full.x) and torch.equal(bare.mask, with_full.mask)  # the same batches


def test_full_gradient_is_the_one_batch_gradient_whatever_the_blocks() -> None:
    """float64: the blockwise sum_s n_s grad f_s / sum_s n_s equals the gradient of the masked mean over all rows
    as one batch, for blocks of 1, 4 (a partial last block) and all 14 rows; padded blocks change nothing."""
    fed, model = vector_fed(), mlp()
    model.module.double()
    params = {k: v.detach().double() for k, v in model.params().items()}
    one = fed.full_data(2, 14)
    one = ClientData(one.x.double(), one.y, one.mask)
    ref, f_ref = full_gradient(model, params, one)
    for b in (1, 4, 14):
        d = fed.full_data(2, b)
        d = ClientData(d.x.double(), d.y, d.mask)
        bigger = ClientData(torch.zeros(20, b, 12).double(), torch.zeros(20, b, dtype=torch.long), torch.ones(20, b))
        padded = stack_data([d, bigger])  # d grows to 20 blocks, as under vmap beside a larger client
        for data in (d, ClientData(padded.x[0], padded.y[0], padded.mask[0])):
            g, f = full_gradient(model, params, data)
            assert abs(float(f - f_ref)) <= 1e-12 * abs(float(f_ref))
            for k in ref:
                assert float((g[k] - ref[k]).norm()) <= 1e-12 * float(ref[k].norm()), (b, k)


def test_cohort_data_pads_the_whole_local_data_to_the_largest_client() -> None:
    fed = vector_fed()
    plan = BatchPlan(local_steps=0, batch_size=4, local_epochs=1)
    datas = [fed.client_data(0, 1, cid, plan, full=True) for cid in (0, 1, 2)]
    s = fed.cohort_data(0, 1, [0, 1, 2], plan, full=True)
    ref = stack_data(datas)
    leaves = torch.utils._pytree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(s), leaves(ref), strict=True))
    assert s.x.shape == (3, 4, 4, 12) and s.full.x.shape == (3, 4, 4, 12) and s.full.mask.shape == (3, 4, 4)
    assert s.full.mask.sum((1, 2)).tolist() == [9.0, 3.0, 14.0] and s.full.y.dtype == torch.long
    assert torch.equal(s.full.x[1, :1], datas[1].full.x)
    assert torch.equal(s.full.x[1, 1:], datas[1].full.x.expand(3, 4, 12))  # the last block again, masked out
    assert s.full.mask[1, 1:].sum() == 0
    assert fed.cohort_data(0, 1, [0, 1], plan).full == ()


def test_the_loop_engine_hands_the_whole_local_data() -> None:
    """FedSGD's aggregate over a cohort of one client is that client's gradient over all of its rows as one
    batch, however few of them the round's plan draws (one step of 2 rows here)."""
    fed, model = vector_fed(), mlp()
    params = model.params()
    alg, rnd = FedSGD(), RoundInfo(1, 4, 1)
    work = RoundWork(alg, alg.broadcast(alg.init_server(params), rnd), fed, BatchPlan(1, 2), model, rnd, 0)
    out = loop_engine(work, np.array([2]), ClientStore((), fed.num_clients))
    rows = torch.from_numpy(fed.parts[2])
    x, y = fed.preprocess(fed.x_train[rows]), fed.y_train[rows]
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    ref = torch.autograd.grad(model.loss(leaves, x, y, torch.ones(len(rows))), list(leaves.values()))
    assert_near(list(out.aggregate.grad.values()), list(ref))  # blocks of 2 rows against one batch of 14


def mlp() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(build_model("mlp", (12,), 3, hidden=[16]))


# ----------------------------------------------------------------------------- engines and Flower agree

FULL_PASS = [
    pytest.param(MimeLite(lr=0.1, beta=0.5), id="mimelite"),
    pytest.param(SCAFFOLD(lr=0.1, control="option1"), id="scaffold-option1"),
    pytest.param(FedSGD(lr=0.3), id="fedsgd"),
]


def engine_rounds(engine, alg, rounds: int = 2) -> list[torch.Tensor]:
    """Two rounds of the whole cohort on unequal clients (3 rows < B = 4 for client 1) with a steps plan."""
    fed, model = vector_fed(), mlp()
    server = alg.init_server(model.params())
    store = ClientStore(alg.init_client(model.params()), fed.num_clients)
    for t in range(1, rounds + 1):
        cohort = np.arange(fed.num_clients)
        rnd = RoundInfo(t, fed.num_clients, len(cohort))
        work = RoundWork(alg, alg.broadcast(server, rnd), fed, BatchPlan(local_steps=2, batch_size=4), model, rnd, 3)
        server, _ = alg.server_update(server, engine(work, cohort, store).aggregate, rnd)
    return [*torch.utils._pytree.tree_leaves(server), *store.state_dict()]


def assert_near(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Float32 engines differ by rounding only: within 1e-5 of each tensor's norm (~100 float32 ulps)."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert float((a.double() - b.double()).norm()) <= 1e-5 * float(b.double().norm()) + 1e-8


@pytest.mark.parametrize("alg", FULL_PASS)
def test_engines_agree_on_full_pass_algorithms(alg) -> None:
    ref = engine_rounds(loop_engine, alg)
    with ProcessEngine(workers=2) as eng:
        assert_near(engine_rounds(eng, alg), ref)
    assert not mp.active_children()
    with VmapEngine(chunk=3) as eng:  # chunks {0, 1, 2} (full data padded to 4 blocks) and {3}
        assert_near(engine_rounds(eng, alg), ref)


def test_flower_client_hands_the_whole_local_data(tmp_path: Path) -> None:
    """SCAFFOLD option I through the Flower ServerApp/ClientApp equals the simulator bit for bit (the registry
    test covers MimeLite and FedSGD at their defaults, which are full-pass too)."""
    pytest.importorskip("flwr")
    from flower_helpers import LocalGrid, max_abs_diff, simulate

    from hafedho.flower.common import experiment
    from hafedho.flower.strategy import HafedhoStrategy

    overrides = ("algorithm.control='option1'", "rounds=2")
    exp, ref, _ = simulate("scaffold", tmp_path, *overrides)
    assert exp.alg.needs_full_pass
    rc = {"hafedho-config": "smoke", "overrides": " ".join(["algorithm.name=scaffold", *overrides])}
    strategy = HafedhoStrategy(experiment(rc), tmp_path / "flower", node_wait=0.0)
    strategy.prepare()
    grid = LocalGrid(rc, strategy.fed.num_clients)
    strategy.start(grid, strategy.initial_arrays(), num_rounds=2, evaluate_fn=strategy.evaluate_global)
    strategy.finish()
    assert max_abs_diff(ref, strategy.final_params()) == 0.0


def test_every_full_pass_algorithm_is_known() -> None:
    """The registry's full-pass algorithms at their defaults: MimeLite and FedSGD (the papers), not SCAFFOLD
    (option II is its default); no other algorithm pays for the extra pass."""
    defaults = {name: cls().needs_full_pass for name, cls in REGISTRY.items()}
    assert {name for name, full in defaults.items() if full} == {"mimelite", "fedsgd"}
