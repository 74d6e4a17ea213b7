"""hafedho: HaFedHo and its baselines, simulated or deployed with Flower.

The Python API (docs/extending.md): ``hafedho.run(config, *overrides, **settings)`` runs one experiment as
``hafedho run`` does and returns its metrics rows; ``hafedho.register(obj, name)`` makes a user's algorithm, model
or data source known by a plain name. Both are imported on first use, so ``import hafedho`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hafedho.api import RunResult, register, run

__all__ = ["RunResult", "register", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hafedho import api

        return getattr(api, name)
    raise AttributeError(f"module 'hafedho' has no attribute {name!r}")
