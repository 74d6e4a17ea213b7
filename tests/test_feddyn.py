"""FedDyn (Algorithm 1) against rounds computed by hand, the objective's gradient, and the official-code options.

Problem: f_k(w) = 1/2 ||w - a_k||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); a population of N = 4
(client 4 is never sampled, so m/N = 2/4 = 1/2); alpha = 0.5, eta_l = 0.5, 2 local steps, theta^0 = (0, 0).
Cohorts: round 1 {1, 2}, round 2 {2, 3}. Local gradient: (w - a_k) - grad L_k + alpha (w - theta^{t-1}).

Round 1 (grad L_k = 0, h = 0):
    client 1: step 1 grad (-1, 0) -> w = (0.5, 0); step 2 grad (-0.5, 0) + 0.5 (0.5, 0) = (-0.25, 0)
              -> w = (0.625, 0); Delta_1 = (0.625, 0); grad L_1 = -0.5 Delta_1 = (-0.3125, 0)
    client 2: step 1 grad (0, -2) -> w = (0, 1); step 2 grad (0, -1) + 0.5 (0, 1) = (0, -0.5)
              -> w = (0, 1.25); Delta_2 = (0, 1.25); grad L_2 = (0, -0.625)
    server:   mean Delta = (0.3125, 0.625); h^1 = -0.5 * 1/2 * (0.3125, 0.625) = (-0.078125, -0.15625)
              theta^1 = (0.3125, 0.625) - h^1 / 0.5 = (0.46875, 0.9375)
Round 2 (theta^1 = (0.46875, 0.9375)):
    client 2: -grad L_2 = (0, 0.625)
              step 1: (0.46875, -1.0625) + (0, 0.625) + 0 = (0.46875, -0.4375) -> w = (0.234375, 1.15625)
              step 2: (0.234375, -0.84375) + (0, 0.625) + 0.5 (-0.234375, 0.21875) = (0.1171875, -0.109375)
                      -> w = (0.17578125, 1.2109375)
              Delta_2 = (-0.29296875, 0.2734375)
              grad L_2 = (0, -0.625) - 0.5 Delta_2 = (0.146484375, -0.76171875)
    client 3: grad L_3 = 0
              step 1: (1.46875, 1.9375) -> w = (-0.265625, -0.03125)
              step 2: (0.734375, 0.96875) + 0.5 (-0.734375, -0.96875) = (0.3671875, 0.484375)
                      -> w = (-0.44921875, -0.2734375)
              Delta_3 = (-0.91796875, -1.2109375);  grad L_3 = (0.458984375, 0.60546875)
    server:   mean Delta = (-0.60546875, -0.46875)
              h^2 = h^1 - 0.25 mean Delta = (0.0732421875, -0.0390625)
              theta^2 = theta^1 + mean Delta - h^2 / 0.5 = (-0.283203125, 0.546875)
    client 1 keeps grad L_1 = (-0.3125, 0). Check: h^2 = (1/N) sum_k grad L_k = (1/4)(0.29296875, -0.15625).
"""

from __future__ import annotations

import math

import pytest
import quadratic
import torch
from quadratic import MODEL, SIZES, client_data, close, info, rnd, rounds, w
from torch.func import grad

from hafedho.algorithms.feddyn import Broadcast, ClientState, FedDyn, ServerState, Upload, clip_by_global_norm

A = {**quadratic.A, 4: (2.0, 2.0)}
N = 4


def two_rounds(**kw):
    alg = FedDyn(lr=0.5, alpha=0.5, **kw)
    sizes = {**SIZES, 4: 1.0}  # p = (0.2, 0.2, 0.4, 0.2)
    (s1, r1, st1), (s2, r2, states) = rounds(alg, [[1, 2], [2, 3]], w(0.0, 0.0), sizes=sizes, num_clients=N)
    return s1, s2, r1, r2, st1, states


def test_two_rounds_by_hand() -> None:
    s1, s2, r1, r2, st1, st2 = two_rounds()
    assert close(r1[1].upload.delta, [0.625, 0.0]) and close(st1[1].grad_l, [-0.3125, 0.0])
    assert close(r1[2].upload.delta, [0.0, 1.25]) and close(st1[2].grad_l, [0.0, -0.625])
    assert close(s1.h, [-0.078125, -0.15625]) and close(s1.params, [0.46875, 0.9375])
    assert close(r2[2].upload.delta, [-0.29296875, 0.2734375])  # the linear term moved client 2
    assert close(st2[2].grad_l, [0.146484375, -0.76171875])
    assert close(r2[3].upload.delta, [-0.91796875, -1.2109375])
    assert close(st2[3].grad_l, [0.458984375, 0.60546875])
    assert close(s2.h, [0.0732421875, -0.0390625]) and close(s2.params, [-0.283203125, 0.546875])
    # client 1 skipped round 2 and client 4 never took part: their states are untouched
    assert torch.equal(st2[1].grad_l["w"], st1[1].grad_l["w"]) and torch.equal(st2[4].grad_l["w"], torch.zeros(2))
    # h = (1/N) sum_k grad L_k over the whole population
    assert torch.allclose(s2.h["w"], sum(st2[k].grad_l["w"] for k in A) / N, atol=1e-7)
    assert all(float(r.weight) == 1.0 for r in r2.values())  # the plain mean over the active clients


def test_objective_gradient_has_both_penalty_terms() -> None:
    """At w = (1, 1), theta^{t-1} = (0.5, 0), grad L = (0.2, -0.4), a = (0, 2), alpha = 0.5:
    grad phi = (w - a) - grad L + alpha (w - theta) = (1, -1) - (0.2, -0.4) + 0.5 (0.5, 1) = (1.05, -0.1);
    phi = 1/2 ||(1, -1)||^2 - <(0.2, -0.4), (1, 1)> + 0.25 ||(0.5, 1)||^2 = 1 + 0.2 + 0.3125 = 1.5125."""
    alg = FedDyn(alpha=0.5)
    phi = alg.objective(MODEL, Broadcast(w(0.5, 0.0)), ClientState(w(0.2, -0.4)), info(0.25), rnd(1, 1))
    d = client_data(A[2], 1)
    g = grad(lambda p: phi(p, d.x[0], d.y[0], d.mask[0])[0])(w(1.0, 1.0))
    assert close(g, [1.05, -0.1])
    value, f = phi(w(1.0, 1.0), d.x[0], d.y[0], d.mask[0])
    assert float(value) == pytest.approx(1.5125) and float(f) == pytest.approx(1.0)


def test_server_update_by_hand() -> None:
    """h = (0.1, 0.2), theta = (1, -1), mean Delta = (0.4, -0.8), m = 1, N = 4, alpha = 0.5:
    h' = (0.1, 0.2) - 0.5 * 1/4 * (0.4, -0.8) = (0.05, 0.3);
    theta' = (1, -1) + (0.4, -0.8) - (0.05, 0.3) / 0.5 = (1.3, -2.4)."""
    alg = FedDyn(alpha=0.5)
    new, metrics = alg.server_update(ServerState(w(1.0, -1.0), w(0.1, 0.2)), Upload(w(0.4, -0.8)), rnd(1, 1, n=4))
    assert close(new.h, [0.05, 0.3]) and close(new.params, [1.3, -2.4])
    assert metrics["server/h_norm"] == pytest.approx(math.hypot(0.05, 0.3))


def test_alpha_scaling_data_size() -> None:
    """Official code: alpha_k = alpha / (N p_k). Client 3 alone in round 1 with p_3 = 0.5, N = 4: alpha_3 = 0.25.
    step 1 grad (1, 1) -> w = (-0.5, -0.5); step 2 grad (0.5, 0.5) + 0.25 (-0.5, -0.5) = (0.375, 0.375)
    -> w = (-0.6875, -0.6875); grad L_3 = -0.25 w = (0.171875, 0.171875).
    With alpha_scaling="none" (alpha = 0.5): step 2 grad 0.25 -> w = (-0.625, -0.625), grad L_3 = (0.3125, 0.3125).
    The server keeps alpha = 0.5 either way."""
    msg = ServerState(w(0.0, 0.0), w(0.0, 0.0))
    out = {}
    for scaling in ("data_size", "none"):
        alg = FedDyn(lr=0.5, alpha=0.5, alpha_scaling=scaling)
        st = alg.init_client(w(0.0, 0.0))
        out[scaling] = alg.client_update(msg, st, client_data(A[3], 2), info(0.5, 2), rnd(1, 1, n=4), MODEL)
    assert close(out["data_size"].upload.delta, [-0.6875, -0.6875])
    assert close(out["data_size"].state.grad_l, [0.171875, 0.171875])
    assert close(out["none"].upload.delta, [-0.625, -0.625]) and close(out["none"].state.grad_l, [0.3125, 0.3125])


def test_max_grad_norm_clips_each_step() -> None:
    """Client 3 in round 1 with max_grad_norm = 1: step 1 grad (1, 1) has norm sqrt 2 and becomes
    (1, 1) / (sqrt 2 + 1e-6) -> w = -0.5 / sqrt 2 (1, 1) = -0.353553 (1, 1); step 2 grad
    (1 - 0.353553) + 0.5 (-0.353553) = 0.469670 per coordinate, norm 0.664214 < 1: not clipped
    -> w = -0.353553 - 0.234835 = -0.588388 (1, 1)."""
    alg = FedDyn(lr=0.5, alpha=0.5, max_grad_norm=1.0)
    msg = ServerState(w(0.0, 0.0), w(0.0, 0.0))
    res = alg.client_update(msg, alg.init_client(w(0, 0)), client_data(A[3], 2), info(0.4), rnd(1, 1, n=4), MODEL)
    w1 = -0.5 / (math.sqrt(2) + 1e-6)
    w2 = w1 - 0.5 * ((w1 + 1) + 0.5 * w1)
    assert close(res.upload.delta, [w2, w2]) and abs(w2 + 0.588388) < 1e-5


def test_clip_transform() -> None:
    t = clip_by_global_norm(2.0)
    g, _ = t.update(w(3.0, 4.0), t.init(w(0.0, 0.0)), w(0.0, 0.0))
    assert close(g, [1.2, 1.6], atol=1e-5)
    g, _ = t.update(w(0.3, 0.4), (), w(0.0, 0.0))
    assert torch.equal(g["w"], w(0.3, 0.4)["w"])


def test_padded_steps_are_no_ops() -> None:
    alg = FedDyn(lr=0.5, alpha=0.5)
    msg, st = ServerState(w(0.2, 0.1), w(0.0, 0.0)), alg.init_client(w(0, 0))._replace(grad_l=w(0.1, -0.3))
    a = alg.client_update(msg, st, client_data(A[1], 2), info(0.2), rnd(1, 1, n=4), MODEL)
    b = alg.client_update(msg, st, client_data(A[1], 6, real_steps=2), info(0.2), rnd(1, 1, n=4), MODEL)
    assert torch.equal(a.upload.delta["w"], b.upload.delta["w"]) and torch.equal(
        a.state.grad_l["w"], b.state.grad_l["w"]
    )
