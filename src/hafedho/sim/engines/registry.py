"""The engine registry: ``engine = NAME`` in a config picks ``ENGINES[NAME]``; ``auto`` picks among them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hafedho.core import FunctionalModel
from hafedho.sim.engines.base import CohortResult, Engine, RoundWork, available_cores, has_batchnorm
from hafedho.sim.engines.loop import LoopEngine
from hafedho.sim.store import ClientStore


def auto_choice(model: FunctionalModel) -> str:
    """``vmap`` on a GPU (unless the model has BatchNorm), ``process`` on a multi-core CPU, else ``loop``."""
    if torch.cuda.is_available() and not has_batchnorm(model.module):
        return "vmap"
    return "process" if available_cores() >= 2 else "loop"


class AutoEngine:
    """Picks its engine at the first round, when the model is known (see ``auto_choice``); ``name`` tells which."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.inner: Engine | None = None
        self.name = "auto"

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        if self.inner is None:
            choice = auto_choice(work.model)
            self.inner = make_engine(choice, **self.options)
            self.name = f"auto:{choice}"
        return self.inner(work, cohort, store)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def __enter__(self) -> AutoEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _process(workers: int = 0, **_: Any) -> Engine:
    from hafedho.sim.engines.process import ProcessEngine  # imported on demand: loop runs never load it

    return ProcessEngine(workers=workers)


def _vmap(vmap_chunk: int = 0, **_: Any) -> Engine:
    from hafedho.sim.engines.vmap import VmapEngine

    return VmapEngine(chunk=vmap_chunk)


ENGINES: dict[str, Callable[..., Engine]] = {
    "loop": lambda **_: LoopEngine(),
    "process": _process,
    "vmap": _vmap,
    "auto": AutoEngine,
}


def make_engine(name: str, *, workers: int = 0, vmap_chunk: int = 0) -> Engine:
    """A fresh engine by config name; call ``close()`` (or use it as a context manager) when the run ends."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: choose one of {', '.join(map(repr, ENGINES))}")
    return ENGINES[name](workers=workers, vmap_chunk=vmap_chunk)
