"""The algorithm contract (``FedAlgorithm``, the base class the runtime is written against) and its hyperparameters.

Hyperparameters are dataclass fields declared with ``hp(...)``; they are type- and range-checked when the
algorithm is built, so a bad config fails before any training with one line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from typing import Any, ClassVar

from torch import Tensor

from hafedho.core.aggregate import WeightedMean
from hafedho.core.diagnostics import Diagnostics
from hafedho.core.tree import Params
from hafedho.core.types import Aggregator, ClientData, ClientInfo, ClientResult, Model, RoundInfo


class ConfigError(ValueError):
    """A bad setting, reported as one line: the key, what is wrong, and what would be valid."""


def hp(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    choices: tuple[Any, ...] | None = None,
) -> Any:
    """Declare a hyperparameter with its documentation and its valid range or choices."""
    meta = {"help": help, "gt": gt, "ge": ge, "lt": lt, "le": le, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


def check_value(key: str, value: Any, annotation: Any, meta: dict[str, Any]) -> Any:
    """Type- and range-check one setting; ints are accepted (and converted) where floats are expected."""
    allowed = typing.get_args(annotation) or (annotation,)
    allowed = tuple(a for a in allowed if a is not type(None))
    if value is None:
        if type(None) not in (typing.get_args(annotation) or ()):
            raise ConfigError(f"{key}: None is not allowed; expected {_names(allowed)}")
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not any(isinstance(value, a) and not (a is int and isinstance(value, bool)) for a in allowed):
        raise ConfigError(f"{key}={value!r}: expected {_names(allowed)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    bounds = (("gt", "> ", lambda v, b: v > b), ("ge", ">= ", lambda v, b: v >= b))
    bounds += (("lt", "< ", lambda v, b: v < b), ("le", "<= ", lambda v, b: v <= b))
    for name, sign, ok in bounds:
        bound = meta.get(name)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{key}={value!r}: must be {sign}{bound}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(repr, choices))}")
    return value


def _names(types: tuple[Any, ...]) -> str:
    return " or ".join(getattr(t, "__name__", str(t)) for t in types)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FedAlgorithm:
    """The one contract between an algorithm and the runtime (every engine, the Flower apps), with its defaults.

    A subclass adds its hyperparameters (``hp`` fields) and the four functions every algorithm defines,
    ``init_server``, ``broadcast``, ``client_update`` and ``server_update``; the others have defaults here. Most
    algorithms subclass ``algorithms.fedavg.FedAvg`` instead, which defines the four and exposes the local objective
    and the local transform as hooks. Convention: every ``ServerState`` has a field ``params``, the global model.

    Nothing here belongs to one method: what only the simulator can give (the exact gradient over every client's
    data, for ``[diagnostics]`` or for an idealised method such as HaFedHo's h_source="exact") comes through one
    optional extension, ``diagnostics()`` returning a ``core.diagnostics.Diagnostics`` (default None).
    """

    name: ClassVar[str] = ""
    personalized: ClassVar[bool] = False  # True: also report accuracy of each client's own model on its local test data
    lr: float = hp(0.05, "local learning rate eta_l of plain SGD", gt=0)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = check_value(f"algorithm.{f.name}", getattr(self, f.name), hints[f.name], f.metadata)
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_config(cls, settings: dict[str, Any]) -> FedAlgorithm:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in settings:
            if key not in known:
                raise ConfigError(f"algorithm.{key}: unknown setting for {cls.name}; valid: {', '.join(sorted(known))}")
        return cls(**settings)

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """``(name, default, help)`` for each hyperparameter, for ``hafedho algorithms``."""
        return [(f.name, f.default, f.metadata.get("help", "")) for f in dataclasses.fields(cls)]

    @property
    def needs_full_pass(self) -> bool:
        """True when ``client_update`` reads ``data.full``, the client's whole local data (one extra pass).

        The runtime (every engine, the Flower client) then builds it beside the round's batches; algorithms
        that override this take it with ``full_data``.
        """
        return False

    def full_data(self, data: ClientData) -> ClientData:
        """``data.full``: all of the client's rows, each once, as masked blocks; one line if absent."""
        if not isinstance(data.full, ClientData):
            raise ValueError(
                f"{self.name} needs the client's whole local data in data.full (one extra pass); build the data "
                "with FederatedData.client_data(..., full=alg.needs_full_pass), as the runtime does"
            )
        return data.full

    def diagnostics(self) -> Diagnostics | None:
        """The contract's one optional extension, simulation only (``core.diagnostics``): hooks into the
        simulator's exact full-data gradient pass, to measure the algorithm's estimate (``[diagnostics]``) and/or to
        receive that gradient in the broadcast every round. Default: none."""
        return None

    def init_server(self, params: Params) -> Any:
        """The ``ServerState`` of round 1 from the initial global model."""
        raise NotImplementedError

    def init_client(self, params: Params) -> Any:
        """A client's ``ClientState`` before its first round (``()``: stateless clients)."""
        return ()

    def broadcast(self, server: Any, rnd: RoundInfo) -> Any:
        """The ``Broadcast`` of round ``rnd``: the wire payload, the same for every client."""
        raise NotImplementedError

    def client_update(
        self, msg: Any, state: Any, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        """One client's round: pure and branch-free on data values, so that the vmap engine can batch it."""
        raise NotImplementedError

    def new_aggregator(self) -> Aggregator:
        """A fresh streaming aggregator for one round's uploads (the weighted mean of the ``Upload`` trees)."""
        return WeightedMean()

    def server_update(self, server: Any, agg: Any, rnd: RoundInfo) -> tuple[Any, dict[str, float]]:
        """The next ``ServerState`` from the aggregate, with server metrics; ``rnd.cohort_size`` counts the uploads
        aggregated. Never called for a round in which nobody reported (the runtime keeps the state as it is)."""
        raise NotImplementedError

    def eval_params(self, server: Any, client_state: Any = None) -> Params:
        """The parameters the global evaluation uses (default: ``server.params``)."""
        return server.params

    def predict(self, server: Any, client_state: Any, model: Any, x: Tensor) -> Tensor:
        """Logits of the model a client would deploy (personalised algorithms override this)."""
        return model.logits(self.eval_params(server, client_state), x)

    def run_notes(self, local_steps: int) -> dict[str, float]:
        """Facts worth logging once per run (HaFedHo: ``lambda*mu``); may warn."""
        return {}


# The hooks the runtime and ``FedAvg`` call, each with its positional arguments after ``self``.
HOOKS = (
    "init_server",
    "init_client",
    "broadcast",
    "client_update",
    "new_aggregator",
    "server_update",
    "eval_params",
    "predict",
    "run_notes",
    "objective",
    "transform",
    "train",
    "train_metrics",
    "next_state",
)


def check_hooks(alg: FedAlgorithm) -> None:
    """Each hook that ``alg``'s own class overrides (one the library's classes define) must accept the positional
    arguments the library's definition takes: a wrong count is one line when the run is built, not a TypeError
    after round 1 has trained."""
    cls = type(alg)
    for name in HOOKS:
        ref = next((vars(c)[name] for c in cls.__mro__ if _library(c) and name in vars(c)), None)
        mine = getattr(cls, name, None)
        if ref is None or mine is ref or not callable(ref) or _library(_owner(cls, name)):
            continue
        try:
            want = [p.name for p in inspect.signature(ref).parameters.values() if p.default is p.empty][1:]
            inspect.signature(getattr(alg, name)).bind(*want)
        except TypeError as e:
            if "argument" not in str(e):  # not a signature's complaint
                raise
            has = ", ".join(str(p).split(":")[0] for p in inspect.signature(mine).parameters.values())
            raise ConfigError(
                f"algorithm {cls.__name__}: {name}({has}) cannot take the runtime's call {name}({', '.join(want)}) "
                f"({e}); give it those {len(want)} parameters after self"
            ) from None
        except ValueError:  # no signature to read (a builtin): nothing to check
            continue


def _library(cls: type) -> bool:
    return cls.__module__.split(".")[0] == __name__.split(".")[0]  # this package's own classes


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))
