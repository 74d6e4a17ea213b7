"""Engines built from a config: ``make_engine`` / ``engine_for`` (what the runner calls), and ``auto``.

``hafedho.engine_registry`` (below the config) names the registered engines as ``"module:Class"`` strings; this
module, beside them, imports them on demand (so loading one engine never loads the others) and imports the
class a reference ``engine = "package.module:Class"`` names. It is the one module of ``sim/engines`` that knows
other engines; the engine modules themselves import none (``tests/test_layout.py``).

A user's engine gets the engine options its constructor names as parameters (``workers``, ``vmap_chunk``, or the
keyword a built-in engine takes for one, e.g. ``chunk``, so a subclass of a built-in engine gets what it gets),
every option when it takes ``**options``, and nothing else; it may run on any device.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hafedho.core import ConfigError
from hafedho.core.refs import import_reference, is_reference
from hafedho.engine_registry import ENGINES, OPTIONS, check_engine, default_engine
from hafedho.runtime import work as base

if TYPE_CHECKING:
    import numpy as np

    from hafedho.core import FunctionalModel
    from hafedho.runtime.store import ClientStore
    from hafedho.runtime.work import CohortResult, Engine, RoundWork

__all__ = ["AutoEngine", "auto_choice", "engine_for", "engine_label", "make_engine"]

PROTOCOL = "an engine has name (a str), __call__(work, cohort, store) -> CohortResult and close() (docs/extending.md)"


def make_engine(name: str, **options: int) -> Engine:
    """A fresh engine by config name or reference, given any of the ``OPTIONS`` (each engine takes its own; the
    rest default); call ``close()`` (or use it as a context manager) when the run ends."""
    check_engine(name)
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(sorted(unknown))}; known: {', '.join(OPTIONS)}")
    if is_reference(name):
        return user_engine(name, options)
    spec = ENGINES[name]
    module, _, attr = spec.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)  # on demand: the vmap engine is not loaded for loop
    return cls(**{kw: options.get(opt, OPTIONS[opt].default) for opt, kw in spec.options.items()})


def engine_for(settings: Any, device: torch.device | None = None) -> Engine:
    """``make_engine`` from an object with ``engine`` and every option of ``OPTIONS`` as attributes (a config), for
    a run on ``device`` (default: the CPU): an unset engine is ``default_engine(device)``; ``process`` runs its
    workers on the CPU only, so it is refused (one line) for a GPU run; a user's engine runs anywhere."""
    device = device or torch.device("cpu")
    name = settings.engine or default_engine(device)
    if name == "process" and device.type != "cpu":
        raise ConfigError(
            f"engine='process' runs its workers on the CPU, but device={device}: use engine=vmap (or loop) on "
            "the GPU, or device=cpu"
        )
    return make_engine(name, **{opt: getattr(settings, opt) for opt in OPTIONS})


def engine_label(settings: Any, engine: Engine) -> str:
    """The engine as a run names it (its first line, ``run.json``): a registered one by its ``name``, a user's by
    its reference (what reruns it), with its own ``name`` in brackets when that says more."""
    ref = settings.engine
    if not is_reference(ref):
        return engine.name
    return ref if engine.name in ("", ref) else f"{ref} ({engine.name})"


# The config option each constructor keyword carries: the option's own name, and each built-in engine's keyword.
KEYWORDS = {**{opt: opt for opt in OPTIONS}, **{kw: opt for s in ENGINES.values() for opt, kw in s.options.items()}}


def user_engine(ref: str, options: Mapping[str, int]) -> Engine:
    """The engine ``ref`` names, built with the options its constructor takes (see the module docstring); every
    failure is one ``ConfigError`` naming the reference and the fix."""
    factory = import_reference("engine", ref, ConfigError)
    if not inspect.isclass(factory):  # the user's class (refs: never the standard library's), built here
        raise ConfigError(f"engine={ref!r}: names an object of type {type(factory).__name__}, not a class; {PROTOCOL}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): it gets no options
        params = {}
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    values = {opt: options.get(opt, OPTIONS[opt].default) for opt in OPTIONS}
    kwargs = {kw: values[opt] for kw, opt in KEYWORDS.items() if kw in named}
    if takes_all:
        kwargs = {**values, **kwargs}
    try:
        engine = factory(**kwargs)
    except Exception as e:  # the user's constructor: one line, never a traceback
        what = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"engine={ref!r}: building it raised {type(e).__name__}: {what}; fix its constructor (it is given "
            f"{', '.join(f'{k}={v}' for k, v in kwargs.items()) or 'no arguments'})"
        ) from None
    checks = {
        "a str name": isinstance(getattr(engine, "name", None), str),
        "__call__": callable(engine),
        "close()": callable(getattr(engine, "close", None)),
    }
    missing = [what for what, ok in checks.items() if not ok]
    if missing:
        raise ConfigError(f"engine={ref!r}: {type(engine).__name__} has no {', '.join(missing)}; {PROTOCOL}")
    return engine


def auto_choice(model: FunctionalModel) -> str:
    """``vmap`` for a model on a GPU, ``process`` on a multi-core CPU, else ``loop``."""
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
