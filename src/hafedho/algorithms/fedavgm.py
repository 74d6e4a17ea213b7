"""FedAvgM: Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification.

Hsu, Qi, Brown, arXiv:1909.06335, Section 4.2 ("Federated Averaging with Server Momentum"): FedAvg's local
training, with heavy-ball momentum on the server applied to the averaged client update.

Round t, cohort S_t of m clients:
    client i:  y_i <- x_t;  K steps  y_i <- y_i - eta_l grad f_i(y_i; batch);  upload Delta_i = y_i - x_t
    server:    Delta_w = -sum_i p_i Delta_i / sum_i p_i  (= x_t - weighted mean of the y_i, the paper's Delta w)
               v <- beta v + Delta_w
               x_{t+1} = x_t - eta_g v                          (heavy ball, the paper)
               x_{t+1} = x_t - eta_g (beta v + Delta_w)         (nesterov = true)

Sign convention: clients upload Delta_i = y_i - x_t as in FedAvg here; the server's Delta_w and v are in the
paper's pseudo-gradient direction (plain FedAvg is x <- x - Delta_w), so v points *against* the update.

Symbols:
    x_t (``params``)   global model             eta_l (``lr``)          local learning rate
    v (``v``)          server momentum buffer   beta (``beta``)         server momentum
    Delta_w            averaged pseudo-gradient eta_g (``server_lr``)   server step
    p_i                |D_i| (``weighting="data_size"``, the paper's n_k/n) or 1 (``"uniform"``)

The paper writes x <- x - v, i.e. eta_g = 1 (the default); eta_g is the server learning rate of Reddi et al.
(arXiv:2003.00295) and of Flower's FedAvgM. The paper discusses the effective rate eta_eff = eta_l / (1 - beta).
v accumulates Delta_w itself (not (1 - beta) Delta_w, a known divergence from the paper in APPFL's FedAvgM).

``nesterov = true`` (not in the paper) is Nesterov's momentum in the form of Sutskever et al. (ICML 2013) and of
PyTorch's SGD(nesterov=True): the step looks one momentum step ahead. When Delta_w is linear in x_t (Jacobian J,
as on a quadratic), x_{t+1} - x_t = beta (I - eta_g J)(x_t - x_{t-1}) - eta_g Delta_w(x_t): the momentum factor is
beta (I - eta_g J) rather than beta, damped along curved directions, which is what HaFedHo's look-ahead does to
its own server momentum (docs/algorithms.md, "What is left: the look-ahead"); the `momentum` preset compares them.

Diff from FedAvg: the server, which runs the clients' own transform ``core.local.sgd(eta_g, momentum=beta,
nesterov)`` on Delta_w (``server_transform``; ``core.local.server_step``), its buffer v kept in ``ServerState``.
Reduces to FedAvg exactly when beta = 0 (same ``weighting`` and ``server_lr``; eta_g = 1: plain FedAvg).
An empty round changes nothing (v is not decayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hafedho.algorithms.fedavg import Broadcast, FedAvg, Upload
from hafedho.core import Params, RoundInfo, Transform, hp, server_step, sgd, tree

__all__ = ["Broadcast", "FedAvgM", "ServerState", "Upload"]


class ServerState(NamedTuple):
    params: Params  # x_t
    v: Params  # server momentum buffer of pseudo-gradients


# Broadcast (x_t only; v stays on the server) and Upload (Delta_i = y_i - x_t) are FedAvg's.


@dataclass(frozen=True, kw_only=True)
class FedAvgM(FedAvg):
    """FedAvg's clients (``broadcast``, ``client_update``, ``weighting``); only the server update differs."""

    name = "fedavgm"
    beta: float = hp(0.9, "server momentum beta in v <- beta v + Delta_w (0 = FedAvg)", ge=0, lt=1)
    server_lr: float = hp(1.0, "server learning rate eta_g in x <- x - eta_g v (the paper: 1)", gt=0)
    nesterov: bool = hp(False, "Nesterov's look-ahead step x <- x - eta_g (beta v + Delta_w) (false: the paper)")

    def server_transform(self) -> Transform:
        """Heavy ball on Delta_w: ``v <- beta v + Delta_w``, update ``-eta_g v`` (or ``-eta_g (beta v + Delta_w)``)."""
        return sgd(self.server_lr, momentum=self.beta, nesterov=self.nesterov)

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, self.server_transform().init(params))  # v = 0

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        params, v = server_step(self.server_transform(), server.params, agg.delta, server.v)  # fed -mean Delta_i
        return ServerState(params, v), {"server/v_norm": float(tree.sq_norm(v).sqrt())}
