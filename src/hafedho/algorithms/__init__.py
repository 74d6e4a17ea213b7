"""The algorithm registry: CLI name -> class. File name = registry key = CLI name.

A user's algorithm (a ``FedAlgorithm`` subclass in their own module) is named by a reference
``"package.module:Class"`` wherever a name goes (``algorithm.name``, overrides, presets), imported on demand
(``hafedho.core.refs``), or registered under a plain name by ``hafedho.register`` (in that process only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.fedavgm import FedAvgM
from hafedho.algorithms.feddyn import FedDyn
from hafedho.algorithms.fedlws import FedLWS
from hafedho.algorithms.fedprox import FedProx
from hafedho.algorithms.fedsgd import FedSGD
from hafedho.algorithms.hafedho import HaFedHo
from hafedho.algorithms.mimelite import MimeLite
from hafedho.algorithms.moon import MOON
from hafedho.algorithms.pfedafm import PFedAFM
from hafedho.algorithms.scaffold import SCAFFOLD
from hafedho.core import ConfigError, FedAlgorithm
from hafedho.core.refs import import_reference, is_reference

# The paper's order: HaFedHo, its eight baselines, then FedAvgM and FedSGD.
REGISTRY: dict[str, type[FedAlgorithm]] = {
    cls.name: cls
    for cls in (HaFedHo, FedAvg, FedProx, SCAFFOLD, FedDyn, MimeLite, MOON, FedLWS, PFedAFM, FedAvgM, FedSGD)
}


def algorithm_class(name: str) -> type[FedAlgorithm]:
    """The class ``algorithm.name`` names: a registered name, or a reference ``"package.module:Class"``."""
    if is_reference(name):
        return check_algorithm_class(import_reference("algorithm.name", name, ConfigError), f"algorithm.name={name!r}")
    if name not in REGISTRY:
        raise ConfigError(
            f"algorithm.name={name!r}: unknown algorithm; choose one of {', '.join(REGISTRY)}, or name your own "
            "class by reference, algorithm.name='package.module:Class'"
        )
    return REGISTRY[name]


def check_algorithm_class(obj: object, where: str) -> type[FedAlgorithm]:
    """``obj`` if it is a usable algorithm class, else one line saying what to change."""
    if not (isinstance(obj, type) and issubclass(obj, FedAlgorithm)):
        what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        raise ConfigError(
            f"{where}: {what} is not a FedAlgorithm subclass; subclass hafedho.algorithms.FedAvg (or "
            "hafedho.core.FedAlgorithm)"
        )
    if any(isinstance(v, dataclasses.Field) for v in vars(obj).values()):
        # undecorated, its hp(...) fields would stay class attributes holding Field objects: silently wrong values
        raise ConfigError(f"{where}: decorate class {obj.__name__} with @dataclass(frozen=True, kw_only=True)")
    missing = [m for m in CONTRACT if getattr(obj, m) is getattr(FedAlgorithm, m)]
    if missing:  # else the first round raises NotImplementedError, after the run directory exists
        raise ConfigError(
            f"{where}: class {obj.__name__} does not define {', '.join(missing)}; define them, or subclass "
            "hafedho.algorithms.FedAvg, which defines all four"
        )
    return obj


CONTRACT = ("init_server", "broadcast", "client_update", "server_update")  # what FedAlgorithm leaves undefined


def build_algorithm(name: str, settings: dict[str, Any] | None = None) -> FedAlgorithm:
    """Instantiate the algorithm ``name`` names (``algorithm_class``) from its settings (strictly validated)."""
    return algorithm_class(name).from_config(settings or {})


def applicable(table: Mapping[str, Any]) -> dict[str, Any]:
    """``[algorithm]`` without the tables of the algorithms it does not select (they never apply to the run)."""
    name = table.get("name")
    return {k: v for k, v in table.items() if not isinstance(v, dict) or k == name}


def resolve_algorithm(table: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one meaning of an ``[algorithm]`` table: the selected algorithm and the settings that apply to it.

    ``[algorithm]`` holds ``name``, settings given to the selected algorithm whatever it is (``lr``), and
    optional per-algorithm tables (``[algorithm.hafedho]``) so that one config carries every algorithm's tuned
    values; only the selected algorithm's table applies, so ``algorithm.name=fedavg`` never inherits HaFedHo's
    ``mu``. A shared key applies unless the selected table sets the same key to another value: that is refused
    with both keys named (never resolved silently). A shared key the selected algorithm does not have is refused
    by ``build_algorithm``. The config checks ``[algorithm]`` through this function once, when it is loaded
    (``hafedho.config.Config.selected_algorithm``); run names, the experiment builder, sweeps, Flower and
    reports all read it through this function.
    """
    name = table.get("name")
    if not isinstance(name, str):
        raise ConfigError("algorithm: needs a table with name = '<algorithm>' (see `hafedho algorithms`)")
    for key, value in table.items():
        if isinstance(value, dict) and key not in REGISTRY and not is_reference(key):
            raise ConfigError(f"algorithm.{key}: not an algorithm; per-algorithm tables are: {', '.join(REGISTRY)}")
    shared = {k: v for k, v in table.items() if k != "name" and not isinstance(v, dict)}
    own = dict(table.get(name, {}))
    for key in sorted(shared.keys() & own.keys()):
        if shared[key] != own[key]:
            raise ConfigError(
                f"algorithm.{key}={_text(shared[key])} conflicts with algorithm.{name}.{key}={_text(own[key])} "
                f"([algorithm.{name}] sets {key}); set one of them, e.g. algorithm.{name}.{key}={_text(shared[key])}"
            )
    return name, {**shared, **own}


def algorithm_from_table(table: Mapping[str, Any]) -> FedAlgorithm:
    """The algorithm an ``[algorithm]`` table selects, with its settings resolved by ``resolve_algorithm``; an error
    about a setting names the key as the table spells it (``algorithm.hafedho.mu`` or ``algorithm.mu``)."""
    name, settings = resolve_algorithm(table)
    try:
        return build_algorithm(name, settings)
    except ConfigError as e:
        text, own = str(e), table.get(name, {})
        for key in own:
            for sep in ("=", ":"):
                if text.startswith(f"algorithm.{key}{sep}"):
                    raise ConfigError(f"algorithm.{name}.{key}{text[len(f'algorithm.{key}') :]}") from None
        raise


def _text(value: Any) -> str:
    """A value as it is typed in a ``key=value`` override."""
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)
