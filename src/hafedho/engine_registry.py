"""The engine registry: ``engine = NAME`` in a config builds ``ENGINES[NAME]``; ``auto`` picks among them.

A new engine is one module beside the others (a class with the ``Engine`` protocol, importing only
``hafedho.runtime.work``) plus one ``ENGINES`` line here; the config's ``engine`` choices and help come
from this table. An engine option (``workers``, ``vmap_chunk``) is declared once in ``OPTIONS``; ``config.Config``
takes its field from there (``option_field``) and a test checks that the two agree.

Engines are named by module path and imported on demand, so importing the config (which reads this table)
loads no engine, and no engine module imports this one: no cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hafedho.core.algorithm import ConfigError, hp

if TYPE_CHECKING:
    import numpy as np

    from hafedho.core import FunctionalModel
    from hafedho.runtime.store import ClientStore
    from hafedho.runtime.work import CohortResult, Engine, RoundWork


@dataclass(frozen=True)
class Option:
    """A config setting read by engines: an int with a default, a help line and a lower bound."""

    default: int
    help: str
    ge: int = 0


OPTIONS: dict[str, Option] = {
    "workers": Option(0, "process engine workers; 0 = one per core"),
    "vmap_chunk": Option(0, "vmap engine: clients per vectorised call; 0 = the whole cohort"),
}


@dataclass(frozen=True)
class EngineSpec:
    """One registered engine: where its class lives, a few words for the config's help, and the config options
    it takes (config name -> keyword of the class's constructor)."""

    target: str  # "module:Class"
    help: str
    options: Mapping[str, str] = field(default_factory=dict)

    def load(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


ENGINES: dict[str, EngineSpec] = {
    "loop": EngineSpec("hafedho.sim.engines.loop:LoopEngine", "reference"),
    "process": EngineSpec("hafedho.sim.engines.process:ProcessEngine", "worker pool", {"workers": "workers"}),
    "vmap": EngineSpec("hafedho.sim.engines.vmap:VmapEngine", "vectorised, GPU", {"vmap_chunk": "chunk"}),
    "auto": EngineSpec("hafedho.engine_registry:AutoEngine", "fastest here", {k: k for k in OPTIONS}),
}


def engine_help() -> str:
    """The config's help line for ``engine``, from the table."""
    names = ", ".join(f"{name} ({spec.help})" for name, spec in ENGINES.items())
    return f"simulation engine: {names}; unset = vmap on a GPU, loop (the reference) on the CPU"


def default_engine(device: torch.device) -> str:
    """The engine of a run that sets none: the fastest on a GPU (``vmap``), the reference (``loop``) on a CPU."""
    return "vmap" if device.type == "cuda" else "loop"


def option_field(name: str) -> Any:
    """``config.Config``'s dataclass field for engine option ``name`` (default, help and bound from ``OPTIONS``)."""
    opt = OPTIONS[name]
    return hp(opt.default, opt.help, ge=opt.ge)


def make_engine(name: str, **options: int) -> Engine:
    """A fresh engine by config name, given any of the ``OPTIONS`` (each engine takes its own; the rest default);
    call ``close()`` (or use it as a context manager) when the run ends."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: choose one of {', '.join(map(repr, ENGINES))}")
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(sorted(unknown))}; known: {', '.join(OPTIONS)}")
    spec = ENGINES[name]
    return spec.load()(**{kw: options.get(opt, OPTIONS[opt].default) for opt, kw in spec.options.items()})


def engine_for(settings: Any, device: torch.device | None = None) -> Engine:
    """``make_engine`` from an object with ``engine`` and every option of ``OPTIONS`` as attributes (a config), for
    a run on ``device`` (default: the CPU): an unset engine is ``default_engine(device)``; ``process`` runs its
    workers on the CPU only, so it is refused (one line) for a GPU run."""
    device = device or torch.device("cpu")
    name = settings.engine or default_engine(device)
    if name == "process" and device.type != "cpu":
        raise ConfigError(
            f"engine='process' runs its workers on the CPU, but device={device}: use engine=vmap (or loop) on "
            "the GPU, or device=cpu"
        )
    return make_engine(name, **{opt: getattr(settings, opt) for opt in OPTIONS})


def auto_choice(model: FunctionalModel) -> str:
    """``vmap`` for a model on a GPU, ``process`` on a multi-core CPU, else ``loop``."""
    from hafedho.runtime import work as base  # loaded with the first engine, not with the config

    if model.device.type == "cuda":
        return "vmap"
    return "process" if base.available_cores() >= 2 else "loop"


class AutoEngine:
    """Picks its engine at the first round, when the model is known (see ``auto_choice``); ``name`` tells which."""

    def __init__(self, **options: int) -> None:
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
