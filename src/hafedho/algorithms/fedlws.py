"""FedLWS: Federated Learning with Adaptive Layer-wise Weight Shrinking.

Shi, Li, Zhao, Guo, Chang, ICLR 2025, arXiv:2503.15111 (method section: the shrinking factor
gamma = ||w_g|| / (beta tau ||eta_g g_g|| + ||w_g||), made layer-wise), checked against the authors' code.
Clients train as in FedAvg; after averaging, the server shrinks each layer of the new global model by a factor
gamma_l <= 1 (global weight shrinking: the aggregation weights of layer l sum to gamma_l instead of 1).

With the pseudo-gradient g = -Delta, the shrunk aggregate is
gamma (w_t - eta_g g) = w_t - [(1 - gamma) w_t + gamma eta_g g]. The paper sets the ratio of the regularisation
term to the optimisation term, (1 - gamma) ||w_t|| / (gamma ||eta_g g||), to beta tau, with tau the spread of the
clients' local updates around their mean; solved per layer l:

    gamma_l = ||w_t^l|| / ( ||w_t^l|| + clip(beta tau_l, tau_min, tau_max) * ||eta_g Delta^l|| )
    w_{t+1}^l = gamma_l (w_t^l + eta_g Delta^l),      Delta = sum_i p_i Delta_i / sum_i p_i

Spread, from one streaming weighted mean (each client uploads Delta_i and ||Delta_i^l||^2 per layer; no list of
uploads is held):
    tau_l = sqrt( E_p ||Delta_i^l||^2 - ||E_p Delta_i^l||^2 ) = sqrt( sum_i p_i ||Delta_i^l - Delta^l||^2 / sum_i p_i )

Symbols:
    w_t (``params``)       global model            Delta_i (``delta``)  y_i - w_t, client i's update
    tau_l                  spread of the Delta_i^l  beta (``beta``)      ratio coefficient
    tau_min, tau_max       clip of beta tau_l       eta_g (``server_lr``) server learning rate (1 = averaging)
    p_i                    |D_i| (``weighting="data_size"``, as the official code) or 1 (``"uniform"``)

Layers (``layers``): "module" (default) groups the parameters of one module (weight and bias of a Linear, Conv
or GroupNorm); "tensor" treats every parameter tensor as a layer; "bias_delimited" is the official code's rule
(github.com/ChanglongShi/FedLWS ``server_funct.py``): concatenate parameters in order and close a layer after
every name containing "bias", so a bias-free conv is grouped with the norm that follows it.

Differences from the official code: it computes the spread as the unweighted mean of
||Delta_i^l - mean_i Delta_i^l|| (a mean of norms, which needs every upload held at once); we use the p-weighted
standard deviation above, which equals it for two clients with equal weights and upper-bounds it otherwise.
It clips the product beta tau_l to [min_tau, max_tau] = [0.01, 0.2] with beta = 0.03: our defaults. A layer with
||w_t^l|| = 0 would get gamma_l = 0 and stay 0 forever; we leave such a layer unshrunk (gamma_l = 1).

Reduces to FedAvg exactly when beta = 0 and tau_min = 0 (then gamma_l = 1 for every layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from hafedho.algorithms.fedavg import Broadcast, FedAvg, ServerState
from hafedho.core import ClientData, ClientInfo, ClientResult, ConfigError, Model, Params, RoundInfo, hp, tree

__all__ = ["Broadcast", "FedLWS", "ServerState", "Upload", "layer_groups"]

# ServerState (w_t) and Broadcast (w_t) are FedAvg's.


class Upload(NamedTuple):
    delta: Params  # Delta_i = y_i - w_t
    sq_norm: dict[str, Tensor]  # layer -> ||Delta_i^l||^2 (0-d)


def layer_groups(names: list[str], rule: str) -> dict[str, list[str]]:
    """Layer key -> its parameter names, in model order."""
    groups: dict[str, list[str]] = {}
    if rule == "bias_delimited":
        current: list[str] = []
        for name in names:
            current.append(name)
            if "bias" in name:
                groups[name] = current
                current = []
        if current:
            groups[current[-1]] = current
        return groups
    for name in names:
        key = (name.rpartition(".")[0] or name) if rule == "module" else name
        groups.setdefault(key, []).append(name)
    return groups


@dataclass(frozen=True, kw_only=True)
class FedLWS(FedAvg):
    """FedAvg's clients, which also upload ||Delta_i^l||^2 per layer; the server shrinks the averaged model."""

    name = "fedlws"
    beta: float = hp(0.03, "coefficient beta of the ratio beta * tau_l", ge=0)
    tau_min: float = hp(0.01, "lower clip of beta * tau_l", ge=0)
    tau_max: float = hp(0.2, "upper clip of beta * tau_l", ge=0)
    layers: str = hp("module", "what a layer is", choices=("module", "tensor", "bias_delimited"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau_min > self.tau_max:
            raise ConfigError(f"algorithm.tau_min={self.tau_min!r}: must be <= algorithm.tau_max={self.tau_max!r}")

    def client_update(
        self, msg: Broadcast, state: tuple, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = super().client_update(msg, state, data, info, rnd, model)  # FedAvg's local training and Delta_i
        delta = res.upload.delta
        groups = layer_groups(list(delta), self.layers)
        sq = {key: sum((delta[k] ** 2).sum() for k in names) for key, names in groups.items()}
        return res._replace(upload=Upload(delta, sq))

    def server_update(
        self, server: ServerState, agg: Upload | None, rnd: RoundInfo
    ) -> tuple[ServerState, dict[str, float]]:
        if agg is None:  # an empty round: nothing to apply
            return server, {}
        w, step = server.params, tree.scale(agg.delta, self.server_lr)
        new, gammas, ratios = {}, [], []
        for key, names in layer_groups(list(w), self.layers).items():
            w_norm = sum((w[k] ** 2).sum() for k in names).sqrt()
            mean_sq = sum((agg.delta[k] ** 2).sum() for k in names)
            tau = (agg.sq_norm[key] - mean_sq).clamp(min=0.0).sqrt()  # weighted std of the Delta_i^l
            ratio = (self.beta * tau).clamp(self.tau_min, self.tau_max)
            denom = w_norm + ratio * sum((step[k] ** 2).sum() for k in names).sqrt()
            gamma = torch.where(w_norm > 0, w_norm / torch.where(denom > 0, denom, 1.0), 1.0)
            for k in names:
                new[k] = gamma * (w[k] + step[k])
            gammas.append(gamma)
            ratios.append(ratio)
        g, r = torch.stack(gammas), torch.stack(ratios)
        metrics = {"server/gamma_mean": float(g.mean()), "server/gamma_min": float(g.min())}
        metrics["server/beta_tau_mean"] = float(r.mean())
        return ServerState({k: new[k] for k in w}), metrics
