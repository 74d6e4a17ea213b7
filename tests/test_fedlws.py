"""FedLWS: layer-wise shrinking factors computed by hand, the clip bounds, and the reduction to FedAvg.

Toy model with three parameter tensors, l1.weight in R^2, l1.bias in R^1, l2.weight in R^2 (two modules, so two
layers under layers="module"); its loss is 1/2 ||cat(params) - x||^2 per row, so ONE local step with eta_l = 1
lands exactly on the row x: each client's Delta_i is chosen by its data.

Round from w_t = (l1: (3, 0 | 4), l2: (1, 0)), two clients of equal size, beta = 0.025, clip [0.01, 0.2]:
    client A: Delta_A = (l1: (4, 3 | 0), l2: (2, 10));   client B: Delta_B = (l1: (-4, 3 | 0), l2: (2, -10))
    layer l1: ||w|| = ||(3, 0, 4)|| = 5, Delta = (0, 3 | 0), ||Delta|| = 3
              E||Delta_i||^2 = 25, tau = sqrt(25 - 9) = 4 (deviations (+-4, 0, 0)), beta tau = 0.1 (inside the clip)
              gamma = 5 / (5 + 0.1 * 3) = 0.9433962,  w_{t+1} = gamma * (3, 3 | 4) = (2.8301887, 2.8301887 | 3.7735849)
    layer l2: ||w|| = 1, Delta = (2, 0), ||Delta|| = 2
              E||Delta_i||^2 = 104, tau = sqrt(104 - 4) = 10, beta tau = 0.25 -> clipped to 0.2
              gamma = 1 / (1 + 0.2 * 2) = 0.7142857,  w_{t+1} = gamma * (3, 0) = (2.1428571, 0)
    The official code's spread (mean of ||Delta_i - mean Delta||) is also 4 and 10 here: two equal-weight clients.
layers="tensor": l1.weight alone: ||w|| = 3, Delta = (0, 3), tau = 4: gamma = 3 / (3 + 0.3) = 0.9090909;
    l1.bias: Delta = 0, so gamma = 4 / (4 + 0) = 1 and the bias stays 4.
"""

from __future__ import annotations

import pytest
import torch
from quadratic import client_updates, mean_upload, rnd, rounds, run_round

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.fedlws import FedLWS, layer_groups
from hafedho.core import ClientData, ConfigError, FunctionalModel
from hafedho.models import MLP

NAMES = ("l1.weight", "l1.bias", "l2.weight")
SPLIT = (2, 1, 2)


class StackedQuadratic:
    """f(w; x) = mean over real rows of 1/2 ||cat(w) - x_row||^2 (x rows are 5-vectors)."""

    def loss(self, params, x, y, mask):
        flat = torch.cat([params[k] for k in NAMES])
        per = 0.5 * ((flat - x) ** 2).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)


def params(*v: float) -> dict:
    return dict(zip(NAMES, torch.tensor(v).split(SPLIT), strict=True))


def target_data(point) -> ClientData:
    """One step of two rows: the target (real) and a padding row that must be ignored."""
    x = torch.tensor([point, [99.0] * 5]).unsqueeze(0)
    return ClientData(x, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1.0, 0.0]]))


W_T = (3.0, 0.0, 4.0, 1.0, 0.0)
TARGETS = {"A": (7.0, 3.0, 4.0, 3.0, 10.0), "B": (-1.0, 3.0, 4.0, 3.0, -10.0)}  # w_t + Delta_A, w_t + Delta_B


def one_round(alg, w_t=W_T, targets=TARGETS, sizes=None):
    """One round from w_t, each client's data its target; returns the server's (new state, metrics)."""
    server = alg.init_server(params(*w_t))
    r = rnd(1, len(targets))
    data = {name: target_data(point) for name, point in targets.items()}
    sizes = dict.fromkeys(targets, 2.0) if sizes is None else sizes
    results = client_updates(
        alg, alg.broadcast(server, r), dict.fromkeys(targets, ()), list(targets), r, data, sizes, StackedQuadratic()
    )
    return alg.server_update(server, mean_upload(results), r)


def flat(p) -> torch.Tensor:
    return torch.cat([p[k] for k in NAMES])


def test_two_layer_gammas_by_hand() -> None:
    new, metrics = one_round(FedLWS(lr=1.0, beta=0.025))
    expected = torch.tensor([2.8301887, 2.8301887, 3.7735849, 2.1428571, 0.0])
    assert torch.allclose(flat(new.params), expected, atol=1e-6)
    assert metrics["server/gamma_min"] == pytest.approx(0.7142857, abs=1e-6)
    assert metrics["server/gamma_mean"] == pytest.approx((0.9433962 + 0.7142857) / 2, abs=1e-6)
    assert metrics["server/beta_tau_mean"] == pytest.approx((0.1 + 0.2) / 2, abs=1e-6)
    # the official bias-delimited grouping coincides here (each module ends with a bias or is the last one)
    official, _ = one_round(FedLWS(lr=1.0, beta=0.025, layers="bias_delimited"))
    assert torch.allclose(flat(official.params), expected, atol=1e-6)


def test_tensor_layers_shrink_weight_and_bias_separately() -> None:
    new, _ = one_round(FedLWS(lr=1.0, beta=0.025, layers="tensor"))
    assert torch.allclose(new.params["l1.weight"], torch.tensor([3.0, 3.0]) * 3 / 3.3, atol=1e-6)
    assert torch.equal(new.params["l1.bias"], torch.tensor([4.0]))
    assert torch.allclose(new.params["l2.weight"], torch.tensor([2.1428571, 0.0]), atol=1e-6)


def test_lower_clip_and_weighted_spread() -> None:
    """Identical clients: tau = 0, beta tau is clipped up to 0.01. l1: gamma = 5 / (5 + 0.01 * 5) = 1/1.01 for
    Delta = (4, 3 | 0); l2 (Delta = (2, 10), ||Delta|| = sqrt(104)): gamma = 1 / (1 + 0.01 sqrt(104)).
    Sizes 1 and 3 for A and B of the main case: Delta^{l2} = (2, -5), E||Delta||^2 = 104, tau = sqrt(104 - 29) =
    sqrt(75) = 8.660254, beta tau = 0.2165 -> 0.2: gamma = 1 / (1 + 0.2 sqrt(29)) = 0.4814560 times (3, -5)."""
    same, _ = one_round(FedLWS(lr=1.0, beta=0.025), targets={"A": TARGETS["A"], "C": TARGETS["A"]})
    assert torch.allclose(same.params["l1.weight"], torch.tensor([7.0, 3.0]) / 1.01, atol=1e-6)
    assert torch.allclose(same.params["l2.weight"], torch.tensor([3.0, 10.0]) / (1 + 0.01 * 104**0.5), atol=1e-6)
    weighted, _ = one_round(FedLWS(lr=1.0, beta=0.025), sizes={"A": 1.0, "B": 3.0})
    assert torch.allclose(weighted.params["l2.weight"], torch.tensor([3.0, -5.0]) * 0.4814560, atol=1e-6)


def test_zero_norm_layer_is_not_shrunk() -> None:
    """w_t^{l2} = 0 would give gamma = 0 forever; it is left unshrunk: w_{t+1}^{l2} = Delta^{l2} = (2, 0)."""
    new, _ = one_round(
        FedLWS(lr=1.0), w_t=(3.0, 0.0, 4.0, 0.0, 0.0), targets={"A": (7, 3, 4, 2, 10), "B": (-1, 3, 4, 2, -10)}
    )
    assert torch.equal(new.params["l2.weight"], torch.tensor([2.0, 0.0]))


def official_spread(deltas: list[torch.Tensor]) -> float:
    """The authors' statistic: unweighted mean over clients of ||Delta_i - mean_i Delta_i||."""
    mean = torch.stack(deltas).mean(0)
    return float(torch.stack([(d - mean).norm() for d in deltas]).mean())


def test_spread_matches_official_for_two_equal_clients_and_bounds_it_otherwise() -> None:
    """With beta = 1 and no clip, beta tau_l is our spread; compare with the authors' statistic layer by layer."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        points = [tuple(torch.randn(5).tolist()) for _ in range(3)]
    for cohort in (points[:2], points):
        alg = FedLWS(lr=1.0, beta=1.0, tau_min=0.0, tau_max=1e9, weighting="uniform")
        _, metrics = one_round(alg, w_t=(1.0,) * 5, targets={str(i): p for i, p in enumerate(cohort)})
        deltas = [torch.tensor(p) - 1.0 for p in cohort]
        official = (official_spread([d[:3] for d in deltas]) + official_spread([d[3:] for d in deltas])) / 2
        if len(cohort) == 2:
            assert metrics["server/beta_tau_mean"] == pytest.approx(official, rel=1e-5)
        else:
            assert metrics["server/beta_tau_mean"] > official


# --- rounds on a real network: the clip bounds and the reduction to FedAvg -------------------------------------

with torch.random.fork_rng():
    torch.manual_seed(0)
    NET = FunctionalModel(MLP((4,), 3, hidden=(5,)))
    MASK = torch.tensor([1.0, 1.0, 1.0, 0.0]).expand(3, 4)
    DATA = {i: ClientData(torch.randn(3, 4, 4) + i, torch.randint(0, 3, (3, 4)), MASK) for i in range(3)}
W0 = NET.params()
SIZES = {0: 2.0, 1: 3.0, 2: 5.0}
COHORTS = [[0, 1], [1, 2], [0, 2]]


ON_NET = {"data": DATA, "sizes": SIZES, "model": NET}  # run_round's clients for these rounds


def test_no_shrinking_is_fedavg_exactly() -> None:
    lws = rounds(FedLWS(lr=0.1, beta=0.0, tau_min=0.0, server_lr=0.7), COHORTS, W0, **ON_NET)
    avg = rounds(FedAvg(lr=0.1, server_lr=0.7), COHORTS, W0, **ON_NET)
    for (ls, _, _), (fs, _, _) in zip(lws, avg, strict=True):
        assert all(torch.equal(ls.params[k], fs.params[k]) for k in W0)


@pytest.mark.parametrize("beta", [1e-6, 0.03, 1e6])
def test_clip_bounds_hold(beta: float) -> None:
    """From w_{t+1}^l = gamma_l (w_t^l + Delta^l): beta tau_l = (||w_t^l|| / gamma_l - ||w_t^l||) / ||Delta^l||,
    which must lie in [tau_min, tau_max] (at tau_min for tiny beta, at tau_max for huge beta)."""
    alg = FedLWS(lr=0.5, beta=beta, tau_min=0.01, tau_max=0.2)
    server = alg.init_server(W0)
    for t, cohort in enumerate(COHORTS, start=1):
        new, results = run_round(alg, server, dict.fromkeys(SIZES, ()), cohort, t, **ON_NET)
        agg = mean_upload(results)
        for names in layer_groups(list(W0), "module").values():
            w_norm = torch.cat([server.params[k].flatten() for k in names]).double().norm()
            avg = torch.cat([(server.params[k] + agg.delta[k]).flatten() for k in names]).double()
            gamma = torch.cat([new.params[k].flatten() for k in names]).double().norm() / avg.norm()
            d_norm = torch.cat([agg.delta[k].flatten() for k in names]).double().norm()
            ratio = float((w_norm / gamma - w_norm) / d_norm)
            assert 0.01 - 1e-4 <= ratio <= 0.2 + 1e-4 and 0 < float(gamma) < 1
            if beta == 1e-6:
                assert ratio == pytest.approx(0.01, abs=1e-4)
            if beta == 1e6:
                assert ratio == pytest.approx(0.2, abs=1e-4)
        server = new


def test_layer_groups() -> None:
    names = ["conv1.weight", "norm1.weight", "norm1.bias", "fc.weight", "fc.bias", "scale"]
    assert layer_groups(names, "module") == {
        "conv1": ["conv1.weight"],
        "norm1": ["norm1.weight", "norm1.bias"],
        "fc": ["fc.weight", "fc.bias"],
        "scale": ["scale"],
    }
    assert layer_groups(names, "tensor") == {n: [n] for n in names}
    assert layer_groups(names, "bias_delimited") == {
        "norm1.bias": ["conv1.weight", "norm1.weight", "norm1.bias"],
        "fc.bias": ["fc.weight", "fc.bias"],
        "scale": ["scale"],
    }


def test_empty_round_and_bad_hyperparameters() -> None:
    alg = FedLWS()
    s = alg.init_server(W0)
    assert alg.server_update(s, None, rnd(1, 0))[0] is s
    with pytest.raises(ConfigError, match=r"^algorithm\.tau_min=0\.3: must be <= algorithm\.tau_max=0\.2$"):
        FedLWS(tau_min=0.3)
    with pytest.raises(ConfigError, match=r"^algorithm\.beta=-1\.0: must be >= 0$"):
        FedLWS(beta=-1.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.layers='block': choose one of 'module', 'tensor', 'bias_del"):
        FedLWS(layers="block")
