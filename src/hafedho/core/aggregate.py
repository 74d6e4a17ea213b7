"""Streaming aggregators: uploads are folded in as they arrive, never held as a list."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


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

    def result(self, like: Any = None) -> Any:
        """The weighted mean, cast back to each leaf's dtype of ``like`` (default float32)."""
        if self._sum is None or float(self.total) == 0.0:
            return None
        dtypes = [t.dtype for t in pytree.tree_leaves(like)] if like is not None else None
        out = [(acc / self.total).to(dtypes[i] if dtypes else torch.float32) for i, acc in enumerate(self._sum)]
        return pytree.tree_unflatten(out, self._spec)
