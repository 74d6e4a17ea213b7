"""The simulator's full-data gradient pass: grad f_j(w_t) over every client's whole training data, streamed.

Two users, one pass per round at most (docs/algorithms.md, "Theorem 1 measured / Proposition 1's ideal"):

* ``[diagnostics] every = k`` (Theorem 1 measured): every k-th round, before the cohort trains, how well each
  sampled client's estimate (HaFedHo's h, ``FedAlgorithm.estimate``) matches the exact quantity it stands for;
  cohort means go into the round's metrics row as ``diag/*``. Only reads: the trajectory is bit-identical with
  diagnostics on or off, and the pass's seconds are left out of ``wall_s`` (logged as ``diag/seconds``).
* ``alg.needs_full_gradient`` (HaFedHo's h_source="exact", Proposition 1's ideal): the aggregates are attached to
  the broadcast (``attach_full_gradient``) every round; the pass is then part of the method and of ``wall_s``.

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

from hafedho.core import Params, RoundInfo, full_gradient, tree
from hafedho.core.seeds import seed_for
from hafedho.experiment import Experiment
from hafedho.runtime.store import ClientStore

WEIGHTINGS = ("uniform", "data_size")  # a_j = 1/N, a_j = p_j (``core.aggregation_weight``'s names)
DIAG_KEYS = ("diag/h_cos", "diag/h_rel_err", "diag/h_norm", "diag/target_norm", "diag/grad_norm", "diag/seconds")


class FullGradients(NamedTuple):
    """One full-data pass at w_t: the aggregates (float64) and the kept clients' own gradients."""

    grad: dict[str, Params]  # weighting -> sum_j a_j grad f_j(w_t)
    f: dict[str, Tensor]  # weighting -> sum_j a_j f_j(w_t)
    own: dict[int, tuple[Params, Tensor]]  # kept client i -> (grad f_i(w_t), f_i(w_t)), in the parameters' dtype

    def aggregates(self, dtype: torch.dtype) -> dict[str, tuple[Params, Tensor]]:
        """What ``FedAlgorithm.attach_full_gradient`` and ``estimate`` receive: the aggregates in ``dtype``."""
        return {w: ({k: v.to(dtype) for k, v in self.grad[w].items()}, self.f[w].to(dtype)) for w in WEIGHTINGS}


def full_gradients(exp: Experiment, params: Params, t: int, keep: list[int] | tuple[int, ...] = ()) -> FullGradients:
    """grad f_j(params) of the plain loss over client j's whole training data, for every client j, folded into the
    uniform and the data-size aggregates as it goes (float64 sums: memory is two parameter copies plus the
    ``keep`` clients' own gradients, never N). Client j's data comes in masked blocks (``FederatedData.full_data``,
    ``core.full_gradient``) of equal size, at most ``model.rows_per_pass`` rows (the cache rule of ``core.sizing``:
    blocks of the batch size B, as before, ran 1.6x slower on LeNet-5); see the module docstring for the
    training mode and the seeds."""
    fed, model = exp.fed, exp.model
    n = fed.num_clients
    p = fed.sizes.astype(np.float64) / float(fed.sizes.sum())
    keep_set = set(int(c) for c in keep)
    most = model.rows_per_pass(fed.input_shape, fed.dtype)  # rows per block: the cache rule of core.sizing
    sums = {w: {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()} for w in WEIGHTINGS}
    fsum = {w: torch.zeros((), dtype=torch.float64) for w in WEIGHTINGS}
    own: dict[int, tuple[Params, Tensor]] = {}
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
                if j in keep_set:
                    own[j] = (g, f)
        finally:
            model.train(was_training)
    return FullGradients(sums, fsum, own)


def _block(n: int, most: int) -> int:
    """Rows per block for a client of ``n`` rows: ceil(n / most) blocks of equal size (at most ``most`` rows),
    so the padding of the last block is under one row per block."""
    return math.ceil(n / math.ceil(n / most))


def _f64(x: Params) -> Params:
    return {k: v.double() for k, v in x.items()}


def _norm(x: Params) -> float:
    return math.sqrt(float(tree.sq_norm(_f64(x))))


def measure(h: Params, target: Params, scale: float) -> dict[str, float]:
    """One client's diagnostic (float64): the cosine between h and the target (0 when either is 0), the relative
    error ||h/s - target|| / ||target|| after the steady-state scale s, and both norms."""
    h, target = _f64(h), _f64(target)
    hn, tn = _norm(h), _norm(target)
    dot = float(tree.dot(h, target))
    err = _norm(tree.sub({k: v / scale for k, v in h.items()}, target))
    return {
        "diag/h_cos": dot / (hn * tn) if hn > 0 and tn > 0 else 0.0,
        "diag/h_rel_err": err / tn if tn > 0 else (0.0 if err == 0 else 1.0),
        "diag/h_norm": hn,
        "diag/target_norm": tn,
    }


def diagnose(
    exp: Experiment, msg: Any, rnd: RoundInfo, cohort: list[int], store: ClientStore, full: FullGradients, dtype: Any
) -> dict[str, float]:
    """Cohort means of ``measure`` for each sampled client's estimate (``alg.estimate``, from its state before it
    trains; the aggregates in the parameters' ``dtype``), and ``diag/grad_norm`` = ||sum_j p_j grad f_j(w_t)||,
    the norm of grad Gamma(w_t)."""
    alg, fed = exp.alg, exp.fed
    aggs = full.aggregates(dtype)
    sums: dict[str, float] = {}
    for cid in cohort:
        steps = exp.plan.steps_for(int(fed.sizes[cid]))
        h, target, scale = alg.estimate(msg, store.gather(cid), fed.client_info(cid), rnd, aggs, full.own[cid], steps)
        for k, v in measure(h, target, scale).items():
            sums[k] = sums.get(k, 0.0) + v
    out = {k: v / max(len(cohort), 1) for k, v in sums.items()}
    out["diag/grad_norm"] = _norm(full.grad["data_size"])
    return out


def is_diagnostic_round(exp: Experiment, t: int) -> bool:
    every = exp.cfg.diagnostics.every
    return every > 0 and t % every == 0


def prepare_round(
    exp: Experiment, params: Params, msg: Any, rnd: RoundInfo, cohort: list[int], store: ClientStore
) -> tuple[Any, dict[str, float], float]:
    """Round ``rnd``'s full-data work before the cohort trains: ``(broadcast, diag metrics, untimed seconds)``.

    The broadcast gets the exact gradient when the algorithm needs it; on diagnostic rounds the metrics are the
    ``diag/*`` cohort means (else empty). The untimed seconds are the pass's when only the diagnostic needed it
    (the runner leaves them out of ``wall_s``); 0 when the algorithm needs the pass anyway.
    """
    needs, diag = exp.alg.needs_full_gradient, is_diagnostic_round(exp, rnd.round)
    if not (needs or diag):
        return msg, {}, 0.0
    t0 = time.perf_counter()
    full = full_gradients(exp, params, rnd.round, keep=cohort if diag else ())
    dtype = next(iter(params.values())).dtype
    if needs:
        msg = exp.alg.attach_full_gradient(msg, full.aggregates(dtype))
    metrics: dict[str, float] = {}
    if diag:
        metrics = diagnose(exp, msg, rnd, cohort, store, full, dtype)
        metrics["diag/seconds"] = round(time.perf_counter() - t0, 4)
    return msg, metrics, 0.0 if needs else time.perf_counter() - t0
