"""The ``vmap`` engine: ``torch.func.vmap`` of ``alg.client_update`` over chunks of the cohort, on the run's device.

A chunk of c clients becomes one batched call: their ``ClientData`` stacked to ``[c, S, B, ...]`` by one indexed
read of the training data (``FederatedData.cohort_data``: clients with fewer steps are padded with all-padding
steps, which ``local_train`` treats as no-ops; the whole local data of a full-pass algorithm likewise, to the
chunk's largest client), their ``ClientInfo`` and states stacked leafwise (``ClientStore.gather_many``: one indexed
read per leaf); the broadcast, round and model are shared. The batched uploads are folded into the aggregator with
one float64 reduction per leaf (``CohortStream.add_stacked``), equal to adding them one client at a time in cohort
order after the final float32 rounding (``core.aggregate``), and the states go back with one indexed write per
leaf. Everything stays where the run's tensors live (``device``): on a GPU no client's data, state or upload
crosses to the host; on a CPU the same code runs in place, for testing (grouped convolutions make it no faster
than ``loop`` there).

Chunks: ``vmap_chunk = 0`` runs the whole cohort in one call where it fits; on a GPU a chunk that runs out of
memory is halved and run again (it has changed nothing yet), with one warning line, and the size that fits is
kept for the rest of the run, so no cohort size ends in "out of memory".

Equality with ``loop``: up to float rounding for dropout-free models, BatchNorm included (``FunctionalModel``
makes it functorch-safe: batch statistics, no running ones, so each client normalises with its own batch as
under ``loop``). Dropout under vmap draws each chunk's masks from one generator seeded by (seed, round,
chunk), so dropout models train as well but not identically to ``loop`` (and results depend on the chunk size).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from hafedho.core.seeds import seed_for
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult, CohortStream, RoundWork, client_result


class VmapEngine:
    """``engine = "vmap"``: see the module docstring.

    Args:
        chunk: clients per vectorised call; 0 = the whole cohort where it fits (halved until it does).
        warn: where the one line about a halved chunk goes (default: stderr).
    """

    name = "vmap"

    def __init__(self, chunk: int = 0, warn: Any = None) -> None:
        if chunk < 0:
            raise ValueError(f"vmap_chunk={chunk}: must be >= 0 (0 = the whole cohort)")
        self.chunk = chunk
        self.fits: int | None = None  # vmap_chunk=0: the largest chunk known to fit on the device
        self.warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr))

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        alg = work.alg
        stream = CohortStream(alg, len(cohort), param_shapes=work.param_shapes)
        cids = cohort.tolist()
        if not cids:
            return stream.result()
        work.model.train()
        # msg, rnd and model are shared; state, data and info carry the client dimension
        fn = torch.func.vmap(
            lambda *args: client_result(alg, alg.client_update(*args)),
            in_dims=(None, 0, 0, 0, None, None),
            randomness="different",
        )
        size = self.chunk or min(self.fits or len(cids), len(cids))
        start, k = 0, 0
        while start < len(cids):
            part = cids[start : start + size]
            try:
                res = self._chunk(fn, work, part, k, store)
            except torch.cuda.OutOfMemoryError:
                if self.chunk or size == 1:
                    raise
                size = self._halve(size, len(cids))
                continue
            stream.add_stacked(res.upload, res.weight, res.metrics)
            store.scatter_many(part, res.state)
            start, k = start + len(part), k + 1
        return stream.result()

    def _chunk(self, fn: Any, work: RoundWork, part: list[int], k: int, store: ClientStore) -> Any:
        alg, rnd = work.alg, work.rnd
        data = work.fed.cohort_data(work.seed, rnd.round, part, work.plan, full=alg.needs_full_pass)
        info = work.fed.cohort_info(part)
        state = store.gather_many(part)
        torch.manual_seed(seed_for(work.seed, "vmap_chunk", rnd.round, k))  # dropout: pure in (seed, t, chunk)
        return fn(work.msg, state, data, info, rnd, work.model)

    def _halve(self, size: int, cohort: int) -> int:
        torch.cuda.empty_cache()
        self.fits = max(1, size // 2)
        self.warn(
            f"vmap: {size} clients in one call do not fit in the GPU's memory; running chunks of {self.fits} "
            f"(of {cohort} a round) from now on (set vmap_chunk to choose)"
        )
        return self.fits

    def close(self) -> None:
        self.fits = None

    def __enter__(self) -> VmapEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
