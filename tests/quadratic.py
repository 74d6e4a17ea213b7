"""A tiny problem whose rounds can be computed by hand: f_i(w) = 1/2 ||w - a_i||^2 (with w in R^2).

Each example's features are the point a_i, so a client's data is a_i repeated; the masked mean over a batch
of identical rows is exactly 1/2 ||w - a_i||^2 and grad f_i(w) = w - a_i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hafedho.core import ClientData, ClientInfo, Params, RoundInfo


class QuadraticModel:
    """Implements the ``Model`` protocol for f(w; x) = mean_b 1/2 ||w - x_b||^2 over real rows."""

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        per = 0.5 * ((params["w"] - x) ** 2).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    def logits(self, params: Params, x: Tensor) -> Tensor:  # pragma: no cover - unused by these tests
        raise NotImplementedError


def client_data(a: tuple[float, float], steps: int, batch: int = 2, real_steps: int | None = None) -> ClientData:
    """``steps`` batches of the point ``a``; steps after ``real_steps`` are all padding (mask 0)."""
    x = torch.tensor(a, dtype=torch.float32).expand(steps, batch, 2).clone()
    mask = torch.ones(steps, batch)
    if real_steps is not None:
        mask[real_steps:] = 0.0
    return ClientData(x, torch.zeros(steps, batch, dtype=torch.long), mask)


def info(p: float, n: float = 1.0) -> ClientInfo:
    return ClientInfo(torch.tensor(p), torch.tensor(n))


def rnd(t: int, m: int, n: int = 3) -> RoundInfo:
    return RoundInfo(t, n, m)


def w(*v: float) -> Params:
    return {"w": torch.tensor(v, dtype=torch.float32)}
