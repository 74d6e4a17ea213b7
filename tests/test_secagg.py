"""SecAgg+ on the deployed path (hafedho.flower.secagg): the secure sum equals the plain weighted sum up to the
quantisation bound, in process (fast) and on a loopback deployment, including a SuperNode killed mid-round (slow).

Fast tests drive the ServerApp's SecAgg+ rounds and the ClientApp (with flwr's ``secaggplus_mod``) in this process
through ``LocalGrid``; the slow ones start a SuperLink and SuperNodes on 127.0.0.1 and end them by pid.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

import test_flower
from flower_helpers import LocalGrid, flower_final, max_abs_diff, simulate, simulate_with_drops
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from test_flower import finish, run_config, start_federation

from hafedho.config import ConfigError
from hafedho.core import RoundInfo, WeightedMean, tree
from hafedho.flower.common import experiment
from hafedho.flower.secagg import SecAggSettings, check_algorithm, client_vector
from hafedho.flower.secagg_server import SecureRounds
from hafedho.flower.strategy import HafedhoStrategy
from hafedho.runfiles import read_metrics
from hafedho.runtime.work import RoundWork

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower"
deployments = test_flower.deployments  # the Flower tests' fixture: processes ended by pid, pass or fail


class WireGrid(LocalGrid):
    """A LocalGrid that hands each node its own copy of a message, as the wire does (SecAgg+'s workflow sends one
    content object to every node and flwr's mod edits it in place), and answers a failing ClientApp with an error."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            try:
                replies += super().send_and_receive([copy.deepcopy(msg)], timeout=timeout)
            except Exception as e:  # a SuperNode turns a failing ClientApp into an error reply
                replies.append(Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg))
        return replies


class DroppingGrid(WireGrid):
    """A WireGrid whose nodes of ``drop`` (client ids) stop answering from SecAgg+ stage ``stage`` on."""

    def __init__(self, run_config: dict[str, Any], num_nodes: int, drop: set[int], stage: str) -> None:
        super().__init__(run_config, num_nodes)
        self.drop, self.stage, self.dead = drop, stage, set()

    def send_and_receive(self, messages, *, timeout=None):
        alive = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            conf = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            cid = int(self.contexts[node].node_config["partition-id"])
            if conf is not None and conf.get(Key.STAGE) == self.stage and cid in self.drop:
                self.dead.add(node)
            if node in self.dead:
                continue  # no reply at all, as a killed node
            alive.append(msg)
        return list(super().send_and_receive(alive, timeout=timeout))


def secure_run(alg: str, tmp: Path, *overrides: str, grid: Any = None, **settings: Any) -> tuple[Any, SecureRounds]:
    rc = {"hafedho-config": "smoke", "overrides": " ".join([f"algorithm.name={alg}", *overrides])}
    strategy = HafedhoStrategy(experiment(rc), tmp / "flower", node_wait=0.0)
    secure = SecureRounds(strategy, SecAggSettings(**settings), timeout=30.0)
    strategy.prepare()
    grid = grid or WireGrid(rc, strategy.fed.num_clients)
    secure.start(grid, Context(1, 0, {}, RecordDict(), rc))
    strategy.finish()
    return strategy, secure


def plain_aggregate(exp: Any, t: int, clients: list[int]) -> Any:
    """Round ``t``'s plain weighted mean over ``clients`` from the initial server state (round 1: fresh clients)."""
    alg, fed = exp.alg, exp.fed
    server = alg.init_server(exp.model.params())
    rnd = RoundInfo(t, fed.num_clients, len(exp.cohort(t)))
    work = RoundWork(alg, alg.broadcast(server, rnd), fed, exp.plan, exp.model, rnd, exp.cfg.seed)
    agg, like = WeightedMean(), None
    for cid in clients:
        res = work.client_update(cid, alg.init_client(exp.model.params()))
        agg.add(tree.detach(res.upload), res.weight)
        like = res.upload
    return agg.result(like)


def leaves_diff(a: Any, b: Any) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(la, lb, strict=True))


# ---------------------------------------------------------------------------------------------- fast


def test_settings_and_algorithms_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secagg-num-shares=2"):
        SecAggSettings(num_shares=2)
    with pytest.raises(ConfigError, match="must be below secagg-num-shares=3"):
        SecAggSettings(num_shares=3, reconstruction_threshold=3)
    with pytest.raises(ConfigError, match=r"secagg-clipping-range=-1\.0"):
        SecAggSettings(clipping_range=-1.0)
    with pytest.raises(ConfigError, match="overflows the 2\\^32"):
        SecAggSettings(quantization_range=2**30).quantization_for(5)
    with pytest.raises(ConfigError, match="at least 2 clients"):
        SecAggSettings().quantization_for(1)
    assert SecAggSettings().quantization_for(3) == 2**30 and SecAggSettings().quantization_for(5) == 2**29
    assert SecAggSettings.from_run_config({}) is None
    rc = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedlws"}
    with pytest.raises(ConfigError, match=r"fedlws's aggregator HeldUploads .*algorithm\.spread=weighted_std"):
        check_algorithm(experiment(rc))
    check_algorithm(experiment({**rc, "overrides": "algorithm.name=fedlws algorithm.spread=weighted_std"}))


@pytest.mark.parametrize("alg", ["fedavg", "hafedho"])
def test_secure_sum_equals_the_weighted_sum_up_to_quantisation(tmp_path: Path, alg: str) -> None:
    """In process, one SecAgg+ round (setup, key shares, masked vectors, unmask through flwr's mod and workflow):
    the unmasked aggregate is the plain weighted mean of the same uploads within the stated bound."""
    strategy, secure = secure_run(alg, tmp_path, "rounds=1")
    exp, last = strategy.exp, secure.last
    ref = plain_aggregate(exp, 1, exp.cohort(1).tolist())
    diff = leaves_diff(last["aggregate"], ref)
    print(f"{alg}: secure vs plain aggregate max |diff| = {diff:.3g}, bound {last['bound']:.3g}")
    assert last["used"] == sorted(exp.cohort(1).tolist())
    assert diff <= last["bound"] + 1e-7 * (1 + max(float(v.abs().max()) for v in tree_leaves(ref)))
    assert last["bound"] < 1e-6
    rows = read_metrics(tmp_path / "flower")
    assert [r["round"] for r in rows] == [1] and (tmp_path / "flower" / "done").exists()
    assert "dropped" not in rows[0]


def tree_leaves(x: Any) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(x)


def test_a_client_lost_after_sharing_keys_is_unmasked_from_the_survivors(tmp_path: Path) -> None:
    """A node that stops answering at the masked-vector stage (after setup and key sharing): SecAgg+ rebuilds its
    pairwise masks from the survivors' shares, and the aggregate is the weighted mean over the survivors."""
    overrides = ("data.num_clients=4", "sampling.cohort_size=3", "rounds=1")
    rc = {"hafedho-config": "smoke", "overrides": " ".join(["algorithm.name=fedavg", *overrides])}
    exp = experiment(rc)
    cohort = exp.cohort(1).tolist()
    victim = cohort[1]
    grid = DroppingGrid(rc, exp.fed.num_clients, {victim}, Stage.COLLECT_MASKED_VECTORS)
    _, secure = secure_run("fedavg", tmp_path, *overrides, grid=grid)
    survivors = sorted(set(cohort) - {victim})
    assert secure.last["used"] == survivors
    diff = leaves_diff(secure.last["aggregate"], plain_aggregate(exp, 1, survivors))
    assert diff <= secure.last["bound"] + 1e-7
    row = read_metrics(tmp_path / "flower")[0]
    assert row["dropped"] == [victim] and row["cohort_size"] == 2


def test_uploads_beyond_the_clipping_range_stop_the_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"beyond secagg-clipping-range=1e-06 .* raise secagg-clipping-range"):
        secure_run("fedavg", tmp_path, "rounds=1", clipping_range=1e-6)


def test_entries_outside_the_range_or_not_finite_are_counted() -> None:
    upload = {"w": torch.tensor([float("nan"), 3.0, -20.0, 1.0])}
    vec, outside = client_vector(upload, torch.tensor(2.0), 4.0, 8.0)  # s = 1/2: entries nan, 1.5, -10, 0.5
    assert outside == 2 and vec[0].tolist() == [0.5] and vec[1][1:].tolist() == [1.5, -10.0, 0.5]
    with pytest.raises(ConfigError, match="exceeds the federation's largest"):
        client_vector(upload, torch.tensor(5.0), 4.0, 8.0)


def test_the_automatic_clipping_range_grows_with_the_local_steps() -> None:
    exp = experiment({"hafedho-config": "smoke", "overrides": "clients.local_steps=10"})
    assert SecAggSettings().clipping_for(exp) == 64.0 and SecAggSettings(clipping_range=3.0).clipping_for(exp) == 3.0


# ---------------------------------------------------------------------------------------------- processes (slow)

# SecAgg+ takes 4 message exchanges per round, each a ClientApp process per node: seconds each when idle, up to a
# minute on a loaded 2-core machine; every stage waits up to round-timeout.
SECAGG = {"secagg": True, "round-timeout": 300.0, "node-wait": 10.0}
THREE = ("data.num_clients=3", "sampling.fraction=1.0", "rounds=2")


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("alg", ["fedavg", "hafedho"])
def test_deployment_with_secagg_ends_at_the_plain_model(tmp_path: Path, deployments, alg: str) -> None:
    """A SuperLink and 3 SuperNodes on 127.0.0.1, 2 rounds with SecAgg+: every round aggregates all three clients
    and the final model is the plain run's (= the simulator's, bit for bit: tests/test_flower.py) up to the
    quantisation, each round's aggregate within its ``secagg/bound``."""
    d = deployments()
    start_federation(d, 3)
    secure = tmp_path / "secagg"
    finish(d, d.run(EXAMPLE, run_config(alg, secure, *THREE, **SECAGG)), timeout=1200)
    exp, plain, sim_dir = simulate(alg, tmp_path / "sim", *THREE)
    final = flower_final(secure, exp)
    diff = max_abs_diff(plain, final)
    rel = diff / max(float(v.abs().max()) for v in plain.values())
    rows, ref = read_metrics(secure), read_metrics(sim_dir)
    bounds = [r["secagg/bound"] for r in rows]
    acc = rows[-1]["test/acc"] - ref[-1]["test/acc"]
    print(f"{alg}: SecAgg+ vs plain final max |diff| = {diff:.3g} (rel {rel:.3g}), bounds {bounds}, acc diff {acc}")
    assert [r["cohort_size"] for r in rows] == [3, 3] and all(0 < x < 1e-6 for x in bounds)
    assert diff <= 1e-5 and abs(acc) <= 1 / 180 + 1e-12  # at most one of the 180 test examples
    assert (secure / "done").exists()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_supernode_killed_after_setup_is_unmasked_by_the_survivors(tmp_path: Path, deployments) -> None:
    """Kill -9 a SuperNode in round 2 of 2 once SecAgg+'s setup and key sharing reached it (its third ClientApp
    process of the round, the masked-vector stage): the survivors' shares rebuild its masks, the round completes
    with the other two, the model equals the plain weighted sum over the survivors within the bound, and the run
    directory is whole."""
    d = deployments()
    nodes = start_federation(d, 3)
    run_dir = tmp_path / "flower"
    overrides = THREE
    run_id = d.run(EXAMPLE, run_config("fedavg", run_dir, *overrides, **SECAGG))
    victim, end = nodes[1], time.monotonic() + 400
    while len(read_metrics(run_dir)) < 1:
        assert time.monotonic() < end and d.superlink.alive(), d.log(run_id)[-4000:]
        time.sleep(0.2)
    seen: set[str] = set(victim.children())
    new: list[str] = []
    while len(new) < 3:  # setup, share keys, collect masked vectors (training)
        for c in victim.children():
            if "flwr-clientapp" in c and c not in seen:
                seen.add(c)
                new.append(c)
        assert time.monotonic() < end, d.log(run_id)[-4000:]
        time.sleep(0.05)
    victim.stop(kill=True)
    finish(d, run_id, timeout=1200)
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2] and (run_dir / "done").exists()
    assert "dropped" not in rows[0] and rows[1]["dropped"] == [1] and rows[1]["cohort_size"] == 2
    exp, _, _ = simulate("fedavg", tmp_path / "sim", *overrides)
    ref, final = simulate_with_drops(exp, {2: {1}}), flower_final(run_dir, exp)
    diff = max_abs_diff(ref, final)
    print(
        f"killed node under SecAgg+: vs plain over the survivors max |diff| = {diff:.3g}, bounds "
        f"{[r['secagg/bound'] for r in rows]}"
    )
    assert diff <= 2 * sum(r["secagg/bound"] for r in rows) + 1e-6


def test_a_client_lost_before_sharing_keys_leaves_the_round_empty(tmp_path: Path) -> None:
    """flwr 1.42's unmask stage needs shares of every sampled client's secrets: a client lost at key sharing has
    none, so SecAgg+ halts; the round aggregates nothing (the server state stays) and the row says so."""
    overrides = ("data.num_clients=4", "sampling.cohort_size=3", "rounds=1")
    rc = {"hafedho-config": "smoke", "overrides": " ".join(["algorithm.name=fedavg", *overrides])}
    exp = experiment(rc)
    cohort = exp.cohort(1).tolist()
    grid = DroppingGrid(rc, exp.fed.num_clients, {cohort[0]}, Stage.SHARE_KEYS)
    strategy, _ = secure_run("fedavg", tmp_path, *overrides, grid=grid)
    row = read_metrics(tmp_path / "flower")[0]
    assert row["cohort_size"] == 0 and row["dropped"] == sorted(cohort) and "secagg/bound" not in row
    init = exp.alg.eval_params(exp.alg.init_server(exp.model.params()))
    assert max(float((strategy.final_params()[k] - init[k]).abs().max()) for k in init) == 0.0
