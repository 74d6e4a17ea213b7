"""Fully connected models: multinomial logistic regression and an MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from hafedho.models._common import Output, check_classes, check_shape, projection_head


class LogReg(nn.Module):
    """Multinomial logistic regression: flatten, then one Linear layer.

    The usual convex baseline of FL papers (e.g. FedProx's MNIST/FEMNIST "MCLR").
    Its representation ``z`` is the flattened input itself (with ``projection > 0``, the projection head's
    output, which makes the model a one-hidden-layer MLP: no longer convex).

    Args:
        input_shape: Shape of one example (any rank; it is flattened).
        num_classes: Number of output classes.
        projection: Width of MOON's projection head before the Linear layer; 0 = none.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, projection: int = 0) -> None:
        super().__init__()
        shape = check_shape("logreg", input_shape)
        num_classes = check_classes("logreg", num_classes)
        dim = math.prod(shape)
        self.proj = projection_head("logreg", dim, projection)
        self.linear = nn.Linear(projection or dim, num_classes)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        z = x.flatten(1)
        z = z if self.proj is None else self.proj(z)
        logits = self.linear(z)
        return (z, logits) if return_features else logits


class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU`` per hidden layer, then a final Linear.

    The default ``hidden=(200, 200)`` is McMahan et al.'s "2NN" (FedAvg,
    arXiv:1602.05629): 199,210 parameters on 28x28 inputs with 10 classes.

    Args:
        input_shape: Shape of one example (any rank; it is flattened).
        num_classes: Number of output classes.
        hidden: Widths of the hidden layers.
        projection: Width of MOON's projection head before the output layer; 0 = none.
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (200, 200), projection: int = 0
    ) -> None:
        super().__init__()
        shape = check_shape("mlp", input_shape)
        num_classes = check_classes("mlp", num_classes)
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise ValueError(f"model 'mlp': hidden widths must be >= 1 (got {tuple(hidden)})")
        layers: list[nn.Module] = []
        prev = math.prod(shape)
        for width in widths:
            layers += [nn.Linear(prev, width), nn.ReLU()]
            prev = width
        self.body = nn.Sequential(*layers)
        self.proj = projection_head("mlp", prev, projection)
        self.head = nn.Linear(projection or prev, num_classes)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        z = self.body(x.flatten(1))
        z = z if self.proj is None else self.proj(z)
        logits = self.head(z)
        return (z, logits) if return_features else logits
