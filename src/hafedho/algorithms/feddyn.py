"""FedDyn: Federated Learning Based on Dynamic Regularization.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, ICLR 2021, arXiv:2111.04263 (Algorithm 1).

Round t, active set P_t of m clients out of N; server state (theta^{t-1}, h^{t-1}), h^0 = 0; client state
grad L_k (0 before the client's first round):
    client k:  theta_k^t = argmin_theta  L_k(theta) - <grad L_k(theta_k^{t-1}), theta>
                                         + alpha/2 ||theta - theta^{t-1}||^2        (local SGD steps from theta^{t-1})
               grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})
               upload Delta_k = theta_k^t - theta^{t-1}
    server:    h^t = h^{t-1} - alpha (1/N) sum_{k in P_t} Delta_k       (= - alpha (m/N) mean_k Delta_k)
               theta^t = (1/m) sum_{k in P_t} theta_k^t - h^t / alpha   (= theta^{t-1} + mean_k Delta_k - h^t/alpha)

Symbols:
    theta^t (``params``)    global (cloud) model       alpha (``alpha``)   dynamic regulariser strength
    h^t (``h``)             server state               eta_l (``lr``)      local learning rate
    grad L_k (``grad_l``)   client's linear term       m, N                uploads aggregated, population

The whole local objective is differentiated inside ``local_train``: the linear term contributes -grad L_k
and the quadratic alpha (theta - theta^{t-1}) to every step (penalties built from detached tensors, a known
bug of popular implementations, never move a parameter). Facts (each is a test): clients not sampled keep grad L_k
exactly; h^t = (1/N) sum_k grad L_k over all N clients at every round.

Official code (github alpemreacar/FedDyn, ``train_FedDyn``) versus Algorithm 1, exposed as options:
    alpha_scaling   "none" (the paper); "data_size": client k uses alpha_k = alpha / (N p_k), p_k = |D_k|/|D|,
                    in its objective and its grad L_k update (the code's ``alpha_coef / weight_list``); the
                    server keeps alpha, as the code's h/alpha does not depend on alpha_k.
    max_grad_norm   None (the paper); a float clips each step's gradient to that global L2 norm (the code uses
                    10 for every method). Here the whole objective's gradient is clipped; the code clips
                    grad L_k(theta) - grad L_k(theta_k^{t-1}) - alpha_k theta^{t-1} and adds alpha_k theta after
                    the clip (its quadratic is the optimiser's weight decay), which differs only while clipping.
The code's plain mean over the active clients and its h (the mean of all N clients' -grad L_k / alpha)
agree with Algorithm 1.

Diff from FedAvg: the ``objective`` hook (the linear and quadratic terms), the ``transform`` hook (SGD, clipped
with ``max_grad_norm``), the client state grad L_k (``next_state``), uniform weights (``weighting`` pinned) and
the server's h; Broadcast and Upload are FedAvg's. Never reduces to FedAvg: as alpha -> 0 the local steps become
FedAvg's, but -h/alpha is the running sum of (1/N) sum_k Delta_k over all rounds and still shifts the server model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from hafedho.algorithms.fedavg import Broadcast, FedAvg, Upload
from hafedho.core import (
    ClientInfo,
    LocalResult,
    Model,
    Params,
    RoundInfo,
    Transform,
    chain,
    hp,
    sgd,
    tree,
)
from hafedho.core.types import Objective

__all__ = ["Broadcast", "ClientState", "FedDyn", "ServerState", "Upload", "clip_by_global_norm"]


class ServerState(NamedTuple):
    params: Params  # theta^{t-1}
    h: Params  # h^{t-1}


# Broadcast (theta^{t-1}; h never leaves the server) and Upload (Delta_k = theta_k^t - theta^{t-1}) are FedAvg's.


class ClientState(NamedTuple):
    grad_l: Params  # grad L_k(theta_k^{t-1}), zeros before the client's first round


def clip_by_global_norm(max_norm: float) -> Transform:
    """``g <- g * min(1, max_norm / (||g|| + 1e-6))`` (torch's ``clip_grad_norm_``), branch-free."""

    def update(g: Params, s: tuple, p: Params) -> tuple[Params, tuple]:
        return tree.scale(g, (max_norm / (tree.sq_norm(g).sqrt() + 1e-6)).clamp(max=1.0)), s

    return Transform(lambda p: (), update)


@dataclass(frozen=True, kw_only=True)
class FedDyn(FedAvg):
    """FedAvg's local steps on the dynamically regularised objective; the server keeps h."""

    name = "feddyn"
    logs_objective = True
    server_lr: ClassVar[float] = 1.0  # not a setting: theta^t is the mean theta_k^t - h^t / alpha
    weighting: ClassVar[str] = "uniform"  # not a setting: Algorithm 1 averages the active clients uniformly
    alpha: float = hp(0.01, "dynamic regulariser strength alpha", gt=0)
    alpha_scaling: str = hp(
        "none", "client alpha: alpha (paper) or alpha / (N p_k) (official code)", choices=("none", "data_size")
    )
    max_grad_norm: float | None = hp(None, "clip each local gradient to this L2 norm; None = no clipping", gt=0)

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, tree.zeros_like(params))

    def init_client(self, params: Params) -> ClientState:
        return ClientState(tree.zeros_like(params))

    def client_alpha(self, info: ClientInfo, rnd: RoundInfo) -> Tensor:
        alpha = torch.full_like(info.weight, self.alpha)
        return alpha / (rnd.num_clients * info.weight) if self.alpha_scaling == "data_size" else alpha

    def objective(
        self, model: Model, msg: Broadcast, state: ClientState, info: ClientInfo, rnd: RoundInfo
    ) -> Objective:
        """``phi(w) = L_k(w) - <grad L_k, w> + alpha/2 ||w - theta^{t-1}||^2``; every term carries w's gradient."""
        theta_t, grad_l, alpha = msg.params, state.grad_l, self.client_alpha(info, rnd)

        def phi(w: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            f = model.loss(w, x, y, m)
            return f - tree.dot(grad_l, w) + 0.5 * alpha * tree.sq_norm(tree.sub(w, theta_t)), f

        return phi

    def transform(self, msg: Broadcast, state: ClientState, info: ClientInfo, rnd: RoundInfo) -> Transform:
        """FedAvg's SGD, on the gradient clipped to ``max_grad_norm`` when that is set."""
        if self.max_grad_norm is None:
            return sgd(self.lr)
        return chain(clip_by_global_norm(self.max_grad_norm), sgd(self.lr))

    def next_state(
        self, state: ClientState, res: LocalResult, delta: Params, info: ClientInfo, rnd: RoundInfo
    ) -> ClientState:
        """``grad_L_i <- grad_L_i - alpha (theta_i - theta^{t-1})``."""
        return ClientState(tree.axpy(-self.client_alpha(info, rnd), delta, state.grad_l))

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        h = tree.axpy(-self.alpha * rnd.cohort_size / rnd.num_clients, agg.delta, server.h)
        params = tree.axpy(-1.0 / self.alpha, h, tree.add(server.params, agg.delta))
        return ServerState(params, h), {"server/h_norm": float(tree.sq_norm(h).sqrt())}
