"""The contract's one optional, simulation-only extension: what an algorithm gives the simulator's exact full-data
gradient pass (``hafedho.sim.fullgrad``), through ``FedAlgorithm.diagnostics()`` (default None: nothing).

That pass computes grad f_j(w_t) over every client's whole training data, which only a simulator holds. An
algorithm uses it in two ways, kept apart:

* measurement (``estimate``, ``weightings``): with ``[diagnostics] every = k``, every k-th round, each sampled
  client's estimate (HaFedHo's h) against the exact quantity it stands for, logged as ``diag/*``. It only reads:
  the trajectory is bit-identical with the diagnostics on or off. Without ``estimate`` the config refuses
  ``diagnostics.every > 0``.
* training input (``attach_full_gradient``): an idealised method whose broadcast carries the exact full-data
  gradient at w_t every round (HaFedHo's h_source = "exact"). It moves the trajectory, the pass counts in
  ``wall_s``, and the Flower apps refuse it. Not to be confused with a client's gradient over its *own* whole data
  (MimeLite's, SCAFFOLD option I's, FedSGD's): that is ``FedAlgorithm.needs_full_pass``, computed on the client,
  in every runtime.

``full`` below is ``{weighting: (sum_j a_j grad f_j(w_t), sum_j a_j f_j(w_t))}`` over all N clients, with a_j = 1/N
for ``"uniform"`` and a_j = p_j for ``"data_size"`` (``aggregation_weight``'s names), in the parameters' dtype;
the diagnostic pass adds the algorithm's ``weightings`` under their own names (docs/extending.md, section 9).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torch import Tensor

from hafedho.core.tree import Params
from hafedho.core.types import ClientInfo, RoundInfo

FullAggregates = dict[str, tuple[Params, Tensor]]  # weighting -> (sum_j a_j grad f_j(w_t), sum_j a_j f_j(w_t))


class Estimate(NamedTuple):
    """What ``Diagnostics.estimate`` gives the ``[diagnostics]`` pass for one client (docs/algorithms.md,
    "Theorem 1 measured")."""

    e: Params  # the estimate the client uses (HaFedHo: h)
    target: Params  # the exact quantity it stands for at w_t (HaFedHo: the other clients' share T_i)
    scale: float  # s with e ~ s * target (one scalar; diag/{name}_rel_err divides by it)
    reference: Params  # what e would be at w_t in a steady state of the method (e.g. noise-free, full participation)
    coef: float  # the factor e enters the objective with (HaFedHo: mu_t), for the error ||coef e - target||


# estimate(msg, state, info, rnd, full, own, steps): a client about to train in round rnd from its state; own =
# (grad f_i(w_t), f_i(w_t)) over its whole data, steps its lambda
EstimateFn = Callable[[Any, Any, ClientInfo, RoundInfo, FullAggregates, tuple[Params, Tensor], int], Estimate]
# weightings(p, steps, rnd): name -> per-client weights w_j ([N]) from every client's p_j and lambda_j
WeightingsFn = Callable[[np.ndarray, np.ndarray, RoundInfo], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Diagnostics:
    """An algorithm's hooks into the simulator's full-data pass (module docstring); each is optional.

    ``estimate``: the ``Estimate`` of a client about to train in round ``rnd`` (the estimate its ``client_update``
    would use, from the broadcast ``msg`` and its ``state``), the exact quantity it stands for (from ``full`` and
    ``own``), its scale and steady-state reference. ``weightings``: extra per-client weights ``w_j`` whose sums
    ``(sum_j w_j grad f_j(w_t), sum_j w_j)`` the pass hands ``estimate`` in ``full`` under the same name (the second
    slot is the weights' total, not a loss). ``attach_full_gradient(msg, full)``: the broadcast with the full-data
    gradient at w_t attached, every round (set only by algorithms that train on it). ``name``: the estimate's
    symbol, which names its metrics (``hafedho.sim.fullgrad.diag_keys``), so a report of the method reads them by
    its own names.
    """

    estimate: EstimateFn | None = None
    weightings: WeightingsFn | None = None
    attach_full_gradient: Callable[[Any, FullAggregates], Any] | None = None
    name: str = "e"  # the estimate's symbol in the metric keys: diag/{name}_cos, ... (HaFedHo: "h")

    @property
    def needs_full_gradient(self) -> bool:
        """Whether the broadcast must carry the exact full-data gradient (simulation only)."""
        return self.attach_full_gradient is not None

    @staticmethod
    def of(alg: Any) -> Diagnostics:
        """``alg.diagnostics()``, or the empty ``Diagnostics()`` for an algorithm that provides none."""
        return alg.diagnostics() or Diagnostics()
