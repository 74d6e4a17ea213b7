"""A SuperNode's client state, by the round that produced it: in ``context.state``, or on the node's disk.

A client's ``ClientState`` (SCAFFOLD's c_i, HaFedHo's g_i and f_i, ...) lives on its node. Flower keeps
``context.state`` only in the SuperNode process and per run series, so a restarted SuperNode, or a resumed
deployment (each ``flwr run`` is a new series), would start its clients again from ``alg.init_client``. With
``state-dir = "/abs/folder"`` in its node config a node keeps the states on disk instead::

    STATE_DIR/<digest>-<run token>/client-<cid>/r<round>.pt     (one file per version, written atomically)

``digest`` is the experiment's (``common.digest``: config, seed, partition) and the run token is drawn by the
ServerApp when the run directory is created and kept in its checkpoints, so a resumed run finds its states and
no other run (another config, or the same one started again with ``--force``) ever reads them.

Versions, not one state: the state used in round t is the newest one written before t, so a ServerApp resumed
from its checkpoint of round k recomputes round k+1 from the state of round <= k even where the client already
trained in the lost round k+1 (its version of that round is ignored, then replaced). The server sends, with every
train message, the round of its last checkpoint known to be on disk (``checkpoint-round``): older versions than
the newest one at or before it are never needed again and are deleted.

A lost state is never silent: the server sends the round of the client's last aggregated upload
(``state-round``); a node whose newest version is older (a store deleted, a SuperNode restarted without
``state-dir``) trains from ``alg.init_client`` and says so (``state-lost``), and the server lists the client in
the round's ``state_reset``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from torch.utils import _pytree as pytree

from hafedho.config import ConfigError
from hafedho.flower import codec
from hafedho.runfiles import RunDirError, RunLock, atomic_write, make_folder, refuse_link

STATE_DIR = "state-dir"  # node-config key: the folder of this node's client-state store (absolute)
MEMORY_PREFIX = "hafedho.client_state."  # context.state keys: MEMORY_PREFIX + "<key>.r<round>"
_VERSION = re.compile(r"r(\d+)\.pt")
RUN_TOKEN = re.compile(r"[0-9a-f]{1,64}")  # a run token's form (the ServerApp draws 16 hex digits): never a path


class NodeStore:
    """The state versions of client ``cid`` of the run ``key`` on this node (``state_dir`` None: in
    ``context.state``, lost with the SuperNode process)."""

    def __init__(self, context: Context, key: str, cid: int, like: Any, state_dir: Path | None) -> None:
        self.context, self.key, self.cid, self.like = context, key, cid, like
        self.folder = state_dir / key / f"client-{cid}" if state_dir is not None else None
        self.stateless = not pytree.tree_leaves(like)  # FedAvg, FedProx, ...: nothing to keep, nothing to lose

    @classmethod
    def of(cls, context: Context, key: str, cid: int, like: Any) -> NodeStore:
        raw = context.node_config.get(STATE_DIR)
        if raw in (None, ""):
            return cls(context, key, cid, like, None)
        path = Path(str(raw))
        if not path.is_absolute():  # a ClientApp process need not share the SuperNode's working directory
            raise ConfigError(f"node config {STATE_DIR}={raw!r} is relative; give the SuperNode an absolute path")
        return cls(context, key, cid, like, path)

    # ----------------------------------------------------------------- versions

    def lost(self, found: int, expected: int) -> bool:
        """The server aggregated this client's upload of round ``expected``; its newest state here is of round
        ``found``: an older one is a lost one."""
        return not self.stateless and found < expected

    def _rounds(self) -> list[int]:
        if self.folder is None:
            prefix = f"{MEMORY_PREFIX}{self.key}.r"
            return sorted(int(k[len(prefix) :]) for k in self.context.state.array_records if k.startswith(prefix))
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _VERSION.fullmatch(p.name)))

    def _path(self, t: int) -> Path:
        assert self.folder is not None
        return self.folder / f"r{t}.pt"

    def load(self, before: int) -> tuple[int, Any]:
        """``(round, state)`` of the newest version written before round ``before``; ``(0, None)`` if none."""
        older = [] if self.stateless else [t for t in self._rounds() if t < before]
        if not older:
            return 0, None
        t = older[-1]
        if self.folder is None:
            return t, codec.decode(self.context.state.array_records[f"{MEMORY_PREFIX}{self.key}.r{t}"], self.like)
        return t, self._read(self._path(t))

    def _read(self, path: Path) -> Any:
        fix = f"delete {path} to restart client {self.cid} from init_client (the run's rows will say so)"
        refuse_link(path, "a client-state file", fix)
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            leaves = [torch.as_tensor(x).clone() for x in saved["leaves"]]  # clone: torch's aligned memory
            ok = saved["key"] == self.key and int(saved["client"]) == self.cid
        except Exception as e:  # unreadable, not ours, or not a state file: named, never guessed
            raise ConfigError(f"{path}: not a readable client state ({type(e).__name__}); {fix}") from None
        like, spec = pytree.tree_flatten(self.like)
        shapes = [(x.dtype, tuple(x.shape)) for x in leaves]
        if not ok or shapes != [(x.dtype, tuple(x.shape)) for x in like]:
            raise ConfigError(f"{path}: not a state of client {self.cid} of this run, or of another shape; {fix}")
        return pytree.tree_unflatten(leaves, spec)

    def save(self, t: int, state: Any, keep_from: int) -> None:
        """Write round ``t``'s version; delete the versions of a lost future (rounds > t, from a run resumed
        before them) and those older than the newest version at or before round ``keep_from``."""
        if self.stateless:
            return
        if self.folder is None:
            records = self.context.state.array_records
            for k in [k for k in records if k.startswith(MEMORY_PREFIX)]:
                if not k.startswith(f"{MEMORY_PREFIX}{self.key}."):  # another run's: never read again
                    del self.context.state[k]
            self.context.state[f"{MEMORY_PREFIX}{self.key}.r{t}"] = codec.encode(state)
        else:
            leaves = [x.detach().cpu().contiguous() for x in pytree.tree_leaves(state)]
            payload = {"key": self.key, "client": self.cid, "round": t, "leaves": leaves}
            atomic_write(self._path(t), lambda f: torch.save(payload, f))
        rounds = [r for r in self._rounds() if r != t]
        kept = max([r for r in rounds if r <= keep_from], default=None)
        for r in rounds:
            if r > t or (kept is not None and r < kept):
                self._drop(r)

    def _drop(self, t: int) -> None:
        if self.folder is None:
            del self.context.state[f"{MEMORY_PREFIX}{self.key}.r{t}"]
        else:
            self._path(t).unlink(missing_ok=True)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold this client's store for one train message: its folder made (never through a link) and locked, so
        two SuperNodes given the same partition and ``state-dir`` cannot interleave versions."""
        if self.folder is None or self.stateless:
            yield
            return
        fix = f"give the SuperNode of client {self.cid} a {STATE_DIR} of real folders"
        for p in (self.folder.parent.parent, self.folder.parent, self.folder):
            refuse_link(p, "a client-state folder", fix)
        make_folder(self.folder, f"{STATE_DIR} (node config)")
        lock = RunLock(self.folder)
        with lock as held:
            if not held:
                raise RunDirError(
                    f"{self.folder} is in use by another process (pid {lock.holder}): two SuperNodes "
                    f"serve client {self.cid} with the same {STATE_DIR}; give each node its own partition-id"
                )
            yield
