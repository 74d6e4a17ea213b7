"""The engine table: ``engine = NAME`` in a config names ``ENGINES[NAME]``, or one's own engine by reference.

A new engine is one module beside the others (a class with the ``Engine`` protocol, importing only
``hafedho.runtime.work``) plus one ``ENGINES`` line here; the config's ``engine`` help and check come from this
table. An engine option (``workers``, ``vmap_chunk``) is declared once in ``OPTIONS``; ``config.Config`` takes its
field from there (``option_field``) and a test checks that the two agree.

This is data only, below the config: the engines' classes are ``"module:Class"`` strings, imported on demand by
``hafedho.sim.engines.make`` (``make_engine``, ``engine_for``, ``auto``), which stands beside the engines. So
loading the config loads no engine and this module imports nothing above ``core``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hafedho.core.algorithm import ConfigError, hp
from hafedho.core.refs import is_reference


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

    target: str  # "module:Class", imported by hafedho.sim.engines.make, never here
    help: str
    options: Mapping[str, str] = field(default_factory=dict)


ENGINES: dict[str, EngineSpec] = {
    "loop": EngineSpec("hafedho.sim.engines.loop:LoopEngine", "reference"),
    "process": EngineSpec("hafedho.sim.engines.process:ProcessEngine", "worker pool", {"workers": "workers"}),
    "vmap": EngineSpec("hafedho.sim.engines.vmap:VmapEngine", "vectorised, GPU", {"vmap_chunk": "chunk"}),
    "auto": EngineSpec("hafedho.sim.engines.make:AutoEngine", "fastest here", {k: k for k in OPTIONS}),
}


def engine_help() -> str:
    """The config's help line for ``engine``, from the table."""
    names = ", ".join(f"{name} ({spec.help})" for name, spec in ENGINES.items())
    return (
        f"simulation engine: {names}, or your own as 'package.module:Class'; unset = vmap on a GPU, loop (the "
        "reference) on the CPU"
    )


def check_engine(name: str) -> None:
    """Refuse (one line) an ``engine`` that is neither registered nor a reference; a reference is only imported
    when a run builds its engine (``sim.engines.make``): the config is also read where the run's code is not
    (the report reading stored runs), and the engine is no part of a run's identity."""
    if name not in ENGINES and not is_reference(name):
        raise ConfigError(
            f"engine={name!r}: choose one of {', '.join(map(repr, ENGINES))}, or name your own engine class as "
            "'package.module:Class'"
        )


def default_engine(device: torch.device) -> str:
    """The engine of a run that sets none: the fastest on a GPU (``vmap``), the reference (``loop``) on a CPU."""
    return "vmap" if device.type == "cuda" else "loop"


def option_field(name: str) -> Any:
    """``config.Config``'s dataclass field for engine option ``name`` (default, help and bound from ``OPTIONS``)."""
    opt = OPTIONS[name]
    return hp(opt.default, opt.help, ge=opt.ge)
