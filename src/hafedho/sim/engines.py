"""Engines run one round's cohort: every client's update, streamed into the algorithm's aggregator.

``loop`` is the reference: a plain Python loop, any ``nn.Module``. Faster engines must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hafedho.core import FedAlgorithm, FunctionalModel, RoundInfo, tree
from hafedho.data.federated import BatchPlan, FederatedData
from hafedho.sim.seeds import seed_for
from hafedho.sim.store import ClientStore


@dataclass
class CohortResult:
    aggregate: Any  # the aggregated upload, None if nobody reported
    metrics: dict[str, float] = field(default_factory=dict)  # cohort means of the clients' metrics
    bytes_up: int = 0


def loop_engine(
    alg: FedAlgorithm,
    msg: Any,
    cohort: np.ndarray,
    store: ClientStore,
    fed: FederatedData,
    plan: BatchPlan,
    model: FunctionalModel,
    rnd: RoundInfo,
    seed: int,
) -> CohortResult:
    agg = alg.new_aggregator()
    sums: dict[str, float] = {}
    like, bytes_up = None, 0
    model.train()
    for cid in cohort.tolist():
        torch.manual_seed(seed_for(seed, "client_torch", rnd.round, cid))  # dropout: pure in (seed, t, i)
        data = fed.client_data(seed, rnd.round, cid, plan)
        res = alg.client_update(msg, store.gather(cid), data, fed.client_info(cid), rnd, model)
        agg.add(tree.detach(res.upload), res.weight)
        store.scatter(cid, res.state)
        like = res.upload
        bytes_up += tree.num_bytes(res.upload)
        for k, v in res.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    n = max(len(cohort), 1)
    return CohortResult(agg.result(like), {k: v / n for k, v in sums.items()}, bytes_up)


ENGINES = {"loop": loop_engine}
