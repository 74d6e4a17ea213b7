"""How many rows one forward (or forward + backward) pass takes at once: sized by a rule, never a constant.

The rule: the largest number of rows whose forward activations fit in half of the CPU's last-level cache
(rounded down to a multiple of 8, between 8 and ``MAX_ROWS``). A pass over a chunk writes every layer's output
and reads it back in the next layer; while they stay in the cache the pass runs at the cache's bandwidth, and
once a chunk's activations leave it every layer streams them from memory. Half the cache leaves room for the
weights, the next chunk's inputs and a neighbour process. The activation bytes per row are measured once per
model and input shape, from the tensors that autograd saves in a forward (``activation_bytes``; a few ms).

On a GPU the cache is not the limit (the device's memory bandwidth and its thousands of threads want large
passes): there a pass takes the rows whose activations fit in ``GPU_SHARE`` of the device's total memory, between
8 and ``GPU_MAX_ROWS``.

Deterministic on a machine (no timing probe), so the chunk, and with it every float sum over chunks, is the
same in every run and resume there.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

MAX_ROWS = 1024  # beyond this the per-call overhead is long amortised
FALLBACK_CACHE = 8 * 1024**2  # bytes, where the OS does not say
GPU_SHARE = 1 / 16  # of a GPU's total memory for one pass's activations (8.7 GiB on a 140 GiB H200)
GPU_MAX_ROWS = 16384


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of the largest data (or unified) CPU cache that Linux's sysfs lists for CPU 0, else 8 MiB."""
    best = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            best = max(best, _bytes((index / "size").read_text().strip()))
        except (OSError, ValueError):
            continue
    return best or FALLBACK_CACHE


def _bytes(text: str) -> int:
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def module_device(module: nn.Module) -> torch.device:
    """Where a module's parameters live (the CPU for a module without any)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def activation_bytes(module: nn.Module, row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes per row of the activations of a forward of ``module``: every tensor that autograd saves for the
    backward (the inputs of convolutions and linear layers, ReLU and pooling outputs, whatever the module's code,
    functional calls included), its parameters excepted, plus the output; measured on two rows in eval mode
    (batch statistics need more than one)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}  # storage -> bytes, so views of one tensor count once

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    was_training = module.training
    module.eval()
    device = module_device(module)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(torch.zeros((2, *row_shape), dtype=dtype, device=device))
    finally:
        module.train(was_training)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            pack(t)
    return sum(seen.values()) // 2


def rows_per_pass(module: nn.Module, row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The module docstring's rule for ``module`` on rows of ``row_shape`` (``FunctionalModel`` memoises it): the
    CPU's cache rule, or the GPU's memory rule for a module whose parameters are on a GPU; the largest number of
    rows allowed for a module whose forward cannot be measured on two zero rows (the pass then reports the
    module's own error)."""
    device = module_device(module)
    if device.type == "cuda":
        budget, most = int(torch.cuda.get_device_properties(device).total_memory * GPU_SHARE), GPU_MAX_ROWS
    else:
        budget, most = last_level_cache_bytes() // 2, MAX_ROWS
    try:
        per_row = max(activation_bytes(module, tuple(row_shape), dtype), 1)
    except Exception:  # a user module with its own ideas about inputs: its real pass will say what is wrong
        return most
    return int(min(most, max(8, budget // per_row // 8 * 8)))
