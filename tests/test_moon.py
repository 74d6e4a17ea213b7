"""MOON against a contrastive loss and a local step computed by hand, and its reduction to FedAvg.

Hand-checkable model ``DiagToy``: parameters w in R^2, representation z = x * w (row-wise), logits = z, and a
plain loss f = 0 (so a local step moves w by the contrastive gradient alone). Temperature tau = 0.5.
With s = sim(z, z_glob), s' = sim(z, z_prev): l_con = -log(e^{s/tau} / (e^{s/tau} + e^{s'/tau})) = softplus(a),
a = (s' - s)/tau, and dl/ds = -sigma(a)/tau, dl/ds' = sigma(a)/tau. For cosine similarity,
d sim(z, u)/dz = u / (|z||u|) - (z.u) z / (|z|^3 |u|).

Case A (w = (1, 0), w_glob = (1, 1), w_prev = (0, 1), row x = (1, 1)):
    z = (1, 0), z_glob = (1, 1), z_prev = (0, 1); s = 1/sqrt2 = 0.7071068, s' = 0
    a = -sqrt2 = -1.4142136, l = log(1 + e^a) = 0.2176217, sigma(a) = 0.1955703
    ds/dz = (1,1)/sqrt2 - (1/sqrt2)(1,0) = (0, 0.7071068), ds'/dz = (0, 1), dz/dw = diag(x) = I
    grad_w l = sigma(a)/tau * ((0,1) - (0,0.7071068)) = 0.3911406 * (0, 0.2928932) = (0, 0.1145624)
Case B (same w's, row x = (2, 1)):
    z = (2, 0), z_glob = (2, 1), z_prev = (0, 1); s = 2/sqrt5 = 0.8944272, s' = 0
    a = -1.7888544, l = 0.1545662, sigma(a) = 0.1432132
    ds/dz = (2,1)/(2 sqrt5) - 4 (2,0)/(8 sqrt5) = (0, 0.2236068), ds'/dz = (0,1)/2 - 0 = (0, 0.5)
    dz/dw = diag(2, 1): grad_w l = 0.2864265 * (0, 0.5 - 0.2236068) = (0, 0.0791663)
    batch {A, B}: l = (0.2176217 + 0.1545662)/2 = 0.1860940, grad = (0, 0.0968644)
Case C, one local step from the global model (w = w_glob = (1, 1), w_prev = (0, 1), x = (1, 1), eta_l = mu = 1):
    z = z_glob = (1, 1): s = 1 and ds/dz = 0 (cosine is maximal there); s' = 1/sqrt2
    a = (0.7071068 - 1)/0.5 = -0.5857864, l = 0.4425476, sigma(a) = 0.3576022
    ds'/dz = (0,1)/sqrt2 - (1,1)/(2 sqrt2) = (-0.3535534, 0.3535534)
    grad_w l = 0.7152044 * (-0.3535534, 0.3535534) = (-0.2528630, 0.2528630)
    w_1 = (1, 1) - grad = (1.2528630, 0.7471370) = the new previous model; Delta = (0.2528630, -0.2528630)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quadratic import info, rnd, rounds, run_round
from tolerance import fp32_close, longest_reduction
from torch.func import grad

from hafedho.algorithms.fedavg import FedAvg
from hafedho.algorithms.moon import MOON, ClientState, model_contrastive_loss
from hafedho.core import ClientData, ConfigError, FunctionalModel, tree
from hafedho.models import MLP, build_model
from hafedho.sweep.expand import expand
from hafedho.sweep.presets import list_presets, load_preset

TAU = 0.5


class DiagToy:
    """z = x * w, logits = z, f = 0 (or the masked cross-entropy if ``zero_loss=False``)."""

    def __init__(self, zero_loss: bool = True) -> None:
        self.zero_loss = zero_loss

    def features(self, params, x):
        z = x * params["w"]
        return z, z

    def loss_from_logits(self, params, logits, y, mask):
        if self.zero_loss:
            return (logits * 0.0).sum()
        return (F.cross_entropy(logits, y, reduction="none") * mask).sum() / mask.sum().clamp(min=1.0)

    def loss(self, params, x, y, mask):
        return self.loss_from_logits(params, self.features(params, x)[1], y, mask)


def w2(a: float, b: float) -> dict:
    return {"w": torch.tensor([a, b])}


def con(w, rows, mask):
    """l_con of DiagToy at w against w_glob = (1, 1), w_prev = (0, 1) on ``rows``."""
    x = torch.tensor(rows)
    z_glob, z_prev = x * torch.tensor([1.0, 1.0]), x * torch.tensor([0.0, 1.0])
    return model_contrastive_loss(x * w["w"], z_glob, z_prev, torch.tensor(mask), TAU)


def test_contrastive_loss_value_and_gradient_by_hand() -> None:
    at = w2(1.0, 0.0)
    assert float(con(at, [[1.0, 1.0]], [1.0])) == pytest.approx(0.2176217, abs=1e-6)
    assert torch.allclose(grad(con)(at, [[1.0, 1.0]], [1.0])["w"], torch.tensor([0.0, 0.1145624]), atol=1e-6)
    assert float(con(at, [[2.0, 1.0]], [1.0])) == pytest.approx(0.1545662, abs=1e-6)
    assert torch.allclose(grad(con)(at, [[2.0, 1.0]], [1.0])["w"], torch.tensor([0.0, 0.0791663]), atol=1e-6)
    both = [[1.0, 1.0], [2.0, 1.0]]
    assert float(con(at, both, [1.0, 1.0])) == pytest.approx(0.1860940, abs=1e-6)
    assert torch.allclose(grad(con)(at, both, [1.0, 1.0])["w"], torch.tensor([0.0, 0.0968644]), atol=1e-6)


def test_padding_rows_contribute_nothing() -> None:
    at = w2(1.0, 0.0)
    padded = [[1.0, 1.0], [2.0, 1.0], [-7.0, 3.0]]
    assert float(con(at, padded, [1.0, 0.0, 0.0])) == pytest.approx(0.2176217, abs=1e-6)
    assert torch.allclose(grad(con)(at, padded, [1.0, 0.0, 0.0])["w"], torch.tensor([0.0, 0.1145624]), atol=1e-6)
    assert float(con(at, padded, [0.0, 0.0, 0.0])) == 0.0  # an all-padding batch


def toy_data(steps: int = 1, real_steps: int | None = None) -> ClientData:
    """``steps`` batches of two rows: a real row (1, 1) and a padding row (5, -3) that must be ignored."""
    x = torch.tensor([[1.0, 1.0], [5.0, -3.0]]).expand(steps, 2, 2).clone()
    mask = torch.tensor([1.0, 0.0]).expand(steps, 2).clone()
    if real_steps is not None:
        mask[real_steps:] = 0.0
    return ClientData(x, torch.zeros(steps, 2, dtype=torch.long), mask)


def test_one_local_step_by_hand_updates_the_previous_model() -> None:
    alg = MOON(lr=1.0, mu=1.0, tau=TAU)
    msg = alg.broadcast(alg.init_server(w2(1.0, 1.0)), rnd(2, 1))
    state = ClientState(w2(0.0, 1.0))
    # a second, all-padding step is a no-op
    res = alg.client_update(msg, state, toy_data(2, real_steps=1), info(0.5, 3.0), rnd(2, 1), DiagToy())
    assert torch.allclose(res.upload.delta["w"], torch.tensor([0.2528630, -0.2528630]), atol=1e-6)
    assert torch.allclose(res.state.prev["w"], torch.tensor([1.2528630, 0.7471370]), atol=1e-6)
    assert float(res.weight) == 3.0  # data size
    assert float(res.metrics["train/objective"]) == pytest.approx(0.4425476, abs=1e-6)
    assert float(res.metrics["train/loss"]) == 0.0
    assert torch.equal(state.prev["w"], torch.tensor([0.0, 1.0])), "client_update must not write into its state"
    uniform = MOON(lr=1.0, weighting="uniform").client_update(
        msg, state, toy_data(), info(0.5, 3.0), rnd(2, 1), DiagToy()
    )
    assert float(uniform.weight) == 1.0


def test_previous_equal_to_global_carries_no_gradient() -> None:
    """Round 1: prev = w^0 = global, so s' = s, l_con = log 2 and its gradient is 0: the step is plain CE."""
    toy = DiagToy(zero_loss=False)
    alg = MOON(lr=1.0, mu=1.0)
    msg = alg.broadcast(alg.init_server(w2(1.0, 1.0)), rnd(1, 1))
    res = alg.client_update(msg, alg.init_client(w2(1.0, 1.0)), toy_data(), info(0.5), rnd(1, 1), toy)
    ref = FedAvg(lr=1.0).client_update(msg, (), toy_data(), info(0.5), rnd(1, 1), toy)
    assert torch.equal(res.upload.delta["w"], ref.upload.delta["w"])  # bit for bit: the two terms cancel exactly
    assert float(res.metrics["train/objective"]) == pytest.approx(float(res.metrics["train/loss"]) + 0.6931472)


# --- rounds on a real network (an MLP through FunctionalModel) -------------------------------------------------

with torch.random.fork_rng():  # seeded, without touching the global RNG other tests may rely on
    torch.manual_seed(0)
    NET = FunctionalModel(MLP((4,), 3, hidden=(5,)))
    MASK = torch.tensor([1.0, 1.0, 1.0, 0.0]).expand(3, 4)  # the last row of every batch is padding
    DATA = {i: ClientData(torch.randn(3, 4, 4) + i, torch.randint(0, 3, (3, 4)), MASK) for i in range(3)}
W0 = NET.params()
SIZES = {0: 2.0, 1: 3.0, 2: 5.0}


ON_NET = {"data": DATA, "sizes": SIZES, "model": NET}  # run_round's clients for these rounds
COHORTS = [[0, 1], [1, 2], [0, 2]]


def test_mu_zero_is_fedavg_exactly() -> None:
    moon = rounds(MOON(lr=0.1, mu=0.0), COHORTS, W0, **ON_NET)
    avg = rounds(FedAvg(lr=0.1), COHORTS, W0, **ON_NET)
    for (ms, _, _), (fs, _, _) in zip(moon, avg, strict=True):
        assert all(torch.equal(ms.params[k], fs.params[k]) for k in W0)


def test_previous_model_is_kept_while_skipping_and_replaced_after_training() -> None:
    alg, fed = MOON(lr=0.1, mu=1.0), FedAvg(lr=0.1)
    server = alg.init_server(W0)
    states = {i: alg.init_client(W0) for i in SIZES}
    msg1 = alg.broadcast(server, rnd(1, 2))
    server, r1 = run_round(alg, server, states, COHORTS[0], 1, **ON_NET)
    # round 1: prev = w^0 = global, the contrastive term has no gradient: the round is FedAvg's, bit for bit
    fs, _ = run_round(fed, fed.init_server(W0), {i: () for i in SIZES}, COHORTS[0], 1, **ON_NET)
    assert all(torch.equal(server.params[k], fs.params[k]) for k in W0)
    for i in COHORTS[0]:  # the previous model is now the client's final local model w^t + Delta_i
        assert all(torch.equal(tree.sub(states[i].prev, msg1.params)[k], r1[i].upload.delta[k]) for k in W0)
    assert all(torch.equal(states[2].prev[k], W0[k]) for k in W0)  # never sampled: still w^0
    after_r1 = {k: v.clone() for k, v in states[0].prev.items()}
    msg2 = alg.broadcast(server, rnd(2, 2))
    server, r2 = run_round(alg, server, states, COHORTS[1], 2, **ON_NET)
    assert all(torch.equal(states[0].prev[k], after_r1[k]) for k in W0)  # client 0 skipped round 2: unchanged
    for i in COHORTS[1]:
        assert all(torch.equal(tree.sub(states[i].prev, msg2.params)[k], r2[i].upload.delta[k]) for k in W0)
    # client 1 now contrasts against its round-1 model: its update differs from FedAvg's
    plain = fed.client_update(msg2, (), DATA[1], info(0.3, 3.0), rnd(2, 2), NET)
    assert not torch.allclose(r2[1].upload.delta["head.weight"], plain.upload.delta["head.weight"], atol=1e-6)


@pytest.mark.parametrize(("name", "shape"), [("mlp", (6,)), ("lenet5", (3, 32, 32)), ("resnet18_gn", (3, 8, 8))])
def test_round_one_is_fedavg_bit_for_bit(name: str, shape: tuple[int, ...]) -> None:
    """Round 1 (previous model = w^0 = global) with mu = 5, on models with MOON's projection head: the
    contrastive gradient is exactly 0 and every update equals FedAvg's bit for bit (no dropout in these models)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = FunctionalModel(build_model(name, shape, 3, projection=8))
        data = {i: ClientData(torch.randn(2, 4, *shape), torch.randint(0, 3, (2, 4)), torch.ones(2, 4)) for i in SIZES}
    w0 = net.params()
    kw = {"data": data, "sizes": SIZES, "model": net}
    alg, fed = MOON(lr=0.1, mu=5.0), FedAvg(lr=0.1)
    moon, r = run_round(alg, alg.init_server(w0), {i: alg.init_client(w0) for i in SIZES}, [0, 1], 1, **kw)
    avg, ref = run_round(fed, fed.init_server(w0), dict.fromkeys(SIZES, ()), [0, 1], 1, **kw)
    for i in (0, 1):
        assert all(torch.equal(r[i].upload.delta[k], ref[i].upload.delta[k]) for k in w0)
    assert all(torch.equal(moon.params[k], avg.params[k]) for k in w0)


def test_contrastive_loss_uses_the_projection_head_output() -> None:
    """With model.options.projection = 16, z is the 16-d head output: one local step's objective is
    f + mu * l_con(z, z_glob, z_prev) of those projected z, and the contrastive gradient reaches the head."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = FunctionalModel(build_model("mlp", (4,), 3, hidden=(5,), projection=16))
    w_t = net.params()
    prev = {k: v + 0.3 * torch.randn_like(v) for k, v in w_t.items()}
    x, y, m = DATA[0].x[:1], DATA[0].y[:1], DATA[0].mask[:1]
    z, logits = net.features(w_t, x[0])
    assert z.shape == (4, 16) and "proj.2.weight" in w_t
    l_con = model_contrastive_loss(z, net.features(w_t, x[0])[0], net.features(prev, x[0])[0], m[0], TAU)
    alg = MOON(lr=0.1, mu=2.0, tau=TAU)
    res = alg.client_update(
        alg.broadcast(alg.init_server(w_t), rnd(2, 1)),
        ClientState(prev),
        ClientData(x, y, m),
        info(0.5, 3.0),
        rnd(2, 1),
        net,
    )
    f = net.loss_from_logits(w_t, logits, y[0], m[0])
    assert float(res.metrics["train/objective"]) == pytest.approx(float(f + 2.0 * l_con), rel=1e-6)
    plain = FedAvg(lr=0.1).client_update(
        alg.broadcast(alg.init_server(w_t), rnd(2, 1)), (), ClientData(x, y, m), info(0.5, 3.0), rnd(2, 1), net
    )
    assert not torch.allclose(res.upload.delta["proj.0.weight"], plain.upload.delta["proj.0.weight"], atol=1e-6)


def test_client_update_is_vmap_safe() -> None:
    alg = MOON(lr=0.1, mu=1.0)
    msg = alg.broadcast(alg.init_server(W0), rnd(2, 2))
    states = [ClientState({k: v + 0.1 * (i + 1) for k, v in W0.items()}) for i in range(2)]
    infos = [info(0.2, 2.0), info(0.3, 3.0)]
    loop = [alg.client_update(msg, states[i], DATA[i], infos[i], rnd(2, 2), NET) for i in range(2)]

    def stack(*trees):
        return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *trees)

    batched = torch.func.vmap(lambda s, d, n: alg.client_update(msg, s, d, n, rnd(2, 2), NET))(
        stack(*states), stack(DATA[0], DATA[1]), stack(*infos)
    )
    for i in range(2):  # vmap's batched kernels against the loop's: up to float32 rounding (tests/tolerance.py)
        bounds = {"reduction": longest_reduction(NET.module, DATA[i].x[0]), "steps": DATA[i].x.shape[0]}
        fp32_close({k: batched.upload.delta[k][i] for k in W0}, loop[i].upload.delta, **bounds)


def test_bad_hyperparameters() -> None:
    with pytest.raises(ConfigError, match=r"^algorithm\.tau=0\.0: must be > 0$"):
        MOON(tau=0.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.mu=-1\.0: must be >= 0$"):
        MOON(mu=-1.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.weighting='size': choose one of 'data_size', 'uniform'$"):
        MOON(weighting="size")


@pytest.mark.parametrize("scale", ["cpu", "full"])
def test_paper_presets_give_every_row_the_same_network_with_moons_head(scale: str) -> None:
    """The two protocols (_common.toml). head (and every preset without a `protocol` axis): one network for all
    methods of a comparison, MOON's 256-d head included (logistic regression, FedProx's synthetic setting, has no
    encoder and no head). main and main-long: the same network without the head for every method but MOON,
    whose head is part of its method."""
    for name in list_presets():
        models: dict[tuple[str, str, bool], set] = {}
        for spec in expand(load_preset(name, scale), seeds=1):
            model = spec.cfg.model
            for point in (spec.point, *(p for p, _ in spec.views)):
                key = (spec.cfg.data.source, str(point.get("protocol", "head")), spec.cfg.algorithm["name"] == "moon")
                models.setdefault(key, set()).add((model.name, tuple(sorted((model.options or {}).items()))))
        for (source, protocol, moon), seen in models.items():
            assert len(seen) == 1, (name, source, protocol, seen)
            ((model_name, options),) = seen
            head = 0 if model_name == "logreg" or (protocol != "head" and not moon) else 256
            assert dict(options).get("projection") == head, (name, source, protocol, moon)
