"""Small convolutional networks from the FL literature (no BatchNorm anywhere)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hafedho.models._common import Dropout, Output, check_classes, check_image, projection_head


class FemnistCNN(nn.Module):
    """FedML's ``CNN_DropOut`` for (F)EMNIST, from Reddi et al. "Adaptive Federated
    Optimization" (arXiv:2003.00295).

    ``conv3x3(C->32) ReLU, conv3x3(32->64) ReLU, maxpool 2, dropout 0.25, flatten (9216),
    Linear(9216->128) ReLU, dropout 0.5, Linear(128->num_classes)``; 1,206,590 parameters
    for 1x28x28 inputs and 62 classes, as in FedML's ``fedml/model/cv/cnn.py``.
    ``z`` is the 128-d ReLU output before the second dropout, so features are not
    perturbed by dropout noise (in eval mode the distinction vanishes).

    Args:
        input_shape: ``(C, 28, 28)``; FEMNIST is ``(1, 28, 28)``.
        num_classes: Number of output classes (62 for FEMNIST).
        projection: Width of MOON's projection head on the 128-d ``z`` (then ``z`` is its output); 0 = none.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 62, projection: int = 0) -> None:
        super().__init__()
        channels = check_image("femnist_cnn", input_shape, sizes=(28,))[0]
        num_classes = check_classes("femnist_cnn", num_classes)
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.pool = nn.MaxPool2d(2, stride=2)
        self.dropout1 = Dropout(0.25)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)  # 28 -> 26 -> 24 -> pool -> 12
        self.dropout2 = Dropout(0.5)
        self.proj = projection_head("femnist_cnn", 128, projection)
        self.fc2 = nn.Linear(projection or 128, num_classes)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(self.pool(x)).flatten(1)
        z = F.relu(self.fc1(x))
        z = z if self.proj is None else self.proj(z)
        logits = self.fc2(self.dropout2(z))
        return (z, logits) if return_features else logits


class CifarCNN(nn.Module):
    """The CIFAR-10 CNN of McMahan et al. (FedAvg, arXiv:1602.05629) as coded by FedDyn
    (Acar et al., ICLR 2021, ``utils_models.py``, model ``cifar10``).

    ``conv5x5(C->64) ReLU maxpool(2,2), conv5x5(64->64) ReLU maxpool(2,2), flatten (1600),
    Linear(1600->384) ReLU, Linear(384->192) ReLU, Linear(192->num_classes)``; no padding,
    so 32 -> 28 -> 14 -> 10 -> 5. ``z`` is the 192-d ReLU output.

    Args:
        input_shape: ``(C, 32, 32)``; CIFAR is ``(3, 32, 32)``.
        num_classes: Number of output classes.
        projection: Width of MOON's projection head on the 192-d ``z`` (then ``z`` is its output); 0 = none.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10, projection: int = 0) -> None:
        super().__init__()
        channels = check_image("cifar_cnn", input_shape, sizes=(32,))[0]
        num_classes = check_classes("cifar_cnn", num_classes)
        self.conv1 = nn.Conv2d(channels, 64, kernel_size=5)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(64 * 5 * 5, 384)
        self.fc2 = nn.Linear(384, 192)
        self.proj = projection_head("cifar_cnn", 192, projection)
        self.fc3 = nn.Linear(projection or 192, num_classes)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x))).flatten(1)
        z = F.relu(self.fc2(F.relu(self.fc1(x))))
        z = z if self.proj is None else self.proj(z)
        logits = self.fc3(z)
        return (z, logits) if return_features else logits


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al., 1998) in the modern form used by FL codebases
    (ReLU and max pooling instead of tanh and subsampling), e.g. pFedMe/FedLab.

    ``conv5x5(C->6) ReLU maxpool 2, conv5x5(6->16) ReLU maxpool 2, flatten (400),
    Linear(400->120) ReLU, Linear(120->84) ReLU, Linear(84->num_classes)``. 32x32 inputs
    use no padding; 28x28 inputs get padding 2 on the first conv, as in the original
    MNIST setup. 62,006 parameters for 3x32x32 inputs and 10 classes. ``z`` is the
    84-d ReLU output.

    Args:
        input_shape: ``(C, 32, 32)`` or ``(C, 28, 28)``.
        num_classes: Number of output classes.
        projection: Width of MOON's projection head on the 84-d ``z`` (then ``z`` is its output); 0 = none.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10, projection: int = 0) -> None:
        super().__init__()
        channels, side, _ = check_image("lenet5", input_shape, sizes=(32, 28))
        num_classes = check_classes("lenet5", num_classes)
        self.conv1 = nn.Conv2d(channels, 6, kernel_size=5, padding=2 if side == 28 else 0)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.proj = projection_head("lenet5", 84, projection)
        self.fc3 = nn.Linear(projection or 84, num_classes)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x))).flatten(1)
        z = F.relu(self.fc2(F.relu(self.fc1(x))))
        z = z if self.proj is None else self.proj(z)
        logits = self.fc3(z)
        return (z, logits) if return_features else logits
