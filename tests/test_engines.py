"""Engines: every engine agrees with the reference ``loop`` on every registered algorithm, and the process
pool is deterministic, streams errors back and never leaks workers."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import SMOKE, stack_data
from tolerance import fp32_close, longest_reduction, smooth, smooth_functional_relu
from torch import nn

from hafedho.algorithms import REGISTRY
from hafedho.algorithms.fedavg import Broadcast, FedAvg
from hafedho.config import Config, load_config
from hafedho.core import ClientData, ClientInfo, ClientResult, ConfigError, FunctionalModel, RoundInfo, hp
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.engine_registry import ENGINES, OPTIONS
from hafedho.experiment import build
from hafedho.models import build_model, cnn
from hafedho.runfiles import read_metrics
from hafedho.runtime import work as base
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import RoundWork
from hafedho.sim.engines.loop import LoopEngine, loop_engine
from hafedho.sim.engines.make import AutoEngine, auto_choice, engine_for, make_engine
from hafedho.sim.engines.process import ProcessEngine, WorkerError, dumps, loads
from hafedho.sim.engines.vmap import VmapEngine
from hafedho.sim.runner import Divergence, run

CONTRACT = [
    "rounds=3",
    "eval_every=3",
    "checkpoint_every=3",
    "model.name='mlp'",
    "model.options={hidden=[32]}",
    "sampling.cohort_size=4",
    "clients.local_epochs=1",  # unequal step counts: vmap pads with no-op steps
]


def final_state(tmp: Path, alg: str, *overrides: str) -> list[torch.Tensor]:
    """Server state and client store after three rounds of the smoke experiment (mlp on digits, smoothed: a
    ReLU kink would turn a rounding difference into an O(1) one, see tests/tolerance.py)."""
    cfg = load_config(SMOKE, [f"algorithm.name={alg}", *CONTRACT, *overrides])
    cfg.out = str(tmp)
    exp = build(cfg)
    smooth(exp.model.module)
    run(exp, tmp / "run", progress=False)
    ckpt = torch.load(tmp / "run" / "checkpoint.pt", weights_only=True)
    return ckpt["server"] + ckpt["store"]


_LOOP: dict[str, list[torch.Tensor]] = {}


def loop_state(tmp: Path, alg: str) -> list[torch.Tensor]:
    if alg not in _LOOP:
        _LOOP[alg] = final_state(tmp / "loop", alg, "engine='loop'")
    return _LOOP[alg]


@functools.cache
def contract_bounds() -> dict[str, int]:
    """The contract experiment's longest reduction and its sequential steps (rounds x (local steps + 1))."""
    exp = build(load_config(SMOKE, CONTRACT))
    lam = max(exp.plan.steps_for(int(n)) for n in exp.fed.sizes)
    x = exp.fed.preprocess(exp.fed.x_train[: exp.cfg.clients.batch_size])
    return {"reduction": longest_reduction(exp.model.module, x), "steps": exp.cfg.rounds * (lam + 1)}


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool = False) -> None:
    """Equal bit for bit (``exact``), else up to float32 rounding of the contract experiment (tests/tolerance.py)."""
    assert len(a) == len(b)
    if exact:
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    else:
        fp32_close(a, b, **contract_bounds(), what="final state")


ENGINE_CASES = [("process", "workers=2"), ("vmap", "vmap_chunk=3")]  # chunk 3 of 4: a short last chunk


def contract_cases() -> list[Any]:
    cases = []
    for alg in sorted(REGISTRY):  # the registry grows: every algorithm is checked the moment it is registered
        for engine, option in ENGINE_CASES:
            cases.append(pytest.param(alg, engine, option, id=f"{alg}-{engine}"))
    return cases


@pytest.mark.parametrize(("alg", "engine", "option"), contract_cases())
def test_engine_matches_loop_after_three_rounds(tmp_path: Path, alg: str, engine: str, option: str) -> None:
    ref = loop_state(tmp_path, alg)
    got = final_state(tmp_path / engine, alg, f"engine='{engine}'", option)
    assert_close(got, ref)
    assert not mp.active_children(), "the run left worker processes behind"


def test_process_results_do_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    one = final_state(tmp_path / "one", "hafedho", "engine='process'", "workers=1")
    three = final_state(tmp_path / "three", "hafedho", "engine='process'", "workers=3")
    assert_close(one, three, exact=True)


def test_auto_engine_runs_and_matches_loop(tmp_path: Path) -> None:
    ref = loop_state(tmp_path, "fedavg")
    assert_close(final_state(tmp_path / "auto", "fedavg", "engine='auto'"), ref)


# ----------------------------------------------------------------------------- engine-level fixtures


def image_fed(num_clients: int = 4, n: int = 24, side: int = 28, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (num_clients * n, 1, side, side), dtype=np.uint8)
    y = rng.integers(0, 10, num_clients * n)
    parts = [np.arange(i * n, (i + 1) * n - 3 * i) for i in range(num_clients)]  # unequal sizes
    return FederatedData(x, y, x[:8], y[:8], parts)


def run_rounds(engine: Any, alg: Any, fed: FederatedData, model: FunctionalModel, rounds: int = 2) -> tuple:
    """A bare round loop (no run directory): the final server state, store leaves and last metrics."""
    server = alg.init_server(model.params())
    store = ClientStore(alg.init_client(model.params()), fed.num_clients)
    plan = BatchPlan(local_steps=2, batch_size=4)
    out = None
    for t in range(1, rounds + 1):
        cohort = np.arange(fed.num_clients)
        rnd = RoundInfo(t, fed.num_clients, len(cohort))
        out = engine(RoundWork(alg, alg.broadcast(server, rnd), fed, plan, model, rnd, 7), cohort, store)
        server, _ = alg.server_update(server, out.aggregate, rnd)
    return server, store, out


def conv_model(name: str) -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(build_model(name, (1, 28, 28), 10))


@pytest.mark.parametrize("name", ["lenet5", "femnist_cnn"])  # femnist_cnn has dropout: same seeds, same masks
def test_process_matches_loop_on_conv_models_with_channels_last(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Channels-last workers against the NCHW loop, up to float32 rounding (tests/tolerance.py). The models are
    smoothed (softplus, average pooling): with ReLU and max pooling, a near-tie that the two layouts' rounding
    decides differently changes one example's gradient at one unit by O(1) (seen: 2.5e-5 in one channel of
    femnist_cnn's conv2 store, 1e-8 elsewhere), and how often that happens depends on the CPU."""
    smooth_functional_relu(monkeypatch, [cnn])  # before the workers fork: they inherit it
    fed, alg = image_fed(), REGISTRY["hafedho"](lr=0.05)
    ref_server, ref_store, ref_out = run_rounds(loop_engine, alg, fed, FunctionalModel(smooth(conv_model(name).module)))
    with ProcessEngine(workers=2) as eng:
        server, store, out = run_rounds(eng, alg, fed, FunctionalModel(smooth(conv_model(name).module)))
    x = fed.preprocess(fed.x_train[:4])  # one batch of the plan
    bounds = {"reduction": longest_reduction(conv_model(name).module, x), "steps": 2 * (2 + 1)}  # 2 rounds
    fp32_close(server.params, ref_server.params, **bounds, what="server")
    fp32_close(store.state_dict(), ref_store.state_dict(), **bounds, what="store")
    swapped = [t[[1, 0, 2, 3]] if t.dim() else t for t in ref_store.state_dict()]  # clients 0 and 1 mixed up
    with pytest.raises(AssertionError, match="float32 bound"):  # a real bug is far outside the bound
        fp32_close(swapped, ref_store.state_dict(), **bounds)
    assert out.bytes_up == ref_out.bytes_up and out.metrics.keys() == ref_out.metrics.keys()
    assert not mp.active_children()


@pytest.mark.slow
def test_spawned_workers_get_the_data_through_shared_memory() -> None:
    """The start method used where fork is unavailable (macOS, Windows), checked here on Linux: spawned workers
    compute what forked ones do, bit for bit (same kernels, one thread each, the same inputs)."""
    fed, alg = image_fed(), REGISTRY["scaffold"](lr=0.05)
    with ProcessEngine(workers=2) as eng:
        ref_server, ref_store, _ = run_rounds(eng, alg, fed, conv_model("lenet5"))
    with ProcessEngine(workers=2, start_method="spawn") as eng:
        server, store, _ = run_rounds(eng, alg, fed, conv_model("lenet5"))
    assert fed.x_train.is_shared()
    assert_close(list(server.params.values()), list(ref_server.params.values()), exact=True)
    assert_close(store.state_dict(), ref_store.state_dict(), exact=True)


def test_empty_cohort_gives_no_aggregate() -> None:
    fed, alg, model = image_fed(), FedAvg(), FunctionalModel(build_model("logreg", (1, 28, 28), 10))
    store = ClientStore((), fed.num_clients)
    rnd = RoundInfo(1, fed.num_clients, 0)
    msg = alg.broadcast(alg.init_server(model.params()), rnd)
    for eng in (LoopEngine(), ProcessEngine(workers=2), VmapEngine()):
        with eng:
            out = eng(RoundWork(alg, msg, fed, BatchPlan(2, 4), model, rnd, 0), np.array([], dtype=np.int64), store)
        assert out.aggregate is None and out.metrics == {} and out.bytes_up == 0
    assert not mp.active_children()


# ----------------------------------------------------------------------------- process pool behaviour


@dataclass(frozen=True, kw_only=True)
class Faulty(FedAvg):
    """FedAvg that fails on one client: by raising, or by killing its worker process outright."""

    name = "faulty"
    bad: int = 2
    how: str = "raise"

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Any
    ) -> ClientResult:
        if int(info.num_examples) == self.bad:
            if self.how == "exit":
                os._exit(3)
            raise ValueError("boom on purpose")
        return super().client_update(msg, state, data, info, rnd, model)


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_worker_failure_is_reported_and_the_pool_is_closed(how: str) -> None:
    fed = image_fed()
    alg = Faulty(bad=int(fed.sizes[2]), how=how)
    eng = ProcessEngine(workers=2)
    with pytest.raises(WorkerError) as err:
        run_rounds(eng, alg, fed, conv_model("lenet5"), rounds=1)
    if how == "raise":
        assert "client 2" in str(err.value) and "ValueError: boom on purpose" in str(err.value)
    else:
        assert "died (exit code 3)" in str(err.value)
    assert eng._pool is None and not mp.active_children()
    eng.close()  # idempotent


def test_interrupt_in_the_parent_terminates_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    fed, alg = image_fed(), FedAvg()
    eng = ProcessEngine(workers=2)
    run_rounds(eng, alg, fed, conv_model("lenet5"), rounds=1)
    assert len(mp.active_children()) == 2  # the pool persists across rounds

    def interrupt(self: ClientStore, cid: int, state: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ClientStore, "scatter", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_rounds(eng, alg, fed, conv_model("lenet5"), rounds=1)
    assert not mp.active_children()


def test_divergence_closes_the_pool(tmp_path: Path) -> None:
    cfg = load_config(SMOKE, ["rounds=40", "engine='process'", "algorithm.hafedho.mu=50.0"])
    cfg.out = str(tmp_path)
    with pytest.raises(Divergence):
        run(build(cfg), tmp_path / "run", progress=False)
    assert not mp.active_children()


def test_wire_format_round_trips_any_pytree() -> None:
    state = ({"w": torch.randn(3, 4).t(), "b": torch.arange(3)}, torch.tensor(-1), torch.ones(2, dtype=torch.bfloat16))
    back = loads(dumps(state))
    assert torch.equal(back[0]["w"], state[0]["w"]) and torch.equal(back[0]["b"], state[0]["b"])
    assert torch.equal(back[1], state[1]) and back[2].dtype == torch.bfloat16


def test_wire_format_delivers_aligned_tensors() -> None:
    """Received tensors start at 64-byte boundaries whatever the sizes before them (pickle alone leaves them
    16-byte aligned): a kernel whose result depends on alignment then sees the same in every worker."""
    for n in range(1, 40):
        back = loads(dumps([torch.randn(n), torch.arange(n), torch.randn(3, n)]))
        assert all(t.data_ptr() % 64 == 0 for t in back), f"misaligned after a {n}-element tensor"


# ----------------------------------------------------------------------------- vmap and auto


class BatchNormNet(nn.Module):
    """Linear, BatchNorm, softplus (smooth: see tests/tolerance.py), Linear; with MOON's ``return_features``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.BatchNorm1d(16), nn.Softplus())
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Any:
        z = self.body(x)
        return (z, self.fc(z)) if return_features else self.fc(z)


@pytest.mark.filterwarnings("ignore:BatchNorm layers")
@pytest.mark.parametrize("alg", sorted(REGISTRY))
def test_vmap_matches_loop_on_batchnorm(alg: str) -> None:
    """``FunctionalModel`` makes BatchNorm functorch-safe (batch statistics, no running ones), so under vmap each
    client normalises with its own batch, as under ``loop``: equal up to float32 rounding."""

    def model() -> FunctionalModel:
        torch.manual_seed(0)
        return FunctionalModel(BatchNormNet())

    fed, algo = image_fed(), REGISTRY[alg]()
    ref_server, ref_store, ref_out = run_rounds(loop_engine, algo, fed, model())
    server, store, out = run_rounds(VmapEngine(chunk=3), algo, fed, model())  # a short last chunk
    bounds = {"reduction": longest_reduction(model().module, fed.preprocess(fed.x_train[:4])), "steps": 2 * (2 + 1)}
    fp32_close(server, ref_server, **bounds, what="server")
    fp32_close(store.state_dict(), ref_store.state_dict(), **bounds, what="store")
    assert out.bytes_up == ref_out.bytes_up and out.metrics.keys() == ref_out.metrics.keys()


@pytest.mark.parametrize("plan", [BatchPlan(3, 8), BatchPlan(0, 8, local_epochs=2)], ids=["steps", "epochs"])
def test_cohort_data_equals_each_clients_data_stacked(plan: BatchPlan) -> None:
    """One indexed read for a whole cohort gives, bit for bit, each client's batches (uint8 images scaled, unequal
    clients) stacked, with a short client's missing steps padded by its last step, masked out."""
    fed = image_fed()
    cids = [3, 0, 2]  # not sorted: cohort order
    got = fed.cohort_data(5, 2, cids, plan, full=True)
    ref = stack_data([fed.client_data(5, 2, c, plan, full=True) for c in cids])
    leaves = torch.utils._pytree.tree_leaves
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(leaves(got), leaves(ref), strict=True))
    info, one = fed.cohort_info(cids), [fed.client_info(c) for c in cids]
    assert torch.equal(info.weight, torch.stack([i.weight for i in one]))
    assert torch.equal(info.num_examples, torch.stack([i.num_examples for i in one]))
    if plan.local_epochs:  # client 3: 15 rows, 2 steps an epoch, 4 in all; clients 0 and 2: 3 an epoch, 6
        assert got.mask[0].sum(1).tolist()[-2:] == [0.0, 0.0] and torch.equal(got.x[0, -1], got.x[0, 3])


def test_auto_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = FunctionalModel(nn.Linear(4, 2))
    monkeypatch.setattr(base, "available_cores", lambda: 1)
    assert auto_choice(plain) == "loop"
    monkeypatch.setattr(base, "available_cores", lambda: 8)
    assert auto_choice(plain) == "process"
    on_gpu = typing.cast(FunctionalModel, SimpleNamespace(device=torch.device("cuda", 0)))
    assert auto_choice(on_gpu) == "vmap"  # by where the run's model lives


def test_auto_engine_names_its_choice() -> None:
    fed, alg = image_fed(), FedAvg()
    with AutoEngine() as eng:
        run_rounds(eng, alg, fed, conv_model("lenet5"), rounds=1)
        assert eng.name == f"auto:{auto_choice(conv_model('lenet5'))}"
    assert not mp.active_children()


def test_engine_config_is_validated() -> None:
    for name in ("loop", "process", "vmap", "auto"):
        assert load_config(SMOKE, [f"engine='{name}'"]).engine == name
    with pytest.raises(ConfigError, match="workers"):
        load_config(SMOKE, ["workers=-1"])
    with pytest.raises(ValueError, match="engine='gpu'"):
        make_engine("gpu")
    with pytest.raises(ValueError, match="unknown engine option"):
        make_engine("loop", chunk=3)


# ----------------------------------------------------------------------------- the registry


def test_config_takes_engine_choices_and_options_from_the_registry() -> None:
    """A new engine is a module plus an ``ENGINES`` line; its options are declared once, in ``OPTIONS``."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert all(load_config(SMOKE, [f"engine='{name}'"]).engine == name for name in ENGINES)
    assert all(name in fields["engine"].metadata["help"] for name in ENGINES)
    hints = typing.get_type_hints(Config)
    for opt, decl in OPTIONS.items():
        assert hints[opt] is int and fields[opt].default == decl.default, opt
        assert fields[opt].metadata["help"] == decl.help and fields[opt].metadata["ge"] == decl.ge, opt
    assert {opt for spec in ENGINES.values() for opt in spec.options} == set(OPTIONS)  # none declared unused


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registered_engine_builds_from_a_config(name: str) -> None:
    cfg = load_config(SMOKE, [f"engine='{name}'", "workers=2", "vmap_chunk=3"])
    with engine_for(cfg) as eng:
        assert eng.name == name and callable(eng)
        for opt, kw in ENGINES[name].options.items():  # each option reaches the engine under its keyword
            value = getattr(eng, kw, None) if name != "auto" else eng.options[kw]
            assert value == getattr(cfg, opt), (opt, kw)


@dataclass(frozen=True, kw_only=True)
class KilledOnce(FedAvg):
    """FedAvg whose worker process is killed (``os._exit``) at its first client of round 2, once: the flag file,
    made before it exits, lets the resumed run pass (the uninterrupted run's flag is made beforehand)."""

    name = "killedonce"
    flag: str = hp("", "a file whose absence kills the worker in round 2")

    def client_update(self, msg, state, data, info, rnd, model):
        if rnd.round == 2 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os._exit(9)
        return super().client_update(msg, state, data, info, rnd, model)


def test_a_killed_worker_ends_in_one_line_and_the_run_resumes_exactly(
    tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker killed mid-round (exit code 9) is no error of the run's: one line naming it and the round --resume
    continues from; the resumed run equals an uninterrupted one bit for bit (rows, wall time aside)."""
    import hafedho
    from hafedho.algorithms import REGISTRY
    from hafedho.cli import main

    hafedho.register(KilledOnce)
    request.addfinalizer(lambda: REGISTRY.pop(KilledOnce.name))
    (tmp_path / "done.flag").touch()
    args = ["smoke", "algorithm.name=killedonce", "engine=process", "workers=2", "rounds=3", "checkpoint_every=1"]
    assert (
        main(["run", *args, f"algorithm.flag={tmp_path / 'done.flag'}", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    )
    killed = [*args, f"algorithm.flag={tmp_path / 'kill.flag'}", "--out", str(tmp_path / "b"), "--quiet"]
    assert main(["run", *killed]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "died (exit code 9) in round 2; " in err and "interrupted at round 1; continue with --resume" in err, err
    (run_b,) = (p for p in (tmp_path / "b").iterdir() if not p.name.startswith("."))  # .locks aside
    assert [r["round"] for r in read_metrics(run_b)] == [1]
    assert main(["run", *killed, "--resume"]) == 0
    (run_a,) = (p for p in (tmp_path / "a").iterdir() if not p.name.startswith("."))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]
    assert strip(read_metrics(run_b)) == strip(read_metrics(run_a)) and len(read_metrics(run_a)) == 3
