"""MimeLite: Breaking the centralized barrier for cross-device federated learning.

Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich, Suresh, NeurIPS 2021, arXiv:2008.03606 (first titled "Mime:
Mimicking Centralized Stochastic Algorithms in Federated Learning"), Algorithm 1 (MimeLite lines) with the
base optimiser SGD with momentum. Clients apply the server's optimiser state *frozen*; only the
server updates it, from full-batch gradients at the round-start model, so local steps mimic centralised SGDm.

Round t, cohort S of m clients, broadcast (x, m):
    client i:  y_i <- x;  K steps  y_i <- y_i - eta ((1 - beta) g_i(y_i; batch) + beta m)    (m frozen)
               c_i = grad f_i(x), the full-batch gradient at x over ALL of the client's local data
                     (one extra pass: ``needs_full_pass``, ``data.full``, ``core.full_gradient``)
               upload (Delta_i = y_i - x, c_i)
    server:    x <- x + eta_g sum_i p_i Delta_i / sum_i p_i          (eta_g = 1: x <- mean_i y_i, the paper)
               m <- (1 - beta) sum_i p_i c_i / sum_i p_i + beta m     (m uses the OLD x's gradients)

Symbols:
    x (``params``)   global model              eta (``lr``)           local learning rate
    m (``m``)        server momentum, frozen    beta (``beta``)        momentum
    Delta_i          y_i - x                    eta_g (``server_lr``)  server step on the averaged delta
    c_i (``grad``)   grad f_i(x), full batch    p_i                    |D_i| (``"data_size"``) or 1 (``"uniform"``)

Where implementations differ from the paper (named options):
    momentum_form  "ema" (the paper's SGDm): U = (1-beta) g + beta m, V: m <- (1-beta) c + beta m.
                   "heavy_ball" (FedJAX ``mime_lite`` / TFF ``build_weighted_mime_lite`` with an sgdm base
                   optimiser): U = g + beta m, V: m <- c + beta m. heavy_ball with lr (1-beta) eta follows
                   exactly the trajectory of ema with lr eta (its m is ema's m / (1-beta)), so tuned learning
                   rates do not carry over between the two forms.
    weighting      Algorithm 1 writes 1/|S| ("uniform"); FedJAX and TFF weight both the deltas and the
                   gradients by example counts ("data_size", the default, as FedAvg here). One weight per
                   upload, so the deltas and the gradients are always averaged with the same p_i.
    stats          "full" (the paper, and FedJAX ``mime_lite``'s pass over the client's whole dataset): c_i is
                   the masked-mean gradient at x over every local row once. "batches": over the rows the
                   runtime sampled for this round's steps (S x B, drawn twice counts twice; no extra pass),
                   an approximation. The two coincide when the runtime plans exactly one local epoch.

Diff from FedAvg: the ``transform`` hook (the frozen momentum mixed into each step), the momentum in the broadcast,
c_i in the upload and the server's momentum update; the model step, ``server_lr`` and ``weighting`` are FedAvg's.
Reduces to FedAvg (same ``weighting`` and ``server_lr``) when beta = 0, exactly: U = 1 g + 0 m.
An empty round changes nothing (m is not decayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hafedho.algorithms.fedavg import FedAvg
from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    Model,
    Params,
    RoundInfo,
    Transform,
    chain,
    full_gradient,
    hp,
    mix,
    sgd,
    tree,
)


class ServerState(NamedTuple):
    params: Params  # x
    m: Params  # server momentum m


Broadcast = ServerState  # the wire payload is (x, m)


class Upload(NamedTuple):
    delta: Params  # Delta_i = y_i - x
    grad: Params  # c_i = grad f_i(x), full batch over the client's local data (``stats``)


@dataclass(frozen=True, kw_only=True)
class MimeLite(FedAvg):
    """FedAvg's local steps mixing in the frozen server momentum; the server also updates the momentum."""

    name = "mimelite"
    lr: float = hp(0.05, "local learning rate eta of the mimicked SGDm steps", gt=0)
    beta: float = hp(0.9, "momentum beta of the mimicked SGDm (0 = FedAvg)", ge=0, lt=1)
    momentum_form: str = hp(
        "ema", "ema: (1-beta) g + beta m (paper); heavy_ball: g + beta m (FedJAX/TFF)", choices=("ema", "heavy_ball")
    )
    server_lr: float = hp(1.0, "server learning rate eta_g on the averaged delta (1 = mean of y_i)", gt=0)
    stats: str = hp(
        "full",
        "c_i = grad f_i(x) over: full (all local data, one extra pass; paper) or batches (the round's sampled rows)",
        choices=("full", "batches"),
    )

    @property
    def needs_full_pass(self) -> bool:
        return self.stats == "full"

    @property
    def grad_coef(self) -> float:
        """The factor of the fresh gradient in U and V: 1 - beta (ema) or 1 (heavy_ball)."""
        return 1.0 - self.beta if self.momentum_form == "ema" else 1.0

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, tree.zeros_like(params))

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return server

    def transform(self, msg: Broadcast, state: Any, info: ClientInfo, rnd: RoundInfo) -> Transform:
        """``-eta (grad_coef g + beta m)`` with m frozen for all K steps."""
        return chain(mix(msg.m, self.grad_coef, self.beta), sgd(self.lr))

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = super().client_update(msg, state, data, info, rnd, model)  # FedAvg's Delta_i, weight and metrics
        c_i, _ = full_gradient(model, msg.params, self.full_data(data) if self.needs_full_pass else data)
        return res._replace(upload=Upload(res.upload.delta, c_i))

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        params = tree.axpy(self.server_lr, agg.delta, server.params)
        m = tree.axpy(self.grad_coef, agg.grad, tree.scale(server.m, self.beta))
        return ServerState(params, m), {"server/m_norm": float(tree.sq_norm(m).sqrt())}
