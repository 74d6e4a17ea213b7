"""HaFedHo's momentum twin: a derived row (``[[variants]]`` with ``of`` and ``derive``, ``hafedho.sweep.expand``).

The derivation is docs/algorithms.md, "HaFedHo's momentum twin". A preset names it as
``derive = "hafedho_paper.twin:momentum_twin"``; how the report reads the twin's row is ``TWIN`` (``study.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hafedho.config import Config

# HaFedHo's settings the twin covers; any other one away from its default (e.g. an option added later) has no twin.
_TWIN_COVERS = {"lr", "mu", "eta", "accumulate", "aggregation", "self_correction", "mu_schedule"}

# How the report reads a twin row (``[report.derived]``'s keys, ``hafedho.report.study.DerivedView``).
TWIN = {
    "name": "FedAvgM, β = λμ",  # ASCII: "FedAvgM, beta = lambda*mu"; docs/algorithms.md
    "noun": "twin",
    "value": "beta",  # a twin split by beta reads "FedAvgM, β = λμ = 0.5"
    "plot_key": "mu",  # an accuracy-vs-mu figure of its row draws the twin at mu = beta / lambda
    "divide_by": "clients.local_steps",
    "matches": "the gain is server momentum",
    "share": "server momentum alone gives",
    "note": (
        "HaFedHo's momentum twin, FedAvgM with beta = lambda*mu of the HaFedHo run beside it, uniform weights, "
        "server_lr 1 and the same local lr (docs/algorithms.md, HaFedHo's momentum twin)"
    ),
}


def momentum_twin(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """The ``[algorithm]`` table of a HaFedHo run's momentum twin, or None and why it has none.

    With accumulate = "phi" the uploads obey g^t = G^t + lambda*mu*g^{t-1} (exactly without self-correction), the
    heavy-ball recursion of FedAvgM with beta = lambda*mu (lambda = clients.local_steps, mu = the resolved
    algorithm.hafedho.mu), server_lr = eta / eta_l (1 when eta is unset, its default), the same local lr, and
    FedAvgM's weighting = HaFedHo's aggregation ("uniform" -> "uniform", "data_size" -> "data_size": HaFedHo's
    data-size aggregate is the |D_i|-weighted mean FedAvgM's "data_size" forms). beta is lambda*mu rounded to 12
    significant digits (10 * 0.05 reads 0.5). Defined only for accumulate = "phi", mu_schedule = "constant",
    fixed local_steps (local_epochs = 0) and lambda*mu < 1; see docs/algorithms.md.
    """
    alg = cfg.selected_algorithm()
    if alg.name != "hafedho":
        return None, f"a {alg.name} run has no momentum twin (only hafedho runs do)"
    if alg.accumulate != "phi":
        return None, f'gradient rectification (accumulate = "{alg.accumulate}")'
    if alg.mu_schedule != "constant":
        return None, f'mu_schedule = "{alg.mu_schedule}": the factor lambda*mu_t changes every round'
    if cfg.clients.local_epochs > 0:
        return None, f"clients.local_epochs = {cfg.clients.local_epochs}: lambda differs from client to client"
    for f in dataclasses.fields(alg):
        if f.name not in _TWIN_COVERS and getattr(alg, f.name) != f.default:
            return None, f"{f.name} = {getattr(alg, f.name)!r} is not plain HaFedHo"
    lam = cfg.clients.local_steps
    beta = float(f"{lam * alg.mu:.12g}")
    if beta >= 1:
        return None, f"lambda*mu = {lam}*{alg.mu:g} = {beta:g} >= 1: no heavy-ball twin (FedAvgM needs beta < 1)"
    eta = alg.lr if alg.eta is None else alg.eta
    settings = {"beta": beta, "server_lr": eta / alg.lr, "weighting": alg.aggregation}
    return {"name": "fedavgm", "lr": alg.lr, "fedavgm": settings}, ""
