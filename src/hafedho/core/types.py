"""The plain records that cross between an algorithm and the runtime, and the protocols of what it is handed.

An algorithm (``core.algorithm.FedAlgorithm``, the one contract) is a frozen dataclass of hyperparameters plus pure
functions over explicit state (optax's ``init/update``, FedJAX's ``init/apply``). It never sees where clients run:
the reference loop, a vectorised engine or a Flower client all call the same ``client_update``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from torch import Tensor

from hafedho.core.tree import Params


class RoundInfo(NamedTuple):
    """What every client and the server know about round t."""

    round: int  # t, 1-based
    num_clients: int  # N, the population
    cohort_size: int  # m, the clients sampled (server side: the uploads actually aggregated)


class ClientInfo(NamedTuple):
    """Per-client facts (batched along a leading dimension under vmap)."""

    weight: Tensor  # p_i = |D_i| / |D|, a 0-d float tensor
    num_examples: Tensor  # |D_i|, a 0-d float tensor


class ClientData(NamedTuple):
    """A client's local work for one round, built by the runtime; algorithms never build batches.

    ``full`` is the client's whole local data, its rows each once in partition order, as a masked
    ``ClientData`` ``[ceil(n_i / B), B, ...]`` (blocks of the round's batch size, which bound the memory of a pass
    over it; padded to the chunk's largest client under vmap). It is built only for an algorithm whose
    ``needs_full_pass`` is true (MimeLite's and SCAFFOLD option I's gradient at x, FedSGD's B = infinity), which
    reads it with ``core.full_gradient``; otherwise it is ``()``, an empty pytree, so that
    ``vmap(..., in_dims=0)`` over a ``ClientData`` still works.
    """

    x: Tensor  # [S, B, ...]  S local steps of batch B
    y: Tensor  # [S, B]
    mask: Tensor  # [S, B]  1 = real example, 0 = padding (unequal client sizes, unequal step counts)
    full: ClientData | tuple[()] = ()  # [ceil(n_i / B), B, ...]: all of the client's rows when asked for, else ()


class ClientResult(NamedTuple):
    upload: Any  # the algorithm's Upload (a NamedTuple of tensors / Params)
    weight: Tensor  # aggregation weight of this upload (0-d)
    state: Any  # the client's new ClientState
    metrics: dict[str, Tensor]  # scalars, averaged over the cohort by the runtime


class Model(Protocol):
    """The functional view of a network that algorithms use (built by the runtime from an ``nn.Module``)."""

    def logits(self, params: Params, x: Tensor) -> Tensor: ...

    def features(self, params: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(z, logits)`` with z the representation before the last layer."""
        ...

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """Masked mean cross-entropy of one batch (0 when the batch is all padding)."""
        ...

    def loss_from_logits(self, params: Params, logits: Tensor, y: Tensor, mask: Tensor) -> Tensor: ...

    def head(self, params: Params, z: Tensor) -> Tensor:
        """The final Linear layer applied to a representation z."""
        ...


class Aggregator(Protocol):
    """Streaming reduction of weighted uploads (``FedAlgorithm.new_aggregator``); ``result`` gives the aggregate,
    cast to the dtypes of ``like`` (default float32), or None if nothing arrived."""

    def add(self, upload: Any, weight: Tensor | float) -> None: ...

    def result(self, like: Any = None) -> Any: ...


Objective = Callable[[Params, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``objective(params, x, y, mask) -> (phi, f)``: the loss minimised locally and the plain model loss."""
