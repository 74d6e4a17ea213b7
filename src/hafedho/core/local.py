"""Local training shared by every algorithm: S masked steps of a transform over an objective.

Algorithms differ from FedAvg in one of two places: the *objective* (FedProx, FedDyn, MOON, HaFedHo) or the
*transform* that turns a gradient into an update (SCAFFOLD's ``+ c - c_i``, MimeLite's frozen momentum). This
module owns the loop so that no algorithm copies it. The same transforms are server optimizers (``server_step``):
FedAvgM is FedAvg with ``sgd`` (momentum) on the server, FedAdam (examples/server_adam) with ``adam``.

``local_train`` is pure and branch-free: it never writes into its inputs and never branches in Python on
data values, so a vectorised engine can ``vmap`` it over a cohort. A step whose batch is all padding
(``mask.sum() == 0``) is a no-op, gated arithmetically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad

from hafedho.core import tree
from hafedho.core.tree import Params
from hafedho.core.types import ClientData, ClientInfo, Objective


class Transform(NamedTuple):
    """An optax-style gradient transformation: ``update(grads, state, params) -> (updates, state)``."""

    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple[Params, Any]]


def sgd(lr: float, momentum: float | None = None, nesterov: bool = False) -> Transform:
    """SGD, ``update = -lr g``; with ``momentum`` beta, the heavy ball on a buffer v (the state)::

        v <- beta v + g
        update = -lr v                   (nesterov: -lr (beta v + g), Sutskever et al. 2013, PyTorch's form)

    ``momentum=None`` keeps no state; a float, 0.0 included, keeps v (optax's convention), so a server that stores
    v (FedAvgM's ``ServerState.v``) has one at beta = 0 too.
    """
    if momentum is None:
        if nesterov:
            raise ValueError("sgd: nesterov needs a momentum")
        return Transform(lambda p: (), lambda g, s, p: (tree.scale(g, -lr), s))

    def update(g: Params, v: Params, p: Params) -> tuple[Params, Params]:
        v = tree.axpy(momentum, v, g)  # beta v + g
        step = tree.axpy(momentum, v, g) if nesterov else v
        return tree.scale(step, -lr), v

    return Transform(tree.zeros_like, update)


class AdamState(NamedTuple):
    m: Params  # first moment of the gradient
    v: Params  # second moment (elementwise square)


def adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, v0: float = 0.0) -> Transform:
    """Adam (Kingma & Ba, arXiv:1412.6980, Algorithm 1) in the form Reddi et al.'s FedAdam (arXiv:2003.00295,
    Algorithm 2) runs on the server; the state is ``AdamState(m, v)``::

        m <- b1 m + (1 - b1) g           m_0 = 0
        v <- b2 v + (1 - b2) g^2         v_0 = v0 (FedAdam: tau^2)
        update = -lr m / (sqrt(v) + eps)  (FedAdam: eps = tau, outside the root as in Kingma & Ba)

    Without Kingma & Ba's bias correction (their m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)): FedAdam has
    none, and starts v at tau^2 (Kingma & Ba: 0).
    """

    def init(p: Params) -> AdamState:
        return AdamState(tree.zeros_like(p), {k: torch.full_like(x, v0) for k, x in p.items()})

    def update(g: Params, s: AdamState, p: Params) -> tuple[Params, AdamState]:
        m = {k: b1 * s.m[k] + (1 - b1) * g[k] for k in g}
        v = {k: b2 * s.v[k] + (1 - b2) * g[k] ** 2 for k in g}
        return {k: -lr * m[k] / (v[k].sqrt() + eps) for k in g}, AdamState(m, v)

    return Transform(init, update)


def shift(delta: Params) -> Transform:
    """``g <- g + delta`` with a constant delta (SCAFFOLD's ``c - c_i``)."""
    return Transform(lambda p: (), lambda g, s, p: (tree.add(g, delta), s))


def mix(other: Params, a: float, b: float) -> Transform:
    """``g <- a g + b other`` with a constant ``other`` (MimeLite's frozen server momentum)."""
    return Transform(lambda p: (), lambda g, s, p: ({k: a * g[k] + b * other[k] for k in g}, s))


def chain(*transforms: Transform) -> Transform:
    """Apply transforms in order; the state is the tuple of their states."""

    def init(p: Params) -> tuple:
        return tuple(t.init(p) for t in transforms)

    def update(g: Params, states: tuple, p: Params) -> tuple[Params, tuple]:
        new = []
        for t, s in zip(transforms, states, strict=True):
            g, s = t.update(g, s, p)
            new.append(s)
        return g, tuple(new)

    return Transform(init, update)


def server_step(transform: Transform, params: Params, delta: Params, state: Any) -> tuple[Params, Any]:
    """A server optimizer's step, ``(x_{t+1}, state)``: ``transform`` on the pseudo-gradient ``Delta_w = -delta``
    (``delta`` = the clients' mean Delta_i = y_i - x_t, so plain FedAvg is the step ``-Delta_w``), its update added
    to ``params`` = x_t. Reddi et al.'s FedOpt (arXiv:2003.00295, Algorithm 2) with the clients' own transforms."""
    updates, state = transform.update(tree.scale(delta, -1.0), state, params)
    return tree.add(params, updates), state


def value_grad(fn: Callable[..., tuple[Tensor, Any]]) -> Callable[..., tuple[Params, Any]]:
    """``torch.func.grad(fn, has_aux=True)``, but through plain autograd when no functorch transform is active.

    Both give the same gradients. Under ``vmap`` (the vmap engine) only the functional form works; elsewhere
    (loop, process, Flower) autograd skips functorch's per-call wrapping, which dominates small models (a
    610-parameter logistic regression step is about 2.5x faster without it).
    """
    functional = grad(fn, has_aux=True)

    def eager(p: Params, *args: Any) -> tuple[Params, Any]:
        if torch._C._are_functorch_transforms_active():
            return functional(p, *args)
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in p.items()}
            out, aux = fn(leaves, *args)
            # functorch returns zeros for a parameter the objective never touches (or for all of them, when the
            # objective is constant: pFedAFM's header step on a model without a header); so must we
            ins = list(leaves.values())
            gs = torch.autograd.grad(out, ins, allow_unused=True) if out.requires_grad else [None] * len(ins)
        return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), gs, strict=True)}, aux

    return eager


class LocalResult(NamedTuple):
    params: Params  # the final local model y_i
    grad_sum: Params  # sum over real steps k of grad objective(w^{(k)})
    steps: Tensor  # number of real steps K_i (0-d float)
    loss: Tensor  # mean over real steps of the plain loss f(w^{(k)}), measured before each step
    objective: Tensor  # mean over real steps of the objective phi(w^{(k)})


def local_train(objective: Objective, params: Params, data: ClientData, transform: Transform) -> LocalResult:
    """Run ``S = data.x.shape[0]`` masked steps of ``transform`` on ``objective`` starting from ``params``."""

    def with_aux(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        phi, f = objective(p, x, y, m)
        return phi, (phi, f)

    grad_fn = value_grad(with_aux)
    dtype = next(iter(params.values())).dtype
    w = params
    opt_state = transform.init(w)
    g_sum = tree.zeros_like(w)
    zero = torch.zeros((), dtype=dtype, device=data.y.device)
    steps, f_sum, phi_sum = zero, zero, zero
    for s in range(data.x.shape[0]):
        g, (phi, f) = grad_fn(w, data.x[s], data.y[s], data.mask[s])
        active = (data.mask[s].sum() > 0).to(dtype)  # 0 for an all-padding step: the step is a no-op
        updates, new_state = transform.update(g, opt_state, w)
        w = tree.axpy(active, updates, w)
        opt_state = tree.where(active > 0, new_state, opt_state)
        g_sum = tree.axpy(active, g, g_sum)
        steps = steps + active
        f_sum = f_sum + active * f.detach()
        phi_sum = phi_sum + active * phi.detach()
    n = steps.clamp(min=1.0)
    return LocalResult(w, g_sum, steps, f_sum / n, phi_sum / n)


def plain_objective(model: Any) -> Objective:
    """The client's own loss, ``phi = f``."""

    def objective(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        f = model.loss(p, x, y, m)
        return f, f

    return objective


def aggregation_weight(info: ClientInfo, weighting: str) -> Tensor:
    """The weight of a client's upload in the server's weighted mean: |D_i| (``"data_size"``) or 1 (``"uniform"``)."""
    return info.num_examples if weighting == "data_size" else torch.ones_like(info.num_examples)


def full_gradient(model: Any, params: Params, data: ClientData) -> tuple[Params, Tensor]:
    """``(grad f_i(params), f_i(params))`` of the plain masked-mean loss over ALL of ``data``'s real examples.

    One gradient at ``params`` over every real row of every step (the mask keeps padding out), not a training
    loop: sum_s n_s grad f_s / sum_s n_s with n_s the real rows of step s, which is the gradient of the masked
    mean over all rows at once, computed step by step so that memory is that of one step's batch. Given
    ``data.full`` this is the full-batch gradient over the client's whole local data (FedSGD's upload, MimeLite's
    and SCAFFOLD option I's ``grad f_i(x)``); given a round's batches, over its data *as sampled for this round*
    (its dataset once when the runtime plans one local epoch; with a fixed step count, examples drawn twice count
    twice). Equal to the one-batch gradient up to float rounding, except for models with BatchNorm, whose batch
    statistics are then those of each step. An all-padding client gets a zero gradient and loss 0.
    Pure and branch-free (vmap-safe).
    """

    def with_value(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        f = model.loss(p, x, y, m)
        return f, f.detach()

    grad_fn = value_grad(with_value)
    dtype = next(iter(params.values())).dtype
    rows = data.mask.to(dtype).flatten(1).sum(1)  # n_s, real rows per step
    total = rows.sum().clamp(min=1.0)
    g_sum, f_sum = tree.zeros_like(params), torch.zeros((), dtype=dtype, device=total.device)
    for s in range(data.x.shape[0]):
        g, f = grad_fn(params, data.x[s], data.y[s], data.mask[s])
        share = rows[s] / total  # 0 for an all-padding step, whose (finite) gradient drops out
        g_sum = tree.axpy(share, g, g_sum)
        f_sum = f_sum + share * f
    return g_sum, f_sum
