"""The simulator's full-data gradient pass: grad f_j(w_t) over every client's whole training data, streamed.

Two users, one pass per round at most, both through the algorithm's ``Diagnostics`` (``FedAlgorithm.diagnostics()``,
``core.diagnostics``; docs/algorithms.md, "Theorem 1 measured / Proposition 1's ideal"):

* ``[diagnostics] every = k`` (Theorem 1 measured): every k-th round, before the cohort trains, how well each
  sampled client's estimate (HaFedHo's h, ``Diagnostics.estimate``) matches the exact quantity it stands for
  (``diagnose``: the h used in round t), and after it trained, how well what it uploaded does (``fresh``: the h
  round t+1 builds from round t's aggregate), both against the target at w_t; cohort means go into the round's
  metrics row as ``diag/*``. Only reads: the trajectory is bit-identical with diagnostics on or off, and the
  pass's seconds are left out of ``wall_s`` (logged as ``diag/seconds``).
* ``Diagnostics.needs_full_gradient`` (HaFedHo's h_source="exact", Proposition 1's ideal): the aggregates are
  attached to the broadcast (``Diagnostics.attach_full_gradient``) every round; the pass is then part of the method
  and of ``wall_s``.

The pass runs in the runner's process, whatever the engine, so every engine receives the same broadcast.

Dropout: the pass runs the model in training mode with a fixed torch seed per (run seed, round, client) (seed
purpose ``"full_gradient"``), inside ``torch.random.fork_rng`` so no other draw moves. The estimates it is
compared with are sums of training-mode gradients, whose expectation is the gradient of the expected dropout
loss; a training-mode full-data gradient is an unbiased, low-variance (independent masks for every row of the
client's data) estimate of that gradient, while the eval-mode gradient is the gradient of another function
(without dropout). For dropout-free models (LeNet-5, the CIFAR CNN, ResNet-18-GN, MLPs) both modes coincide.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from hafedho.core import Diagnostics, Estimate, Params, RoundInfo, full_gradient, tree
from hafedho.core.diagnostics import EstimateFn
from hafedho.core.seeds import seed_for
from hafedho.experiment import Experiment
from hafedho.runtime.store import ClientStore

WEIGHTINGS = ("uniform", "data_size")  # a_j = 1/N, a_j = p_j (``core.aggregation_weight``'s names)


def diag_keys(name: str) -> tuple[str, ...]:
    """Every key a diagnostic round adds to the metrics row, for an estimate the algorithm names ``name``
    (``Diagnostics.name``; HaFedHo's h gives ``diag/h_cos``, ...): ``diag/{name}_*`` for the estimate used in round
    t (built at w_{t-1}) against the target T at w_t, ``diag/fresh_*`` for round t's fresh aggregate (the estimate
    of round t+1) against the same target."""
    return (
        f"diag/{name}_cos",  # cos(e, T)
        f"diag/{name}_rel_err",  # ||e / s - T|| / ||T||, after the scalar scale s (Estimate.scale)
        f"diag/{name}_ss_rel_err",  # ||e - e^*|| / ||e^*||, against the estimate's steady state (Estimate.reference)
        f"diag/{name}_def1_abs_err",  # ||coef e - T|| (Estimate.coef)
        f"diag/{name}_norm",
        "diag/target_norm",
        "diag/ref_norm",  # ||e^*||
        "diag/grad_norm",
        "diag/fresh_cos",
        "diag/fresh_ss_rel_err",
        "diag/fresh_def1_abs_err",
        "diag/fresh_norm",
        "diag/seconds",
    )


class FullGradients(NamedTuple):
    """One full-data pass at w_t: the aggregates (float64) and the kept clients' own gradients."""

    grad: dict[str, Params]  # weighting -> sum_j a_j grad f_j(w_t)
    f: dict[str, Tensor]  # weighting -> sum_j a_j f_j(w_t)
    own: dict[int, tuple[Params, Tensor]]  # kept client i -> (grad f_i(w_t), f_i(w_t)), in the parameters' dtype
    extra: dict[str, tuple[Params, Tensor]] | None = None  # name -> (sum_j w_j grad f_j, sum_j w_j), float64

    def aggregates(self, dtype: torch.dtype, prefix: str | None = None) -> dict[str, tuple[Params, Tensor]]:
        """What ``Diagnostics.attach_full_gradient`` and ``estimate`` receive: the aggregates in ``dtype``, and with
        ``prefix`` the extra weightings named ``prefix + name``, under ``name``."""
        out = {w: ({k: v.to(dtype) for k, v in self.grad[w].items()}, self.f[w].to(dtype)) for w in WEIGHTINGS}
        for name, (g, total) in (self.extra or {}).items():
            if prefix is not None and name.startswith(prefix):
                out[name[len(prefix) :]] = ({k: v.to(dtype) for k, v in g.items()}, total.to(dtype))
        return out


def full_gradients(
    exp: Experiment,
    params: Params,
    t: int,
    keep: list[int] | tuple[int, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
) -> FullGradients:
    """grad f_j(params) of the plain loss over client j's whole training data, for every client j, folded into the
    uniform and the data-size aggregates as it goes (float64 sums: memory is two parameter copies plus the
    ``keep`` clients' own gradients, never N). Client j's data comes in masked blocks (``FederatedData.full_data``,
    ``core.full_gradient``) of equal size, at most ``model.rows_per_pass`` rows (the cache rule of ``core.sizing``:
    blocks of the batch size B, as before, ran 1.6x slower on LeNet-5); see the module docstring for the
    training mode and the seeds. ``extra``: more per-client weights (name -> ``[N]``), folded likewise into
    ``(sum_j w_j grad f_j, sum_j w_j)``, after and apart from the two aggregates (whose bits they never move)."""
    fed, model = exp.fed, exp.model
    n = fed.num_clients
    p = fed.sizes.astype(np.float64) / float(fed.sizes.sum())
    keep_set = set(int(c) for c in keep)
    most = model.rows_per_pass(fed.input_shape, fed.dtype)  # rows per block: the cache rule of core.sizing
    sums = {w: {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()} for w in WEIGHTINGS}
    fsum = {w: torch.zeros((), dtype=torch.float64) for w in WEIGHTINGS}
    own: dict[int, tuple[Params, Tensor]] = {}
    extra = extra or {}
    xsums = {name: {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()} for name in extra}
    was_training = model.module.training
    with torch.random.fork_rng(devices=[]):
        model.train(True)
        try:
            for j in range(n):
                torch.manual_seed(seed_for(exp.cfg.seed, "full_gradient", t, j))
                g, f = full_gradient(model, params, fed.full_data(j, _block(int(fed.sizes[j]), most)))
                g, f = tree.detach(g), f.detach()
                g64, f64 = _f64(g), f.double()  # once per client, for both weightings
                for w, a in (("uniform", 1.0 / n), ("data_size", float(p[j]))):
                    sums[w] = tree.axpy(a, g64, sums[w])
                    fsum[w] = fsum[w] + a * f64
                for name, wts in extra.items():
                    xsums[name] = tree.axpy(float(wts[j]), g64, xsums[name])
                if j in keep_set:
                    own[j] = (g, f)
        finally:
            model.train(was_training)
    totals = {
        name: torch.tensor(float(np.sum(wts, dtype=np.float64)), dtype=torch.float64) for name, wts in extra.items()
    }
    return FullGradients(sums, fsum, own, {name: (xsums[name], totals[name]) for name in extra} if extra else None)


def _block(n: int, most: int) -> int:
    """Rows per block for a client of ``n`` rows: ceil(n / most) blocks of equal size (at most ``most`` rows),
    so the padding of the last block is under one row per block."""
    return math.ceil(n / math.ceil(n / most))


def _f64(x: Params) -> Params:
    return {k: v.double() for k, v in x.items()}


def params_dtype(params: Params) -> torch.dtype:
    return next(iter(params.values())).dtype


def _norm(x: Params) -> float:
    return math.sqrt(float(tree.sq_norm(_f64(x))))


def measure(e: Params, target: Params, scale: float) -> dict[str, float]:
    """One client's diagnostic (float64): the cosine between e and the target (0 when either is 0), the relative
    error ||e/s - target|| / ||target|| after the scale s, and both norms (keys without their ``diag/`` prefix)."""
    e, target = _f64(e), _f64(target)
    en, tn = _norm(e), _norm(target)
    dot = float(tree.dot(e, target))
    err = _norm(tree.sub({k: v / scale for k, v in e.items()}, target))
    return {
        "cos": dot / (en * tn) if en > 0 and tn > 0 else 0.0,
        "rel_err": err / tn if tn > 0 else (0.0 if err == 0 else 1.0),
        "norm": en,
        "target_norm": tn,
    }


def errors(est: Estimate, key: str) -> dict[str, float]:
    """What only an ``Estimate`` gives (float64): ``diag/{key}_ss_rel_err`` = ||e - reference|| / ||reference||
    (0 / 1 conventions as ``measure``) and ``diag/{key}_def1_abs_err`` = ||coef e - target||."""
    e, ref, target = _f64(est.e), _f64(est.reference), _f64(est.target)
    rn, err = _norm(ref), _norm(tree.sub(e, ref))
    return {
        f"diag/{key}_ss_rel_err": err / rn if rn > 0 else (0.0 if err == 0 else 1.0),
        f"diag/{key}_def1_abs_err": _norm(tree.sub({k: est.coef * v for k, v in e.items()}, target)),
    }


def diagnostic_weights(exp: Experiment, rnd: RoundInfo) -> dict[str, np.ndarray]:
    """The ``extra`` of a diagnostic pass: the algorithm's ``Diagnostics.weightings`` (from every client's p_j and
    lambda_j) for round t's estimate and for round t+1's (``fresh``), named ``"t:name"``."""
    weightings = Diagnostics.of(exp.alg).weightings
    if weightings is None:
        return {}
    sizes = exp.fed.sizes
    p = sizes.astype(np.float64) / float(sizes.sum())
    steps = np.array([exp.plan.steps_for(int(n)) for n in sizes], dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    for t in (rnd.round, rnd.round + 1):
        at = RoundInfo(t, rnd.num_clients, rnd.cohort_size)
        out.update({f"{t}:{k}": v for k, v in weightings(p, steps, at).items()})
    return out


def _estimate(exp: Experiment) -> EstimateFn:
    """The algorithm's ``Diagnostics.estimate``; one line if it has none (the config refuses that setting)."""
    estimate = Diagnostics.of(exp.alg).estimate
    if estimate is None:
        raise ValueError(f"diagnostics.every: {exp.alg.name} keeps no estimate to measure (FedAlgorithm.diagnostics)")
    return estimate


def _mean(per: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(d[k] for d in per) / max(len(per), 1) for k in (per[0] if per else {})}


def diagnose(
    exp: Experiment, msg: Any, rnd: RoundInfo, cohort: list[int], store: ClientStore, full: FullGradients, dtype: Any
) -> dict[str, float]:
    """Cohort means of ``measure`` and ``errors`` for each sampled client's estimate (``Diagnostics.estimate``, from
    its state before it trains; the aggregates in the parameters' ``dtype``), named by ``Diagnostics.name``
    (``diag_keys``), and ``diag/grad_norm`` = ||sum_j p_j grad f_j(w_t)||, the norm of grad Gamma(w_t)."""
    estimate, fed, name = _estimate(exp), exp.fed, Diagnostics.of(exp.alg).name
    aggs = full.aggregates(dtype, f"{rnd.round}:")
    per = []
    for cid in cohort:
        steps = exp.plan.steps_for(int(fed.sizes[cid]))
        est = estimate(msg, store.gather(cid), fed.client_info(cid), rnd, aggs, full.own[cid], steps)
        m = measure(est.e, est.target, est.scale)
        per.append(
            {f"diag/{name}_{k}": m[k] for k in ("cos", "rel_err", "norm")} | {"diag/target_norm": m["target_norm"]}
        )
        per[-1] |= {**errors(est, name), "diag/ref_norm": _norm(est.reference)}
    out = _mean(per)
    out["diag/grad_norm"] = _norm(full.grad["data_size"])
    return out


def fresh(
    exp: Experiment, server: Any, rnd: RoundInfo, cohort: list[int], store: ClientStore, full: FullGradients, dtype: Any
) -> dict[str, float]:
    """Round t's fresh aggregate against the target at w_t (the pass of ``diagnose``): cohort means of cos, the
    steady-state error and Definition 1's error of the h each client of round t's cohort would build in round t+1
    (``Diagnostics.estimate`` with round t+1's broadcast and each client's state after round t). Empty for
    estimates made from the full gradient rather than from uploads (``needs_full_gradient``: round t+1's broadcast
    would need the full gradient at w_{t+1}, which this pass at w_t is not)."""
    alg, fed = exp.alg, exp.fed
    if Diagnostics.of(alg).needs_full_gradient:
        return {}
    estimate = _estimate(exp)
    nxt = RoundInfo(rnd.round + 1, rnd.num_clients, rnd.cohort_size)
    msg, aggs = alg.broadcast(server, nxt), full.aggregates(dtype, f"{nxt.round}:")
    per = []
    for cid in cohort:
        steps = exp.plan.steps_for(int(fed.sizes[cid]))
        est = estimate(msg, store.gather(cid), fed.client_info(cid), nxt, aggs, full.own[cid], steps)
        m = measure(est.e, est.target, est.scale)
        per.append({"diag/fresh_cos": m["cos"], **errors(est, "fresh"), "diag/fresh_norm": m["norm"]})
    return _mean(per)


def is_diagnostic_round(exp: Experiment, t: int) -> bool:
    every = exp.cfg.diagnostics.every
    return every > 0 and t % every == 0


def prepare_round(
    exp: Experiment, params: Params, msg: Any, rnd: RoundInfo, cohort: list[int], store: ClientStore
) -> tuple[Any, dict[str, float], float, FullGradients | None]:
    """Round ``rnd``'s full-data work before the cohort trains: ``(broadcast, diag metrics, untimed seconds, the
    pass for ``fresh`` on diagnostic rounds, else None)``.

    The broadcast gets the exact gradient when the algorithm needs it; on diagnostic rounds the metrics are the
    ``diag/*`` cohort means (else empty). The untimed seconds are the pass's when only the diagnostic needed it
    (the runner leaves them out of ``wall_s``); 0 when the algorithm needs the pass anyway.
    """
    attach, diag = Diagnostics.of(exp.alg).attach_full_gradient, is_diagnostic_round(exp, rnd.round)
    if attach is None and not diag:
        return msg, {}, 0.0, None
    t0 = time.perf_counter()
    extra = diagnostic_weights(exp, rnd) if diag else None
    full = full_gradients(exp, params, rnd.round, keep=cohort if diag else (), extra=extra)
    dtype = params_dtype(params)
    if attach is not None:
        msg = attach(msg, full.aggregates(dtype))
    metrics: dict[str, float] = {}
    if diag:
        metrics = diagnose(exp, msg, rnd, cohort, store, full, dtype)
        metrics["diag/seconds"] = round(time.perf_counter() - t0, 4)
    return msg, metrics, 0.0 if attach is not None else time.perf_counter() - t0, full if diag else None
