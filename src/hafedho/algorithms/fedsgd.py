"""FedSGD: the large-batch synchronous SGD baseline of "Communication-Efficient Learning of Deep Networks
from Decentralized Data".

McMahan, Moore, Ramage, Hampson, Aguera y Arcas, AISTATS 2017, arXiv:1602.05629, Section 2 ("FederatedSGD"):
each selected client computes ONE gradient of its loss at the current model on its local data; the server
averages the gradients and takes one step.

Round t, cohort S_t of m clients:
    client k:  g_k = grad F_k(w_t), the masked-mean gradient over ALL of the client's local data at once
               (B = infinity: ``needs_full_pass``, ``data.full``, ``core.full_gradient``; no local steps)
    server:    w_{t+1} = w_t - eta sum_k p_k g_k / sum_k p_k

Symbols:
    w_t (``params``)   global model        eta (``lr``)   learning rate, applied on the server
    g_k (``grad``)     client gradient     p_k            n_k (``weighting="data_size"``, the paper) or 1

Named option ``batch``: "full" (the default, the paper's B = infinity) ignores the round's batches;
"batches" takes g_k over the S*B rows the runtime sampled for the round instead (drawn twice counts twice):
large-batch SGD on a sample, not the paper's FedSGD. The two coincide when the runtime plans exactly one local
epoch. Either way the gradient is one masked mean over all those rows, evaluated in blocks of the batch size.

Equals FedAvg with ONE local step on the same examples as one batch and the same eta and weighting (FedAvg
with E = 1, B = infinity: one step of batch >= n_k; "batches": S = 1, B = S*B): FedAvg's Delta_k = -eta g_k, so
its server step is the same, up to float rounding (the rows are summed in another order), for models without
BatchNorm (whose batch statistics would be those of each block).
An empty round changes nothing.

Diff from FedAvg: one full-batch gradient replaces the local steps (``client_update``), and the server steps along
the averaged gradient with eta (``lr``); the states, ``init_server``, ``broadcast`` and ``weighting`` are FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from hafedho.algorithms.fedavg import Broadcast, FedAvg, ServerState
from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    Model,
    Params,
    RoundInfo,
    aggregation_weight,
    full_gradient,
    hp,
    tree,
)

__all__ = ["Broadcast", "FedSGD", "ServerState", "Upload"]

# ServerState (w_t) and Broadcast (w_t) are FedAvg's.


class Upload(NamedTuple):
    grad: Params  # g_k = grad F_k(w_t)


@dataclass(frozen=True, kw_only=True)
class FedSGD(FedAvg):
    """FedAvg's states; each client sends one gradient at w_t instead of running local steps, the server steps along
    their mean."""

    name = "fedsgd"
    server_lr: ClassVar[float] = 1.0  # not a setting: the server's step is eta (lr) itself
    lr: float = hp(0.05, "learning rate eta of the server step w <- w - eta g (no local steps)", gt=0)
    weighting: str = hp("data_size", "aggregation weight p_k", choices=("data_size", "uniform"))
    batch: str = hp(
        "full",
        "g_k over: full (all local data, B = infinity; paper) or batches (the round's S x B sampled rows)",
        choices=("full", "batches"),
    )

    @property
    def needs_full_pass(self) -> bool:
        return self.batch == "full"

    def client_update(
        self, msg: Broadcast, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        g, f = full_gradient(model, msg.params, self.full_data(data) if self.needs_full_pass else data)
        weight = aggregation_weight(info, self.weighting)
        return ClientResult(Upload(g), weight, state, {"train/loss": f})

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        return ServerState(tree.axpy(-self.lr, agg.grad, server.params)), {}
