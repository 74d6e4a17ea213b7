"""What the ServerApp and the ClientApp share: run-config keys, the cached Experiment, templates, a digest.

Both halves build the same :class:`~hafedho.experiment.Experiment` from the Flower run config (a hafedho config
name or path plus ``key=value`` overrides), so the algorithm, model, partition, seeds and cohorts are those the
simulator would use. Deployment-only facts are explicit: the server sends N and m with every message, each node
names its partition in its node config (``partition-id``, ``num-partitions``), and a digest of the settings that
determine the computation must match on both ends.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hafedho.config import Config, ConfigError, canonical_json, config_path, experiment_identity, load_config
from hafedho.core import ClientData, ClientInfo, Diagnostics, RoundInfo, tree
from hafedho.experiment import Experiment
from hafedho.flower.app import RUN_CONFIG_DEFAULTS  # the run config's keys and defaults, defined there
from hafedho.runtime.work import client_result

# Node-config keys (``flower-supernode --node-config``); the simulation engine sets the first two itself.
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_PATH = "data-path"  # optional: this node's copy of the data (overrides data.path)

META_KEY = "hafedho"  # ConfigRecord with round/partition facts in every message

_CACHE: dict[tuple[str, tuple[str, ...]], Experiment] = {}


def run_setting(run_config: Mapping[str, Any], key: str) -> Any:
    """A run-config value, or its default."""
    return run_config.get(key, RUN_CONFIG_DEFAULTS[key])


def overrides_of(run_config: Mapping[str, Any], data_path: str | None = None) -> tuple[str, ...]:
    items = shlex.split(str(run_setting(run_config, "overrides")))
    if data_path:
        items.append(f"data.path={json.dumps(str(data_path))}")
    return tuple(items)


def load_run_config(run_config: Mapping[str, Any], data_path: str | None = None) -> Config:
    """The hafedho ``Config`` named by a Flower run config (checked like ``hafedho run``, and refused where it needs
    the simulator: ``check_deployable``)."""
    path = config_path(str(run_setting(run_config, "hafedho-config")))
    return check_deployable(load_config(path, list(overrides_of(run_config, data_path))))


def check_deployable(cfg: Config) -> Config:
    """Refuse what only the simulator can compute (every client's data in one place): ``[diagnostics]`` and
    algorithms that need the exact full-data gradient (``Diagnostics.needs_full_gradient``: HaFedHo's
    h_source="exact")."""
    if cfg.diagnostics.every:
        raise ConfigError(
            f"diagnostics.every={cfg.diagnostics.every}: diagnostics are simulation only (they read every client's "
            "data); run with `hafedho run`, or set diagnostics.every=0 for Flower"
        )
    alg = cfg.selected_algorithm()
    if Diagnostics.of(alg).needs_full_gradient:
        raise ConfigError(
            f"{alg.name}: these settings need the exact full-data gradient over every client's data (hafedho: "
            "h_source='exact', Proposition 1's ideal), simulation only; run with `hafedho run`, or set "
            "algorithm.h_source='aggregate' for Flower"
        )
    return cfg


def experiment(run_config: Mapping[str, Any], data_path: str | None = None) -> Experiment:
    """The Experiment of this run config, built once per process (data loaded once, then cached)."""
    from hafedho.experiment import build

    key = (str(run_setting(run_config, "hafedho-config")), overrides_of(run_config, data_path))
    if key not in _CACHE:
        _CACHE[key] = build(load_run_config(run_config, data_path))
    return _CACHE[key]


def set_threads(run_config: Mapping[str, Any]) -> None:
    n = int(run_setting(run_config, "torch-threads"))
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def digest(exp: Experiment) -> str:
    """A short hash of everything that determines the numbers: the experiment (``experiment_identity``, seed
    included) without the data's path (each node reads its own copy), and the partition it produced. Server and
    clients must agree on it."""
    ident = experiment_identity(exp.cfg)
    ident["data"] = {k: v for k, v in ident["data"].items() if k != "path"}
    text = canonical_json({**ident, "partition": exp.partition["hash"]})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def server_template(exp: Experiment) -> Any:
    return exp.alg.init_server(exp.model.params())


def broadcast_template(exp: Experiment) -> Any:
    rnd = RoundInfo(1, exp.fed.num_clients, 1)
    return exp.alg.broadcast(server_template(exp), rnd)


def client_template(exp: Experiment) -> Any:
    return exp.alg.init_client(exp.model.params())


def upload_template(exp: Experiment, info: ClientInfo | None = None) -> tuple[Any, Tensor]:
    """``(upload, weight)`` of one client update on all-padding data: the structure, dtypes and shapes of a reply
    (and the weight of a client with ``info``, default client 0's).

    An all-padding step is a no-op by the runtime contract, so this costs one gradient of a single masked
    example and touches no global random state.
    """
    alg, fed, model = exp.alg, exp.fed, exp.model
    rnd = RoundInfo(1, fed.num_clients, 1)
    msg = alg.broadcast(server_template(exp), rnd)
    x = torch.zeros((1, 1, *fed.input_shape), dtype=torch.float32)
    data = ClientData(x, torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1)))
    data = data._replace(full=data) if alg.needs_full_pass else data  # an all-padding full pass too
    with torch.random.fork_rng():
        res = alg.client_update(msg, client_template(exp), data, info or fed.client_info(0), rnd, model)
    res = client_result(alg, res)  # the simulator's check of what client_update returned
    return tree.detach(res.upload), torch.as_tensor(res.weight).detach()


def client_info(exp: Experiment, cid: int, node_config: Mapping[str, Any]) -> ClientInfo:
    """p_i and n_i of partition ``cid``: from the partition, or stated in the node config (``weight``,
    ``num-examples``) for a silo whose share of the federation is known outside the data."""
    info = exp.fed.client_info(cid)
    if "weight" in node_config:
        info = info._replace(weight=torch.tensor(float(node_config["weight"])))
    if "num-examples" in node_config:
        info = info._replace(num_examples=torch.tensor(float(node_config["num-examples"])))
    return info


def partition_of(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a node config; both are required."""
    missing = [k for k in (PARTITION_ID, NUM_PARTITIONS) if k not in node_config]
    if missing:
        raise ConfigError(
            f"node config lacks {', '.join(missing)}; start the SuperNode with "
            f"--node-config 'partition-id=K num-partitions=N'"
        )
    pid, n = int(node_config[PARTITION_ID]), int(node_config[NUM_PARTITIONS])
    if not 0 <= pid < n:
        raise ConfigError(f"node config partition-id={pid} is outside 0..{n - 1}")
    return pid, n
