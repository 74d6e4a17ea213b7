"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data.

McMahan, Moore, Ramage, Hampson, Aguera y Arcas, AISTATS 2017, arXiv:1602.05629 (Algorithm 1), with the
server learning rate of Reddi et al. (arXiv:2003.00295) as an option.

Round t, cohort S_t of m clients:
    client i:  y_i <- x_t;  K steps  y_i <- y_i - eta_l grad f_i(y_i; batch)
               Delta_i = y_i - x_t
    server:    x_{t+1} = x_t + eta_g * sum_i p_i Delta_i / sum_i p_i

Symbols:
    x_t (``params``)   global model          eta_l (``lr``)        local learning rate
    Delta_i (``delta``) local minus global   eta_g (``server_lr``) server learning rate (1.0 = plain averaging)
    p_i                weight: |D_i| (``weighting="data_size"``, the paper) or 1 (``"uniform"``)

This is the reference every other algorithm reduces to. Algorithms that change only FedAvg's server (FedAvgM,
FedLWS) subclass ``FedAvg`` and reuse its clients: ``broadcast`` (the model only) and ``client_update``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

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
    plain_objective,
    sgd,
    tree,
)


class ServerState(NamedTuple):
    params: Params  # x_t


class Broadcast(NamedTuple):
    params: Params  # x_t


class Upload(NamedTuple):
    delta: Params  # Delta_i = y_i - x_t


@dataclass(frozen=True, kw_only=True)
class FedAvg(FedAlgorithm):
    name = "fedavg"
    server_lr: float = hp(1.0, "server learning rate eta_g applied to the averaged delta", gt=0)
    weighting: str = hp("data_size", "aggregation weight p_i", choices=("data_size", "uniform"))

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params)

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return Broadcast(server.params)

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = local_train(plain_objective(model), msg.params, data, sgd(self.lr))
        upload = Upload(tree.sub(res.params, msg.params))
        return ClientResult(upload, aggregation_weight(info, self.weighting), state, {"train/loss": res.loss})

    def server_update(
        self, server: ServerState, agg: Upload | None, rnd: RoundInfo
    ) -> tuple[ServerState, dict[str, float]]:
        return ServerState(tree.axpy(self.server_lr, agg.delta, server.params)), {}
