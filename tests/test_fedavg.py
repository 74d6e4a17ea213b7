"""FedAvg against a round computed by hand.

f_i(w) = 1/2 ||w - a_i||^2, a_1 = (1, 0), a_3 = (-1, -1), n = (1, 2), lr 0.5, 2 local steps, w_0 = 0:
    client 1: (0,0) -> (0.5,0) -> (0.75,0): Delta_1 = (0.75, 0)
    client 3: (0,0) -> (-0.5,-0.5) -> (-0.75,-0.75): Delta_3 = (-0.75, -0.75)
    data-size weights: mean Delta = (1 * (0.75, 0) + 2 * (-0.75, -0.75)) / 3 = (-0.25, -0.5)
    server lr 2: x_1 = 0 + 2 * (-0.25, -0.5) = (-0.5, -1); uniform weights: mean = (0, -0.375)
"""

from __future__ import annotations

import torch
from quadratic import run_round, w

from hafedho.algorithms.fedavg import FedAvg


def one_round(alg: FedAvg) -> torch.Tensor:
    server, _ = run_round(alg, alg.init_server(w(0.0, 0.0)), {1: (), 3: ()}, [1, 3], 1)
    return server.params["w"]


def test_fedavg_round_by_hand() -> None:
    assert torch.allclose(one_round(FedAvg(lr=0.5, server_lr=2.0)), torch.tensor([-0.5, -1.0]))
    assert torch.allclose(one_round(FedAvg(lr=0.5, weighting="uniform")), torch.tensor([0.0, -0.375]))
