"""Shape checks and layers shared by the model constructors."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch
from torch import nn

# What every model's forward returns: logits, or (features z, logits).
Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def check_shape(model: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    """Return ``input_shape`` as a tuple of positive ints, or raise a one-line ValueError."""
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"model {model!r}: input shape must be a tuple of ints (got {input_shape!r})") from None
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"model {model!r}: input shape must be non-empty and positive (got {shape})")
    return shape


def check_classes(model: str, num_classes: int) -> int:
    """Return ``num_classes`` as an int >= 1, or raise a one-line ValueError."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, Integral) or num_classes < 1:
        raise ValueError(f"model {model!r}: num_classes must be an integer >= 1 (got {num_classes!r})")
    return int(num_classes)


def check_image(model: str, input_shape: Sequence[int], sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """Validate a ``(C, H, W)`` image shape; ``sizes`` restricts square H = W to the listed values.

    Args:
        model: Model name, for the error message.
        input_shape: Shape of one example, without the batch dimension.
        sizes: Accepted square side lengths, or None to accept any H, W >= 8.

    Returns:
        The shape as a tuple of ints.
    """
    shape = check_shape(model, input_shape)
    if sizes is None:
        ok = len(shape) == 3 and min(shape[1:]) >= 8
        expected = "(C, H, W) images with H, W >= 8"
    else:
        ok = len(shape) == 3 and shape[1] == shape[2] and shape[1] in sizes
        expected = " or ".join(f"(C, {s}, {s})" for s in sizes) + " images"
    if not ok:
        raise ValueError(f"model {model!r} cannot take input shape {shape}: it expects {expected}")
    return shape


def projection_head(model: str, dim: int, out: int) -> nn.Sequential | None:
    """MOON's projection head between a model's encoder and its output layer, or None when ``out == 0``.

    Li, He, Song, arXiv:2103.16257 (Sec. 3.3, network architecture; official code ``ModelFedCon``):
    ``Linear(dim, dim) ReLU Linear(dim, out)``, no activation after the second Linear; its output is the
    representation z of the contrastive loss and the input of the output layer. The official default width is 256.
    """
    if isinstance(out, bool) or not isinstance(out, Integral) or out < 0:
        raise ValueError(f"model {model!r}: projection must be an integer >= 0 (got {out!r}); 0 = no head")
    if out == 0:
        return None
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, int(out)))


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose mask depends on the seed and the logical shape only, not on the memory layout.

    PyTorch's CPU kernel fills the mask in memory order, so a channels-last input (the process engine's layout)
    gets other masks from the same seed than a contiguous one (the loop engine's), and the engines would
    disagree. Uniforms drawn for the logical shape give every engine the same masks.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape, dtype=x.dtype, device=x.device) >= self.p
        return x * keep / (1.0 - self.p) if self.p < 1.0 else x * 0.0
