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
    Both spreads agree here (two clients of equal weight): official (1/2) sum ||Delta_i - mean Delta|| = 4 and 10.
    The default layer rule ("bias_delimited") coincides with "module" here: each module ends with its bias or
    is the last one.
layers="tensor": l1.weight alone: ||w|| = 3, Delta = (0, 3), tau = 4: gamma = 3 / (3 + 0.3) = 0.9090909;
    l1.bias: Delta = 0, so gamma = 4 / (4 + 0) = 1 and the bias stays 4.
"""

from __future__ import annotations

import pytest
import torch
from quadratic import client_updates, rnd

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.fedlws import Aggregate, DeltaUpload, FedLWS, layer_groups
from hafedho.core import ClientData, ConfigError, FunctionalModel, tree
from hafedho.models import MLP, build_model

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


def aggregate(alg, results):
    """The runtime's aggregation: the algorithm's own aggregator, uploads added in cohort order."""
    agg = alg.new_aggregator()
    for res in results.values():
        agg.add(tree.detach(res.upload), res.weight)
    return agg.result()


def one_round(alg, w_t=W_T, targets=TARGETS, sizes=None):
    """One round from w_t, each client's data its target; returns the server's (new state, metrics)."""
    server = alg.init_server(params(*w_t))
    r = rnd(1, len(targets))
    data = {name: target_data(point) for name, point in targets.items()}
    sizes = dict.fromkeys(targets, 2.0) if sizes is None else sizes
    results = client_updates(
        alg, alg.broadcast(server, r), dict.fromkeys(targets, ()), list(targets), r, data, sizes, StackedQuadratic()
    )
    return alg.server_update(server, aggregate(alg, results), r)


def flat(p) -> torch.Tensor:
    return torch.cat([p[k] for k in NAMES])


def test_two_layer_gammas_by_hand() -> None:
    new, metrics = one_round(FedLWS(lr=1.0, beta=0.025))
    expected = torch.tensor([2.8301887, 2.8301887, 3.7735849, 2.1428571, 0.0])
    assert torch.allclose(flat(new.params), expected, atol=1e-6)
    assert metrics["server/gamma_min"] == pytest.approx(0.7142857, abs=1e-6)
    assert metrics["server/gamma_mean"] == pytest.approx((0.9433962 + 0.7142857) / 2, abs=1e-6)
    assert metrics["server/beta_tau_mean"] == pytest.approx((0.1 + 0.2) / 2, abs=1e-6)
    for other in ({"layers": "module"}, {"spread": "weighted_std"}):  # both coincide here (see the docstring)
        new, _ = one_round(FedLWS(lr=1.0, beta=0.025, **other))
        assert torch.allclose(flat(new.params), expected, atol=1e-6)


def test_tensor_layers_shrink_weight_and_bias_separately() -> None:
    new, _ = one_round(FedLWS(lr=1.0, beta=0.025, layers="tensor"))
    assert torch.allclose(new.params["l1.weight"], torch.tensor([3.0, 3.0]) * 3 / 3.3, atol=1e-6)
    assert torch.equal(new.params["l1.bias"], torch.tensor([4.0]))
    assert torch.allclose(new.params["l2.weight"], torch.tensor([2.1428571, 0.0]), atol=1e-6)


def test_lower_clip_and_both_spreads_with_unequal_weights() -> None:
    """Identical clients: tau = 0, beta tau is clipped up to 0.01. l1: gamma = 5 / (5 + 0.01 * 5) = 1/1.01 for
    Delta = (4, 3 | 0); l2 (Delta = (2, 10), ||Delta|| = sqrt(104)): gamma = 1 / (1 + 0.01 sqrt(104)).

    Sizes 1 and 3 for A and B of the main case (p = 1/4, 3/4):
    l1: Delta = (4, 3 | 0)/4 + 3 (-4, 3 | 0)/4 = (-2, 3 | 0), ||Delta|| = sqrt(13).
        official: unweighted mean (0, 3 | 0), distances 4 and 4: tau = 4, beta tau = 0.1,
                  gamma = 5 / (5 + 0.1 sqrt(13)) = 0.9327392,
                  w_{t+1} = gamma (1, 3 | 4) = (0.9327392, 2.7982177 | 3.7309569)
        weighted_std: E||Delta_i||^2 = 25, tau = sqrt(25 - 13) = sqrt(12), beta tau = 0.0866025,
                  gamma = 5 / (5 + 0.0866025 sqrt(13)) = 0.9412208: w_{t+1} = (0.9412208, 2.8236623 | 3.7648831)
    l2: Delta = (2, -5); official tau = 10, weighted tau = sqrt(104 - 29) = 8.660254: beta tau is 0.25 or 0.2165,
        both clipped to 0.2: gamma = 1 / (1 + 0.2 sqrt(29)) = 0.4814560 times (3, -5) either way."""
    same, _ = one_round(FedLWS(lr=1.0, beta=0.025), targets={"A": TARGETS["A"], "C": TARGETS["A"]})
    assert torch.allclose(same.params["l1.weight"], torch.tensor([7.0, 3.0]) / 1.01, atol=1e-6)
    assert torch.allclose(same.params["l2.weight"], torch.tensor([3.0, 10.0]) / (1 + 0.01 * 104**0.5), atol=1e-6)
    sizes = {"A": 1.0, "B": 3.0}
    official, _ = one_round(FedLWS(lr=1.0, beta=0.025), sizes=sizes)
    weighted, _ = one_round(FedLWS(lr=1.0, beta=0.025, spread="weighted_std"), sizes=sizes)
    l1 = torch.cat([official.params["l1.weight"], official.params["l1.bias"]])
    assert torch.allclose(l1, torch.tensor([0.9327392, 2.7982177, 3.7309569]), atol=1e-6)
    l1 = torch.cat([weighted.params["l1.weight"], weighted.params["l1.bias"]])
    assert torch.allclose(l1, torch.tensor([0.9412208, 2.8236623, 3.7648831]), atol=1e-6)
    for new in (official, weighted):
        assert torch.allclose(new.params["l2.weight"], torch.tensor([3.0, -5.0]) * 0.4814560, atol=1e-6)


def test_the_official_spread_is_not_bounded_by_the_weighted_one() -> None:
    """Weights (0.99, 0.01), updates 0 and 1 (layer l1: Delta_A = 0, Delta_B = (1, 0 | 0); l2 identical clients).
    official tau = (0.5 + 0.5)/2 = 0.5; weighted_std tau = sqrt(0.01 - 0.01^2) = sqrt(0.99 * 0.01) = 0.0994987.
    With beta = 0.1 (official beta tau = 0.05, inside the clip): Delta^{l1} = (0.01, 0 | 0), ||Delta|| = 0.01,
    gamma = 5 / (5 + 0.05 * 0.01) = 0.9999000, w_{t+1}^{l1} = gamma (3.01, 0 | 4) = (3.0096990, 0 | 3.9996000)."""
    targets = {"A": W_T, "B": (4.0, 0.0, 4.0, 1.0, 0.0)}
    alg = FedLWS(lr=1.0, beta=0.1)
    server = alg.init_server(params(*W_T))
    r = rnd(1, 2)
    data = {k: target_data(p) for k, p in targets.items()}
    results = client_updates(
        alg,
        alg.broadcast(server, r),
        {"A": (), "B": ()},
        ["A", "B"],
        r,
        data,
        {"A": 99.0, "B": 1.0},
        StackedQuadratic(),
    )
    assert all(isinstance(res.upload, DeltaUpload) for res in results.values())  # FedAvg's upload, nothing more
    agg = aggregate(alg, results)
    assert isinstance(agg, Aggregate)
    assert float(agg.spread["l1.bias"]) == pytest.approx(0.5, abs=1e-7)
    assert float(agg.spread["l2.weight"]) == 0.0
    new, _ = alg.server_update(server, agg, r)
    l1 = torch.cat([new.params["l1.weight"], new.params["l1.bias"]])
    assert torch.allclose(l1, torch.tensor([3.0096990, 0.0, 3.9996000]), atol=1e-6)
    weighted = FedLWS(lr=1.0, beta=1.0, tau_min=0.0, tau_max=1e9, spread="weighted_std")
    results = client_updates(
        weighted,
        weighted.broadcast(server, r),
        {"A": (), "B": ()},
        ["A", "B"],
        r,
        data,
        {"A": 99.0, "B": 1.0},
        StackedQuadratic(),
    )
    _, metrics = weighted.server_update(server, aggregate(weighted, results), r)
    assert metrics["server/beta_tau_mean"] == pytest.approx(0.0994987 / 2, abs=1e-6)  # l2's tau is 0


def test_zero_norm_layer_is_not_shrunk() -> None:
    """w_t^{l2} = 0 would give gamma = 0 forever; it is left unshrunk: w_{t+1}^{l2} = Delta^{l2} = (2, 0)."""
    new, _ = one_round(
        FedLWS(lr=1.0), w_t=(3.0, 0.0, 4.0, 0.0, 0.0), targets={"A": (7, 3, 4, 2, 10), "B": (-1, 3, 4, 2, -10)}
    )
    assert torch.equal(new.params["l2.weight"], torch.tensor([2.0, 0.0]))


def official_spread(deltas: list[torch.Tensor]) -> float:
    """The authors' statistic (server_funct.py): unweighted mean over clients of ||Delta_i - mean_i Delta_i||."""
    mean = torch.stack(deltas).double().mean(0)
    return float(torch.stack([(d.double() - mean).norm() for d in deltas]).mean())


def weighted_std(deltas: list[torch.Tensor], p: list[float]) -> float:
    w = torch.tensor(p, dtype=torch.float64) / sum(p)
    x = torch.stack(deltas).double()
    return float((w * ((x - (w[:, None] * x).sum(0)) ** 2).sum(1)).sum().sqrt())


@pytest.mark.parametrize("sizes", [(1.0, 1.0, 1.0), (1.0, 5.0, 20.0)])
def test_each_spread_against_its_reference(sizes: tuple[float, ...]) -> None:
    """With beta = 1 and no clip, beta tau_l is the spread; compared layer by layer, equal and unequal weights."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        points = [tuple(torch.randn(5).tolist()) for _ in range(3)]
    deltas = [torch.tensor(p) - 1.0 for p in points]
    targets = {str(i): p for i, p in enumerate(points)}
    size = {str(i): n for i, n in enumerate(sizes)}
    for spread in ("official", "weighted_std"):
        alg = FedLWS(lr=1.0, beta=1.0, tau_min=0.0, tau_max=1e9, spread=spread)
        _, metrics = one_round(alg, w_t=(1.0,) * 5, targets=targets, sizes=size)
        if spread == "official":
            ref = [official_spread([d[:3] for d in deltas]), official_spread([d[3:] for d in deltas])]
        else:
            ref = [weighted_std([d[:3] for d in deltas], sizes), weighted_std([d[3:] for d in deltas], sizes)]
        assert metrics["server/beta_tau_mean"] == pytest.approx(sum(ref) / 2, rel=1e-5)


def test_neither_spread_bounds_the_other() -> None:
    """Equal weights, scalar updates (0, 0, 3): official 4/3 < weighted sqrt(2); weights (0.99, 0.01) and updates
    (0, 1): official 0.5 > weighted 0.0995 (the false "upper-bounds" claim of the old docstring)."""
    u = [torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([3.0])]
    assert official_spread(u) == pytest.approx(4 / 3) and weighted_std(u, [1, 1, 1]) == pytest.approx(2**0.5)
    v = [torch.tensor([0.0]), torch.tensor([1.0])]
    assert official_spread(v) == pytest.approx(0.5) and weighted_std(v, [0.99, 0.01]) == pytest.approx(0.0994987)


def official_groups(names: list[str]) -> list[list[str]]:
    """A transcription of the authors' grouping loop: concatenate parameters, close a layer at a name with "bias"."""
    out, cur = [], []
    for name in names:
        cur.append(name)
        if "bias" in name:
            out.append(cur)
            cur = []
    return out


def test_default_layers_on_resnet18_gn_are_the_official_ones() -> None:
    """resnet18_gn: bias-free convs, each followed by its GroupNorm. The official rule pairs every conv with its
    norm: the stem, 8 blocks x 2 convs, 3 shortcuts (conv 1x1 + norm) and fc: 21 layers, of which 20 hold one
    conv weight and one norm's weight and bias. "module" would split them into 41."""
    names = [k for k, _ in build_model("resnet18_gn", (3, 32, 32), 10).named_parameters()]
    groups = layer_groups(names, FedLWS().layers)
    assert list(groups.values()) == official_groups(names)
    assert len(groups) == 21 and len(layer_groups(names, "module")) == 41
    first, *_, last = groups.values()
    assert first == ["conv1.weight", "norm1.weight", "norm1.bias"] and last == ["fc.weight", "fc.bias"]
    assert groups["layers.1.0.shortcut.1.bias"] == [
        "layers.1.0.shortcut.0.weight",
        "layers.1.0.shortcut.1.weight",
        "layers.1.0.shortcut.1.bias",
    ]
    for conv, norm_w, norm_b in list(groups.values())[:-1]:  # each: one conv weight, then its norm's two tensors
        assert conv.endswith(("conv1.weight", "conv2.weight", "shortcut.0.weight"))
        assert norm_w == norm_b.replace(".bias", ".weight") and norm_b.endswith(("norm1.bias", "norm2.bias", "1.bias"))


def test_server_step_on_resnet18_gn_matches_the_official_formula() -> None:
    """One server step on resnet18_gn from three random updates (weights 1, 2, 3), against the authors' formula
    per official layer in float64: gamma = ||w|| / (||w|| + clip(beta mean_i ||D_i - mean D||) ||sum p_i D_i||)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        w = {k: v.detach() for k, v in build_model("resnet18_gn", (3, 16, 16), 10).named_parameters()}
        deltas = [{k: 0.01 * (i + 1) * torch.randn_like(v) for k, v in w.items()} for i in range(3)]
    p = [1.0, 2.0, 3.0]
    alg = FedLWS(beta=0.5)
    agg = alg.new_aggregator()
    for d, weight in zip(deltas, p, strict=True):
        agg.add(DeltaUpload(d), torch.tensor(weight))
    new, _ = alg.server_update(alg.init_server(w), agg.result(), rnd(1, 3))

    def cat(t: dict, names: list[str]) -> torch.Tensor:
        return torch.cat([t[k].double().flatten() for k in names])

    for names in official_groups(list(w)):
        layer = [cat(d, names) for d in deltas]
        avg = sum(pi * d for pi, d in zip(p, layer, strict=True)) / sum(p)
        tau = min(max(0.5 * official_spread(layer), 0.01), 0.2)
        w_l = cat(w, names)
        ref = float(w_l.norm() / (w_l.norm() + tau * avg.norm())) * (w_l + avg)
        # float32 arithmetic against a float64 reference: a few roundings of the layer's largest entry
        torch.testing.assert_close(cat(new.params, names), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))


# --- rounds on a real network: the clip bounds and the reduction to FedAvg -------------------------------------

with torch.random.fork_rng():
    torch.manual_seed(0)
    NET = FunctionalModel(MLP((4,), 3, hidden=(5,)))
    MASK = torch.tensor([1.0, 1.0, 1.0, 0.0]).expand(3, 4)
    DATA = {i: ClientData(torch.randn(3, 4, 4) + i, torch.randint(0, 3, (3, 4)), MASK) for i in range(3)}
W0 = NET.params()
SIZES = {0: 2.0, 1: 3.0, 2: 5.0}
COHORTS = [[0, 1], [1, 2], [0, 2]]


def net_round(alg, server, cohort, t):
    """Round t on NET: the cohort's updates, the algorithm's aggregator, the server step."""
    r = rnd(t, len(cohort))
    results = client_updates(alg, alg.broadcast(server, r), dict.fromkeys(SIZES, ()), cohort, r, DATA, SIZES, NET)
    agg = aggregate(alg, results)
    return alg.server_update(server, agg, r)[0], agg


@pytest.mark.parametrize("spread", ["official", "weighted_std"])
def test_no_shrinking_is_fedavg_exactly(spread: str) -> None:
    lws, avg = FedLWS(lr=0.1, beta=0.0, tau_min=0.0, server_lr=0.7, spread=spread), FedAvg(lr=0.1, server_lr=0.7)
    ls, fs = lws.init_server(W0), avg.init_server(W0)
    for t, cohort in enumerate(COHORTS, start=1):
        ls, fs = net_round(lws, ls, cohort, t)[0], net_round(avg, fs, cohort, t)[0]
        assert all(torch.equal(ls.params[k], fs.params[k]) for k in W0)


@pytest.mark.parametrize("beta", [1e-6, 0.03, 1e6])
def test_clip_bounds_hold(beta: float) -> None:
    """From w_{t+1}^l = gamma_l (w_t^l + Delta^l): beta tau_l = (||w_t^l|| / gamma_l - ||w_t^l||) / ||Delta^l||,
    which must lie in [tau_min, tau_max] (at tau_min for tiny beta, at tau_max for huge beta)."""
    alg = FedLWS(lr=0.5, beta=beta, tau_min=0.01, tau_max=0.2)
    server = alg.init_server(W0)
    for t, cohort in enumerate(COHORTS, start=1):
        new, agg = net_round(alg, server, cohort, t)
        for names in layer_groups(list(W0), alg.layers).values():
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


def test_clip_interval_must_not_be_empty() -> None:
    """The one cross-field rule (each field's own range is a registry contract, tests/test_contract.py)."""
    with pytest.raises(ConfigError, match=r"^algorithm\.tau_min=0\.3: must be <= algorithm\.tau_max=0\.2$"):
        FedLWS(tau_min=0.3)
    assert FedLWS(tau_min=0.2, tau_max=0.2).tau_min == 0.2


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


def test_bad_hyperparameters() -> None:
    with pytest.raises(ConfigError, match=r"^algorithm\.tau_min=0\.3: must be <= algorithm\.tau_max=0\.2$"):
        FedLWS(tau_min=0.3)
    with pytest.raises(ConfigError, match=r"^algorithm\.beta=-1\.0: must be >= 0$"):
        FedLWS(beta=-1.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.layers='block': choose one of 'bias_delimited', 'module'"):
        FedLWS(layers="block")
    with pytest.raises(ConfigError, match=r"^algorithm\.spread='std': choose one of 'official', 'weighted_std'$"):
        FedLWS(spread="std")
