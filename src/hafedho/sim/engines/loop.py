"""The ``loop`` engine, the reference: one client after another, any ``nn.Module``."""

from __future__ import annotations

import numpy as np

from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult, CohortStream, RoundWork


def loop_engine(work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
    """The reference engine: one client after another, states gathered from and scattered to ``store``."""
    stream = CohortStream(work.alg, len(cohort), param_shapes=work.param_shapes)
    work.model.train()
    for cid in cohort.tolist():
        res = work.client_update(cid, store.gather(cid))
        stream.add(res.upload, res.weight, res.metrics)
        store.scatter(cid, res.state)
    return stream.result()


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
