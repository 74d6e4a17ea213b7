"""FedProx: Federated Optimization in Heterogeneous Networks.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020, arXiv:1812.06127 (Algorithm 2, Eq. (2)).

Round t, cohort S_t of m clients:
    client i:  y_i <- x_t;  K steps on the proximal objective
                   h_i(w; x_t) = f_i(w) + mu/2 ||w - x_t||^2
                   y_i <- y_i - eta_l (grad f_i(y_i; batch) + mu (y_i - x_t))
               Delta_i = y_i - x_t
    server:    x_{t+1} = x_t + sum_i p_i Delta_i / sum_i p_i      (as FedAvg)

Symbols:
    x_t (``params``)    global model                 eta_l (``lr``)  local learning rate
    Delta_i (``delta``) local minus global model     mu (``mu``)     proximal strength
    p_i                 weight: |D_i| (``weighting="data_size"``) or 1 (``"uniform"``)

Paper vs official code (github litian96/FedProx): Algorithm 2 samples clients with probability p_k and
averages uniformly; the code samples uniformly and averages with weights |D_k| (``fedbase.aggregate``). The
default follows the code (and is FedAvg's default), ``weighting="uniform"`` gives the plain mean.
The paper's tolerance to partial work (gamma-inexact solutions, stragglers doing fewer epochs) is a property
of the runtime's step plan: each client runs its own real steps (``res.steps``), padded steps are no-ops.

Reduces to FedAvg exactly when mu = 0 (same weighting): the proximal gradient adds 0 * (y - x_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    FedAlgorithm,
    Model,
    Params,
    RoundInfo,
    aggregation_weight,
    hp,
    local_train,
    sgd,
    tree,
)
from hafedho.core.types import Objective


class ServerState(NamedTuple):
    params: Params  # x_t


class Broadcast(NamedTuple):
    params: Params  # x_t


class Upload(NamedTuple):
    delta: Params  # Delta_i = y_i - x_t


@dataclass(frozen=True, kw_only=True)
class FedProx(FedAlgorithm):
    name = "fedprox"
    mu: float = hp(0.01, "proximal strength mu in f_i(w) + mu/2 ||w - x_t||^2", ge=0)
    weighting: str = hp("data_size", "aggregation weight p_i", choices=("data_size", "uniform"))

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params)

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return Broadcast(server.params)

    def objective(self, model: Model, x_t: Params) -> Objective:
        """``phi(w) = f_i(w) + mu/2 ||w - x_t||^2``; x_t is a constant, w carries the gradient."""

        def phi(w: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            f = model.loss(w, x, y, m)
            return f + 0.5 * self.mu * tree.sq_norm(tree.sub(w, x_t)), f

        return phi

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = local_train(self.objective(model, msg.params), msg.params, data, sgd(self.lr))
        weight = aggregation_weight(info, self.weighting)
        metrics = {"train/loss": res.loss, "train/objective": res.objective}
        return ClientResult(Upload(tree.sub(res.params, msg.params)), weight, state, metrics)

    def server_update(
        self, server: ServerState, agg: Upload | None, rnd: RoundInfo
    ) -> tuple[ServerState, dict[str, float]]:
        return ServerState(tree.add(server.params, agg.delta)), {}
