"""The algorithm registry: CLI name -> class. File name = registry key = CLI name."""

from __future__ import annotations

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

# The paper's order: HaFedHo, its eight baselines, then FedAvgM and FedSGD.
REGISTRY: dict[str, type[FedAlgorithm]] = {
    cls.name: cls
    for cls in (HaFedHo, FedAvg, FedProx, SCAFFOLD, FedDyn, MimeLite, MOON, FedLWS, PFedAFM, FedAvgM, FedSGD)
}


def build_algorithm(name: str, settings: dict[str, Any] | None = None) -> FedAlgorithm:
    """Instantiate a registered algorithm from its config table (strictly validated)."""
    if name not in REGISTRY:
        raise ConfigError(f"algorithm.name={name!r}: unknown algorithm; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name].from_config(settings or {})
