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

This is the reference the other algorithms reduce to and the base class of all of them but HaFedHo, so that each
file reads as its diff from FedAvg. ``client_update`` runs ``train``, the K masked local steps of ``local_train``
from the broadcast model, built from two hooks, the two places where algorithms differ from FedAvg's clients:
    ``objective``  the local objective phi (FedAvg: f_i itself); FedProx, MOON and FedDyn add terms
    ``transform``  how a gradient becomes a step (FedAvg: plain SGD); SCAFFOLD shifts it, MimeLite mixes in the
                   frozen server momentum, FedDyn can clip it
plus ``next_state``, the client's state after its steps (FedAvg: unchanged; MOON and FedDyn keep one), and
``logs_objective``, set where phi is not f_i so clients log ``train/objective`` beside the loss. A subclass that
changes more (its upload, its server) overrides ``client_update`` (calling ``train``), ``init_client``,
``server_update`` and its states. FedAvg's two settings can be pinned: a subclass
whose paper has no server learning rate or weighting declares ``server_lr: ClassVar[float] = 1.0`` (or
``weighting: ClassVar[str] = "uniform"``), which keeps FedAvg's computation with that value and removes the
hyperparameter (it is then no setting and not part of the run's identity).
Subclasses: FedProx and MOON (the objective), SCAFFOLD and MimeLite (the transform), FedDyn (both), FedAvgM and
FedLWS (the server; under ``spread="weighted_std"`` FedLWS's clients also upload per-layer squared norms), FedSGD
(one gradient instead of local steps) and pFedAFM (a personalised client). HaFedHo shares no state with FedAvg and
defines the contract (``core.algorithm.FedAlgorithm``) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from torch import Tensor

from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    FedAlgorithm,
    LocalResult,
    Model,
    Params,
    RoundInfo,
    Transform,
    aggregation_weight,
    hp,
    local_train,
    plain_objective,
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
class FedAvg(FedAlgorithm):
    name = "fedavg"
    logs_objective: ClassVar[bool] = False  # True where the objective hook is not f_i: log train/objective too
    server_lr: float = hp(1.0, "server learning rate eta_g applied to the averaged delta", gt=0)
    weighting: str = hp("data_size", "aggregation weight p_i", choices=("data_size", "uniform"))

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params)

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return Broadcast(server.params)

    def objective(self, model: Model, msg: Any, state: Any, info: ClientInfo, rnd: RoundInfo) -> Objective:
        """Hook: the local objective ``phi(w, x, y, mask) -> (phi, f)``; FedAvg's is the client's loss f_i."""
        return plain_objective(model)

    def transform(self, msg: Any, state: Any, info: ClientInfo, rnd: RoundInfo) -> Transform:
        """Hook: the local transform from gradient to step; FedAvg's is plain SGD, ``-eta_l g``."""
        return sgd(self.lr)

    def train(
        self, msg: Any, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> LocalResult:
        """The client's local steps from the broadcast model x_t: ``transform`` on ``objective``."""
        objective = self.objective(model, msg, state, info, rnd)
        return local_train(objective, msg.params, data, self.transform(msg, state, info, rnd))

    def train_metrics(self, res: LocalResult) -> dict[str, Tensor]:
        """What a client logs: the mean local loss, and the mean objective where it is not f_i."""
        if self.logs_objective:
            return {"train/loss": res.loss, "train/objective": res.objective}
        return {"train/loss": res.loss}

    def next_state(self, state: Any, res: LocalResult, delta: Params, info: ClientInfo, rnd: RoundInfo) -> Any:
        """Hook: the client's state after its local steps (``delta`` = y_i - x_t); FedAvg's clients keep none."""
        return state

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = self.train(msg, state, data, info, rnd, model)
        delta = tree.sub(res.params, msg.params)
        new_state = self.next_state(state, res, delta, info, rnd)
        return ClientResult(Upload(delta), aggregation_weight(info, self.weighting), new_state, self.train_metrics(res))

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        return ServerState(tree.axpy(self.server_lr, agg.delta, server.params)), {}
