"""HaFedHo (Algorithm 1) against rounds computed by hand, and each named switch.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); p = (0.25, 0.25, 0.5);
eta_l = eta = 0.5, lambda = 2 local steps, mu = 0.1, w_0 = (0, 0). Cohorts: round 1 {1, 2}, round 2 {2, 3},
so client 2 is sampled in consecutive rounds (self-correction applies) and client 3 is not.

Round 1 (g^0 = 0, f_hat^0 = 0, so h = 0: plain local GD):
    client 1: w (0,0) -> (0.5,0) -> (0.75,0); grads (-1,0), (-0.5,0): g_1 = (-1.5, 0); f: 0.5, 0.125 -> f_hat_1 = 0.3125
    client 2: w (0,0) -> (0,1) -> (0,1.5); grads (0,-2), (0,-1): g_2 = (0, -3); f: 2, 0.5 -> f_hat_2 = 1.25
    server: g^1 = (-0.75, -1.5), f_hat^1 = 0.78125, w_1 = w_0 - 0.5 g^1 = (0.375, 0.75) (= mean final model)
Round 2 (mu h enters every gradient):
    client 2: h = g^1 - p_2 g_2 = (-0.75, -0.75); f_hat = 0.78125 - 0.25 * 1.25 = 0.46875
        step 1: w - a = (0.375, -1.25), f = 0.8515625, grad phi = (0.3, -1.325), w = (0.225, 1.4125)
        step 2: w - a = (0.225, -0.5875), f = 0.197890625, grad phi = (0.15, -0.6625), w = (0.15, 1.74375)
        g_2 = (0.45, -1.9875), f_hat_2 = 0.5247265625
    client 3: h = g^1 = (-0.75, -1.5) (not sampled in round 1)
        step 1: w - a = (1.375, 1.75), f = 2.4765625, grad phi = (1.3, 1.6), w = (-0.275, -0.05)
        step 2: w - a = (0.725, 0.95), f = 0.7140625, grad phi = (0.65, 0.8), w = (-0.6, -0.45)
        g_3 = (1.95, 2.4), f_hat_3 = 1.5953125
    server: g^2 = (1.2, 0.20625), f_hat^2 = 1.06001953125, w_2 = (-0.225, 0.646875) (= mean final model)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from quadratic import COHORTS, MODEL, SIZES, A, client_data, client_updates, close, info, mean_upload, rnd, rounds, w

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.hafedho import HaFedHo, ServerState
from hafedho.core import ClientData, FunctionalModel
from hafedho.models import MLP


def two_rounds(**kw):
    (s1, r1, _), (s2, r2, states) = rounds(HaFedHo(lr=0.5, mu=0.1, **kw), COHORTS[:2], w(0.0, 0.0))
    return s1, s2, r1, r2, states


def test_two_rounds_by_hand() -> None:
    s1, s2, r1, r2, states = two_rounds()
    assert close(r1[1].upload.g_i, [-1.5, 0.0]) and abs(float(r1[1].upload.f_hat_i) - 0.3125) < 1e-7
    assert close(r1[2].upload.g_i, [0.0, -3.0]) and abs(float(r1[2].upload.f_hat_i) - 1.25) < 1e-7
    assert close(s1.g, [-0.75, -1.5]) and abs(float(s1.f_hat) - 0.78125) < 1e-7
    assert close(s1.params, [0.375, 0.75])
    assert close(r2[2].upload.g_i, [0.45, -1.9875])  # self-corrected h = (-0.75, -0.75)
    assert abs(float(r2[2].upload.f_hat_i) - 0.5247265625) < 1e-6
    assert close(r2[3].upload.g_i, [1.95, 2.4])  # no correction: h = g^1
    assert abs(float(r2[3].upload.f_hat_i) - 1.5953125) < 1e-6
    assert close(s2.g, [1.2, 0.20625]) and abs(float(s2.f_hat) - 1.06001953125) < 1e-6
    assert close(s2.params, [-0.225, 0.646875])
    # client 1 skipped round 2: its state is exactly its round-1 upload
    assert close(states[1].g_i, [-1.5, 0.0]) and int(states[1].last_round) == 1
    assert int(states[3].last_round) == 2


def test_without_self_correction_client_2_uses_full_g() -> None:
    """h = g^1 = (-0.75, -1.5) for client 2 too: step 1 grad phi = (0.375-0.075, -1.25-0.15) = (0.3, -1.4),
    w = (0.225, 1.45); step 2 grad = (0.225-0.075, -0.55-0.15) = (0.15, -0.7): g_2 = (0.45, -2.1)."""
    _, _, _, r2, _ = two_rounds(self_correction=False)
    assert close(r2[2].upload.g_i, [0.45, -2.1])


def test_accumulate_f_same_steps_different_upload() -> None:
    """Gradient rectification uploads sum grad f = g_2(phi) - lambda mu h = (0.45,-1.9875) - 2*0.1*(-0.75,-0.75)
    = (0.6, -1.8375); the local steps (hence final models) are those of objective rectification."""
    _, _, _, phi, _ = two_rounds(accumulate="phi")
    _, _, _, f, _ = two_rounds(accumulate="f")
    assert close(f[2].upload.g_i, [0.6, -1.8375])
    assert torch.allclose(phi[2].upload.f_hat_i, f[2].upload.f_hat_i)  # same trajectory, same losses
    assert not torch.allclose(phi[2].upload.g_i["w"], f[2].upload.g_i["w"])


def test_mu_f_hat_term_moves_no_parameter() -> None:
    alg = HaFedHo(lr=0.5, mu=0.1)
    st = alg.init_client(w(0.0, 0.0))
    base = ServerState(w(0.375, 0.75), w(-0.75, -1.5), torch.tensor(0.78125))
    big = base._replace(f_hat=torch.tensor(1000.0))
    a = alg.client_update(base, st, client_data(A[3], 2), info(0.5), rnd(2, 2), MODEL)
    b = alg.client_update(big, st, client_data(A[3], 2), info(0.5), rnd(2, 2), MODEL)
    assert torch.equal(a.upload.g_i["w"], b.upload.g_i["w"])
    assert torch.equal(a.upload.f_hat_i, b.upload.f_hat_i)
    assert float(b.metrics["train/objective"]) - float(a.metrics["train/objective"]) == pytest.approx(0.1 * 999.21875)


def test_mu_zero_is_uniform_fedavg_up_to_the_stated_rounding() -> None:
    """The docstring's bound, round by round from the same w_t: |w_HaFedHo - w_FedAvg| <= (3 lambda + 8) u S per
    entry, u = 2^-24, S = max(|w_t|, |y_i|, eta |g_i|) over the leaf (final iterates: a smaller S, a stricter
    check). On the hand problem (lambda = 2) and on a small MLP (lambda = 3 steps, one padded row per batch)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = FunctionalModel(MLP((4,), 3, hidden=(5,)))
        mask = torch.tensor([1.0, 1.0, 1.0, 0.0]).expand(3, 4)
        net_data = {i: ClientData(torch.randn(3, 4, 4) + i, torch.randint(0, 3, (3, 4)), mask) for i in SIZES}
    u = torch.finfo(torch.float32).eps / 2
    for model, lam, w0, data in (
        (MODEL, 2, w(0.3, -0.7), {i: client_data(A[i], 2) for i in SIZES}),
        (net, 3, net.params(), net_data),
    ):
        hfh, avg = HaFedHo(lr=0.5, mu=0.0), FedAvg(lr=0.5, weighting="uniform")
        server, states = hfh.init_server(w0), {i: hfh.init_client(w0) for i in SIZES}
        for t, cohort in enumerate(COHORTS * 2, start=1):
            r = rnd(t, len(cohort))
            rh = client_updates(hfh, hfh.broadcast(server, r), states, cohort, r, data, SIZES, model)
            start = avg.init_server(server.params)
            rf = client_updates(avg, avg.broadcast(start, r), dict.fromkeys(SIZES, ()), cohort, r, data, SIZES, model)
            new, _ = hfh.server_update(server, mean_upload(rh), r)
            ref, _ = avg.server_update(start, mean_upload(rf), r)
            for k, v in server.params.items():
                local = [(v + rf[i].upload.delta[k]).abs().max() for i in cohort]
                grads = [0.5 * rh[i].upload.g_i[k].abs().max() for i in cohort]
                scale = float(torch.stack([v.abs().max(), *local, *grads]).max())
                assert float((new.params[k] - ref.params[k]).abs().max()) <= (3 * lam + 8) * u * scale, (t, k)
            server = new


def test_data_size_aggregation() -> None:
    """Weights n_i = 4 p_i = (1, 1) in round 1 (equal), (1, 2) in round 2:
    g^2 = (1 * (0.45, -1.9875) + 2 * (1.95, 2.4)) / 3 = (1.45, 0.9375)."""
    _, s2, _, _, _ = two_rounds(aggregation="data_size")
    assert close(s2.g, [1.45, 0.9375])


def test_inverse_round_schedule() -> None:
    """Round 2 uses mu_2 = 0.1 / 2 = 0.05 for client 3: step 1 grad = (1.375-0.0375, 1.75-0.075) = (1.3375, 1.675)."""
    alg = HaFedHo(lr=0.5, mu=0.1, mu_schedule="inverse_round")
    assert alg.mu_at(2) == 0.05
    base = ServerState(w(0.375, 0.75), w(-0.75, -1.5), torch.tensor(0.0))
    res = alg.client_update(base, alg.init_client(w(0, 0)), client_data(A[3], 1), info(0.5), rnd(2, 2), MODEL)
    assert close(res.upload.g_i, [1.3375, 1.675])


def test_lambda_mu_logged_and_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HaFedHo(mu=0.01).run_notes(10) == {"lambda_mu": pytest.approx(0.1)}
    with pytest.warns(UserWarning, match=r"lambda\*mu = 20\*0.1 = 2 >= 1"):
        HaFedHo(mu=0.1).run_notes(20)
