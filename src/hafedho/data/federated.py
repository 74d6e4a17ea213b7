"""The federated view of a data set: per-client index arrays into one in-memory tensor per split.

No DataLoader in the hot path: a client's local work for a round is an index tensor ``[S, B]`` plus a mask,
drawn from a generator seeded by (seed, round, client), and one gather from the train tensor.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hafedho.core import ClientData, ClientInfo, ConfigError
from hafedho.core.seeds import rng_for
from hafedho.data.safe_pickle import DataError


@dataclass(frozen=True)
class BatchPlan:
    """How much local work a client does: ``local_steps`` steps, or whole ``local_epochs`` when > 0."""

    local_steps: int
    batch_size: int
    local_epochs: int = 0

    def steps_for(self, n: int) -> int:
        if self.local_epochs > 0:
            return self.local_epochs * math.ceil(n / self.batch_size)
        return self.local_steps


def plan_indices(rng: np.random.Generator, n: int, plan: BatchPlan) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[S, B]`` into a client's ``n`` examples and their mask.

    Steps mode: a stream of fresh permutations (sampling without replacement within each pass), cut into S
    batches of ``min(B, n)``; a client smaller than B trains on all its data each step (padded, masked).
    Epochs mode: each epoch is one permutation cut into ceil(n/B) batches, the last one partial (masked).
    """
    B = plan.batch_size
    if plan.local_epochs > 0:
        per = math.ceil(n / B)
        pos = np.zeros((plan.local_epochs * per, B), dtype=np.int64)
        mask = np.zeros((plan.local_epochs * per, B), dtype=np.float32)
        for e in range(plan.local_epochs):
            perm = rng.permutation(n)
            for j in range(per):
                chunk = perm[j * B : (j + 1) * B]
                pos[e * per + j, : len(chunk)] = chunk
                mask[e * per + j, : len(chunk)] = 1.0
        return pos, mask
    b = min(B, n)
    need = plan.local_steps * b
    stream = np.concatenate([rng.permutation(n) for _ in range(math.ceil(need / n))])[:need]
    pos = np.zeros((plan.local_steps, B), dtype=np.int64)
    mask = np.zeros((plan.local_steps, B), dtype=np.float32)
    pos[:, :b] = stream.reshape(plan.local_steps, b)
    mask[:, :b] = 1.0
    return pos, mask


def split_local_test(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hold out ``round(fraction * n_i)`` of each client's examples (at most n_i - 1) as its local test set.

    Personalised algorithms are judged on each client's own distribution, which the global test set is not.
    """
    rng = rng_for(seed, "local_test")
    train, test = [], []
    for p in parts:
        perm = rng.permutation(p)
        k = min(round(fraction * len(p)), len(p) - 1)
        test.append(np.sort(perm[:k]))
        train.append(np.sort(perm[k:]))
    return train, test


def _tensor(a: np.ndarray) -> Tensor:
    """``a`` as a tensor sharing its memory. A read-only array (the decoded-data memo's, ``data.cache``) is
    shared too: the training tensors are only ever read (gathered into batches), never written."""
    a = np.ascontiguousarray(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


class FederatedData:
    """Train/test tensors plus the partition, producing each client's ``ClientData`` for a round.

    Args:
        x_train, y_train, x_test, y_test: arrays as loaded (uint8 images are scaled to [0, 1] at batch time).
        parts: one sorted index array into the train split per client.
        mean, std: per-channel normalisation applied at batch time (None = none).
        dtype: floating dtype of the model inputs and of each client's ``ClientInfo`` (p_i, n_i), i.e. the
            model parameters' dtype. None (default): ``torch.get_default_dtype()`` when constructed, float32 in
            the CLI pipeline. Pass ``torch.float64`` for float64 models under float32 as the default dtype.
    """

    def __init__(
        self,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        parts: list[np.ndarray],
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        local_test: list[np.ndarray] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.x_train = _tensor(x_train)
        self.y_train = _tensor(y_train).long()
        self.x_test_raw = _tensor(x_test)
        self.y_test = _tensor(y_test).long()
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self.local_test = local_test  # per-client held-out train indices (personalised evaluation), or None
        self.sizes = np.array([len(p) for p in self.parts], dtype=np.int64)
        if (self.sizes == 0).any():
            empty = int(np.flatnonzero(self.sizes == 0)[0])
            raise ConfigError(f"client {empty} has no training samples; use fewer clients or a larger data.min_size")
        if len(self.y_test) == 0:  # evaluation would report 0% accuracy, not an error
            raise DataError("the test split is empty (0 examples); give the data a test set")
        self.dtype = dtype or torch.get_default_dtype()  # fixed here, so process-engine workers see the same
        shape = (1, -1) + (1,) * (self.x_train.dim() - 2) if self.x_train.dim() > 2 else (1, -1)
        self._mean = torch.tensor(mean, dtype=self.dtype).view(shape) if mean is not None else None
        self._std = torch.tensor(std, dtype=self.dtype).view(shape) if std is not None else None

    @property
    def num_clients(self) -> int:
        return len(self.parts)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def preprocess(self, x: Tensor) -> Tensor:
        """Raw stored values -> normalised model inputs of ``self.dtype``."""
        x = x.to(self.dtype) / 255.0 if x.dtype == torch.uint8 else x.to(self.dtype)
        if self._mean is not None:
            x = (x - self._mean) / self._std
        return x

    def x_test(self) -> Tensor:
        return self.preprocess(self.x_test_raw)

    def client_info(self, cid: int, dtype: torch.dtype | None = None) -> ClientInfo:
        """p_i = |D_i| / |D| and n_i = |D_i| of client ``cid`` as 0-d tensors of ``dtype`` (default: ``self.dtype``).

        p_i is divided in float64 and rounded once to ``dtype``, so it is the correctly rounded ratio in any dtype.
        """
        dtype = dtype or self.dtype
        n = float(self.sizes[cid])
        return ClientInfo(torch.tensor(n / float(self.sizes.sum()), dtype=dtype), torch.tensor(n, dtype=dtype))

    def client_data(self, seed: int, rnd: int, cid: int, plan: BatchPlan, full: bool = False) -> ClientData:
        """Client ``cid``'s batches for round ``rnd``; with ``full``, also its whole local data (``full_data``)."""
        pos, mask = plan_indices(rng_for(seed, "batches", rnd, cid), int(self.sizes[cid]), plan)
        idx = torch.from_numpy(self.parts[cid][pos])  # [S, B] global train indices
        x = self.preprocess(self.x_train[idx.reshape(-1)])
        data = ClientData(x.reshape(*idx.shape, *x.shape[1:]), self.y_train[idx], torch.from_numpy(mask))
        return data._replace(full=self.full_data(cid, plan.batch_size)) if full else data

    def full_data(self, cid: int, batch_size: int) -> ClientData:
        """All of client ``cid``'s training rows, each once, in partition order: ``[ceil(n_i / B), B, ...]``.

        The blocks only bound the memory of a pass over them (``core.full_gradient`` weighs each by its real
        rows); the last block is padded with the client's last row again, masked out.
        """
        n = int(self.sizes[cid])
        blocks = math.ceil(n / batch_size)
        pos = np.minimum(np.arange(blocks * batch_size), n - 1)
        idx = torch.from_numpy(self.parts[cid][pos]).view(blocks, batch_size)
        x = self.preprocess(self.x_train[idx.reshape(-1)])
        mask = (torch.arange(blocks * batch_size) < n).float().view(blocks, batch_size)
        return ClientData(x.reshape(blocks, batch_size, *x.shape[1:]), self.y_train[idx], mask)
