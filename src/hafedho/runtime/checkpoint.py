"""Checkpoints: server state, client store and round, as plain tensor lists (loaded with weights_only)."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hafedho.runfiles import RunDirError, atomic_write_bytes


def save(path: Path, round: int, server: Any, store_leaves: list[torch.Tensor], extra: dict[str, Any]) -> None:
    buf = io.BytesIO()
    payload = {"round": round, "server": pytree.tree_leaves(server), "store": store_leaves, "extra": extra}
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())


def saved_round(path: Path) -> int:
    """The round of the checkpoint at ``path``; 0 when there is none."""
    if not path.exists():
        return 0
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["round"])
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, KeyError, EOFError, TypeError, ValueError) as e:
        raise RunDirError(f"{path}: corrupt checkpoint ({type(e).__name__}); start over with --force") from None


def load(path: Path, server_template: Any) -> tuple[int, Any, list[torch.Tensor], dict[str, Any]]:
    """Read a checkpoint and rebuild the server state on the template's structure (no code is unpickled)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        leaves, spec = pytree.tree_flatten(server_template)
        if len(payload["server"]) != len(leaves):
            raise RunDirError(f"{path}: checkpoint was written by another algorithm or model; start over with --force")
        server = pytree.tree_unflatten(payload["server"], spec)
        return int(payload["round"]), server, payload["store"], payload.get("extra", {})
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, KeyError, EOFError) as e:
        raise RunDirError(f"{path}: corrupt checkpoint ({type(e).__name__}); start over with --force") from None
