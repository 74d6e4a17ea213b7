"""The Flower ClientApp: a SuperNode's half of any registered algorithm.

``train`` runs exactly the simulator's client step, ``RoundWork.client_update`` (its seeding, its data,
``alg.client_update``), and ``evaluate`` the simulator's ``hafedho.runtime.rounds.client_accuracy``. The client's
``ClientState`` lives in the node's store (``flower/node_store.py``: ``context.state``, or on disk with the node
config's ``state-dir``), by the round that produced it. The node's partition (= the simulator's client id) and N
come from its node config and are checked against what the server sends; nothing is guessed.

Messages (record keys):
    query     in: -                                 out: ``hafedho`` {partition-id, num-partitions}
    train     in: ``broadcast``, ``config``          out: ``upload`` (leaves of (upload, weight)), ``metrics``,
                                                          ``hafedho`` {partition-id, server-round, state-lost}
              under SecAgg+ (``flower/secagg.py``): FitIns in, a FitRes-shaped reply that flwr's mod masks
    evaluate  in: ``server``, ``config``             out: ``metrics`` {correct, total} of the personal model
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from hafedho.config import ConfigError
from hafedho.core import RoundInfo, tree
from hafedho.experiment import Experiment
from hafedho.flower import codec, secagg
from hafedho.flower.common import (
    DATA_PATH,
    META_KEY,
    broadcast_template,
    client_info,
    client_template,
    digest,
    experiment,
    partition_of,
    server_template,
    set_threads,
)
from hafedho.flower.node_store import RUN_TOKEN, NodeStore
from hafedho.runtime.rounds import client_accuracy
from hafedho.runtime.work import RoundWork

app = ClientApp(mods=[secagg.client_mod])  # SecAgg+ messages only; the rest pass straight through


def _experiment(context: Context) -> Experiment:
    set_threads(context.run_config)
    path = context.node_config.get(DATA_PATH)
    return experiment(context.run_config, str(path) if path else None)


def _check(exp: Experiment, context: Context, config: ConfigRecord) -> tuple[int, int]:
    """This node's ``(client id, N)``, after checking that server and node describe the same federation."""
    cid, n = partition_of(context.node_config)
    if str(config.get("digest")) != digest(exp):
        raise ConfigError(
            "this node's hafedho config or data differ from the server's (digest mismatch); "
            "run the same hafedho version, config and data on both"
        )
    server_n = int(config["num-clients"])
    if not server_n == n == exp.fed.num_clients:
        raise ConfigError(
            f"N disagrees: server says {server_n}, node config num-partitions={n}, partition has {exp.fed.num_clients}"
        )
    if "partition-id" in config and int(config["partition-id"]) != cid:
        raise ConfigError(f"message for partition {config['partition-id']} reached partition {cid}")
    return cid, n


def _store(exp: Experiment, context: Context, cid: int, config: ConfigRecord) -> NodeStore:
    """Client ``cid``'s store for the run the server names (the experiment's digest and the run's token)."""
    token = str(config.get("run-token", ""))
    if token and not RUN_TOKEN.fullmatch(token):  # it names a folder on this node: never a path
        raise ConfigError(f"the server sent run-token={token[:80]!r}, not a hex token; run the same hafedho on both")
    key = f"{digest(exp)}-{token}"
    return NodeStore.of(context, key, cid, client_template(exp))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition so the server can map node ids to client ids."""
    cid, n = partition_of(context.node_config)
    return Message(RecordDict({META_KEY: ConfigRecord({"partition-id": cid, "num-partitions": n})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the algorithm's client update, as the simulator runs it."""
    exp = _experiment(context)
    alg, fed, model, cfg = exp.alg, exp.fed, exp.model, exp.cfg
    fit = secagg.FITINS_PARAMS in msg.content.array_records  # SecAgg+'s stage 2 carries the legacy FitIns
    config = msg.content.config_records[secagg.FITINS_CONFIG if fit else "config"]
    cid, n = _check(exp, context, config)
    t = int(config["server-round"])
    rnd = RoundInfo(t, n, int(config["cohort-size"]))
    record = secagg.broadcast_record(msg) if fit else msg.content.array_records["broadcast"]
    bmsg = codec.decode(record, broadcast_template(exp))
    store = _store(exp, context, cid, config)
    with store.writing():
        found, state = store.load(t)
        lost = store.lost(found, int(config.get("state-round", 0)))
        if state is None or lost:
            state = client_template(exp)
        model.train()
        work = RoundWork(alg, bmsg, fed, exp.plan, model, rnd, cfg.seed)  # the simulator's seeded client step
        res = work.client_update(cid, state, client_info(exp, cid, context.node_config))
        store.save(t, tree.detach(res.state), int(config.get("checkpoint-round", 0)))
    weight = torch.as_tensor(res.weight).detach()
    if fit:
        metrics = {k: float(v) for k, v in res.metrics.items()}
        metrics[secagg.STATE_LOST] = float(lost)  # "hafedho." metrics are not averaged into the row
        return Message(secagg.fit_reply(tree.detach(res.upload), weight, config, metrics, cid), reply_to=msg)
    content = RecordDict(
        {
            "upload": codec.encode((tree.detach(res.upload), weight)),
            "metrics": MetricRecord({k: float(v) for k, v in res.metrics.items()}),
            META_KEY: ConfigRecord({"partition-id": cid, "server-round": t, "state-lost": int(lost)}),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of this client's deployed model (``alg.predict``) on its held-out local data."""
    exp = _experiment(context)
    config = msg.content.config_records["config"]
    cid, _ = _check(exp, context, config)
    server = codec.decode(msg.content.array_records["server"], server_template(exp))
    _, state = _store(exp, context, cid, config).load(int(config["server-round"]) + 1)  # as trained in this round
    state = client_template(exp) if state is None else state
    correct, total = client_accuracy(exp, server, cid, state)
    return Message(RecordDict({"metrics": MetricRecord({"correct": correct, "total": total})}), reply_to=msg)
