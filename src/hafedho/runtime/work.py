"""What every engine shares: the round's work, the cohort stream that folds results into the aggregator, the
result, and the ``Engine`` protocol."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils import _pytree as pytree

from hafedho.core import ClientInfo, ClientResult, FedAlgorithm, FunctionalModel, RoundInfo, tree
from hafedho.core.aggregate import add_stacked_or_each
from hafedho.core.seeds import seed_for
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.runtime.store import ClientStore


@dataclass
class CohortResult:
    aggregate: Any  # the aggregated upload, None if nobody reported
    metrics: dict[str, float] = field(default_factory=dict)  # cohort means of the clients' metrics
    bytes_up: int = 0


class CohortStream:
    """Folds clients' results into the aggregator, metric sums and byte count, in cohort order: one client at a
    time (``add``) or a stacked chunk of the cohort at once (``add_stacked``). Metric sums stay float64 tensors on
    the uploads' device until ``result``, so a round syncs with the host once, not once per client."""

    def __init__(self, alg: FedAlgorithm, size: int) -> None:
        self.agg = alg.new_aggregator()
        self.size = size
        self.sums: dict[str, Any] = {}
        self.like: Any = None
        self.bytes_up = 0

    def add(self, upload: Any, weight: Any, metrics: dict[str, Any]) -> None:
        self.agg.add(tree.detach(upload), weight)
        self.like = upload
        self.bytes_up += tree.num_bytes(upload)
        for k, v in metrics.items():
            self._sum(k, torch.as_tensor(v, dtype=torch.float64))

    def add_stacked(self, uploads: Any, weights: torch.Tensor, metrics: dict[str, Any]) -> None:
        """c clients' results at once: leaves ``[c, ...]``, weights and metrics ``[c]``."""
        uploads = tree.detach(uploads)
        add_stacked_or_each(self.agg, uploads, weights)
        self.like = pytree.tree_map(lambda t: t[0], uploads)
        self.bytes_up += tree.num_bytes(uploads)  # c uploads of a client's bytes each
        for k, v in metrics.items():
            self._sum(k, torch.as_tensor(v).detach().to(torch.float64).sum())

    def _sum(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = value if key not in self.sums else self.sums[key] + value.to(self.sums[key].device)

    def result(self) -> CohortResult:
        n = max(self.size, 1)
        return CohortResult(self.agg.result(self.like), {k: float(v) / n for k, v in self.sums.items()}, self.bytes_up)


@dataclass(frozen=True)
class RoundWork:
    """What every client of one round needs: the algorithm and its broadcast, the data, the model, the round."""

    alg: FedAlgorithm
    msg: Any
    fed: FederatedData
    plan: BatchPlan
    model: FunctionalModel
    rnd: RoundInfo
    seed: int

    def client_update(self, cid: int, state: Any, info: ClientInfo | None = None) -> ClientResult:
        """Client ``cid``'s update from ``state``, seeded as every engine seeds it (dropout pure in (seed, t, i));
        ``info`` defaults to the partition's (a Flower node may state its own)."""
        torch.manual_seed(seed_for(self.seed, "client_torch", self.rnd.round, cid))
        data = self.fed.client_data(self.seed, self.rnd.round, cid, self.plan, full=self.alg.needs_full_pass)
        info = self.fed.client_info(cid) if info is None else info
        return self.alg.client_update(self.msg, state, data, info, self.rnd, self.model)


class Engine(Protocol):
    """A round's cohort runner with the signature of ``loop_engine``; ``close()`` frees workers (idempotent).

    An engine whose workers hold cores of their own may say how many in ``cores`` (the process engine does): they
    idle between rounds, so the runner evaluates on them (``runner.server_threads``)."""

    name: str

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult: ...

    def close(self) -> None: ...


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
