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
from hafedho.core.algorithm import ConfigError
from hafedho.core.seeds import seed_for
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.runtime.store import ClientStore


class WorkerLost(RuntimeError):
    """An engine's worker process ended in the middle of a round (killed, out of memory) or its connection was lost:
    nothing the run's code did, and ``--resume`` continues from the last checkpoint (the runner says so in one
    line). A client update that raised is another error, whose traceback the engine keeps."""


@dataclass
class CohortResult:
    aggregate: Any  # the aggregated upload, None if nobody reported
    metrics: dict[str, float] = field(default_factory=dict)  # cohort means of the clients' metrics
    bytes_up: int = 0


class CohortStream:
    """Folds clients' results into the aggregator, metric sums and byte count, in cohort order: one client at a
    time (``add``) or a stacked chunk of the cohort at once (``add_stacked``). Metric sums stay float64 tensors on
    the uploads' device until ``result``, so a round syncs with the host once, not once per client.

    Each upload is checked against ``like`` (an upload template, when given: same tree and shapes, as Flower's
    codec checks a reply), against the round's first upload (same tree, shapes and dtypes), and, with
    ``param_shapes`` (the model's parameter shapes by name), each leaf keyed by a parameter's name that is not a
    scalar must have that parameter's shape: so uploads that all agree with each other but not with the model
    (``delta['fc.weight']`` of [10, 1] for [10, 64]) are refused before they broadcast into it. The weights are
    checked at ``result``: finite, none negative, a positive sum (a zero sum leaves the model where it is)."""

    def __init__(
        self, alg: FedAlgorithm, size: int, like: Any = None, param_shapes: dict[str, tuple[int, ...]] | None = None
    ) -> None:
        self.agg = alg.new_aggregator()
        self.name = type(alg).__name__
        self.size = size
        self.sums: dict[str, Any] = {}
        self.like: Any = None
        self.bytes_up = 0
        self.template = None if like is None else (_leaf_specs(like), _leaf_paths(like))
        self.expected: Any = None  # the round's first upload's specs and paths
        self.param_shapes = param_shapes
        self.expected_paths: list[str] = []
        self.wmin: torch.Tensor | None = None  # float64 on the weights' device: no host sync per client
        self.wsum: torch.Tensor | None = None

    def add(self, upload: Any, weight: Any, metrics: dict[str, Any]) -> None:
        self._check(upload, stacked=False)
        self._weights(torch.as_tensor(weight).detach().to(torch.float64).reshape(-1))
        self.agg.add(tree.detach(upload), weight)
        self.like = upload
        self.bytes_up += tree.num_bytes(upload)
        for k, v in metrics.items():
            self._sum(k, torch.as_tensor(v, dtype=torch.float64))

    def add_stacked(self, uploads: Any, weights: torch.Tensor, metrics: dict[str, Any]) -> None:
        """c clients' results at once: leaves ``[c, ...]``, weights and metrics ``[c]``."""
        self._check(uploads, stacked=True)
        self._weights(torch.as_tensor(weights).detach().to(torch.float64).reshape(-1))
        uploads = tree.detach(uploads)
        add_stacked_or_each(self.agg, uploads, weights)
        self.like = pytree.tree_map(lambda t: t[0], uploads)
        self.bytes_up += tree.num_bytes(uploads)  # c uploads of a client's bytes each
        for k, v in metrics.items():
            self._sum(k, torch.as_tensor(v).detach().to(torch.float64).sum())

    def _check(self, upload: Any, stacked: bool) -> None:
        """The upload's tree and leaf shapes (without the stacked axis) against the template's, and its tree, shapes
        and dtypes against the round's first upload's (uploads of one round never broadcast into each other)."""
        got = _leaf_specs(upload, stacked)
        if self.template is not None:
            (spec, specs), paths = self.template
            shapes = (spec, [shape for shape, _ in specs])
            if (got[0], [shape for shape, _ in got[1]]) != shapes:  # same tree here: as many leaves as the template
                want = [(shape, d) for (shape, _), (_, d) in zip(specs, got[1], strict=got[0] == spec)]
                self._refuse(upload, got, (spec, want), paths)
        if self.expected is None:
            self._check_param_shapes(upload, got)
            self.expected, self.expected_paths = got, _leaf_paths(upload)
            return
        if got != self.expected:
            self._refuse(upload, got, self.expected, self.expected_paths)

    def _check_param_shapes(self, upload: Any, got: Any) -> None:
        """The round's first upload (the others must equal it): its non-scalar leaves keyed by a parameter's name
        have that parameter's shape (a scalar may be a per-layer number)."""
        if not self.param_shapes:
            return
        keyed = pytree.tree_flatten_with_path(upload)[0]
        for (path, _), (shape, dtype) in zip(keyed, got[1], strict=True):
            key = getattr(path[-1], "key", None) if path else None
            want = self.param_shapes.get(key) if isinstance(key, str) else None
            if want is not None and len(shape) > 0 and tuple(shape) != tuple(want):
                raise ConfigError(
                    f"algorithm {self.name}: upload leaf {pytree.keystr(path)} is {dtype}{list(shape)}, but parameter "
                    f"{key} is {list(want)}; an upload keyed by a parameter's name must have its shape (one of "
                    "another shape would broadcast into the model)"
                )

    def _refuse(self, upload: Any, got: Any, expected: Any, want: list[str]) -> None:
        """One line naming the first way ``upload`` (specs ``got``) differs from ``expected`` (paths ``want``)."""
        if got[0] != expected[0] or len(got[1]) != len(expected[1]):
            paths = _leaf_paths(upload)
            diff = [f"lacks {p}" for p in want if p not in paths] + [f"has extra {p}" for p in paths if p not in want]
            raise ConfigError(
                f"algorithm {self.name}: a client's upload {', '.join(diff) or 'has another tree'} (expected leaves "
                f"{', '.join(want)}); every client_update must return an Upload of one form"
            )
        for i, (g, e) in enumerate(zip(got[1], expected[1], strict=True)):
            if g != e:
                raise ConfigError(
                    f"algorithm {self.name}: upload leaf {_leaf_paths(upload)[i]} is {g[1]}{list(g[0])}, expected "
                    f"{e[1]}{list(e[0])}; every client's upload must have the template's shapes and dtypes (one "
                    "of another shape would broadcast into the model)"
                )

    def _weights(self, w: torch.Tensor) -> None:
        if w.numel() == 0:
            return
        lo, total = w.min(), w.sum()
        if self.wmin is None or self.wsum is None:
            self.wmin, self.wsum = lo, total
        else:
            self.wmin = torch.minimum(self.wmin, lo.to(self.wmin.device))
            self.wsum = self.wsum + total.to(self.wsum.device)

    def _sum(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = value if key not in self.sums else self.sums[key] + value.to(self.sums[key].device)

    def result(self) -> CohortResult:
        if self.wmin is not None and self.wsum is not None:
            lo, total = torch.stack([self.wmin, self.wsum.to(self.wmin.device)]).tolist()
            if not (lo >= 0 and 0 < total < float("inf")):  # a NaN fails every comparison
                raise ConfigError(
                    f"algorithm {self.name}: client weights must be finite and non-negative with a positive sum "
                    f"(got min {lo:g}, sum {total:g}); return e.g. info.num_examples or 1.0 as each client's weight"
                )
        n = max(self.size, 1)
        return CohortResult(self.agg.result(self.like), {k: float(v) / n for k, v in self.sums.items()}, self.bytes_up)


def _leaf_specs(upload: Any, stacked: bool = False) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    """``(tree structure, [(shape, dtype) per leaf])``; ``stacked`` drops each leaf's leading client axis."""
    leaves, spec = pytree.tree_flatten(upload)
    shapes = [
        (tuple(t.shape[1:] if stacked else t.shape), t.dtype) if isinstance(t, torch.Tensor) else ((), type(t))
        for t in leaves
    ]
    return spec, shapes


def _leaf_paths(upload: Any) -> list[str]:
    """Each leaf of an upload by its path, e.g. ``.delta['fc.weight']``."""
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(upload)[0]]


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
    param_shapes: dict[str, tuple[int, ...]] | None = None  # the model's: upload leaves keyed by a name must fit

    def client_update(self, cid: int, state: Any, info: ClientInfo | None = None) -> ClientResult:
        """Client ``cid``'s update from ``state``, seeded as every engine seeds it (dropout pure in (seed, t, i));
        ``info`` defaults to the partition's (a Flower node may state its own)."""
        torch.manual_seed(seed_for(self.seed, "client_torch", self.rnd.round, cid))
        data = self.fed.client_data(self.seed, self.rnd.round, cid, self.plan, full=self.alg.needs_full_pass)
        info = self.fed.client_info(cid) if info is None else info
        return client_result(self.alg, self.alg.client_update(self.msg, state, data, info, self.rnd, self.model))


def client_result(alg: FedAlgorithm, res: Any) -> ClientResult:
    """``client_update``'s return checked (a ``ClientResult``, or one line naming the algorithm and what it
    returned), its Python-number weight and metrics made float64 tensors, as the aggregator would make them (a
    vmapped call must return tensors). Tensors pass untouched."""
    if not (isinstance(res, tuple) and all(hasattr(res, f) for f in ClientResult._fields)):
        what = f"a tuple of {len(res)}" if type(res) is tuple else type(res).__name__
        raise ConfigError(
            f"algorithm {type(alg).__name__}: client_update returned {what}; it must return "
            "ClientResult(upload, weight, state, metrics) (hafedho.core.ClientResult)"
        )
    if not isinstance(res.metrics, dict):
        raise ConfigError(
            f"algorithm {type(alg).__name__}: client_update's metrics are {type(res.metrics).__name__}; return a "
            "dict of scalars, e.g. {'train/loss': loss} or {}"
        )
    if isinstance(res.weight, (int, float)) or any(isinstance(v, (int, float)) for v in res.metrics.values()):
        dev = next((t.device for t in pytree.tree_leaves(res.upload) if isinstance(t, torch.Tensor)), None)
        as_t = lambda v: torch.tensor(float(v), dtype=torch.float64, device=dev) if isinstance(v, (int, float)) else v
        res = res._replace(weight=as_t(res.weight), metrics={k: as_t(v) for k, v in res.metrics.items()})
    return res


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
