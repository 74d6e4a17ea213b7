"""Streaming aggregators: uploads are folded in as they arrive, never held as a list.

An aggregator takes uploads one at a time (``add``) and, optionally, a stacked cohort at once (``add_stacked``:
``[c, ...]`` leaves and ``[c]`` weights, as the vmap engine produces them, folded in with one reduction per leaf on
the uploads' device). ``add_stacked`` is a drop-in for c calls of ``add`` in order (``add_stacked_or_each``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

BLOCK_ELEMENTS = 32 * 1024**2  # add_stacked: float64 elements of one block (256 MiB)


def add_stacked_or_each(agg: Any, uploads: Any, weights: Tensor) -> None:
    """``agg.add_stacked`` where the aggregator has it, else one ``add`` per client (views, no copies), in order."""
    if hasattr(agg, "add_stacked"):
        agg.add_stacked(uploads, weights)
        return
    for j in range(int(weights.shape[0])):
        agg.add(pytree.tree_map(lambda t, j=j: t[j], uploads), weights[j])


class WeightedMean:
    """``sum_i w_i u_i / sum_i w_i`` over any pytree of tensors; ``result()`` is None when nothing arrived.

    Sums are kept in float64 so that the order in which uploads stream in changes the result only at the
    level of the final float32 rounding.
    """

    def __init__(self) -> None:
        self._sum: list[Tensor] | None = None
        self._spec: Any = None
        self.total = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def add(self, upload: Any, weight: Tensor | float) -> None:
        leaves, spec = pytree.tree_flatten(upload)
        w = torch.as_tensor(weight, dtype=torch.float64)
        if self._sum is None:
            self._spec = spec
            self._sum = [w * leaf.double() for leaf in leaves]
        else:
            self._sum = [acc + w * leaf.double() for acc, leaf in zip(self._sum, leaves, strict=True)]
        self.total = self.total + w
        self.count += 1

    def add_stacked(self, uploads: Any, weights: Tensor) -> None:
        """c uploads at once (leaves ``[c, ...]``, weights ``[c]``): ``sum_i w_i u_i`` as one float64 reduction per
        leaf, in blocks of clients that bound its float64 temporary. The sum of float32 values times integer
        weights in float64 is exact unless the values span more than ~2^29 in magnitude, so the result equals c
        calls of ``add`` after the final float32 rounding (and within that rounding always)."""
        leaves, spec = pytree.tree_flatten(uploads)
        w = torch.as_tensor(weights).to(torch.float64)
        if self._sum is None:
            self._spec = spec
            self._sum = [torch.zeros(leaf.shape[1:], dtype=torch.float64, device=leaf.device) for leaf in leaves]
        for k, leaf in enumerate(leaves):
            w_k = w.to(leaf.device)
            per_client = max(leaf[0].numel(), 1)
            step = max(1, BLOCK_ELEMENTS // per_client)
            for s in range(0, leaf.shape[0], step):
                block = leaf[s : s + step].double()
                self._sum[k] = self._sum[k] + torch.tensordot(w_k[s : s + step], block, dims=1)
        self.total = self.total.to(w.device) + w.sum()
        self.count += int(w.shape[0])

    def result(self, like: Any = None) -> Any:
        """The weighted mean, cast back to each leaf's dtype of ``like`` (default float32)."""
        if self._sum is None or float(self.total) == 0.0:
            return None
        dtypes = [t.dtype for t in pytree.tree_leaves(like)] if like is not None else None
        out = [(acc / self.total).to(dtypes[i] if dtypes else torch.float32) for i, acc in enumerate(self._sum)]
        return pytree.tree_unflatten(out, self._spec)
