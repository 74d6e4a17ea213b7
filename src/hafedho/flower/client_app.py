"""The Flower ClientApp: a SuperNode's half of any registered algorithm.

``train`` runs exactly the simulator's client step (``hafedho.sim.engines.loop_engine``): the torch seed
``seed_for(seed, "client_torch", t, i)``, the data ``fed.client_data(seed, t, i, plan, full=alg.needs_full_pass)``
and ``alg.client_update``. The client's ``ClientState`` lives in ``context.state``, which the SuperNode keeps for the
run. The node's partition (= the simulator's client id) and N come from its node config and are checked against
what the server sends; nothing is guessed.

Messages (record keys):
    query     in: -                                 out: ``hafedho`` {partition-id, num-partitions}
    train     in: ``broadcast``, ``config``          out: ``upload`` (leaves of (upload, weight)), ``metrics``,
                                                          ``hafedho`` {partition-id, server-round}
    evaluate  in: ``server``, ``config``             out: ``metrics`` {correct, total} of the personal model
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from hafedho.config import ConfigError
from hafedho.core import RoundInfo, tree
from hafedho.experiment import Experiment
from hafedho.flower import codec
from hafedho.flower.common import (
    DATA_PATH,
    META_KEY,
    STATE_KEY,
    broadcast_template,
    client_info,
    client_template,
    digest,
    experiment,
    partition_of,
    server_template,
    set_threads,
)
from hafedho.sim.seeds import seed_for

app = ClientApp()


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


def _client_state(exp: Experiment, context: Context) -> Any:
    record = context.state.get(STATE_KEY)
    like = client_template(exp)
    return codec.decode(record, like) if isinstance(record, ArrayRecord) else like


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
    config = msg.content.config_records["config"]
    cid, n = _check(exp, context, config)
    t = int(config["server-round"])
    rnd = RoundInfo(t, n, int(config["cohort-size"]))
    bmsg = codec.decode(msg.content.array_records["broadcast"], broadcast_template(exp))
    state = _client_state(exp, context)
    model.train()
    torch.manual_seed(seed_for(cfg.seed, "client_torch", t, cid))  # dropout: pure in (seed, t, i), as simulated
    data = fed.client_data(cfg.seed, t, cid, exp.plan, full=alg.needs_full_pass)  # as RoundWork.client_update
    res = alg.client_update(bmsg, state, data, client_info(exp, cid, context.node_config), rnd, model)
    context.state[STATE_KEY] = codec.encode(tree.detach(res.state))
    weight = torch.as_tensor(res.weight).detach()
    content = RecordDict(
        {
            "upload": codec.encode((tree.detach(res.upload), weight)),
            "metrics": MetricRecord({k: float(v) for k, v in res.metrics.items()}),
            META_KEY: ConfigRecord({"partition-id": cid, "server-round": t}),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of this client's deployed model (``alg.predict``) on its held-out local data."""
    exp = _experiment(context)
    alg, fed, model = exp.alg, exp.fed, exp.model
    cid, _ = _check(exp, context, msg.content.config_records["config"])
    server = codec.decode(msg.content.array_records["server"], server_template(exp))
    correct = total = 0
    idx = fed.local_test[cid] if fed.local_test is not None else []
    if len(idx):
        was_training = model.module.training
        model.module.eval()
        with torch.no_grad():
            rows = torch.from_numpy(idx)
            logits = alg.predict(server, _client_state(exp, context), model, fed.preprocess(fed.x_train[rows]))
            correct = int((logits.argmax(1) == fed.y_train[rows]).sum())
        model.module.train(was_training)
        total = len(idx)
    return Message(RecordDict({"metrics": MetricRecord({"correct": correct, "total": total})}), reply_to=msg)
