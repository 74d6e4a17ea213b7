"""MimeLite (SGDm base, frozen server momentum) against rounds computed by hand, and each named switch.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); n_i = (1, 1, 2)
(data-size weights); eta = 0.5, beta = 0.5, K = 2 local steps, x_0 = (0, 0), m_0 = 0, momentum_form="ema".
Cohorts: round 1 {1, 2}, round 2 {2, 3}: client 1 skips round 2, client 3 joins in round 2.
Local step: y <- y - 0.5 d with d = 0.5 g + 0.5 m (m frozen); c_i = grad f_i(x) = x - a_i.

Round 1 (m_0 = 0, so d = 0.5 g):
    client 1: c_1 = (-1, 0); y (0,0) -> g (-1,0), d (-0.5,0) -> (0.25,0) -> g (-0.75,0), d (-0.375,0) -> (0.4375,0)
              Delta_1 = (0.4375, 0)
    client 2: c_2 = (0, -2); y (0,0) -> g (0,-2), d (0,-1) -> (0,0.5) -> g (0,-1.5), d (0,-0.75) -> (0,0.875)
              Delta_2 = (0, 0.875)
    server (weights 1, 1): x_1 = (0.21875, 0.4375); mean c = (-0.5, -1); m_1 = 0.5 (-0.5, -1) + 0 = (-0.25, -0.5)
Round 2 (beta m_1 = (-0.125, -0.25) enters every local step):
    client 2: c_2 = x_1 - a_2 = (0.21875, -1.5625)
        step 1: g = (0.21875, -1.5625), d = (-0.015625, -1.03125), y = (0.2265625, 0.953125)
        step 2: g = (0.2265625, -1.046875), d = (-0.01171875, -0.7734375), y = (0.232421875, 1.33984375)
        Delta_2 = (0.013671875, 0.90234375)
    client 3: c_3 = x_1 - a_3 = (1.21875, 1.4375)
        step 1: g = (1.21875, 1.4375), d = (0.484375, 0.46875), y = (-0.0234375, 0.203125)
        step 2: g = (0.9765625, 1.203125), d = (0.36328125, 0.3515625), y = (-0.205078125, 0.02734375)
        Delta_3 = (-0.423828125, -0.41015625)
    server (weights 1, 2):
        mean Delta = ((0.013671875 - 0.84765625) / 3, (0.90234375 - 0.8203125) / 3) = (-0.833984375/3, 0.02734375)
        x_2 = (0.21875 - 0.833984375/3, 0.46484375)
        mean c = ((0.21875 + 2.4375) / 3, (-1.5625 + 2.875) / 3) = (2.65625/3, 0.4375)
        m_2 = 0.5 mean c + 0.5 m_1 = (2.65625/6 - 0.125, 0.21875 - 0.25) = (2.65625/6 - 0.125, -0.03125)
"""

from __future__ import annotations

import pytest
import torch
from quadratic import COHORTS, MODEL, A, client_data, close, info, rnd, rounds, rows_data, w

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.mimelite import MimeLite, ServerState
from hafedho.core import ClientData, full_gradient


def two_rounds(**kw):
    (s1, r1, _), (s2, r2, states) = rounds(MimeLite(lr=0.5, beta=0.5, **kw), COHORTS[:2], w(0.0, 0.0))
    return s1, s2, r1, r2, states


def test_two_rounds_by_hand() -> None:
    s1, s2, r1, r2, states = two_rounds()
    assert close(r1[1].upload.grad, [-1.0, 0.0]) and close(r1[1].upload.delta, [0.4375, 0.0])
    assert close(r1[2].upload.grad, [0.0, -2.0]) and close(r1[2].upload.delta, [0.0, 0.875])
    assert close(s1.params, [0.21875, 0.4375]) and close(s1.m, [-0.25, -0.5])
    assert close(r2[2].upload.grad, [0.21875, -1.5625]) and close(r2[2].upload.delta, [0.013671875, 0.90234375])
    assert close(r2[3].upload.grad, [1.21875, 1.4375]) and close(r2[3].upload.delta, [-0.423828125, -0.41015625])
    assert close(s2.params, [0.21875 - 0.833984375 / 3, 0.46484375])
    assert close(s2.m, [2.65625 / 6 - 0.125, -0.03125])
    assert r2[3].weight == 2.0  # data-size weight
    assert states[1] == () and states[3] == ()  # stateless clients: the skipping client keeps nothing stale


def test_heavy_ball_form_by_hand() -> None:
    """momentum_form="heavy_ball" (FedJAX/TFF): d = g + 0.5 m, m <- mean c + 0.5 m.
    Round 1 (m_0 = 0): plain GD, client 1 -> (0.75, 0), client 2 -> (0, 1.5): x_1 = (0.375, 0.75);
        m_1 = mean c = (-0.5, -1).  Round 2, beta m_1 = (-0.25, -0.5):
    client 2: c = (0.375, -1.25); step 1 d = (0.125, -1.75), y = (0.3125, 1.625);
        step 2 g = (0.3125, -0.375), d = (0.0625, -0.875), y = (0.28125, 2.0625): Delta_2 = (-0.09375, 1.3125)
    client 3: c = (1.375, 1.75); step 1 d = (1.125, 1.25), y = (-0.1875, 0.125);
        step 2 g = (0.8125, 1.125), d = (0.5625, 0.625), y = (-0.46875, -0.1875): Delta_3 = (-0.84375, -0.9375)
    server (1, 2): x_2 = x_1 + ((-0.09375 - 1.6875)/3, (1.3125 - 1.875)/3) = (0.375 - 0.59375, 0.75 - 0.1875)
        = (-0.21875, 0.5625); mean c = (3.125/3, 0.75), m_2 = (3.125/3 - 0.25, 0.25)."""
    s1, s2, _, r2, _ = two_rounds(momentum_form="heavy_ball")
    assert close(s1.params, [0.375, 0.75]) and close(s1.m, [-0.5, -1.0])
    assert close(r2[2].upload.delta, [-0.09375, 1.3125]) and close(r2[3].upload.delta, [-0.84375, -0.9375])
    assert close(s2.params, [-0.21875, 0.5625]) and close(s2.m, [3.125 / 3 - 0.25, 0.25])


def test_heavy_ball_with_scaled_lr_follows_ema() -> None:
    """heavy_ball with lr (1-beta) eta is ema with lr eta: same x every round, m_hb = m_ema / (1 - beta)."""
    ema = rounds(MimeLite(lr=0.5, beta=0.5), COHORTS, w(0.0, 0.0))
    hb = rounds(MimeLite(lr=0.25, beta=0.5, momentum_form="heavy_ball"), COHORTS, w(0.0, 0.0))
    for (es, _, _), (hs, _, _) in zip(ema, hb, strict=True):
        assert torch.allclose(es.params["w"], hs.params["w"], atol=1e-6)
        assert torch.allclose(es.m["w"] / 0.5, hs.m["w"], atol=1e-6)


@pytest.mark.parametrize(("weighting", "server_lr"), [("data_size", 1.0), ("uniform", 0.7)])
def test_beta_zero_is_fedavg_exactly(weighting: str, server_lr: float) -> None:
    mime = rounds(MimeLite(lr=0.5, beta=0.0, weighting=weighting, server_lr=server_lr), COHORTS, w(0.3, -0.2), steps=3)
    avg = rounds(FedAvg(lr=0.5, weighting=weighting, server_lr=server_lr), COHORTS, w(0.3, -0.2), steps=3)
    for (ms, _, _), (fs, _, _) in zip(mime, avg, strict=True):
        assert torch.equal(ms.params["w"], fs.params["w"])


R1, R2, R3, Q = (1.0, 0.0), (0.0, 2.0), (2.0, 1.0), (-1.0, -1.0)
SIZES_31 = {1: 3.0, 2: 1.0}  # n_1 = 3 rows (r1, r2, r3), n_2 = 1 row (q)


@pytest.mark.parametrize("stats", ["full", "batches"])
def test_one_round_on_a_mini_batch_plan_by_hand(stats: str) -> None:
    """Unequal clients on a steps plan (S = 2, B = 2); eta = 0.5, beta = 0.5, x_0 = 0, m_0 = 0; data-size weights.
    client 1: rows r1 = (1, 0), r2 = (0, 2), r3 = (2, 1) (n = 3, mean (1, 1)); the plan draws [r1, r2], [r3, r1]
              (a fresh permutation starts in step 2), mean of the sampled rows (1, 0.75).
    client 2: the row q = (-1, -1) (n = 1 < B): each step [q, padding], a partial batch.
    c_i = x - mean:  full (the paper): c_1 = (-1, -1);  batches (the sampled rows): c_1 = (-1, -0.75);  c_2 = (1, 1).
    m_1 = 0.5 (3 c_1 + c_2) / 4:  full (-0.25, -0.25);  batches 0.5 (-0.5, -0.3125) = (-0.25, -0.15625).
    Local steps (m_0 = 0): y <- y - 0.25 g, the same for both forms:
        client 1: g = (-0.5, -1), y = (0.125, 0.25); g = (0.125 - 1.5, 0.25 - 0.5), y = (0.46875, 0.3125)
        client 2: g = (1, 1), y = (-0.25, -0.25); g = (0.75, 0.75), y = (-0.4375, -0.4375)
    x_1 = (3 (0.46875, 0.3125) + (-0.4375, -0.4375)) / 4 = (0.2421875, 0.125)."""
    data = {1: rows_data([[R1, R2], [R3, R1]], 2, [R1, R2, R3]), 2: rows_data([[Q], [Q]], 2, [Q])}
    (s1, r1, _), *_ = rounds(MimeLite(lr=0.5, beta=0.5, stats=stats), [[1, 2]], w(0.0, 0.0), data=data, sizes=SIZES_31)
    assert close(r1[1].upload.grad, [-1.0, -1.0] if stats == "full" else [-1.0, -0.75])
    assert close(r1[2].upload.grad, [1.0, 1.0])
    assert close(s1.m, [-0.25, -0.25] if stats == "full" else [-0.25, -0.15625])
    assert close(r1[1].upload.delta, [0.46875, 0.3125]) and close(r1[2].upload.delta, [-0.4375, -0.4375])
    assert close(s1.params, [0.2421875, 0.125])


@pytest.mark.parametrize(
    "steps",
    [[[R1, R2, R3]], [[R1, R2], [R3]], [[R3, R1], [R2]]],
    ids=["one-full-batch", "epoch-partial-last", "epoch-other-order"],
)
def test_both_forms_agree_on_one_epoch_plans(steps: list) -> None:
    """When the round's plan is exactly one epoch (one full batch, or batches of 2 with a partial last one), the
    round's rows are the client's rows once, so stats="batches" gives the paper's c_1 = x - (1, 1) too."""
    data = rows_data(steps, 3, [R1, R2, R3])
    for stats in ("full", "batches"):
        alg = MimeLite(lr=0.5, beta=0.5, stats=stats)
        res = alg.client_update(alg.init_server(w(0.5, 0.0)), (), data, info(0.75, 3.0), rnd(1, 1), MODEL)
        assert close(res.upload.grad, [-0.5, -1.0]), stats


def test_full_batch_gradient_respects_mask() -> None:
    """Real rows (1, 0), (0, 2), (0, 2); a padded row (100, 100) and a padded step (50, -50) are ignored.
    At x = (0, 0): grad = x - mean of real rows = -(1/3, 4/3); loss = (0.5 + 2 + 2) / 3 = 1.5. The same rows as
    the whole local data, padded as under vmap ([1, 4] with the last row masked), give the same c_i."""
    x = torch.tensor([[[1.0, 0.0], [100.0, 100.0]], [[0.0, 2.0], [0.0, 2.0]], [[50.0, -50.0], [50.0, -50.0]]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    full = ClientData(x.reshape(1, 6, 2)[:, :4], torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1.0, 0, 1, 1]]))
    data = ClientData(x, torch.zeros(3, 2, dtype=torch.long), mask, full)
    g, f = full_gradient(MODEL, w(0.0, 0.0), data)
    assert close(g, [-1 / 3, -4 / 3]) and abs(float(f) - 1.5) < 1e-6
    for stats in ("full", "batches"):
        alg = MimeLite(lr=0.5, beta=0.5, stats=stats)
        res = alg.client_update(alg.init_server(w(0.0, 0.0)), (), data, info(0.25, 3.0), rnd(1, 1), MODEL)
        assert close(res.upload.grad, [-1 / 3, -4 / 3])
    empty = ClientData(x, data.y, torch.zeros(3, 2), full._replace(mask=torch.zeros(1, 4)))  # no real example
    res = alg.client_update(alg.init_server(w(0.5, 0.5)), (), empty, info(0.0, 0.0), rnd(1, 1), MODEL)
    assert close(res.upload.grad, [0.0, 0.0]) and close(res.upload.delta, [0.0, 0.0])


def test_full_stats_need_the_whole_local_data() -> None:
    """The runtime builds ``data.full`` only when asked (``needs_full_pass``); without it: one line, no guess."""
    assert MimeLite().needs_full_pass and not MimeLite(stats="batches").needs_full_pass
    alg = MimeLite()
    bare = client_data(A[1], 2)._replace(full=())
    with pytest.raises(ValueError, match=r"^mimelite needs the client's whole local data in data.full") as err:
        alg.client_update(alg.init_server(w(0.0, 0.0)), (), bare, info(0.25), rnd(1, 1), MODEL)
    assert "\n" not in str(err.value)


def test_momentum_is_frozen_during_local_steps() -> None:
    """Start at a_3 = (-1, -1) with m = (1, -2), K = 3: beta m = (0.5, -1) is added at every step, unchanged.
    step 1: g = (0, 0), d = (0.5, -1), y = (-1.25, -0.5)
    step 2: g = (-0.25, 0.5), d = (-0.125, 0.25) + (0.5, -1) = (0.375, -0.75), y = (-1.4375, -0.125)
    step 3: g = (-0.4375, 0.875), d = (0.28125, -0.5625), y = (-1.578125, 0.15625): Delta = (-0.578125, 1.15625).
    (A locally updated momentum would give step 2 d = 0.5 g + 0.5 (0.5 * 0 + 0.5 m) = (0.125, -0.25) instead.)"""
    alg = MimeLite(lr=0.5, beta=0.5)
    msg = ServerState(w(-1.0, -1.0), w(1.0, -2.0))
    res = alg.client_update(msg, (), client_data(A[3], 3), info(0.5, 2.0), rnd(1, 1), MODEL)
    assert close(res.upload.delta, [-0.578125, 1.15625]) and close(res.upload.grad, [0.0, 0.0])
    assert close(msg.m, [1.0, -2.0])  # the broadcast is not written into
