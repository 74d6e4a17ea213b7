"""Helpers for tests/test_flower.py: an in-process Grid, simulator references, process fixtures."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from helpers import smoke_config
from tolerance import fp32_close, longest_reduction

from hafedho.core import RoundInfo, tree
from hafedho.core.seeds import seed_for
from hafedho.experiment import Experiment, build
from hafedho.flower.client_app import app as client_app
from hafedho.flower.common import client_template
from hafedho.runtime import checkpoint
from hafedho.runtime.store import ClientStore
from hafedho.sim.runner import run


class LocalGrid(Grid):
    """Calls the ClientApp in this process, one Context per node, as a SuperNode would keep it.

    ``fail`` maps a round to client ids whose nodes answer that round's train message with an error; ``events``
    maps a round t to a call ``f(grid)`` made once, just before round t's train messages go out (a node restart, a
    deleted store, a Ctrl-C of the ServerApp); ``node_config`` adds keys to every node's config.
    """

    def __init__(
        self,
        run_config: dict[str, Any],
        num_nodes: int,
        fail: dict[int, set[int]] | None = None,
        node_config: dict[str, Any] | None = None,
        events: dict[int, Callable[[LocalGrid], object]] | None = None,
    ) -> None:
        self.run_config, self.num_nodes, self.node_config = run_config, num_nodes, node_config or {}
        self.contexts = {100 + i: self._context(i) for i in range(num_nodes)}
        self.fail = fail or {}
        self.events = dict(events or {})
        self.sent: list[Message] = []
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # what a ServerApp process has

    def _context(self, i: int) -> Context:
        conf = {"partition-id": i, "num-partitions": self.num_nodes, **self.node_config}
        return Context(1, 100 + i, conf, RecordDict(), self.run_config)

    def restart(self, *cids: int) -> None:
        """The SuperNodes of clients ``cids`` restart: their ``context.state`` is empty again."""
        for cid in cids:
            self.contexts[100 + cid] = self._context(cid)

    def set_run(self, run: Any) -> None:  # pragma: no cover - not used
        pass

    @property
    def run(self) -> Any:  # pragma: no cover - not used
        return None

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover - not used
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover - not used
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train" and int(m.metadata.group_id) in self.events:
                self.events.pop(int(m.metadata.group_id))(self)
        replies = []
        for msg in messages:
            self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            cid = int(ctx.node_config["partition-id"])
            if msg.metadata.message_type == "train" and cid in self.fail.get(int(msg.metadata.group_id), set()):
                replies.append(Message(Error(code=0, reason="node lost"), reply_to=msg))
                continue
            reply = client_app(msg, ctx)
            replies.append(copy.deepcopy(reply))
        return replies


def run_strategy(rc: dict[str, Any], run_dir: Path, grid: LocalGrid | None = None, finish: bool = True) -> Any:
    """The Flower ServerApp's loop (``Strategy.start``) over ``grid`` (default: a fresh ``LocalGrid``) into
    ``run_dir``; ``finish=False``: a ServerApp that then died before ``finish`` (no ``done``)."""
    from hafedho.flower.common import experiment
    from hafedho.flower.strategy import HafedhoStrategy

    strategy = HafedhoStrategy(experiment(rc), run_dir, node_wait=0.0)
    strategy.prepare()
    grid = grid if grid is not None else LocalGrid(rc, strategy.fed.num_clients)
    strategy.start(
        grid, strategy.initial_arrays(), num_rounds=strategy.cfg.rounds, evaluate_fn=strategy.evaluate_global
    )
    if finish:
        strategy.finish()
    return strategy


def die(grid: LocalGrid) -> None:
    """An event: Ctrl-C of the ServerApp."""
    raise KeyboardInterrupt


def simulate(alg: str, tmp: Path, *overrides: str) -> tuple[Experiment, dict[str, torch.Tensor], Path]:
    """The reference simulator's run; returns the experiment, the final global model and the run dir."""
    cfg = smoke_config(tmp, *overrides, alg=alg)
    exp = build(cfg)
    run_dir = tmp / "sim"
    run(exp, run_dir, progress=False)
    server = exp.alg.init_server(exp.model.params())
    _, server, _, _ = checkpoint.load(run_dir / "checkpoint.pt", server)
    return exp, exp.alg.eval_params(server), run_dir


def simulate_with_drops(exp: Experiment, drops: dict[int, set[int]]) -> dict[str, torch.Tensor]:
    """The simulator's loop with some clients' uploads lost in some rounds (clients ran with the sampled m,
    the server aggregated the rest with m = what arrived); state of a lost client is lost with its node."""
    alg, fed, model, cfg = exp.alg, exp.fed, exp.model, exp.cfg
    params0 = model.params()
    server = alg.init_server(params0)
    store = ClientStore(client_template(exp), fed.num_clients)
    for t in range(1, cfg.rounds + 1):
        cohort = exp.cohort(t).tolist()
        rnd = RoundInfo(t, fed.num_clients, len(cohort))
        msg = alg.broadcast(server, rnd)
        agg, like, used = alg.new_aggregator(), None, 0
        model.train()
        for cid in cohort:
            if cid in drops.get(t, set()):
                continue
            torch.manual_seed(seed_for(cfg.seed, "client_torch", t, cid))
            data = fed.client_data(cfg.seed, t, cid, exp.plan, full=alg.needs_full_pass)
            res = alg.client_update(msg, store.gather(cid), data, fed.client_info(cid), rnd, model)
            agg.add(tree.detach(res.upload), res.weight)
            store.scatter(cid, res.state)
            like, used = res.upload, used + 1
        if used:  # nobody reported: the runtime skips the server update
            server, _ = alg.server_update(server, agg.result(like), RoundInfo(t, fed.num_clients, used))
    return alg.eval_params(server)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_fp32_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], exp: Experiment) -> None:
    """Final models of two processes agree up to float32 rounding of ``exp`` (tests/tolerance.py). With equal
    torch thread counts they are bit-identical (same kernels on the same aligned inputs); the bound covers a
    deployment whose processes run other thread counts."""
    assert got.keys() == ref.keys()
    lam = max(exp.plan.steps_for(int(n)) for n in exp.fed.sizes)
    x = exp.fed.preprocess(exp.fed.x_train[: exp.cfg.clients.batch_size])
    bounds = {"reduction": longest_reduction(exp.model.module, x), "steps": exp.cfg.rounds * (lam + 1)}
    fp32_close([got[k] for k in ref], list(ref.values()), **bounds, what="deployed vs simulated model")


def flower_final(run_dir: Path, exp: Experiment) -> dict[str, torch.Tensor]:
    server = exp.alg.init_server(exp.model.params())
    _, server, _, _ = checkpoint.load(Path(run_dir) / "checkpoint.pt", server)
    return exp.alg.eval_params(server)


def cohorts(exp: Experiment) -> list[list[int]]:
    return [np.asarray(exp.cohort(t)).tolist() for t in range(1, exp.cfg.rounds + 1)]
