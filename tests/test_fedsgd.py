"""FedSGD (one full-batch gradient per client per round) against rounds computed by hand.

Problem: f_i(w) = 1/2 ||w - a_i||^2 in R^2, a_1 = (1, 0), a_2 = (0, 2), a_3 = (-1, -1); n_i = (1, 1, 2)
(data-size weights); eta = 0.5, w_0 = (0, 0); g_k = w - a_k whatever the number of batches.
Cohorts: round 1 {1, 3}, round 2 {2, 3}: client 1 skips round 2, client 2 joins in round 2.

Round 1: g_1 = (-1, 0), g_3 = (1, 1); f_1 = 0.5, f_3 = 1
    mean (weights 1, 2) = ((-1 + 2) / 3, (0 + 2) / 3) = (1/3, 2/3);  w_1 = w_0 - 0.5 (1/3, 2/3) = (-1/6, -1/3)
Round 2: g_2 = w_1 - (0, 2) = (-1/6, -7/3), g_3 = w_1 - (-1, -1) = (5/6, 2/3)
    mean (weights 1, 2) = ((-1/6 + 5/3) / 3, (-7/3 + 4/3) / 3) = (1/2, -1/3);  w_2 = (-1/6 - 1/4, -1/3 + 1/6)
    = (-5/12, -1/6)
"""

from __future__ import annotations

import pytest
import torch
from quadratic import COHORTS, MODEL, A, client_data, close, info, rnd, rounds, rows_data, run_round, w

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.fedsgd import FedSGD
from hafedho.core import ClientData


def test_two_rounds_by_hand() -> None:
    alg = FedSGD(lr=0.5)
    server = alg.init_server(w(0.0, 0.0))
    states = {i: alg.init_client(w(0.0, 0.0)) for i in A}
    s1, r1 = run_round(alg, server, states, [1, 3], 1)
    assert close(r1[1].upload.grad, [-1.0, 0.0]) and close(r1[3].upload.grad, [1.0, 1.0])
    assert float(r1[1].metrics["train/loss"]) == 0.5 and float(r1[3].metrics["train/loss"]) == 1.0
    assert r1[3].weight == 2.0
    assert close(s1.params, [-1 / 6, -1 / 3])
    s2, r2 = run_round(alg, s1, states, [2, 3], 2)
    assert close(r2[2].upload.grad, [-1 / 6, -7 / 3]) and close(r2[3].upload.grad, [5 / 6, 2 / 3])
    assert close(s2.params, [-5 / 12, -1 / 6])
    assert states[1] == () and states[2] == ()  # stateless clients: nothing stale to keep for the skipper


def test_one_gradient_at_w_not_local_steps() -> None:
    """However many batches (S = 5, two of them padding), the upload is grad f at w itself: w - a = (1, 3)."""
    alg = FedSGD(lr=0.5)
    msg = alg.broadcast(alg.init_server(w(0.0, 2.0)), rnd(1, 1))
    res = alg.client_update(msg, (), client_data(A[3], 5, real_steps=3), info(0.5, 2.0), rnd(1, 1), MODEL)
    assert close(res.upload.grad, [1.0, 3.0]) and abs(float(res.metrics["train/loss"]) - 5.0) < 1e-6


def test_mask_weights_real_examples_only() -> None:
    """Real rows (1, 0), (0, 2), (0, 2); a padded row (100, 100) and a padded step are ignored.
    At w = (0, 0): grad = -(mean of real rows) = -(1/3, 4/3). As the whole local data, padded as under vmap
    ([1, 4], the last row masked), the same rows give the same gradient."""
    x = torch.tensor([[[1.0, 0.0], [100.0, 100.0]], [[0.0, 2.0], [0.0, 2.0]], [[50.0, -50.0], [50.0, -50.0]]])
    full = ClientData(x.reshape(1, 6, 2)[:, :4], torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1.0, 0, 1, 1]]))
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    data = ClientData(x, torch.zeros(3, 2, dtype=torch.long), mask, full)
    for batch in ("full", "batches"):
        alg = FedSGD(lr=0.5, batch=batch)
        res = alg.client_update(alg.init_server(w(0.0, 0.0)), (), data, info(0.25, 3.0), rnd(1, 1), MODEL)
        assert close(res.upload.grad, [-1 / 3, -4 / 3])


R1, R2, R3, Q = (1.0, 0.0), (0.0, 2.0), (2.0, 1.0), (-1.0, -1.0)


@pytest.mark.parametrize("batch", ["full", "batches"])
def test_b_infinity_is_all_local_data_by_hand(batch: str) -> None:
    """Unequal clients on a steps plan S = 1, B = 2; eta = 0.5, w_0 = 0, data-size weights (3, 1).
    client 1: rows r1 = (1, 0), r2 = (0, 2), r3 = (2, 1) (mean (1, 1)); the plan draws [r1, r2] only.
    client 2: the row q = (-1, -1) (n = 1 < B): [q, padding], a partial batch.
    full (B = infinity, the paper): g_1 = w - (1, 1) = (-1, -1), f_1 = (0.5 + 2 + 2.5) / 3 = 5/3;
        mean g = (3 (-1, -1) + (1, 1)) / 4 = (-0.5, -0.5), w_1 = (0.25, 0.25).
    batches (the sampled rows): g_1 = w - (0.5, 1) = (-0.5, -1), f_1 = (0.5 + 2) / 2 = 1.25;
        mean g = ((-1.5 + 1) / 4, (-3 + 1) / 4) = (-0.125, -0.5), w_1 = (0.0625, 0.25)."""
    data = {1: rows_data([[R1, R2]], 2, [R1, R2, R3]), 2: rows_data([[Q]], 2, [Q])}
    alg = FedSGD(lr=0.5, batch=batch)
    [(s1, r1, _)] = rounds(alg, [[1, 2]], w(0.0, 0.0), data=data, sizes={1: 3.0, 2: 1.0})
    full = batch == "full"
    assert close(r1[1].upload.grad, [-1.0, -1.0] if full else [-0.5, -1.0]) and close(r1[2].upload.grad, [1.0, 1.0])
    assert abs(float(r1[1].metrics["train/loss"]) - (5 / 3 if full else 1.25)) < 1e-6
    assert close(s1.params, [0.25, 0.25] if full else [0.0625, 0.25])
    assert alg.needs_full_pass == full


@pytest.mark.parametrize("weighting", ["data_size", "uniform"])
def test_equals_fedavg_with_one_full_batch_step(weighting: str) -> None:
    """FedSGD == FedAvg with ONE local step on the same 6 rows as one batch (S = 1, B = 6): with B = infinity
    (the default) those rows are the client's whole local data, whatever the round's batches (here only the
    first 2 rows); with batch="batches" they are S = 3 batches of 2. Clients hold two different points so the
    batch mean matters: rows alternate a_i and a_i + (1, 1)."""

    def rows(i: int, steps: int, batch: int, full: ClientData | tuple = ()) -> ClientData:
        a = torch.tensor(A[i])
        x = torch.stack([a, a + 1.0, a, a + 1.0, a, a + 1.0])[: steps * batch].reshape(steps, batch, 2)
        return ClientData(x, torch.zeros(steps, batch, dtype=torch.long), torch.ones(steps, batch), full)

    avg = rounds(FedAvg(lr=0.3, weighting=weighting), COHORTS, w(0.2, -0.4), data={i: rows(i, 1, 6) for i in A})
    full = {i: rows(i, 1, 2, full=rows(i, 1, 6)) for i in A}
    for alg, data in (
        (FedSGD(lr=0.3, weighting=weighting), full),
        (FedSGD(lr=0.3, weighting=weighting, batch="batches"), {i: rows(i, 3, 2) for i in A}),
    ):
        sgd = rounds(alg, COHORTS, w(0.2, -0.4), data=data)
        for (ss, _, _), (fs, _, _) in zip(sgd, avg, strict=True):
            assert torch.allclose(ss.params["w"], fs.params["w"], atol=1e-6)
