"""The round's bookkeeping shared by every runtime (the simulator and Flower)."""

from __future__ import annotations

from typing import Any

import torch

from hafedho.core import FedAlgorithm
from hafedho.data.federated import FederatedData
from hafedho.sim.store import ClientStore


class Divergence(RuntimeError):
    """Training produced a non-finite loss or model; the last good checkpoint is kept."""


@torch.no_grad()
def personal_accuracy(alg: FedAlgorithm, server: Any, store: ClientStore, fed: FederatedData, model: Any) -> float:
    """Accuracy of each client's deployed model (``alg.predict``) on its own held-out data, pooled over clients.

    For personalised algorithms this is the paper's metric; it is not comparable with global-model accuracy.
    """
    was_training = model.module.training
    model.module.eval()
    correct = total = 0
    for cid, idx in enumerate(fed.local_test):
        if len(idx) == 0:
            continue
        x = fed.preprocess(fed.x_train[torch.from_numpy(idx)])
        logits = alg.predict(server, store.gather(cid), model, x)
        correct += int((logits.argmax(1) == fed.y_train[torch.from_numpy(idx)]).sum())
        total += len(idx)
    model.module.train(was_training)
    return correct / max(total, 1)
