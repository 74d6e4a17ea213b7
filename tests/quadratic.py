"""A tiny problem whose rounds can be computed by hand: f_i(w) = 1/2 ||w - a_i||^2 (with w in R^2).

Each example's features are the point a_i, so a client's data is a_i repeated; the masked mean over a batch
of identical rows is exactly 1/2 ||w - a_i||^2 and grad f_i(w) = w - a_i.

The population most tests use: a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1) (``A``) with n_i = (1, 1, 2) examples
(``SIZES``), so p_i = n_i / 4 = (0.25, 0.25, 0.5); cohorts {1, 2}, {2, 3}, {1, 3} (``COHORTS``: client 1
skips round 2, client 3 joins in it). ``run_round`` is a hand-written runtime for one round, ``rounds`` for several.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import Tensor

from hafedho.core import ClientData, ClientInfo, ClientResult, Params, RoundInfo, WeightedMean, tree


class QuadraticModel:
    """Implements the ``Model`` protocol for f(w; x) = mean_b 1/2 ||w - x_b||^2 over real rows."""

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        per = 0.5 * ((params["w"] - x) ** 2).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    def logits(self, params: Params, x: Tensor) -> Tensor:  # pragma: no cover - unused by these tests
        raise NotImplementedError


MODEL = QuadraticModel()
A = {1: (1.0, 0.0), 2: (0.0, 2.0), 3: (-1.0, -1.0)}
SIZES = {1: 1.0, 2: 1.0, 3: 2.0}
COHORTS = [[1, 2], [2, 3], [1, 3]]


def client_data(a: tuple[float, float], steps: int, batch: int = 2, real_steps: int | None = None) -> ClientData:
    """``steps`` batches of the point ``a``; steps after ``real_steps`` are all padding (mask 0). The client's
    whole local data (``full``, read by full-pass algorithms) is the point ``a`` again, in ``batch`` rows."""
    x = torch.tensor(a, dtype=torch.float32).expand(steps, batch, 2).clone()
    mask = torch.ones(steps, batch)
    if real_steps is not None:
        mask[real_steps:] = 0.0
    full = ClientData(x[:1].clone(), torch.zeros(1, batch, dtype=torch.long), torch.ones(1, batch))
    return ClientData(x, torch.zeros(steps, batch, dtype=torch.long), mask, full)


def rows_data(steps: list[list[tuple[float, float]]], batch: int, rows: list[tuple[float, float]]) -> ClientData:
    """One batch per entry of ``steps`` (its points, padded to ``batch`` with the last point again, masked out), and
    ``full``: the client's whole local data ``rows``, one batch ``[1, n_i, 2]``, as the runtime builds it."""
    x = torch.tensor([s + [s[-1]] * (batch - len(s)) for s in steps])
    mask = torch.tensor([[1.0] * len(s) + [0.0] * (batch - len(s)) for s in steps])
    full = ClientData(torch.tensor([rows]), torch.zeros(1, len(rows), dtype=torch.long), torch.ones(1, len(rows)))
    return ClientData(x, torch.zeros(mask.shape, dtype=torch.long), mask, full)


def info(p: float, n: float = 1.0) -> ClientInfo:
    return ClientInfo(torch.tensor(p), torch.tensor(n))


def rnd(t: int, m: int, n: int = 3) -> RoundInfo:
    return RoundInfo(t, n, m)


def w(*v: float) -> Params:
    return {"w": torch.tensor(v, dtype=torch.float32)}


def close(a: Tensor | Params, b: Any, atol: float = 1e-6) -> bool:
    """``a`` (a tensor, or a ``w(...)`` tree) equals the hand-computed ``b`` up to ``atol``."""
    a = a if isinstance(a, Tensor) else a["w"]
    return torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=atol)


def client_updates(
    alg: Any,
    msg: Any,
    states: dict,
    cohort: list,
    r: RoundInfo,
    data: Mapping[Hashable, ClientData],
    sizes: Mapping[Hashable, float] = SIZES,
    model: Any = MODEL,
) -> dict[Hashable, ClientResult]:
    """Each client of the cohort in turn, with n_i = ``sizes[i]`` and p_i = n_i / (sum of all sizes); its new
    state replaces ``states[i]`` (clients not sampled keep theirs)."""
    total = sum(sizes.values())
    results = {}
    for i in cohort:
        results[i] = alg.client_update(msg, states[i], data[i], info(sizes[i] / total, sizes[i]), r, model)
        states[i] = results[i].state
    return results


def mean_upload(results: Mapping[Hashable, ClientResult]) -> Any:
    """The streaming weighted mean of the uploads, as the runtime forms it (None when nobody reported)."""
    agg = WeightedMean()
    for res in results.values():
        agg.add(tree.detach(res.upload), res.weight)
    return agg.result()


def run_round(
    alg: Any,
    server: Any,
    states: dict,
    cohort: list,
    t: int,
    *,
    steps: int = 2,
    data: Mapping[Hashable, ClientData] | None = None,
    sizes: Mapping[Hashable, float] = SIZES,
    model: Any = MODEL,
    num_clients: int = 3,
) -> tuple[Any, dict[Hashable, ClientResult]]:
    """A hand-written runtime for round t: broadcast, client updates, weighted mean, server update.

    ``data[i]`` is client i's ClientData; by default ``steps`` batches of its point ``A[i]``.
    Returns the new server state and each client's ClientResult.
    """
    r = rnd(t, len(cohort), n=num_clients)
    data = {i: client_data(A[i], steps) for i in cohort} if data is None else data
    results = client_updates(alg, alg.broadcast(server, r), states, cohort, r, data, sizes, model)
    agg = mean_upload(results)
    if agg is not None:  # nobody reported: the runtime skips the server update
        server, _ = alg.server_update(server, agg, r)
    return server, results


def rounds(alg: Any, cohorts: list[list], init: Params, **kw: Any) -> list[tuple[Any, dict, dict]]:
    """Rounds 1, 2, ... with these cohorts, from ``init`` for the server and for every client in ``sizes``
    (``kw`` as for ``run_round``); for each round ``(server, results, states)``, states as they stand after it."""
    server = alg.init_server(init)
    states = {i: alg.init_client(init) for i in kw.get("sizes", SIZES)}
    out = []
    for t, cohort in enumerate(cohorts, start=1):
        server, results = run_round(alg, server, states, cohort, t, **kw)
        out.append((server, results, dict(states)))
    return out
