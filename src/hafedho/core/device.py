"""Where a run's tensors live (``device``) and the float32 arithmetic it allows there (``precision``).

``device`` is a runtime setting: ``auto`` (the GPU when there is one, else the CPU), ``cpu``, ``cuda`` or
``cuda:N``. A run on a GPU keeps its model, server state, broadcast, the cohort's batches and states, the
aggregation and the evaluation there; ``device = "cpu"`` runs the same code on the CPU (how CI tests it).

``precision`` is the numerics policy, part of a run's identity (a tf32 run computes other numbers: its
convolutions and matmuls round their inputs to a 10-bit mantissa, about 1,000x the float32 bound that engines and
devices otherwise agree within):

* ``fp32`` (default): TF32 off for CUDA matmuls and cuDNN convolutions, so a GPU run equals the CPU reference
  within the float32 bound of ``tests/tolerance.py``. PyTorch's own default lets cuDNN convolve in TF32 on Ampere
  and newer GPUs.
* ``tf32``: TF32 on for both, opt-in for speed on such GPUs.

On a CPU both policies compute the same numbers (the flags are CUDA's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
PRECISIONS = ("fp32", "tf32")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_problem(name: str) -> str | None:
    """Why ``name`` is not a ``device`` setting (None when it is one)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        return f"device={name!r}: choose {DEVICE_CHOICES}"
    return None


def resolve_device(name: str) -> torch.device:
    """The device a run with ``device = name`` uses; ``ValueError`` (one line) when it is not available here."""
    problem = device_problem(name)
    if problem:
        raise ValueError(problem)
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: this machine has no CUDA GPU that torch can use; set device=cpu or auto")
    dev = torch.device(name)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} GPU(s) (cuda:0..); pick one")
    return torch.device("cuda", index)


def describe(dev: torch.device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200, 139.8 GiB)``, for a run's first line and its facts."""
    if dev.type != "cuda":
        return str(dev)
    props = torch.cuda.get_device_properties(dev)
    return f"{dev} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def free_bytes(dev: torch.device) -> int:
    """Bytes free on ``dev`` now (GPU: the driver's count plus what torch's allocator holds unused); 0 on a CPU."""
    if dev.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _set(matmul: bool, conv: bool) -> None:
    # The legacy flags, not fp32_precision: torch refuses a mix of the two APIs, and these exist in every
    # supported version. cudnn.allow_tf32 covers convolutions (and RNNs).
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = conv


@contextmanager
def precision(policy: str) -> Iterator[None]:
    """Run the block under ``policy`` (see the module docstring) and restore the caller's flags after."""
    if policy not in PRECISIONS:
        raise ValueError(f"precision={policy!r}: choose one of {', '.join(PRECISIONS)}")
    before = _flags()
    on = policy == "tf32"
    _set(on, on)
    try:
        yield
    finally:
        _set(*before)


def tensor_precision() -> str:
    """The policy the current flags implement: ``tf32`` if either TF32 flag is on, else ``fp32``."""
    return "tf32" if any(_flags()) else "fp32"
