"""SCAFFOLD (Algorithm 1) against rounds computed by hand: control variates, the (m/N) factor, real steps.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); N = 3 clients;
eta_l = 0.5, eta_g = 1, K = 2 local steps, x_0 = (0, 0), c = c_i = 0. Cohorts: round 1 {1, 2}, round 2 {2, 3}
(client 1 skips round 2, client 3 starts in round 2). Option II: c_i+ = c_i - c + (x - y_i) / (K eta_l), and
K eta_l = 1 here.

Round 1 (c = c_i = 0: plain local GD, as FedAvg):
    client 1: y (0,0) -> (0.5,0) -> (0.75,0);  dy_1 = (0.75, 0);  c_1+ = (x - y) = (-0.75, 0) = dc_1
    client 2: y (0,0) -> (0,1) -> (0,1.5);     dy_2 = (0, 1.5);   c_2+ = (0, -1.5) = dc_2
    server:   x_1 = (0.375, 0.75);  c = 0 + (2/3) mean dc = (2/3)(-0.375, -0.75) = (-0.25, -0.5)
Round 2 (x = (0.375, 0.75), c = (-0.25, -0.5)); step y <- y - 0.5 ((y - a_i) + c - c_i):
    client 2: c - c_2 = (-0.25, 1.0)
              step 1: (0.375, -1.25) + (-0.25, 1) = (0.125, -0.25)   -> y = (0.3125, 0.875)
              step 2: (0.3125, -1.125) + (-0.25, 1) = (0.0625, -0.125) -> y = (0.28125, 0.9375)
              dy_2 = (-0.09375, 0.1875)
              c_2+ = (0, -1.5) - (-0.25, -0.5) + (0.09375, -0.1875) = (0.34375, -1.1875);  dc_2 = (0.34375, 0.3125)
    client 3: c - c_3 = (-0.25, -0.5)
              step 1: (1.375, 1.75) + (-0.25, -0.5) = (1.125, 1.25)    -> y = (-0.1875, 0.125)
              step 2: (0.8125, 1.125) + (-0.25, -0.5) = (0.5625, 0.625) -> y = (-0.46875, -0.1875)
              dy_3 = (-0.84375, -0.9375)
              c_3+ = 0 + (0.25, 0.5) + (0.84375, 0.9375) = (1.09375, 1.4375) = dc_3
    server:   x_2 = (0.375, 0.75) + (-0.46875, -0.375) = (-0.09375, 0.375)
              c = (-0.25, -0.5) + (2/3)(0.71875, 0.875) = (0.2291666.., 0.0833333..)
    client 1 keeps c_1 = (-0.75, 0). Check: (1/N) sum_i c_i = (1/3)(0.6875, 0.25) = c.
"""

from __future__ import annotations

import torch
from quadratic import COHORTS, MODEL, A, client_data, close, info, rnd, rounds, rows_data, run_round, w

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.scaffold import SCAFFOLD, ClientState, ServerState, Upload


def two_rounds(**kw):
    (s1, r1, s1_states), (s2, r2, states) = rounds(SCAFFOLD(lr=0.5, **kw), COHORTS[:2], w(0.0, 0.0))
    return s1, s2, r1, r2, s1_states, states


def test_two_rounds_by_hand() -> None:
    s1, s2, r1, r2, st1, st2 = two_rounds()
    assert close(r1[1].upload.dy, [0.75, 0.0]) and close(r1[1].upload.dc, [-0.75, 0.0])
    assert close(r1[2].upload.dy, [0.0, 1.5]) and close(r1[2].upload.dc, [0.0, -1.5])
    assert close(s1.params, [0.375, 0.75]) and close(s1.c, [-0.25, -0.5])
    assert close(r2[2].upload.dy, [-0.09375, 0.1875]) and close(r2[2].upload.dc, [0.34375, 0.3125])
    assert close(st2[2].c_i, [0.34375, -1.1875])
    assert close(r2[3].upload.dy, [-0.84375, -0.9375]) and close(r2[3].upload.dc, [1.09375, 1.4375])
    assert close(st2[3].c_i, [1.09375, 1.4375])
    assert close(s2.params, [-0.09375, 0.375])
    assert close(s2.c, [-0.25 + 2 / 3 * 0.71875, -0.5 + 2 / 3 * 0.875])
    # client 1 skipped round 2: its control variate is exactly the round-1 one
    assert torch.equal(st2[1].c_i["w"], st1[1].c_i["w"]) and close(st2[1].c_i, [-0.75, 0.0])
    # c = (1/N) sum_i c_i over all N clients (all start at 0)
    mean_ci = sum(st2[i].c_i["w"] for i in A) / 3
    assert torch.allclose(s2.c["w"], mean_ci, atol=1e-6)
    assert all(float(r.weight) == 1.0 for r in r2.values())  # uniform, as Algorithm 1


def test_first_round_is_uniform_fedavg() -> None:
    s1, _, _, _, _, _ = two_rounds()
    f = FedAvg(lr=0.5, weighting="uniform")
    fs, fst = f.init_server(w(0.0, 0.0)), {i: () for i in A}
    fs, _ = run_round(f, fs, fst, [1, 2], 1)
    assert torch.equal(s1.params["w"], fs.params["w"])


def test_server_lr() -> None:
    """eta_g = 2: x_1 = 0 + 2 (0.375, 0.75); c does not depend on eta_g."""
    s1, _, _, _, _, _ = two_rounds(server_lr=2.0)
    assert close(s1.params, [0.75, 1.5]) and close(s1.c, [-0.25, -0.5])


def test_m_over_n_factor() -> None:
    """c <- c + (m/N) mean dc: with mean dc = (0.6, -0.3), c = (0.1, 0.1): m=1, N=4 -> (0.25, 0.025);
    m=4, N=4 -> (0.7, -0.2). x moves by eta_g mean dy whatever m is."""
    alg = SCAFFOLD()
    server = ServerState(w(1.0, 1.0), w(0.1, 0.1))
    agg = Upload(w(0.5, 0.5), w(0.6, -0.3))
    one, _ = alg.server_update(server, agg, rnd(1, 1, n=4))
    full, _ = alg.server_update(server, agg, rnd(1, 4, n=4))
    assert close(one.c, [0.25, 0.025]) and close(full.c, [0.7, -0.2])
    assert close(one.params, [1.5, 1.5]) and torch.equal(one.params["w"], full.params["w"])


def test_k_counts_real_steps_only() -> None:
    """A client with 5 planned steps of which 2 are real: y and c_i+ are those of K = 2 (dividing by the nominal
    5 would give c_1+ = (-0.75, 0) / 2.5 = (-0.3, 0)). A client whose steps are all padding keeps c_i."""
    alg = SCAFFOLD(lr=0.5)
    msg = ServerState(w(0.0, 0.0), w(0.0, 0.0))
    st = ClientState(w(0.0, 0.0))
    plain = alg.client_update(msg, st, client_data(A[1], 2), info(0.25, 1), rnd(1, 1), MODEL)
    padded = alg.client_update(msg, st, client_data(A[1], 5, real_steps=2), info(0.25, 1), rnd(1, 1), MODEL)
    assert close(padded.state.c_i, [-0.75, 0.0])
    assert torch.equal(plain.state.c_i["w"], padded.state.c_i["w"])
    assert torch.equal(plain.upload.dy["w"], padded.upload.dy["w"])
    old = ClientState(w(0.3, -0.2))
    msg = ServerState(w(0.0, 0.0), w(0.1, 0.1))
    idle = alg.client_update(msg, old, client_data(A[1], 3, real_steps=0), info(0.25, 1), rnd(1, 1), MODEL)
    assert torch.equal(idle.state.c_i["w"], old.c_i["w"])
    assert torch.equal(idle.upload.dy["w"], torch.zeros(2)) and torch.equal(idle.upload.dc["w"], torch.zeros(2))
    assert torch.isfinite(idle.state.c_i["w"]).all()


def test_option1_uses_gradient_at_x() -> None:
    """Option I: c_i+ = grad f_i(x) = x - a_i. Round 1: c_1+ = (-1, 0), c_2+ = (0, -2); the local steps are the
    same as option II, so x_1 = (0.375, 0.75) and c = (2/3) mean dc = (2/3)(-0.5, -1) = (-1/3, -2/3)."""
    s1, _, _, _, st1, _ = two_rounds(control="option1")
    assert close(st1[1].c_i, [-1.0, 0.0]) and close(st1[2].c_i, [0.0, -2.0])
    assert close(s1.params, [0.375, 0.75]) and close(s1.c, [-1 / 3, -2 / 3])
    alg = SCAFFOLD(lr=0.5, control="option1")
    msg = ServerState(w(0.5, 0.5), w(0.0, 0.0))
    res = alg.client_update(
        msg, ClientState(w(0.0, 0.0)), client_data(A[3], 4, real_steps=1), info(0.5), rnd(1, 1), MODEL
    )
    assert close(res.state.c_i, [1.5, 1.5])


R1, R2, R3 = (1.0, 0.0), (0.0, 2.0), (2.0, 1.0)  # client 1's rows, mean (1, 1)
S1, S2 = (0.0, -2.0), (-2.0, -2.0)  # client 2's rows, mean (-1, -2)


def test_option1_is_one_pass_over_all_local_data_by_hand() -> None:
    """Option I is the gradient at x over every local row once, not a mean of the round's batch means.
    eta_l = 0.5, x_0 = 0, c = c_i = 0, N = 3, cohort {1, 2}:
    client 1, one-epoch plan of B = 2: [r1, r2], [r3, padding] (a partial last batch).
        c_1+ = x - (1, 1) = (-1, -1)  (the mean of batch means, ((0.5, 1) + (2, 1)) / 2, would give (-1.25, -1))
        steps: g = (-0.5, -1), y = (0.25, 0.5); g = (0.25 - 2, 0.5 - 1), y = (1.125, 0.75)
    client 2, a steps plan S = 1, B = 1 that draws s1 = (0, -2) only; s2 = (-2, -2) is never drawn.
        c_2+ = x - (-1, -2) = (1, 2)  (the round's batches alone would give (0, 2))
        step: g = (0, 2), y = (0, -1)
    server: x_1 = ((1.125, 0.75) + (0, -1)) / 2 = (0.5625, -0.125); c = (2/3)(0, 0.5) = (0, 1/3)."""
    data = {1: rows_data([[R1, R2], [R3]], 2, [R1, R2, R3]), 2: rows_data([[S1]], 1, [S1, S2])}
    [(s1, r1, st1)] = rounds(SCAFFOLD(lr=0.5, control="option1"), [[1, 2]], w(0.0, 0.0), data=data)
    assert close(st1[1].c_i, [-1.0, -1.0]) and close(r1[1].upload.dc, [-1.0, -1.0])
    assert close(st1[2].c_i, [1.0, 2.0]) and close(r1[2].upload.dc, [1.0, 2.0])
    assert close(r1[1].upload.dy, [1.125, 0.75]) and close(r1[2].upload.dy, [0.0, -1.0])
    assert close(s1.params, [0.5625, -0.125]) and close(s1.c, [0.0, 1 / 3])
    assert SCAFFOLD(control="option1").needs_full_pass and not SCAFFOLD().needs_full_pass
