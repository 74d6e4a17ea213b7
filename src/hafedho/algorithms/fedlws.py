"""FedLWS: Federated Learning with Adaptive Layer-wise Weight Shrinking.

Shi, Li, Zhao, Guo, Chang, ICLR 2025, arXiv:2503.15111 (method section: the shrinking factor
gamma = ||w_g|| / (beta tau ||eta_g g_g|| + ||w_g||), made layer-wise), checked against the authors' code
(github.com/ChanglongShi/FedLWS, ``server_funct.py``, function ``fedlws``).
Clients train as in FedAvg; after averaging, the server shrinks each layer of the new global model by a factor
gamma_l <= 1 (global weight shrinking: the aggregation weights of layer l sum to gamma_l instead of 1).

With the pseudo-gradient g = -Delta, the shrunk aggregate is
gamma (w_t - eta_g g) = w_t - [(1 - gamma) w_t + gamma eta_g g]. The paper sets the ratio of the regularisation
term to the optimisation term, (1 - gamma) ||w_t|| / (gamma ||eta_g g||), to beta tau, with tau the spread of the
clients' local updates; solved per layer l:

    gamma_l = ||w_t^l|| / ( ||w_t^l|| + clip(beta tau_l, tau_min, tau_max) * ||eta_g Delta^l|| )
    w_{t+1}^l = gamma_l (w_t^l + eta_g Delta^l),      Delta = sum_i p_i Delta_i / sum_i p_i

Spread tau_l (``spread``), over the round's m clients:
    "official" (default, the authors' code): the unweighted mean distance to the unweighted mean update,
        tau_l = (1/m) sum_i || Delta_i^l - (1/m) sum_j Delta_j^l ||
        (unweighted even when the average Delta is p-weighted, as in the code). A mean of norms about a mean
        that is known only once every upload is in: the aggregator holds the round's m uploads (m model copies,
        as the official server holds the m local models).
    "weighted_std": the p-weighted standard deviation from one streaming weighted mean (each client also
        uploads ||Delta_i^l||^2 per layer; no upload is held):
        tau_l = sqrt(E_p ||Delta_i^l||^2 - ||E_p Delta_i^l||^2) = sqrt(sum_i p_i ||Delta_i^l - Delta^l||^2 / sum_i p_i)
    The two agree for two clients of equal weight and differ otherwise, in either direction: weights
    (0.99, 0.01) and scalar updates (0, 1) give 0.5 (official) and sqrt(0.99 * 0.01) = 0.0995 (weighted_std);
    equal weights and updates (0, 0, 3) give 4/3 and sqrt(2) = 1.414.

Layers (``layers``): which parameters share one gamma_l.
    "bias_delimited" (default, the authors' rule): walk the parameters in model order and close a layer after
        every name containing "bias". A weight with its bias is one layer, and a bias-free conv shares its
        gamma with the norm layer that follows it: on ``resnet18_gn`` each conv + GroupNorm pair (and each
        shortcut conv + its GroupNorm) is one layer, 21 in all. Trailing parameters without a bias form a last
        layer (the authors' code would index past its list there).
    "module": the parameters of one module (a conv alone, a GroupNorm's weight and bias together).
    "tensor": every parameter tensor is a layer.

Symbols:
    w_t (``params``)       global model            Delta_i (``delta``)  y_i - w_t, client i's update
    tau_l                  spread of the Delta_i^l  beta (``beta``)      ratio coefficient
    tau_min, tau_max       clip of beta tau_l       eta_g (``server_lr``) server learning rate (1 = averaging)
    p_i                    |D_i| (``weighting="data_size"``, as the official code) or 1 (``"uniform"``)

Other differences from the official code: it clips the product beta tau_l to [min_tau, max_tau] = [0.01, 0.2]
with beta = 0.03 (our defaults); its parameters are the state_dict, so BatchNorm's running statistics are
grouped and shrunk too (our models have no buffers). A layer with ||w_t^l|| = 0 would get gamma_l = 0 and stay 0
forever; we leave such a layer unshrunk (gamma_l = 1).

Diff from FedAvg: the server (``server_update``, and ``new_aggregator`` for the official spread); the clients are
FedAvg's, and under spread="weighted_std" they also upload ||Delta_i^l||^2 (``client_update`` extends FedAvg's).
Reduces to FedAvg exactly (bit for bit, a test) when beta = 0 and tau_min = 0: then gamma_l = 1 for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hafedho.algorithms.fedavg import Broadcast, FedAvg, ServerState
from hafedho.algorithms.fedavg import Upload as DeltaUpload
from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    ConfigError,
    Model,
    Params,
    RoundInfo,
    WeightedMean,
    hp,
    tree,
)

__all__ = ["Aggregate", "Broadcast", "DeltaUpload", "FedLWS", "HeldUploads", "ServerState", "Upload", "layer_groups"]

# ServerState (w_t) and Broadcast (w_t) are FedAvg's; so is the upload under spread="official" (DeltaUpload).


class Upload(NamedTuple):
    """A client's upload under spread="weighted_std"."""

    delta: Params  # Delta_i = y_i - w_t
    sq_norm: dict[str, Tensor]  # layer -> ||Delta_i^l||^2 (0-d)


class Aggregate(NamedTuple):
    """What the server receives under spread="official"."""

    delta: Params  # Delta = sum_i p_i Delta_i / sum_i p_i
    spread: dict[str, Tensor]  # layer -> tau_l = (1/m) sum_i ||Delta_i^l - (1/m) sum_j Delta_j^l|| (0-d)


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


class HeldUploads:
    """Aggregator of spread="official": FedAvg's streaming weighted mean of the Delta_i, plus a copy of each
    Delta_i, because the official spread is a mean of distances to the unweighted mean, known only at the end."""

    def __init__(self, rule: str) -> None:
        self.rule = rule
        self.mean = WeightedMean()
        self.deltas: list[Params] = []

    def add(self, upload: DeltaUpload, weight: Tensor | float) -> None:
        self.mean.add(upload, weight)
        self.deltas.append({k: v.detach().clone() for k, v in upload.delta.items()})

    def result(self, like: Any = None) -> Aggregate | None:
        avg = self.mean.result(like)
        if avg is None:
            return None
        m = len(self.deltas)
        # float64, as WeightedMean: the statistic depends on the order of the uploads only at the final rounding
        center = {k: sum(d[k].double() for d in self.deltas) / m for k in avg.delta}
        spread = {}
        for key, names in layer_groups(list(avg.delta), self.rule).items():
            dist = [sum(((d[k].double() - center[k]) ** 2).sum() for k in names).sqrt() for d in self.deltas]
            spread[key] = (sum(dist) / m).to(avg.delta[names[0]].dtype)
        return Aggregate(avg.delta, spread)


@dataclass(frozen=True, kw_only=True)
class FedLWS(FedAvg):
    """FedAvg's clients (plus per-layer squared norms under spread="weighted_std"); the server shrinks each layer of
    the averaged model by gamma_l."""

    name = "fedlws"
    beta: float = hp(0.03, "coefficient beta of the ratio beta * tau_l", ge=0)
    tau_min: float = hp(0.01, "lower clip of beta * tau_l", ge=0)
    tau_max: float = hp(0.2, "upper clip of beta * tau_l", ge=0)
    spread: str = hp(
        "official",
        "tau_l: the authors' mean distance to the unweighted mean update (holds the round's uploads) or the "
        "streaming p-weighted standard deviation",
        choices=("official", "weighted_std"),
    )
    layers: str = hp(
        "bias_delimited",
        "what shares one gamma_l: the authors' rule (close a layer after each bias), a module, or a tensor",
        choices=("bias_delimited", "module", "tensor"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau_min > self.tau_max:
            raise ConfigError(f"algorithm.tau_min={self.tau_min!r}: must be <= algorithm.tau_max={self.tau_max!r}")

    def new_aggregator(self) -> WeightedMean | HeldUploads:
        return HeldUploads(self.layers) if self.spread == "official" else WeightedMean()

    def client_update(
        self, msg: Broadcast, state: tuple, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        res = super().client_update(msg, state, data, info, rnd, model)  # FedAvg's local training and Delta_i
        if self.spread == "official":
            return res
        delta = res.upload.delta
        groups = layer_groups(list(delta), self.layers)
        sq = {key: sum((delta[k] ** 2).sum() for k in names) for key, names in groups.items()}
        return res._replace(upload=Upload(delta, sq))

    def server_update(
        self, server: ServerState, agg: Aggregate | Upload, rnd: RoundInfo
    ) -> tuple[ServerState, dict[str, float]]:
        w, step = server.params, tree.scale(agg.delta, self.server_lr)
        new, gammas, ratios = {}, [], []
        for key, names in layer_groups(list(w), self.layers).items():
            w_norm = sum((w[k] ** 2).sum() for k in names).sqrt()
            if isinstance(agg, Aggregate):
                tau = agg.spread[key]
            else:  # weighted std of the Delta_i^l: E_p ||Delta_i^l||^2 - ||Delta^l||^2
                tau = (agg.sq_norm[key] - sum((agg.delta[k] ** 2).sum() for k in names)).clamp(min=0.0).sqrt()
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
