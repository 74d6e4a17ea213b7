"""FedAvgM (server momentum, Hsu et al. Section 4.2) against rounds computed by hand.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); n_i = (1, 1, 2)
(data-size weights); eta_l = 0.5, K = 2 local steps, beta = 0.5, eta_g = 0.5, x_0 = (0, 0), v_0 = 0.
Cohorts: round 1 {1, 2}, round 2 {2, 3}: client 1 skips round 2, client 3 joins in round 2.
Two local GD steps with eta_l = 0.5 give y = a + 0.25 (x - a), so Delta_i = y_i - x = 0.75 (a_i - x).

Round 1: Delta_1 = (0.75, 0), Delta_2 = (0, 1.5); mean (weights 1, 1) = (0.375, 0.75)
    Delta_w = -(0.375, 0.75);  v_1 = 0.5 * 0 + Delta_w = (-0.375, -0.75);  x_1 = x_0 - 0.5 v_1 = (0.1875, 0.375)
Round 2: Delta_2 = 0.75 ((0, 2) - x_1) = (-0.140625, 1.21875); Delta_3 = 0.75 ((-1, -1) - x_1) = (-0.890625, -1.03125)
    mean (weights 1, 2) = ((-0.140625 - 1.78125) / 3, (1.21875 - 2.0625) / 3) = (-0.640625, -0.28125)
    Delta_w = (0.640625, 0.28125);  v_2 = 0.5 v_1 + Delta_w = (-0.1875 + 0.640625, -0.375 + 0.28125)
        = (0.453125, -0.09375);  x_2 = x_1 - 0.5 v_2 = (0.1875 - 0.2265625, 0.375 + 0.046875) = (-0.0390625, 0.421875)
"""

from __future__ import annotations

import pytest
import torch
from quadratic import COHORTS, A, close, rnd, rounds, run_round, w

from hafedho.algorithms.fedavg import FedAvg, Upload
from hafedho.algorithms.fedavgm import FedAvgM, ServerState
from hafedho.core import RoundInfo, tree


def test_two_rounds_by_hand() -> None:
    alg = FedAvgM(lr=0.5, beta=0.5, server_lr=0.5)
    server = alg.init_server(w(0.0, 0.0))
    states = {i: alg.init_client(w(0.0, 0.0)) for i in A}
    s1, r1 = run_round(alg, server, states, [1, 2], 1)
    assert close(r1[1].upload.delta, [0.75, 0.0]) and close(r1[2].upload.delta, [0.0, 1.5])
    assert close(s1.v, [-0.375, -0.75]) and close(s1.params, [0.1875, 0.375])
    s2, r2 = run_round(alg, s1, states, [2, 3], 2)
    assert close(r2[2].upload.delta, [-0.140625, 1.21875]) and close(r2[3].upload.delta, [-0.890625, -1.03125])
    assert r2[3].weight == 2.0
    assert close(s2.v, [0.453125, -0.09375]) and close(s2.params, [-0.0390625, 0.421875])
    assert states[1] == () and states[3] == ()  # stateless clients: nothing stale to keep for the skipper


def test_nesterov_two_rounds_by_hand() -> None:
    """The same problem with nesterov = true: the step is d = beta v + Delta_w, x <- x - eta_g d.

    Round 1: v_1 = (-0.375, -0.75) as above; d_1 = 0.5 v_1 + Delta_w = (-0.5625, -1.125); x_1 = (0.28125, 0.5625)
    Round 2: Delta_2 = 0.75 ((0, 2) - x_1) = (-0.2109375, 1.078125); Delta_3 = 0.75 ((-1, -1) - x_1)
        = (-0.9609375, -1.171875); mean (weights 1, 2) = (-0.7109375, -0.421875), Delta_w = (0.7109375, 0.421875)
        v_2 = 0.5 v_1 + Delta_w = (0.5234375, 0.046875); d_2 = 0.5 v_2 + Delta_w = (0.97265625, 0.4453125)
        x_2 = x_1 - 0.5 d_2 = (-0.205078125, 0.33984375)
    """
    alg = FedAvgM(lr=0.5, beta=0.5, server_lr=0.5, nesterov=True)
    server = alg.init_server(w(0.0, 0.0))
    states = {i: alg.init_client(w(0.0, 0.0)) for i in A}
    s1, _ = run_round(alg, server, states, [1, 2], 1)
    assert close(s1.v, [-0.375, -0.75]) and close(s1.params, [0.28125, 0.5625])
    s2, r2 = run_round(alg, s1, states, [2, 3], 2)
    assert close(r2[2].upload.delta, [-0.2109375, 1.078125]) and close(r2[3].upload.delta, [-0.9609375, -1.171875])
    assert close(s2.v, [0.5234375, 0.046875]) and close(s2.params, [-0.205078125, 0.33984375])


def test_broadcast_is_the_model_only() -> None:
    alg = FedAvgM()
    msg = alg.broadcast(ServerState(w(1.0, 2.0), w(3.0, 4.0)), rnd(1, 1))
    assert msg._fields == ("params",) and close(msg.params, [1.0, 2.0])


@pytest.mark.parametrize(("weighting", "server_lr"), [("data_size", 1.0), ("uniform", 0.7)])
def test_beta_zero_is_fedavg_exactly(weighting: str, server_lr: float) -> None:
    avgm = rounds(FedAvgM(lr=0.5, beta=0.0, server_lr=server_lr, weighting=weighting), COHORTS, w(0.3, -0.2), steps=3)
    avg = rounds(FedAvg(lr=0.5, server_lr=server_lr, weighting=weighting), COHORTS, w(0.3, -0.2), steps=3)
    for (ms, _, _), (fs, _, _) in zip(avgm, avg, strict=True):
        if server_lr == 1.0:
            assert torch.equal(ms.params["w"], fs.params["w"])
        else:
            assert torch.allclose(ms.params["w"], fs.params["w"], atol=1e-7)


def hand_written_server(alg: FedAvgM, server: ServerState, delta: dict) -> ServerState:
    """FedAvgM's server as written out before it ran ``sgd`` through ``server_step``: the reference, op for op."""
    delta_w = tree.scale(delta, -1.0)  # Delta_w = -mean Delta_i
    v = tree.axpy(alg.beta, server.v, delta_w)  # beta v + Delta_w
    step = tree.axpy(alg.beta, v, delta_w) if alg.nesterov else v
    params = tree.axpy(-alg.server_lr, step, server.params)
    return ServerState(params, v)


@pytest.mark.parametrize(
    ("beta", "nesterov", "server_lr"), [(0.9, False, 1.0), (0.9, True, 0.7), (0.0, False, 0.3), (0.37, True, 1.0)]
)
def test_server_is_the_hand_written_heavy_ball_bit_for_bit(beta: float, nesterov: bool, server_lr: float) -> None:
    """Five float32 rounds of random deltas: the same bits as the hand-written recursion (params, v, v_norm), and
    the state keeps its shape ``ServerState(params, v)`` (checkpoints store its leaves in that order)."""
    alg = FedAvgM(beta=beta, nesterov=nesterov, server_lr=server_lr)
    gen = torch.Generator().manual_seed(1)
    x = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    server = ref = alg.init_server(x)
    assert type(server) is ServerState and server._fields == ("params", "v")
    assert all(torch.equal(server.v[k], torch.zeros_like(x[k])) for k in x)
    for t in range(1, 6):
        delta = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in x.items()}
        server, metrics = alg.server_update(server, Upload(delta), RoundInfo(t, 10, 2))
        ref = hand_written_server(alg, ref, delta)
        for k in x:
            assert torch.equal(server.params[k], ref.params[k]) and torch.equal(server.v[k], ref.v[k])
        assert metrics == {"server/v_norm": float(tree.sq_norm(ref.v).sqrt())}
