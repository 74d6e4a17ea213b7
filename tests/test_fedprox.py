"""FedProx against rounds computed by hand, and its reduction to FedAvg at mu = 0.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); n_i = (1, 1, 2);
eta_l = 0.5, mu = 0.5, K = 2 local steps, w_0 = (0, 0). Cohorts: round 1 {1, 2}, round 2 {2, 3}.
Local step: w <- w - 0.5 ((w - a_i) + 0.5 (w - x_t)).

Round 1 (x_0 = (0, 0)):
    client 1: step 1 grad (-1, 0) -> w = (0.5, 0); step 2 grad (-0.5, 0) + 0.5 (0.5, 0) = (-0.25, 0)
              -> w = (0.625, 0); Delta_1 = (0.625, 0)
    client 2: step 1 grad (0, -2) -> w = (0, 1); step 2 grad (0, -1) + 0.5 (0, 1) = (0, -0.5)
              -> w = (0, 1.25); Delta_2 = (0, 1.25)
    server (n = 1, 1): x_1 = (0.3125, 0.625)
Round 2 (x_1 = (0.3125, 0.625)):
    client 2: step 1 grad (0.3125, -1.375) -> w = (0.15625, 1.3125);
              step 2 grad (0.15625, -0.6875) + 0.5 (-0.15625, 0.6875) = (0.078125, -0.34375)
              -> w = (0.1171875, 1.484375); Delta_2 = (-0.1953125, 0.859375)
    client 3: step 1 grad (1.3125, 1.625) -> w = (-0.34375, -0.1875);
              step 2 grad (0.65625, 0.8125) + 0.5 (-0.65625, -0.8125) = (0.328125, 0.40625)
              -> w = (-0.5078125, -0.390625); Delta_3 = (-0.8203125, -1.015625)
    server, data_size (n = 1, 2): mean = ((-0.1953125 - 1.640625) / 3, (0.859375 - 2.03125) / 3)
              = (-1.8359375 / 3, -0.390625);  x_2 = (0.3125 - 0.61197916.., 0.234375) = (-0.29947916.., 0.234375)
    server, uniform: mean = (-0.5078125, -0.078125);  x_2 = (-0.1953125, 0.546875)
"""

from __future__ import annotations

import pytest
import torch
from quadratic import COHORTS, MODEL, A, client_data, close, info, rnd, rounds, w
from torch.func import grad

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.fedprox import Broadcast, FedProx


def two_rounds(**kw):
    (s1, r1, _), (s2, r2, _) = rounds(FedProx(lr=0.5, mu=0.5, **kw), COHORTS[:2], w(0.0, 0.0))
    return s1, s2, r1, r2


def test_two_rounds_by_hand() -> None:
    s1, s2, r1, r2 = two_rounds()
    assert close(r1[1].upload.delta, [0.625, 0.0]) and close(r1[2].upload.delta, [0.0, 1.25])
    assert close(s1.params, [0.3125, 0.625])
    assert close(r2[2].upload.delta, [-0.1953125, 0.859375])
    assert close(r2[3].upload.delta, [-0.8203125, -1.015625])
    assert float(r2[3].weight) == 2.0  # data-size weight n_3
    assert close(s2.params, [0.3125 - 1.8359375 / 3, 0.234375])


def test_uniform_weighting() -> None:
    _, s2, _, r2 = two_rounds(weighting="uniform")
    assert float(r2[3].weight) == 1.0
    assert close(s2.params, [-0.1953125, 0.546875])


def test_objective_gradient_has_the_proximal_term() -> None:
    """At w = (1, 1), x_t = (0.5, 0), a = (0, 2): grad = (w - a) + mu (w - x_t) = (1, -1) + 0.5 (0.5, 1) = (1.25, -0.5);
    the objective value is 1/2 ||(1, -1)||^2 + 0.25 ||(0.5, 1)||^2 = 1 + 0.3125."""
    phi = FedProx(mu=0.5).objective(MODEL, Broadcast(w(0.5, 0.0)), (), info(0.25), rnd(1, 1))
    d = client_data(A[2], 1)
    g = grad(lambda p: phi(p, d.x[0], d.y[0], d.mask[0])[0])(w(1.0, 1.0))
    assert close(g, [1.25, -0.5])
    assert float(phi(w(1.0, 1.0), d.x[0], d.y[0], d.mask[0])[0]) == pytest.approx(1.3125)


@pytest.mark.parametrize("weighting", ["data_size", "uniform"])
def test_mu_zero_is_fedavg_exactly(weighting: str) -> None:
    prox = rounds(FedProx(lr=0.5, mu=0.0, weighting=weighting), COHORTS, w(0.0, 0.0), steps=3)
    avg = rounds(FedAvg(lr=0.5, weighting=weighting), COHORTS, w(0.0, 0.0), steps=3)
    for (ps, pr, _), (fs, fr, _) in zip(prox, avg, strict=True):
        assert torch.equal(ps.params["w"], fs.params["w"])
        for i in pr:
            assert torch.equal(pr[i].upload.delta["w"], fr[i].upload.delta["w"])


def test_padded_steps_are_no_ops() -> None:
    alg = FedProx(lr=0.5, mu=0.5)
    msg = alg.broadcast(alg.init_server(w(0.0, 0.0)), rnd(1, 1))
    a = alg.client_update(msg, (), client_data(A[1], 2), info(0.25, 1), rnd(1, 1), MODEL)
    b = alg.client_update(msg, (), client_data(A[1], 5, real_steps=2), info(0.25, 1), rnd(1, 1), MODEL)
    assert torch.equal(a.upload.delta["w"], b.upload.delta["w"])
