"""FedAdam: FedAvg's clients, Adam on the server. Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
arXiv:2003.00295, Algorithm 2 (FedAdam). Round t, cohort S of the clients' deltas Delta_i = y_i - x_t:

    Delta_t = mean_i Delta_i                          (the paper: 1/|S| sum; weighting="data_size" weighs by |D_i|)
    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t          m_{-1} = 0
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2        v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

That is the library's ``adam(eta, beta1, beta2, eps=tau, v0=tau^2)`` transform (Kingma & Ba's Adam without bias
correction) run by ``server_step`` on the pseudo-gradient -Delta_t, as the clients run transforms on gradients:
its moments are (-m_t, v_t), kept in ``ServerState.opt``.

beta1 = 0.9 and beta2 = 0.99 as the paper fixes them in its experiments (Section 5); it tunes tau and eta per
task: tau = 1e-3 and eta = 0.1 here are the defaults of Flower's FedAdam (flwr 1.42, serverapp.strategy).
"""

from dataclasses import dataclass
from typing import NamedTuple

from hafedho.algorithms import FedAvg
from hafedho.core import AdamState, Params, Transform, adam, hp, server_step


class ServerState(NamedTuple):
    params: Params  # x_t
    opt: AdamState  # Adam's moments of the pseudo-gradient -Delta_t: (-m_t, v_t)


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

    def server_transform(self) -> Transform:
        return adam(self.server_lr, self.beta1, self.beta2, eps=self.tau, v0=self.tau**2)

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, self.server_transform().init(params))

    def server_update(self, server: ServerState, agg, rnd) -> tuple[ServerState, dict[str, float]]:
        # agg.delta = Delta_t, FedAvg's aggregate; server_step feeds the transform -Delta_t
        params, opt = server_step(self.server_transform(), server.params, agg.delta, server.opt)
        return ServerState(params, opt), {}
