"""The Python API for scripts and notebooks: ``hafedho.run`` (what ``hafedho run`` does, returning the metrics) and
``hafedho.register`` (a user's algorithm, model or data source under a plain name). See docs/extending.md."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from hafedho.algorithms import REGISTRY, check_algorithm_class
from hafedho.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    config_from_table,
    config_path,
)
from hafedho.core import FedAlgorithm
from hafedho.data.sources import SOURCES, Source, as_source
from hafedho.models import MODELS, check_model_factory
from hafedho.toml_io import deep_merge, parse_override, read_toml

__all__ = ["RunResult", "register", "run"]

BUILT_IN = {"algorithm": frozenset(REGISTRY), "model": frozenset(MODELS), "data": frozenset(SOURCES)}


@dataclass
class RunResult:
    """What ``run`` returns: the run's metrics rows (``metrics.jsonl``, one dict per logged round), its directory,
    its resolved config, and whether it had already finished (resumed at its last round: nothing changed)."""

    rows: list[dict[str, Any]]
    run_dir: Path
    config: Config = field(repr=False)
    already_finished: bool = False

    @property
    def final(self) -> dict[str, Any]:
        """The last row (the last round's metrics)."""
        return self.rows[-1]


def run(
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *overrides: str,
    out: str | Path | None = None,
    resume: bool = True,
    force: bool = False,
    progress: bool = False,
    module: Callable[[], nn.Module] | None = None,
    **settings: Any,
) -> RunResult:
    """Run one experiment, as ``hafedho run`` does through it (``experiment.build``, ``sim.runner.run``); its rows.

    Args:
        config: a ``Config``, a table as TOML would give it (``{"rounds": 5, "algorithm": {"name": "fedavg"}}``),
            a TOML file, an embedded config's name (``"demo"``, ``"smoke"``, ``"default"``), or None (default).
        *overrides: dotted overrides as on the command line, e.g. ``"algorithm.name=my_pkg.fedadam:FedAdam"``.
        out: the folder of run directories (the config's ``out`` otherwise, ``runs``).
        resume: continue an interrupted run and read a finished one back, as sweeps do (the CLI's ``--resume``);
            False refuses an existing run directory.
        force: delete the run's directory first and start over.
        progress: show the progress bar.
        module: a factory of the model (``experiment.build(cfg, module=...)``), instead of ``model.name``.
        **settings: top-level keys, merged into the config like a file's: ``rounds=5``, ``data={"q": 0.1}``.

    Returns:
        ``RunResult``: ``.rows`` (every metrics row), ``.final`` (the last), ``.run_dir``, ``.config``,
        ``.already_finished``.

    Raises:
        ConfigError, DataError, PartitionError, RunDirError: one line naming the problem and the fix, as the CLI
        prints them; ``sim.runner.Divergence`` when the run diverges.
    """
    from hafedho.experiment import build  # the heavy half, imported when a run starts
    from hafedho.runfiles import read_metrics
    from hafedho.runtime.rundir import is_finished
    from hafedho.sim.runner import run as run_experiment

    table = _table(config)
    for text in overrides:
        if not isinstance(text, str):
            raise ConfigError(
                f"run(..., {text!r:.40}): an override is a string 'key=value', e.g. 'rounds=5', or a keyword: rounds=5"
            )
        table = deep_merge(table, parse_override(text))
    table = deep_merge(table, dict(settings))
    if out is not None:
        table["out"] = str(out)
    exp = build(config_from_table(table), module=module)
    run_dir = exp.cfg.run_dir  # exp.cfg: with module=..., it names the user's model
    finished = resume and not force and is_finished(run_dir, exp.cfg.rounds)
    run_experiment(exp, run_dir, resume=resume, force=force, progress=progress)
    return RunResult(read_metrics(run_dir), run_dir, exp.cfg, finished)


def _table(config: Config | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if config is None:
        return read_toml(CONFIG_DIR / "default.toml")
    if isinstance(config, str | Path):  # a name may stand for an embedded config; a Path is always a file
        return read_toml(config_path(config) if isinstance(config, str) else config)
    raise ConfigError(f"run(config={type(config).__name__}): pass a Config, a dict, a TOML path or 'demo'/'smoke'")


def register(obj: Any, name: str | None = None, *, kind: str | None = None) -> Any:
    """Make a user's algorithm, model or data source known by ``name`` in this process; returns ``obj``.

    ``obj`` is a ``FedAlgorithm`` subclass (``kind="algorithm"``; ``name`` defaults to its own ``name``
    attribute), an ``nn.Module`` subclass (``"model"``), a ``Source`` (``"data"``; ``name`` defaults to its
    name), or a function: a model factory (``kind="model"``) or a loader ``load(path=None, **options) -> Dataset``
    (``kind="data"``). Then ``algorithm.name``, ``model.name`` or ``data.source`` = ``name`` selects it, and the
    run's identity records ``name``. A registration lives in this process and the ones it forks (the process
    engine); the ``hafedho`` command and spawned sweep workers (``--jobs``) know only references
    ``"package.module:Name"``, which need no registration. Built-in names cannot be replaced; registering the same
    object (or a redefinition of the same class, as a notebook cell rerun makes) again is fine.
    """
    kind = kind or _kind_of(obj)
    where = f"register({getattr(obj, '__name__', type(obj).__name__)})"
    if kind == "algorithm":
        registry: dict[str, Any] = REGISTRY
        entry = check_algorithm_class(obj, where)
        name = name or vars(obj).get("name")
    elif kind == "model":
        registry, entry = MODELS, _model_factory(obj, where)
    elif kind == "data":
        registry = SOURCES
        name = name or (obj.name if isinstance(obj, Source) else None)
        entry = as_source(obj, name or "", where)
    else:
        raise ConfigError(f"{where}: kind={kind!r}: choose 'algorithm', 'model' or 'data'")
    if not isinstance(name, str) or not name or ":" in name or name != name.strip() or "/" in name:
        raise ConfigError(f"{where}: give it a plain name without ':' or '/', e.g. register(obj, name='mine')")
    if kind == "data" and entry.name != name:
        entry = Source(name, entry.description, entry.default_path, entry.load, entry.needs_files)
    if name in BUILT_IN[kind]:
        raise ConfigError(f"{where}: {name!r} is a built-in {kind} name; pick another name")
    old = registry.get(name)
    if old is not None and _identity(old) != _identity(entry):
        raise ConfigError(f"{where}: {name!r} is already registered to {_identity(old)}; pick another name")
    registry[name] = entry
    return obj


def _kind_of(obj: Any) -> str:
    if isinstance(obj, type) and issubclass(obj, FedAlgorithm):
        return "algorithm"
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return "model"
    if isinstance(obj, Source):
        return "data"
    raise ConfigError(
        f"register({getattr(obj, '__name__', type(obj).__name__)}): say what it is: kind='model' (a function "
        "returning an nn.Module) or kind='data' (a function load(path=None, **options) -> Dataset)"
    )


def _model_factory(obj: Any, where: str) -> Callable[..., nn.Module]:
    try:
        return check_model_factory(obj, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _identity(entry: Any) -> str:
    """``module.qualname`` of what a name stands for (a data source: of its loader)."""
    target = entry.load if isinstance(entry, Source) else entry
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
