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
        self.device = torch.device("cpu")  # where batches, client facts and test inputs are delivered (``to``)

    def to(self, device: torch.device, keep_on_host_above: int | None = None) -> FederatedData:
        """Deliver batches, client facts and the test set on ``device`` (in place). The data moves there too,
        unless its arrays take more than ``keep_on_host_above`` bytes: then they stay in RAM and each batch is
        gathered there and copied over. Values are the same wherever they are gathered and preprocessed."""
        device = torch.device(device)
        arrays = (self.x_train, self.y_train, self.x_test_raw, self.y_test)
        big = keep_on_host_above is not None and sum(a.numel() * a.element_size() for a in arrays) > keep_on_host_above
        home = torch.device("cpu") if big else device
        self.x_train, self.y_train, self.x_test_raw, self.y_test = (a.to(home) for a in arrays)
        self._mean = self._mean.to(home) if self._mean is not None else None
        self._std = self._std.to(home) if self._std is not None else None
        self.device = device
        return self

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
        return self.preprocess(self.x_test_raw).to(self.device)

    def test_set(self) -> tuple[Tensor, Tensor]:
        """The global test set: preprocessed inputs and labels on the delivery device."""
        return self.x_test(), self.y_test.to(self.device)

    def rows(self, idx: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        """Training rows ``idx`` (any shape of global indices) as preprocessed inputs ``[*idx.shape, ...]`` and
        labels ``[*idx.shape]``, on the delivery device: one gather where the data lives, one copy if elsewhere."""
        idx = torch.as_tensor(idx, dtype=torch.int64)
        flat = idx.reshape(-1).to(self.x_train.device)
        x = self.preprocess(self.x_train[flat])
        x, y = x.reshape(*idx.shape, *x.shape[1:]), self.y_train[flat].reshape(idx.shape)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def client_info(self, cid: int, dtype: torch.dtype | None = None) -> ClientInfo:
        """p_i = |D_i| / |D| and n_i = |D_i| of client ``cid`` as 0-d tensors of ``dtype`` (default: ``self.dtype``).

        p_i is divided in float64 and rounded once to ``dtype``, so it is the correctly rounded ratio in any dtype.
        """
        dtype, dev = dtype or self.dtype, self.device
        n = float(self.sizes[cid])
        p = n / float(self.sizes.sum())
        return ClientInfo(torch.tensor(p, dtype=dtype, device=dev), torch.tensor(n, dtype=dtype, device=dev))

    def cohort_info(self, cids: list[int] | np.ndarray) -> ClientInfo:
        """``client_info`` of each of ``cids``, stacked ``[c]`` (the same values, bit for bit)."""
        n = self.sizes[np.asarray(cids, dtype=np.int64)].astype(np.float64)
        p = n / float(self.sizes.sum())
        as_t = lambda a: torch.from_numpy(a).to(self.dtype).to(self.device, non_blocking=True)
        return ClientInfo(as_t(p), as_t(n))

    def client_data(self, seed: int, rnd: int, cid: int, plan: BatchPlan, full: bool = False) -> ClientData:
        """Client ``cid``'s batches for round ``rnd``; with ``full``, also its whole local data (``full_data``)."""
        pos, mask = plan_indices(rng_for(seed, "batches", rnd, cid), int(self.sizes[cid]), plan)
        x, y = self.rows(self.parts[cid][pos])  # [S, B] global train indices
        data = ClientData(x, y, torch.from_numpy(mask).to(self.device))
        return data._replace(full=self.full_data(cid, plan.batch_size)) if full else data

    def cohort_data(
        self, seed: int, rnd: int, cids: list[int] | np.ndarray, plan: BatchPlan, full: bool = False
    ) -> ClientData:
        """The batches of every client of ``cids`` for round ``rnd``, stacked ``[c, S, B, ...]``: equal bit for bit
        to ``client_data`` of each, stacked with clients of fewer steps padded by repeats of their last step
        (mask 0; ``full`` likewise with its last block), and gathered with one indexed read for the whole cohort."""
        plans = [plan_indices(rng_for(seed, "batches", rnd, int(c)), int(self.sizes[c]), plan) for c in cids]
        pos, mask = _padded([self.parts[c][p] for c, (p, _) in zip(cids, plans, strict=True)], [m for _, m in plans])
        x, y = self.rows(pos)
        data = ClientData(x, y, torch.from_numpy(mask).to(self.device, non_blocking=True))
        if not full:
            return data
        blocks = [self._full_rows(int(c), plan.batch_size) for c in cids]
        fpos, fmask = _padded([b for b, _ in blocks], [m for _, m in blocks])
        fx, fy = self.rows(fpos)
        return data._replace(full=ClientData(fx, fy, torch.from_numpy(fmask).to(self.device, non_blocking=True)))

    def _full_rows(self, cid: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``full_data``'s global indices ``[ceil(n_i / B), B]`` and mask."""
        n = int(self.sizes[cid])
        blocks = math.ceil(n / batch_size)
        pos = np.minimum(np.arange(blocks * batch_size), n - 1)
        mask = (np.arange(blocks * batch_size) < n).astype(np.float32).reshape(blocks, batch_size)
        return self.parts[cid][pos].reshape(blocks, batch_size), mask

    def full_data(self, cid: int, batch_size: int) -> ClientData:
        """All of client ``cid``'s training rows, each once, in partition order: ``[ceil(n_i / B), B, ...]``.

        The blocks only bound the memory of a pass over them (``core.full_gradient`` weighs each by its real
        rows); the last block is padded with the client's last row again, masked out.
        """
        pos, mask = self._full_rows(cid, batch_size)
        x, y = self.rows(pos)
        return ClientData(x, y, torch.from_numpy(mask).to(self.device))


def _padded(pos: list[np.ndarray], masks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-client ``[S_i, B]`` indices and masks stacked ``[c, max S_i, B]``: the missing steps of a client repeat
    its last step's indices, masked out (a padding step is then as finite as a real one)."""
    steps = max(p.shape[0] for p in pos)
    out = np.empty((len(pos), steps, pos[0].shape[1]), dtype=np.int64)
    mask = np.zeros(out.shape, dtype=np.float32)
    for j, (p, m) in enumerate(zip(pos, masks, strict=True)):
        out[j, : len(p)], out[j, len(p) :] = p, p[-1]
        mask[j, : len(m)] = m
    return out, mask
