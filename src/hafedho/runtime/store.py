"""The client-state store: per-client state stacked as ``[N, ...]`` leaves, on the run's GPU, in RAM or
memory-mapped on disk.

The runtime gathers the cohort's states, runs the cohort and scatters the new states back; no other client's
state is touched (partial participation keeps stale state exactly). A cohort is gathered and scattered with one
indexed operation per leaf (``gather_many``, ``scatter_many``), wherever the leaves live; the rows scattered since
the last checkpoint are remembered (``take_dirty``), so a checkpoint writes only those (``runtime.checkpoint``).

Placement (``placement``, the config's ``client_store``): on the GPU while the store takes at most
``DEVICE_SHARE`` of the GPU's free memory; else in host RAM (pinned, so copies to the GPU are asynchronous) up to
``DISK_STORE_ABOVE``; else memory-mapped ``.npy`` files, so N x state may exceed RAM (3,400 FEMNIST clients x a
1.2M-parameter model is 16 GB per state vector).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from hafedho.runfiles import no_link, refuse_link

DISK_STORE_ABOVE = 2 * 1024**3  # client_store="auto": memory-map per-client state larger than this (in RAM)
DEVICE_SHARE = 0.5  # client_store="auto": on the GPU while the store takes at most this share of its free memory
PLACES = ("device", "memory", "disk")


def placement(choice: str, nbytes: int, device: torch.device, free: int) -> str:
    """Where a store of ``nbytes`` lives for ``client_store = choice`` on a run on ``device`` with ``free`` bytes
    free there: ``"device"`` (the GPU), ``"memory"`` (host RAM) or ``"disk"`` (memory-mapped files)."""
    if choice == "device":
        return "device" if device.type != "cpu" else "memory"
    if choice in ("memory", "disk"):
        return choice
    if device.type != "cpu" and nbytes <= DEVICE_SHARE * free:
        return "device"
    return "disk" if nbytes > DISK_STORE_ABOVE else "memory"


def _ids(ids: Any) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class ClientStore:
    """Stacked per-client state built from a template ``ClientState`` (a pytree of tensors).

    Args:
        template: one client's initial state (every client starts from it).
        num_clients: N.
        path: if given, leaves live in ``.npy`` memory-mapped files under this folder (``place`` is then "disk").
        device: where gathered states are delivered (the run's device); default: the template's, else the CPU.
        place: "device" (leaves on ``device``), "memory" (host RAM; pinned when ``device`` is a GPU) or "disk"
            (needs ``path``); default: "disk" with a path, else "memory".
    """

    def __init__(
        self,
        template: Any,
        num_clients: int,
        path: str | Path | None = None,
        device: torch.device | str | None = None,
        place: str | None = None,
    ) -> None:
        leaves, self.spec = pytree.tree_flatten(template)
        leaves = [t.detach() for t in leaves]
        self.template = [t.cpu().clone() for t in leaves]  # one client's initial state, for checkpoints
        self.num_clients = num_clients
        self.path = Path(path) if path is not None else None
        self.place = place or ("disk" if self.path is not None else "memory")
        if (self.place == "disk") != (self.path is not None) or self.place not in PLACES:
            raise ValueError(f"client store place={self.place!r} with path={path}: 'disk' needs a path, nothing else")
        self.device = torch.device(device) if device is not None else (leaves[0].device if leaves else None)
        self.device = self.device or torch.device("cpu")
        self.home = self.device if self.place == "device" else torch.device("cpu")  # where the leaves live
        self.pinned = self.place == "memory" and self.device.type == "cuda"
        self.dirty = np.zeros(num_clients, dtype=bool)  # rows scattered since the last ``take_dirty``
        self.leaves: list[Tensor] = []
        for i, leaf in enumerate(leaves):
            shape = (num_clients, *leaf.shape)
            if self.path is None:
                stacked = torch.empty(shape, dtype=leaf.dtype, device=self.home, pin_memory=self.pinned)
                stacked.copy_(leaf.to(self.home).unsqueeze(0).expand(shape))
            else:
                refuse_link(self.path, "a client-store folder")
                self.path.mkdir(parents=True, exist_ok=True)
                no_link(self.path / f"leaf{i}.npy", "a client-store file")  # open_memmap would write through it
                host = leaf.cpu()
                mm = np.lib.format.open_memmap(
                    self.path / f"leaf{i}.npy", mode="w+", dtype=host.numpy().dtype, shape=shape
                )
                if bool(host.any()):  # a new .npy is zero-filled (sparse): write only non-zero templates
                    mm[:] = host.numpy()
                stacked = torch.from_numpy(mm)
            self.leaves.append(stacked)

    # ------------------------------------------------------------------ one client (loop, process, full passes)

    def gather(self, cid: int) -> Any:
        """Client ``cid``'s state, a copy on the delivery device."""
        return pytree.tree_unflatten([leaf[cid].clone().to(self.device) for leaf in self.leaves], self.spec)

    def scatter(self, cid: int, state: Any) -> None:
        for i, (leaf, new) in enumerate(zip(self.leaves, self._leaves_of(state), strict=True)):
            self._check(i, new, leaf.shape[1:])
            leaf[cid] = new.detach().to(leaf.device)
        self.dirty[cid] = True

    # ------------------------------------------------------------------ a cohort at once (vmap)

    def gather_many(self, ids: Any) -> Any:
        """The states of ``ids``, stacked ``[len(ids), ...]`` per leaf on the delivery device: one indexed read per
        leaf, and one copy to the GPU (asynchronous, from pinned memory) for a store in RAM or on disk."""
        ids = _ids(ids)
        out = []
        for leaf in self.leaves:
            if self.place == "disk":
                rows = torch.from_numpy(leaf.numpy()[ids])
                out.append(rows.to(self.device, non_blocking=self.device.type == "cuda"))
            elif self.home == self.device:
                out.append(leaf.index_select(0, torch.from_numpy(ids).to(self.home)))
            else:  # pinned RAM -> GPU
                buf = torch.empty((len(ids), *leaf.shape[1:]), dtype=leaf.dtype, pin_memory=True)
                torch.index_select(leaf, 0, torch.from_numpy(ids), out=buf)
                out.append(buf.to(self.device, non_blocking=True))
        return pytree.tree_unflatten(out, self.spec)

    def scatter_many(self, ids: Any, states: Any) -> None:
        """Write back the stacked states of ``ids`` (as ``gather_many`` returns them): one indexed write per leaf."""
        ids = _ids(ids)
        for i, (leaf, new) in enumerate(zip(self.leaves, self._leaves_of(states), strict=True)):
            self._check(i, new, (len(ids), *leaf.shape[1:]), many=True)
            new = new.detach().to(leaf.dtype)
            if self.place == "disk":
                leaf.numpy()[ids] = new.cpu().numpy()
            else:
                leaf.index_copy_(0, torch.from_numpy(ids).to(leaf.device), new.to(leaf.device))
        self.dirty[ids] = True

    def _leaves_of(self, state: Any) -> list[Tensor]:
        leaves = pytree.tree_leaves(state)
        if len(leaves) != len(self.leaves):
            raise ValueError(
                f"a client state with {len(leaves)} tensors, but the algorithm's init_client has {len(self.leaves)}: "
                "client_update must return a state of the same structure"
            )
        return leaves

    def _check(self, i: int, new: Tensor, shape: tuple[int, ...], many: bool = False) -> None:
        if tuple(new.shape) != tuple(shape):
            what = "stacked client states" if many else "a client state"
            raise ValueError(
                f"{what}: tensor {i} has shape {tuple(new.shape)}, expected {tuple(shape)} (init_client's shape); "
                "client_update must return a state of the same shapes"
            )

    # ------------------------------------------------------------------ checkpoints (runtime.checkpoint)

    def take_dirty(self) -> np.ndarray:
        """The sorted ids scattered since the last call (or since the store was made or restored); resets them."""
        ids = np.flatnonzero(self.dirty)
        self.dirty[:] = False
        return ids

    def rows(self, ids: Any) -> list[Tensor]:
        """Host copies of the rows ``ids`` of every leaf."""
        return [self.leaf_rows(i, ids) for i in range(len(self.leaves))]

    def leaf_rows(self, i: int, ids: Any) -> Tensor:
        """A host copy of the rows ``ids`` of leaf ``i``."""
        ids, leaf = _ids(ids), self.leaves[i]
        if self.place == "disk":
            return torch.from_numpy(leaf.numpy()[ids])
        return leaf.index_select(0, torch.from_numpy(ids).to(leaf.device)).cpu()

    def load_rows(self, ids: Any, leaves: list[Tensor]) -> None:
        """Set rows ``ids`` of every leaf (a restore: they are not marked dirty). Shapes and dtypes must match."""
        ids = _ids(ids)
        for i, (dst, src) in enumerate(zip(self.leaves, leaves, strict=True)):
            if tuple(src.shape) != (len(ids), *dst.shape[1:]) or src.dtype != dst.dtype:
                raise ValueError(
                    f"leaf {i} holds {src.dtype}{tuple(src.shape)}, expected {dst.dtype}{(len(ids), *dst.shape[1:])}"
                )
            if self.place == "disk":
                dst.numpy()[ids] = src.numpy()
            else:
                dst.index_copy_(0, torch.from_numpy(ids).to(dst.device), src.to(dst.device))

    def state_dict(self) -> list[Tensor]:
        """The stacked ``[N, ...]`` leaves, where they live (not copies)."""
        return self.leaves

    def load_state_dict(self, leaves: list[Tensor]) -> None:
        """Set every row from full ``[N, ...]`` leaves (checkpoints written before the journal)."""
        if len(leaves) != len(self.leaves):
            raise ValueError("checkpoint client store does not match this algorithm's client state")
        for dst, src in zip(self.leaves, leaves, strict=True):
            if dst.shape != src.shape:
                raise ValueError(f"checkpoint client state has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        self.load_rows(np.arange(self.num_clients), [s.to(d.dtype) for s, d in zip(leaves, self.leaves, strict=True)])

    @staticmethod
    def template_nbytes(template: Any) -> int:
        return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(template))

    def nbytes(self) -> int:
        return sum(leaf.numel() * leaf.element_size() for leaf in self.leaves)
