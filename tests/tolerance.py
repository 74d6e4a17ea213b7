"""How close two float32 implementations of one computation must be: the one rule for comparisons across
engines, memory formats, thread counts, vmap against a loop, Flower against the simulator.

Two implementations that differ only in the order of their float operations (other reduction kernels, another
layout, another split over threads or SIMD lanes) each carry their own rounding error, so they differ by at
most the sum of the two. The bound, per tensor ``b`` (the reference) and ``a``:

    ||a - b||_2  <=  C * eps * sqrt(K) * T * scale,      scale = ||b||_2 + sqrt(numel(b)) * rms(all of b's tree)

derived as follows:

* ``eps`` = 2^-23, float32's machine epsilon: twice the unit roundoff u, the largest relative error of one
  correctly rounded operation (using eps for u doubles the bound).
* One result that is a reduction of length ``K`` (a dot product, a convolution, a sum over a batch): two
  summation orders differ by at most gamma_K ~ K u relative to the sum of the terms' magnitudes (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1), a worst case that needs every
  rounding to fall the same way. Modelled as independent and mean-zero, as they behave, rounding errors give
  lambda * sqrt(K) * u instead, failing with probability at most 2K exp(-lambda^2 (1-u)^2 / 2), a pessimistic
  union bound (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
  41, 2019): ``sqrt(K)``, ``K`` the longest reduction in the computation (``longest_reduction``).
* ``T`` sequential update steps (local steps and server steps along the trajectory): each step adds its own
  rounding error, and carries the earlier ones on through (I - lr H), whose norm is about 1 for the small
  learning rates and few steps of a test; so errors at most add up: T times one step's.
* ``C = 2 * lambda``: two implementations each with its own error, and lambda = 5 (exp(-lambda^2 / 2) = 4e-6;
  errors of many elements also partly cancel in the norm, which the bound does not count on).
* ``scale``: a tensor's rounding errors are relative to the magnitudes that went into it. Usually that is the
  tensor itself; a tensor formed by cancellation (a control variate, a small bias, a difference of models) is
  smaller than what it was computed from, hence the second term: the tree's RMS entry times sqrt(numel).

What this cannot bound: a branch decided by a rounding difference. At a ReLU kink or a max-pool near-tie, the
two implementations can take different branches, and one example's gradient at one unit changes by O(1)
instead of O(eps); how often that happens depends on the CPU's kernels. Comparisons of whole training runs
therefore use ``smooth`` models (softplus, average pooling: the same layers, layouts and kernels otherwise).

Measured here (float32, 2 cores with AVX-512): engine and layout differences come to 1e-4..5e-4 of the bound on
the smoothed conv models and to 0 on the contract experiment. A real bug is far above it: clients 0 and 1
swapped in the store, 1700-2700x; one local step of two missing, 10-700x; even a 1% change of the learning
rate, 3.6-12x (``test_process_matches_loop_on_conv_models_with_channels_last`` keeps the swap as a check).
Non-float tensors (counters, integer states) must be equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

EPS = torch.finfo(torch.float32).eps  # 2^-23 = 2u
LAMBDA = 5.0  # Higham & Mary's probabilistic bound, P(fail) <= 2 exp(-lambda^2 / 2) per element
C = 2 * LAMBDA  # two implementations, each with its own rounding error


def bound(b: torch.Tensor, rms: float, *, reduction: int, steps: int) -> float:
    """The largest ``||a - b||_2`` two float32 implementations may show (see the module docstring)."""
    scale = float(b.double().norm()) + math.sqrt(b.numel()) * rms
    return C * EPS * math.sqrt(max(reduction, 1)) * max(steps, 1) * scale


def fp32_close(actual: Any, expected: Any, *, reduction: int, steps: int, what: str = "") -> None:
    """Assert that two pytrees (or sequences) of tensors agree up to float32 rounding of a computation whose
    longest reduction has length ``reduction`` and which runs ``steps`` sequential update steps."""
    a_leaves, b_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    assert len(a_leaves) == len(b_leaves), f"{what}: {len(a_leaves)} tensors, expected {len(b_leaves)}"
    floats = [b for b in b_leaves if b.is_floating_point()]
    n = sum(b.numel() for b in floats)
    rms = math.sqrt(sum(float(b.double().square().sum()) for b in floats) / n) if n else 0.0
    for i, (a, b) in enumerate(zip(a_leaves, b_leaves, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
        if not b.is_floating_point():
            assert torch.equal(a, b), f"{what}[{i}]: integer tensors differ"
            continue
        err = float((a.double() - b.double()).norm())
        tol = bound(b, rms, reduction=reduction, steps=steps)
        assert err <= tol, f"{what}[{i}] {tuple(b.shape)}: ||a - b|| = {err:.3g} > {tol:.3g} (float32 bound)"


def longest_reduction(module: nn.Module, x: torch.Tensor) -> int:
    """The longest sum a forward and backward pass of ``module`` on the batch ``x`` computes: a layer's fan-in
    (forward), or the batch times the output positions a weight is shared over (its gradient)."""
    longest = x.shape[0]
    hooks = []

    def hook(m: nn.Module, _: Any, out: torch.Tensor) -> None:
        nonlocal longest
        positions = out[0].numel() // out.shape[1] if out.dim() > 2 else 1  # per sample, per output channel
        longest = max(longest, m.weight[0].numel(), out.shape[0] * positions)

    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            hooks.append(m.register_forward_hook(hook))
    was_training = module.training
    try:
        with torch.no_grad():
            module.eval()(x)
    finally:
        module.train(was_training)
        for h in hooks:
            h.remove()
    return longest


def smooth(module: nn.Module) -> nn.Module:
    """``module`` with its ReLU modules made softplus and its max pools average pools (in place): a smooth
    function of its parameters, so rounding differences stay rounding differences (see the module docstring).
    Functional ``F.relu`` calls are swapped by ``smooth_functional_relu``."""
    for name, child in module.named_children():
        if isinstance(child, nn.ReLU):
            setattr(module, name, nn.Softplus())
        elif isinstance(child, nn.MaxPool2d):
            setattr(module, name, nn.AvgPool2d(child.kernel_size, child.stride, child.padding))
        else:
            smooth(child)
    return module


def smooth_functional_relu(monkeypatch: Any, modules: Sequence[Any]) -> None:
    """Make ``F.relu`` softplus inside these model modules (the zoo's CNNs call ``F.relu`` in ``forward``).
    Forked worker processes inherit the patch."""
    softplus = nn.functional.softplus

    class _F:
        def __getattr__(self, name: str) -> Any:
            return softplus if name == "relu" else getattr(nn.functional, name)

    for mod in modules:
        monkeypatch.setattr(mod, "F", _F())
