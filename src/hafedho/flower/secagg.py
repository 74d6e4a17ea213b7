"""Secure aggregation (SecAgg+, Bell et al. arXiv 2009.11248) of a round's uploads on Flower's deployment engine.

The server sees only the sum of the cohort's uploads, never one client's. This is a thin adapter between the
project's one round loop (``HafedhoStrategy`` over ``rounds.ServerRounds``) and flwr 1.42's
``SecAggPlusWorkflow``, which still speaks the legacy strategy interface (``LegacyContext``, ``FitIns``/``FitRes``):

    round t   strategy.configure_train (ServerRounds.begin: cohort, broadcast, nodes)  ->  one FitIns per node
              SecAggPlusWorkflow: setup, share keys, collect masked vectors (the ClientApp trains here), unmask
              the unmasked sum  ->  the aggregate  ->  strategy.finish_train (ServerRounds.finish_round)
              evaluation, metrics row, checkpoint: the strategy's own methods, as without SecAgg+

Weighted sum under SecAgg+. Client i uploads the vector ``x_i = [s_i, s_i u_i]`` with s_i = w_i / K, where w_i
is the algorithm's aggregation weight and K (``weight_scale``) the largest weight any client of the federation
gets, public, so s_i <= 1. SecAgg+ returns the mean of the quantised x_i over the clients whose masked vectors
arrived (with num_examples = max_weight = 1 its own weighting is uniform and exact), and the server takes
``sum_i s_i u_i / sum_i s_i = sum_i w_i u_i / sum_i w_i``, the algorithm's ``WeightedMean``; the count of
clients cancels.

Quantisation. Each entry is clipped to [-c, c] (c = ``clipping-range``; automatic: ``clipping_for``) and mapped
to an integer in [0, Q] (Q = ``quantization-range``) by stochastic rounding, then masked mod 2^32. An entry's error
in the mean is below delta = 2c/Q, so each entry of the aggregate a is off by less than ``aggregate_error_bound`` =
delta (1 + max|a|) / (mean s_i - delta). Sums must not wrap: m Q < 2^32 for a cohort of m; the default Q is the
largest power of two allowed (at most 2^30: flwr rounds into int32). An entry beyond c is never clipped silently:
the client counts such entries, the count travels with its metrics, and the server stops the run with one line.

Excluded: algorithms whose aggregator is not a ``WeightedMean`` of the uploads (they need each client's upload on
the server): FedLWS with spread="official" (its tau_l is the mean distance of each Delta_i to their mean).

This module holds what both sides agree on (the settings, the weight scale, the bounds) and the client's half
(the vector it uploads, its FitRes-shaped reply, the mod); ``flower/secagg_server.py`` holds the server's half
(``SecureRounds``: a round through ``SecAggPlusWorkflow`` and the aggregate back out of its mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import Code, FitRes, Status, log
from flwr.compat.common import recorddict_compat as compat
from torch.utils import _pytree as pytree

from hafedho.config import ConfigError
from hafedho.core import WeightedMean
from hafedho.experiment import Experiment
from hafedho.flower import codec

MODULUS = 2**32  # SecAgg+'s mask modulus: sums of quantised entries must stay below it
MAX_QUANTIZATION = 2**30  # flwr rounds into int32
FITINS_PARAMS, FITINS_CONFIG = "fitins.parameters", "fitins.config"  # flwr's legacy record keys
WEIGHT_SCALE, CLIP = "secagg-weight-scale", "secagg-clip"  # in each FitIns config
PID, ROUND, CLIPPED = "hafedho.partition-id", "hafedho.server-round", "hafedho.secagg-clipped"  # in FitRes.metrics
STATE_LOST = "hafedho.state-lost"  # in FitRes.metrics: 1 when the node trained from init_client (node_store)


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters (run config ``secagg-*``); 0 means the documented automatic value."""

    num_shares: int = 0  # shares of each client's secrets; 0 = the whole cohort
    reconstruction_threshold: int = 0  # shares that rebuild a secret; 0 = 2/3 of the shares, at least 2
    clipping_range: float = 0.0  # c: every entry of s_i u_i must lie in [-c, c]; 0 = ``clipping_for``
    quantization_range: int = 0  # Q; 0 = the largest power of two <= 2^30 with m Q < 2^32

    def __post_init__(self) -> None:
        if self.num_shares != 0 and self.num_shares < 3:
            raise ConfigError(f"secagg-num-shares={self.num_shares}: use 0 (the whole cohort) or at least 3")
        if self.reconstruction_threshold != 0 and self.reconstruction_threshold < 2:
            raise ConfigError(f"secagg-reconstruction-threshold={self.reconstruction_threshold}: use 0 (2/3) or >= 2")
        if self.num_shares and self.reconstruction_threshold >= self.num_shares:
            raise ConfigError(
                f"secagg-reconstruction-threshold={self.reconstruction_threshold} must be below "
                f"secagg-num-shares={self.num_shares}"
            )
        if not (math.isfinite(self.clipping_range) and self.clipping_range >= 0):
            raise ConfigError(f"secagg-clipping-range={self.clipping_range}: use 0 (automatic) or a positive bound")
        if not 0 <= self.quantization_range <= MAX_QUANTIZATION:
            raise ConfigError(
                f"secagg-quantization-range={self.quantization_range}: use 0 (automatic) or 1..{MAX_QUANTIZATION}"
            )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> SecAggSettings | None:
        """The settings of a run config, or None when ``secagg`` is off."""
        from hafedho.flower.common import run_setting

        if not bool(run_setting(run_config, "secagg")):
            return None
        return cls(
            int(run_setting(run_config, "secagg-num-shares")),
            int(run_setting(run_config, "secagg-reconstruction-threshold")),
            float(run_setting(run_config, "secagg-clipping-range")),
            int(run_setting(run_config, "secagg-quantization-range")),
        )

    def quantization_for(self, m: int) -> int:
        """Q for a cohort of m: as set, checked against m Q < 2^32, or the largest power of two that fits."""
        if m < 2:
            raise ConfigError(f"SecAgg+ needs at least 2 clients per round, the cohort has {m}; sample more clients")
        if self.quantization_range == 0:
            return min(MAX_QUANTIZATION, 2 ** math.floor(math.log2((MODULUS - 1) / m)))
        if m * self.quantization_range >= MODULUS:
            raise ConfigError(
                f"secagg-quantization-range={self.quantization_range} overflows the 2^32 mask modulus for a cohort "
                f"of {m}; use at most {(MODULUS - 1) // m} or 0 (automatic)"
            )
        return self.quantization_range

    def clipping_for(self, exp: Experiment) -> float:
        """c as set, or automatic: 2^ceil(log2(max(8, 4 lambda))), lambda the most local steps of any client.

        Why: HaFedHo's g_i sums lambda batch gradients, so |g_i| <= lambda max|grad f|; measured over 100 rounds of
        the default config (digits, MLP, lambda = 10) every algorithm's max|s_i u_i| per local step is below 0.6
        (HaFedHo: 5.49 in all), so 4 lambda leaves >= 6x headroom, and FedAvg-like deltas (lr times the sum) far more.
        """
        if self.clipping_range > 0:
            return self.clipping_range
        lam = int(max(exp.plan.steps_for(int(n)) for n in exp.fed.sizes))
        return float(2 ** math.ceil(math.log2(max(8, 4 * lam))))

    def workflow(self, m: int, timeout: float, clip: float) -> Any:
        from flwr.server.workflow import SecAggPlusWorkflow

        return SecAggPlusWorkflow(
            self.num_shares or 1.0,  # flwr: a float is a share of the cohort
            self.reconstruction_threshold or 2 / 3,
            max_weight=1.0,
            clipping_range=clip,
            quantization_range=self.quantization_for(m),
            modulus_range=MODULUS,
            timeout=timeout,
        )


def delta(settings: SecAggSettings, m: int, clip: float) -> float:
    """The largest quantisation error of one entry of the mean of the x_i: one level, 2c/Q."""
    return 2 * clip / settings.quantization_for(m)


def aggregate_error_bound(d: float, mean_s: float, max_abs_aggregate: float) -> float:
    """Bound on |a' - a| per entry, a = S_u / S_s, when each of the means S_u/m and S_s/m is off by less than d."""
    return d * (1.0 + max_abs_aggregate) / max(mean_s - d, 1e-300)


def check_algorithm(exp: Experiment) -> None:
    """Refuse, in one line, an algorithm whose aggregate is not a weighted sum of the uploads."""
    agg = exp.alg.new_aggregator()
    if isinstance(agg, WeightedMean):
        return
    hint = " (algorithm.spread=weighted_std is a weighted sum)" if exp.alg.name == "fedlws" else ""
    raise ConfigError(
        f"secagg: {exp.alg.name}'s aggregator {type(agg).__name__} needs each client's upload on the server, which "
        f"SecAgg+ hides; run it without secagg{hint}"
    )


def weight_scale(exp: Experiment) -> float:
    """K: the weight the algorithm gives the federation's largest client (weights are 1, n_i or p_i, all grow
    with the client's size), from one client update on all-padding data (a no-op step); at least the weight of
    client 0's template."""
    from hafedho.flower.common import upload_template

    fed = exp.fed
    big = int(np.argmax(fed.sizes))
    _, w_big = upload_template(exp, fed.client_info(big))
    _, w_0 = upload_template(exp)
    return max(float(w_big), float(w_0), 1e-12)


# --------------------------------------------------------------------------------------------------- client


def client_vector(upload: Any, weight: torch.Tensor, scale: float, clip: float) -> tuple[list[np.ndarray], int]:
    """``[s_i, s_i u_i leaves...]`` in float64 (s_i = w_i / K) and the number of its entries outside [-c, c]."""
    s = float(weight) / scale
    if not 0.0 <= s <= 1.0 + 1e-9:
        raise ConfigError(
            f"this client's weight {float(weight)} exceeds the federation's largest ({scale}) that SecAgg+ was set "
            "up with; state the same weights on the server and the nodes"
        )
    # flat 1-D arrays: flwr 1.42's quantiser mishandles 0-d arrays (a scalar came back 10x too large)
    vec = [np.array([s])] + [
        s * leaf.detach().double().cpu().numpy().reshape(-1) for leaf in pytree.tree_leaves(upload)
    ]
    return vec, int(sum(int((~(np.abs(v) <= clip)).sum()) for v in vec))  # NaN counts: it is not in [-c, c]


def broadcast_record(msg: Message) -> ArrayRecord:
    """The broadcast's leaves from a FitIns record (flwr keys them 0, 1, ...; ours are codec keys)."""
    arrays = msg.content.array_records[FITINS_PARAMS]
    return ArrayRecord({codec._key(i): arr for i, arr in enumerate(arrays.values())})


def fit_reply(
    upload: Any, weight: torch.Tensor, config: ConfigRecord, metrics: dict[str, float], cid: int
) -> RecordDict:
    """The ClientApp's FitRes-shaped reply; ``secaggplus_mod`` quantises and masks its parameters."""
    from flwr.common import ndarrays_to_parameters

    clip = float(config[CLIP])
    vec, clipped = client_vector(upload, weight, float(config[WEIGHT_SCALE]), clip)
    if clipped:
        log(
            WARNING,
            "secagg: %d upload entries beyond the clipping range %g (largest |x| %.3g)",
            clipped,
            clip,
            max(float(np.abs(v).max()) for v in vec),
        )
    t = int(config["server-round"])
    meta = {**metrics, PID: cid, ROUND: t, CLIPPED: clipped}
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vec), 1, meta)
    return compat.fitres_to_recorddict(res, keep_input=False)


def client_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """flwr's ``secaggplus_mod`` for SecAgg+ messages; every other message goes straight to the ClientApp."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


__all__ = [
    "SecAggSettings",
    "aggregate_error_bound",
    "check_algorithm",
    "client_mod",
    "client_vector",
    "weight_scale",
]
