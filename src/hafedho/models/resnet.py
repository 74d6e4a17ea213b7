"""ResNet-18 with GroupNorm for CIFAR-sized images."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hafedho.models._common import Output, check_classes, check_image, projection_head


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


class _BasicBlock(nn.Module):
    """He et al.'s two-conv residual block with GroupNorm in place of BatchNorm."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_ch, out_ch, stride)
        self.norm1 = nn.GroupNorm(groups, out_ch)
        self.conv2 = _conv3x3(out_ch, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.GroupNorm(groups, out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        # Out-of-place ops only, so torch.func transforms (grad, vmap) apply cleanly.
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 (He et al., 2016) with a CIFAR stem and GroupNorm.

    Hsieh et al. ("The Non-IID Data Quagmire", ICML 2020) showed BatchNorm fails under
    non-IID FL and replaced it with GroupNorm; FedML's ``resnet18_gn`` and Reddi et al.
    (arXiv:2003.00295) follow them. Here every norm layer is ``nn.GroupNorm(2, C)``
    (2 groups). The stem is the usual CIFAR one (3x3 conv, stride 1, no max pool),
    stages of 2 blocks with 64/128/256/512 channels, global average pool, Linear.
    ``z`` is the 512-d pooled feature. 11,173,962 parameters for 10 classes.
    Note: FedML's own ``GroupNorm2d(planes, 2)`` puts 2 *channels* in each group and
    keeps an ImageNet stem (7x7 conv, max pool); we use 2 groups and the CIFAR stem.

    Args:
        input_shape: ``(C, H, W)`` with H, W >= 8; CIFAR is ``(3, 32, 32)``.
        num_classes: Number of output classes.
        groups: GroupNorm groups per norm layer.
        projection: Width of MOON's projection head on the 512-d ``z`` (then ``z`` is its output); 0 = none.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10, groups: int = 2, projection: int = 0) -> None:
        super().__init__()
        channels = check_image("resnet18_gn", input_shape)[0]
        num_classes = check_classes("resnet18_gn", num_classes)
        if groups < 1 or 64 % groups:
            raise ValueError(f"model 'resnet18_gn': groups must divide 64 (got {groups})")
        self.conv1 = _conv3x3(channels, 64)
        self.norm1 = nn.GroupNorm(groups, 64)
        stages: list[nn.Module] = []
        in_ch = 64
        for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(
                nn.Sequential(_BasicBlock(in_ch, out_ch, stride, groups), _BasicBlock(out_ch, out_ch, 1, groups))
            )
            in_ch = out_ch
        self.layers = nn.Sequential(*stages)
        self.proj = projection_head("resnet18_gn", 512, projection)
        self.fc = nn.Linear(projection or 512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # He initialisation, as torchvision's and FedML's ResNets do.
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, return_features: bool = False) -> Output:
        """Return logits ``[B, num_classes]``, or ``(z, logits)`` if ``return_features``."""
        x = F.relu(self.norm1(self.conv1(x)))
        z = F.adaptive_avg_pool2d(self.layers(x), 1).flatten(1)
        z = z if self.proj is None else self.proj(z)
        logits = self.fc(z)
        return (z, logits) if return_features else logits
