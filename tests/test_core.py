"""Core: tree math, the streaming aggregator, local_train's purity and masking, hyperparameter checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from quadratic import QuadraticModel, client_data, w
from tolerance import fp32_close

from hafedho.core import (
    ConfigError,
    FedAlgorithm,
    WeightedMean,
    adam,
    chain,
    hp,
    local_train,
    mix,
    plain_objective,
    server_step,
    sgd,
    shift,
    tree,
    value_grad,
)


def test_tree_math_is_pure_and_correct() -> None:
    a, b = w(1.0, 2.0), w(3.0, -1.0)
    a0 = a["w"].clone()
    assert torch.equal(tree.add(a, b)["w"], torch.tensor([4.0, 1.0]))
    assert torch.equal(tree.sub(a, b)["w"], torch.tensor([-2.0, 3.0]))
    assert torch.equal(tree.axpy(2.0, a, b)["w"], torch.tensor([5.0, 3.0]))
    assert float(tree.dot(a, b)) == 1.0
    assert tree.num_bytes({"x": torch.zeros(3), "y": torch.zeros(2, dtype=torch.int64)}) == 3 * 4 + 2 * 8
    assert torch.equal(a["w"], a0)


def test_weighted_mean_streams_and_handles_empty() -> None:
    agg = WeightedMean()
    assert agg.result() is None
    agg.add(w(1.0, 0.0), torch.tensor(1.0))
    agg.add(w(4.0, 3.0), torch.tensor(2.0))
    assert torch.allclose(agg.result()["w"], torch.tensor([3.0, 2.0]))
    rev = WeightedMean()
    rev.add(w(4.0, 3.0), torch.tensor(2.0))
    rev.add(w(1.0, 0.0), torch.tensor(1.0))
    assert torch.equal(rev.result()["w"], agg.result()["w"])


def test_local_train_steps_by_hand_and_padding_is_noop() -> None:
    """f = 1/2||w - a||^2, a = (1, 0), lr 0.5: w (0,0) -> (0.5,0) -> (0.75,0); a third all-padding step is a
    no-op. grad sum = (-1,0) + (-0.5,0); mean loss = (0.5 + 0.125) / 2."""
    model = QuadraticModel()
    start = w(0.0, 0.0)
    res = local_train(plain_objective(model), start, client_data((1.0, 0.0), steps=3, real_steps=2), sgd(0.5))
    assert torch.allclose(res.params["w"], torch.tensor([0.75, 0.0]))
    assert torch.allclose(res.grad_sum["w"], torch.tensor([-1.5, 0.0]))
    assert float(res.steps) == 2.0 and abs(float(res.loss) - 0.3125) < 1e-7
    assert torch.equal(start["w"], torch.zeros(2)), "local_train must not write into its inputs"


def test_value_grad_matches_functorch_eager_and_under_vmap() -> None:
    """The eager (autograd) path and functorch's grad agree, including zeros for an unused parameter."""

    def fn(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = (torch.tanh(x @ p["a"]) ** 2).sum()
        return out, out.detach()

    p = {"a": torch.tensor([[0.3, -1.0], [2.0, 0.5]]), "unused": torch.ones(3)}
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    g, aux = value_grad(fn)(p, x)
    ref, ref_aux = torch.func.grad(fn, has_aux=True)(p, x)
    fp32_close(g["a"], ref["a"], reduction=2, steps=1)
    assert torch.equal(g["unused"], torch.zeros(3))
    assert float(aux) == pytest.approx(float(ref_aux))
    assert not p["a"].requires_grad  # the caller's tensors are untouched
    const, _ = value_grad(lambda q, x: (x.sum(), x.sum()))(p, x)  # an objective that ignores every parameter
    assert all(torch.equal(v, torch.zeros_like(p[k])) for k, v in const.items())
    # under vmap (a functorch transform is active) the functional path runs; per-sample results match eager ones
    batched = torch.vmap(value_grad(fn), in_dims=(None, 0))(p, torch.stack([x, 2 * x]))[0]
    fp32_close(batched["a"][1], value_grad(fn)(p, 2 * x)[0]["a"], reduction=2, steps=1)  # vmap's kernels: rounding


def test_transforms_shift_mix_momentum() -> None:
    model = QuadraticModel()
    data = client_data((1.0, 0.0), steps=1)
    # shift: g + d with d = (1, 1): g = (-1, 0) + (1, 1) = (0, 1); w = -0.5 * (0, 1)
    res = local_train(plain_objective(model), w(0.0, 0.0), data, chain(shift(w(1.0, 1.0)), sgd(0.5)))
    assert torch.allclose(res.params["w"], torch.tensor([0.0, -0.5]))
    # mix: 0.5 g + 0.5 m with m = (2, 2): (-0.5 + 1, 1) = (0.5, 1) -> w = -0.5 * that
    res = local_train(plain_objective(model), w(0.0, 0.0), data, chain(mix(w(2.0, 2.0), 0.5, 0.5), sgd(0.5)))
    assert torch.allclose(res.params["w"], torch.tensor([-0.25, -0.5]))
    # heavy ball, 2 steps, beta 0.5: v1 = g1 = (-1,0), w1 = (0.5,0); g2 = (-0.5,0), v2 = 0.5 v1 + g2 = (-1,0)
    res = local_train(plain_objective(model), w(0.0, 0.0), client_data((1.0, 0.0), steps=2), sgd(0.5, momentum=0.5))
    assert torch.allclose(res.params["w"], torch.tensor([1.0, 0.0]))


def _steps(transform, grads: list[list[float]]) -> tuple[list[list[float]], object]:
    """The updates of ``transform`` fed ``grads`` one after the other (float64 tensors), and its final state."""
    p = {"x": torch.zeros(2, dtype=torch.float64)}
    state, out = transform.init(p), []
    for g in grads:
        u, state = transform.update({"x": torch.tensor(g, dtype=torch.float64)}, state, p)
        out.append(u["x"].tolist())
    return out, state


def test_sgd_momentum_and_nesterov_by_hand() -> None:
    """g = (1, -2), (3, 0), (-1, 4); lr 0.5, beta 0.5.
    Heavy ball: v = (1, -2), (3.5, -1), (0.75, 3.5); update -0.5 v = (-0.5, 1), (-1.75, 0.5), (-0.375, -1.75).
    Nesterov: d = 0.5 v + g = (1.5, -3), (4.75, -0.5), (-0.625, 5.75); update -0.5 d; v as the heavy ball's."""
    grads = [[1.0, -2.0], [3.0, 0.0], [-1.0, 4.0]]
    ups, v = _steps(sgd(0.5, momentum=0.5), grads)
    assert ups == [[-0.5, 1.0], [-1.75, 0.5], [-0.375, -1.75]] and v["x"].tolist() == [0.75, 3.5]
    ups, v = _steps(sgd(0.5, momentum=0.5, nesterov=True), grads)
    assert ups == [[-0.75, 1.5], [-2.375, 0.25], [0.3125, -2.875]] and v["x"].tolist() == [0.75, 3.5]
    ups, state = _steps(sgd(0.5), grads)  # plain SGD keeps no state
    assert ups == [[-0.5, 1.0], [-1.5, 0.0], [0.5, -2.0]] and state == ()
    ups, v = _steps(sgd(0.5, momentum=0.0), grads)  # beta = 0 is plain SGD's steps, with a buffer v = g
    assert ups == [[-0.5, 1.0], [-1.5, 0.0], [0.5, -2.0]] and v["x"].tolist() == [-1.0, 4.0]
    with pytest.raises(ValueError, match="nesterov needs a momentum"):
        sgd(0.5, nesterov=True)


def test_adam_by_hand() -> None:
    """lr 1, b1 = b2 = 0.5, eps 1, v0 2; g = (4, -4), (3, -21). No bias correction: m and v are used as they are.
    Step 1: m = 0.5 g = (2, -2); v = 0.5 * 2 + 0.5 g^2 = (9, 9); update -m / (sqrt v + 1) = (-0.5, 0.5).
    Step 2: m = 0.5 m + 0.5 g = (2.5, -11.5); v = 0.5 v + 0.5 g^2 = (9, 225); update = (-2.5 / 4, 11.5 / 16)."""
    ups, s = _steps(adam(1.0, b1=0.5, b2=0.5, eps=1.0, v0=2.0), [[4.0, -4.0], [3.0, -21.0]])
    assert ups == [[-0.5, 0.5], [-0.625, 0.71875]]
    assert s.m["x"].tolist() == [2.5, -11.5] and s.v["x"].tolist() == [9.0, 225.0]
    init = adam(0.1, v0=0.25).init({"x": torch.ones(3)})
    assert init.m["x"].tolist() == [0.0] * 3 and init.v["x"].tolist() == [0.25] * 3  # m_0 = 0, v_0 = v0


def test_server_step_feeds_the_pseudo_gradient() -> None:
    """x_{t+1} = x_t + update(-delta): plain sgd(eta) is FedAvg's x + eta delta; the state comes back updated."""
    x, delta = w(1.0, 2.0), w(0.5, -1.0)
    params, state = server_step(sgd(0.5), x, delta, ())
    assert params["w"].tolist() == [1.25, 1.5] and state == ()
    params, v = server_step(sgd(1.0, momentum=0.5), x, delta, w(2.0, 2.0))  # v = 0.5 (2, 2) - (0.5, -1) = (0.5, 2)
    assert v["w"].tolist() == [0.5, 2.0] and params["w"].tolist() == [0.5, 0.0]
    assert x["w"].tolist() == [1.0, 2.0]  # pure


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy(FedAlgorithm):
    name = "toy"
    beta: float = hp(0.5, "a coefficient", ge=0, lt=1)
    mode: str = hp("a", "a mode", choices=("a", "b"))
    flag: bool = hp(True, "a switch")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"beta": 1.0}, r"algorithm.beta=1.0: must be < 1"),
        ({"beta": "x"}, r"algorithm.beta='x': expected float, got str"),
        ({"mode": "c"}, r"algorithm.mode='c': choose one of 'a', 'b'"),
        ({"flag": 1}, r"algorithm.flag=1: expected bool, got int"),
        ({"lr": float("nan")}, r"algorithm.lr=nan: must be a finite number"),
        ({"gamma": 1}, r"algorithm.gamma: unknown setting for toy; valid: beta, flag, lr, mode"),
    ],
)
def test_hyperparameters_are_validated(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _Toy.from_config(settings)


def test_int_accepted_for_float() -> None:
    assert _Toy.from_config({"lr": 1}).lr == 1.0
