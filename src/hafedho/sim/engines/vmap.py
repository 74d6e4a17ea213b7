"""The ``vmap`` engine: ``torch.func.vmap`` of ``alg.client_update`` over chunks of the cohort.

A chunk of c clients becomes one batched call: their ``ClientData`` stacked to ``[c, S, B, ...]`` (clients
with fewer steps are padded with all-padding steps, which ``local_train`` treats as no-ops; the whole local
data of a full-pass algorithm likewise, to the chunk's largest client), their ``ClientInfo`` and states
stacked leafwise; the broadcast, round and model are shared. Uploads come back batched and are added to the
aggregator one client at a time, in cohort order, so the float64 sums are the same sequence of additions as
``loop``'s. On a GPU the chunk runs there (the aggregate and states come back
to the CPU); on a CPU it runs in place, for testing (grouped convolutions make it no faster than ``loop``).

Equality with ``loop``: up to float rounding for dropout-free models, BatchNorm included (``FunctionalModel``
makes it functorch-safe: batch statistics, no running ones, so each client normalises with its own batch as
under ``loop``). Dropout under vmap draws each chunk's masks from one generator seeded by (seed, round,
chunk), so dropout models train as well but not identically to ``loop`` (and results depend on ``vmap_chunk``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from hafedho.core import ClientData, FunctionalModel
from hafedho.core.seeds import seed_for
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult, CohortStream, RoundWork


def stack_trees(trees: list[Any]) -> Any:
    """Leafwise ``torch.stack`` of same-structured pytrees (a new leading dimension)."""
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *trees)


def _grow(t: torch.Tensor, dim: int, size: int, fill: str) -> torch.Tensor:
    """``t`` grown to ``size`` along ``dim`` with copies of its last slice (``fill="last"``) or zeros."""
    extra = size - t.shape[dim]
    if not extra:
        return t
    shape = (*t.shape[:dim], extra, *t.shape[dim + 1 :])
    tail = t.narrow(dim, t.shape[dim] - 1, 1).expand(shape) if fill == "last" else t.new_zeros(shape)
    return torch.cat([t, tail], dim)


def _stack(datas: list[ClientData]) -> ClientData:
    """Batches, labels and masks stacked along a new leading dimension, grown to the largest S and B."""
    steps, width = max(d.x.shape[0] for d in datas), max(d.x.shape[1] for d in datas)
    grow = lambda t, fill: _grow(_grow(t, 1, width, fill), 0, steps, fill)
    x = torch.stack([grow(d.x, "last") for d in datas])
    return ClientData(
        x, torch.stack([grow(d.y, "last") for d in datas]), torch.stack([grow(d.mask, "zeros") for d in datas])
    )


def stack_data(datas: list[ClientData]) -> ClientData:
    """``[c, S, B, ...]``; clients with fewer than S steps get all-padding steps (mask 0: no-op steps).

    A padding step repeats the client's last batch (masked out), not zeros: its loss and gradient are then as
    finite as a real step's, so the arithmetic gate ``w + 0 * update`` cannot turn a NaN into the result.
    The whole local data ``full`` (``[ceil(n_i / B), B, ...]``, present for every client or for none) is stacked
    the same way, to the chunk's largest client: its extra blocks are all padding, masked out.
    """
    out = _stack(datas)
    if any(isinstance(d.full, ClientData) for d in datas):
        out = out._replace(full=_stack([d.full for d in datas]))
    return out


def to_device(tree_: Any, device: torch.device) -> Any:
    """Every tensor leaf on ``device`` (a no-op for tensors already there); copies to the CPU are blocking."""
    nb = device.type != "cpu"
    return pytree.tree_map(lambda t: t.to(device, non_blocking=nb) if isinstance(t, torch.Tensor) else t, tree_)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class VmapEngine:
    """``engine = "vmap"``: see the module docstring.

    Args:
        chunk: clients per vectorised call; 0 = the whole cohort (lower it if the device runs out of memory).
        device: where chunks run; None = the GPU if there is one, else the CPU.
    """

    name = "vmap"

    def __init__(self, chunk: int = 0, device: str | torch.device | None = None) -> None:
        if chunk < 0:
            raise ValueError(f"vmap_chunk={chunk}: must be >= 0 (0 = the whole cohort)")
        self.chunk = chunk
        self.device = torch.device(device) if device is not None else default_device()
        self._model: tuple[int, FunctionalModel] | None = None  # (id of the caller's model, its device copy)

    def device_model(self, model: FunctionalModel) -> FunctionalModel:
        if self.device.type == "cpu":
            return model
        if self._model is None or self._model[0] != id(model):
            moved = copy.copy(model)
            moved.module = copy.deepcopy(model.module).to(self.device)
            moved.buffers = dict(moved.module.named_buffers())
            self._model = (id(model), moved)
        return self._model[1]

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        alg, fed, plan, rnd, seed = work.alg, work.fed, work.plan, work.rnd, work.seed
        stream = CohortStream(alg, len(cohort))
        cids = cohort.tolist()
        if not cids:
            return stream.result()
        dev = self.device
        dmodel = self.device_model(work.model)
        dmodel.train()
        dmsg = to_device(work.msg, dev)
        # msg, rnd and model are shared; state, data and info carry the client dimension
        fn = torch.func.vmap(alg.client_update, in_dims=(None, 0, 0, 0, None, None), randomness="different")
        size = self.chunk or len(cids)
        for k, start in enumerate(range(0, len(cids), size)):
            part = cids[start : start + size]
            data = stack_data([fed.client_data(seed, rnd.round, cid, plan, full=alg.needs_full_pass) for cid in part])
            info = stack_trees([fed.client_info(cid) for cid in part])
            state = stack_trees([store.gather(cid) for cid in part])
            torch.manual_seed(seed_for(seed, "vmap_chunk", rnd.round, k))  # dropout: pure in (seed, t, chunk)
            res = fn(dmsg, to_device(state, dev), to_device(data, dev), to_device(info, dev), rnd, dmodel)
            res = to_device(res, torch.device("cpu"))
            for j, cid in enumerate(part):  # cohort order, one client at a time: the sums match loop's
                pick = lambda t, j=j: t[j]
                stream.add(pytree.tree_map(pick, res.upload), res.weight[j], pytree.tree_map(pick, res.metrics))
                store.scatter(cid, pytree.tree_map(pick, res.state))
        return stream.result()

    def close(self) -> None:
        self._model = None

    def __enter__(self) -> VmapEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
