"""Engines run one round's cohort: every client's update, streamed into the algorithm's aggregator.

``loop`` is the reference: a plain Python loop, any ``nn.Module``. Faster engines must agree with it:

* ``process`` (``hafedho.sim.process``): the cohort spread over a persistent pool of single-threaded worker
  processes; same results as ``loop`` up to float rounding, bit-identical for any number of workers.
* ``vmap`` (``hafedho.sim.vmap``): ``torch.func.vmap`` over chunks of the cohort (on a GPU when there is one);
  same results as ``loop`` up to float rounding for dropout-free models.
* ``auto``: ``vmap`` on a GPU, ``process`` on a multi-core CPU, ``loop`` otherwise.

Every engine adds the uploads into the aggregator in cohort order, so the float64 sums see the same
sequence of additions whatever the engine's internal schedule.

"Up to float rounding" means the bound of ``tests/tolerance.py`` (a few eps per operation, growing with the
reduction length and the number of steps) for smooth models. With ReLU or max pooling, a rounding difference
can flip a near-tie (one unit of one example), which moves that unit's gradient by O(1) in one step; engines
then agree in distribution (same accuracy), not to a float bound, and the tests compare smoothed models.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from hafedho.core import ClientInfo, ClientResult, FedAlgorithm, FunctionalModel, RoundInfo, tree
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.sim.seeds import seed_for
from hafedho.sim.store import ClientStore


@dataclass
class CohortResult:
    aggregate: Any  # the aggregated upload, None if nobody reported
    metrics: dict[str, float] = field(default_factory=dict)  # cohort means of the clients' metrics
    bytes_up: int = 0


class CohortStream:
    """Folds clients' results into the aggregator, metric sums and byte count; callers add in cohort order."""

    def __init__(self, alg: FedAlgorithm, size: int) -> None:
        self.agg = alg.new_aggregator()
        self.size = size
        self.sums: dict[str, float] = {}
        self.like: Any = None
        self.bytes_up = 0

    def add(self, upload: Any, weight: Any, metrics: dict[str, Any]) -> None:
        self.agg.add(tree.detach(upload), weight)
        self.like = upload
        self.bytes_up += tree.num_bytes(upload)
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def result(self) -> CohortResult:
        n = max(self.size, 1)
        return CohortResult(self.agg.result(self.like), {k: v / n for k, v in self.sums.items()}, self.bytes_up)


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


def loop_engine(work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
    """The reference engine: one client after another, states gathered from and scattered to ``store``."""
    stream = CohortStream(work.alg, len(cohort))
    work.model.train()
    for cid in cohort.tolist():
        res = work.client_update(cid, store.gather(cid))
        stream.add(res.upload, res.weight, res.metrics)
        store.scatter(cid, res.state)
    return stream.result()


class Engine(Protocol):
    """A round's cohort runner with the signature of ``loop_engine``; ``close()`` frees workers (idempotent)."""

    name: str

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult: ...

    def close(self) -> None: ...


class LoopEngine:
    """``loop_engine`` as an ``Engine`` (nothing to close)."""

    name = "loop"

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        return loop_engine(work, cohort, store)

    def close(self) -> None:
        pass

    def __enter__(self) -> LoopEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def auto_choice(model: FunctionalModel) -> str:
    """``vmap`` on a GPU (unless the model has BatchNorm), ``process`` on a multi-core CPU, else ``loop``."""
    if torch.cuda.is_available() and not has_batchnorm(model.module):
        return "vmap"
    return "process" if available_cores() >= 2 else "loop"


class AutoEngine:
    """Picks its engine at the first round, when the model is known (see ``auto_choice``); ``name`` tells which."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.inner: Engine | None = None
        self.name = "auto"

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        if self.inner is None:
            choice = auto_choice(work.model)
            self.inner = make_engine(choice, **self.options)
            self.name = f"auto:{choice}"
        return self.inner(work, cohort, store)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def __enter__(self) -> AutoEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _process(workers: int = 0, **_: Any) -> Engine:
    from hafedho.sim.process import ProcessEngine  # imported on demand: loop runs never load it

    return ProcessEngine(workers=workers)


def _vmap(vmap_chunk: int = 0, **_: Any) -> Engine:
    from hafedho.sim.vmap import VmapEngine

    return VmapEngine(chunk=vmap_chunk)


ENGINES: dict[str, Callable[..., Engine]] = {
    "loop": lambda **_: LoopEngine(),
    "process": _process,
    "vmap": _vmap,
    "auto": AutoEngine,
}


def make_engine(name: str, *, workers: int = 0, vmap_chunk: int = 0) -> Engine:
    """A fresh engine by config name; call ``close()`` (or use it as a context manager) when the run ends."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: choose one of {', '.join(map(repr, ENGINES))}")
    return ENGINES[name](workers=workers, vmap_chunk=vmap_chunk)
