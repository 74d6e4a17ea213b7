"""FedAdam: FedAvg's clients, Adam on the server. Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
arXiv:2003.00295, Algorithm 2 (FedAdam). Round t, cohort S of the clients' deltas Delta_i = y_i - x_t:

    Delta_t = mean_i Delta_i                          (the paper: 1/|S| sum; weighting="data_size" weighs by |D_i|)
    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t          m_{-1} = 0
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2        v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

beta1 = 0.9 and beta2 = 0.99 as the paper fixes them in its experiments (Section 5); it tunes tau and eta per
task: tau = 1e-3 and eta = 0.1 here are the defaults of Flower's FedAdam (flwr 1.42, serverapp.strategy).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hafedho.algorithms import FedAvg
from hafedho.core import Params, hp


class ServerState(NamedTuple):
    params: Params  # x_t
    m: Params  # first moment m_t
    v: Params  # second moment v_t


@dataclass(frozen=True, kw_only=True)
class FedAdam(FedAvg):
    name = "fedadam"
    server_lr: float = hp(0.1, "server learning rate eta", gt=0)
    weighting: str = hp(
        "uniform", "Delta_t: the paper's plain mean or weighted by |D_i|", choices=("uniform", "data_size")
    )
    beta1: float = hp(0.9, "first-moment decay beta1", ge=0, lt=1)
    beta2: float = hp(0.99, "second-moment decay beta2", ge=0, lt=1)
    tau: float = hp(1e-3, "adaptivity tau", gt=0)

    def init_server(self, params: Params) -> ServerState:
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        return ServerState(params, zeros, {k: torch.full_like(p, self.tau**2) for k, p in params.items()})

    def server_update(self, server: ServerState, agg, rnd) -> tuple[ServerState, dict[str, float]]:
        d, b1, b2 = agg.delta, self.beta1, self.beta2  # agg.delta = Delta_t, FedAvg's aggregate
        m = {k: b1 * server.m[k] + (1 - b1) * d[k] for k in d}
        v = {k: b2 * server.v[k] + (1 - b2) * d[k] ** 2 for k in d}
        x = {k: server.params[k] + self.server_lr * m[k] / (v[k].sqrt() + self.tau) for k in d}
        return ServerState(x, m, v), {}
