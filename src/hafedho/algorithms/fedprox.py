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

Diff from FedAvg: the ``objective`` hook; the server is FedAvg's with eta_g = 1 (the paper has no server learning
rate, so ``server_lr`` is pinned, not a setting). Reduces to FedAvg exactly when mu = 0 (same weighting): the
proximal gradient adds 0 * (y - x_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from hafedho.algorithms.fedavg import Broadcast, FedAvg, ServerState, Upload
from hafedho.core import ClientInfo, Model, Params, RoundInfo, hp, tree
from hafedho.core.types import Objective

__all__ = ["Broadcast", "FedProx", "ServerState", "Upload"]

# ServerState (x_t), Broadcast (x_t) and Upload (Delta_i = y_i - x_t) are FedAvg's.


@dataclass(frozen=True, kw_only=True)
class FedProx(FedAvg):
    """FedAvg on the proximal objective."""

    name = "fedprox"
    logs_objective = True
    server_lr: ClassVar[float] = 1.0  # not a setting: the paper's server averages
    mu: float = hp(0.01, "proximal strength mu in f_i(w) + mu/2 ||w - x_t||^2", ge=0)

    def objective(self, model: Model, msg: Broadcast, state: Any, info: ClientInfo, rnd: RoundInfo) -> Objective:
        """``phi(w) = f_i(w) + mu/2 ||w - x_t||^2``; x_t is a constant, w carries the gradient."""
        x_t = msg.params

        def phi(w: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            f = model.loss(w, x, y, m)
            return f + 0.5 * self.mu * tree.sq_norm(tree.sub(w, x_t)), f

        return phi
