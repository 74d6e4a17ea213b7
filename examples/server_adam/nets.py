"""A user's model, named by reference: ``model.name = "examples.server_adam.nets:SmallNet"``.

hafedho calls it with the ``input_shape`` and ``num_classes`` it declares and ``model.options`` (here ``width``,
checked against its annotation), after seeding the run's model initialisation, exactly as it builds its own models.
"""

import math
from collections.abc import Sequence

from torch import nn


class SmallNet(nn.Module):
    """One hidden layer of ``width`` softplus units; ``forward(x, return_features=True)`` also gives MOON its z."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.Softplus())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x, return_features: bool = False):
        z = self.body(x)
        return (z, self.head(z)) if return_features else self.head(z)
