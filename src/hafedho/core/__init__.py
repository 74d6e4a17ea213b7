"""Core: types, the algorithm base class, tree math, local training, aggregation. Imports nothing else."""

from hafedho.core import tree
from hafedho.core.aggregate import WeightedMean
from hafedho.core.algorithm import ConfigError, FedAlgorithm, hp
from hafedho.core.diagnostics import Diagnostics, Estimate
from hafedho.core.local import (
    AdamState,
    LocalResult,
    Transform,
    adam,
    aggregation_weight,
    chain,
    full_gradient,
    local_train,
    mix,
    plain_objective,
    server_step,
    sgd,
    shift,
    value_grad,
)
from hafedho.core.model import FunctionalModel
from hafedho.core.tree import Params
from hafedho.core.types import Aggregator, ClientData, ClientInfo, ClientResult, Model, RoundInfo

__all__ = [
    "AdamState",
    "Aggregator",
    "ClientData",
    "ClientInfo",
    "ClientResult",
    "ConfigError",
    "Diagnostics",
    "Estimate",
    "FedAlgorithm",
    "FunctionalModel",
    "LocalResult",
    "Model",
    "Params",
    "RoundInfo",
    "Transform",
    "WeightedMean",
    "adam",
    "aggregation_weight",
    "chain",
    "full_gradient",
    "hp",
    "local_train",
    "mix",
    "plain_objective",
    "server_step",
    "sgd",
    "shift",
    "tree",
    "value_grad",
]
