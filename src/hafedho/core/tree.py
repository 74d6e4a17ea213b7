"""Arithmetic on parameter trees: ``dict[str, Tensor]`` keyed by ``nn.Module.named_parameters()`` names.

Every function is pure (returns new tensors, never writes into its inputs) so the same code runs under the
reference loop and under ``torch.func.vmap``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

Params = dict[str, Tensor]


def add(a: Params, b: Params) -> Params:
    return {k: a[k] + b[k] for k in a}


def sub(a: Params, b: Params) -> Params:
    return {k: a[k] - b[k] for k in a}


def scale(a: Params, s: float | Tensor) -> Params:
    return {k: v * s for k, v in a.items()}


def axpy(s: float | Tensor, x: Params, y: Params) -> Params:
    """``s * x + y``. A tensor ``s`` takes one pass per leaf (``addcmul``): local training does this twice per step on
    every parameter with s = 0 or 1, where the product is exact. A float ``s`` rounds ``s * x`` first, as any
    algorithm writing ``w + scale(d, s)`` does, so the two spellings agree bit for bit."""
    if isinstance(s, Tensor):
        return {k: torch.addcmul(y[k], s, x[k]) for k in x}
    return {k: s * x[k] + y[k] for k in x}


def zeros_like(a: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in a.items()}


def dot(a: Params, b: Params) -> Tensor:
    """Inner product ``<a, b>`` summed over all leaves (a 0-d tensor)."""
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


def sq_norm(a: Params) -> Tensor:
    return dot(a, a)


def where(cond: Tensor, a: Any, b: Any) -> Any:
    """Leafwise ``cond ? a : b`` over any pytree, for branch-free (vmap-safe) code."""
    return pytree.tree_map(lambda x, y: torch.where(cond, x, y), a, b)


def num_bytes(tree: Any) -> int:
    """Bytes on the wire for a tree of tensors (what a client would send or receive)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, Tensor))


def detach(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def all_finite(tree: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(tree) if t.is_floating_point())


def to(tree: Any, device: torch.device) -> Any:
    """Every tensor leaf of ``tree`` on ``device`` (leaves already there are returned as they are)."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, tree)
