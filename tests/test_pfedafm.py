"""pFedAFM against steps computed by hand on a toy model with 2-d representations.

Toy model (params s in R^2, W in R^{1x2}, b in R): z = x (.) s, logit = W z + b, loss l = 1/2 (logit - y)^2
(masked mean), so dl/dlogit = e = logit - y. Learning rates eta = 0.1, eta_alpha = 0.2, one step per phase.
G starts at theta_0 = (s_G = (1, 1), W = (1, 1), b = 0); every client's personal model is (s_F = (0, 1),
W = (1, 1), b = 0) with alpha = (0.5, 0.5). Data: x = (1, 2); client 1 has y = 1, client 2 has y = 3.

Step 1 (theta frozen): z_G = (1, 2), z_F = (0, 2), r = 0.5 z_G + 0.5 z_F = (0.5, 2), logit = 2.5.
    client 1: e = 1.5; dW = e r = (0.75, 3), db = 1.5, dr = e W = (1.5, 1.5),
        ds_F = dr (.) (1 - alpha) (.) x = (0.75, 1.5), dalpha = dr (.) (z_G - z_F) = (1.5, 0)
        W = (0.925, 0.7), b = -0.15, s_F = (-0.075, 0.85), alpha = (0.5 - 0.2 * 1.5, 0.5) = (0.2, 0.5)
    client 2: e = -0.5; dW = (-0.25, -1), db = -0.5, ds_F = (-0.25, -0.5), dalpha = (-0.5, 0)
        W = (1.025, 1.1), b = 0.05, s_F = (0.025, 1.05), alpha = (0.6, 0.5)
Step 2 (G through the new, frozen header; z_G = x (.) s_G = (1, 2)):
    client 1: logit = 0.925 + 1.4 - 0.15 = 2.175, e = 1.175, ds_G = e W (.) x = (1.086875, 1.645)
        Delta_1 = (-0.1086875, -0.1645) on s_G, 0 on G's own (unused) head
    client 2: logit = 1.025 + 2.2 + 0.05 = 3.275, e = 0.275, ds_G = (0.281875, 0.605)
        Delta_2 = (-0.0281875, -0.0605)
Server, weights n = (1, 3): s_G = (1, 1) + ((-0.1086875, -0.1645) + 3 (-0.0281875, -0.0605)) / 4
    = (1 - 0.0483125, 1 - 0.0865) = (0.9516875, 0.9135)
"""

from __future__ import annotations

import pytest
import torch
from quadratic import close, info, rnd, run_round
from torch.func import vmap
from torch.utils import _pytree as pytree

from hafedho.algorithms.pfedafm import ClientState, PFedAFM, ServerState
from hafedho.core import ClientData
from hafedho.core.model import FunctionalModel
from hafedho.models.simple import MLP


class Toy:
    """z = x (.) s, logits = z W^T + b (one output), squared loss; implements features/head/loss_from_logits."""

    def head(self, p, z):
        return z @ p["head.weight"].T + p["head.bias"]

    def features(self, p, x):
        z = x * p["s"]
        return z, self.head(p, z)

    def logits(self, p, x):
        return self.features(p, x)[1]

    def loss_from_logits(self, p, logits, y, mask):
        per = 0.5 * (logits[:, 0] - y.to(logits.dtype)) ** 2
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    def loss(self, p, x, y, mask):
        return self.loss_from_logits(p, self.logits(p, x), y, mask)


MODEL = Toy()
X = (1.0, 2.0)
Y = {1: 1, 2: 3, 3: 2}
N = {1: 1.0, 2: 3.0, 3: 2.0}


def params(s=(1.0, 1.0), w=(1.0, 1.0), b=0.0):
    return {"s": torch.tensor(s), "head.weight": torch.tensor([w]), "head.bias": torch.tensor([b])}


def data(y, steps=1, x=X):
    xs = torch.tensor(x).expand(steps, 1, 2).clone()
    return ClientData(xs, torch.full((steps, 1), y, dtype=torch.long), torch.ones(steps, 1))


def start(alg):
    states = {i: ClientState(params(s=(0.0, 1.0)), torch.tensor([0.5, 0.5])) for i in Y}
    return alg.init_server(params()), states


def one_round(alg, server, states, cohort, t):
    return run_round(alg, server, states, cohort, t, data={i: data(y) for i, y in Y.items()}, sizes=N, model=MODEL)


def test_round_by_hand_with_a_skipping_client() -> None:
    alg = PFedAFM(lr=0.1, alpha_lr=0.2)
    server, states = start(alg)
    untouched = states[3]
    server, res = one_round(alg, server, states, [1, 2], 1)
    p1, p2 = states[1].personal, states[2].personal
    assert close(p1["head.weight"][0], [0.925, 0.7]) and close(p1["head.bias"], [-0.15])
    assert close(p1["s"], [-0.075, 0.85]) and close(states[1].alpha, [0.2, 0.5])
    assert close(p2["head.weight"][0], [1.025, 1.1]) and close(p2["s"], [0.025, 1.05])
    assert close(states[2].alpha, [0.6, 0.5]) and close(p2["head.bias"], [0.05])
    assert close(res[1].upload.delta["s"], [-0.1086875, -0.1645])
    assert close(res[1].upload.delta["head.weight"], [[0.0, 0.0]])  # G's own head is unused
    assert close(res[2].upload.delta["s"], [-0.0281875, -0.0605])
    assert float(res[1].weight) == 1.0 and float(res[2].weight) == 3.0
    assert close(server.params["s"], [0.9516875, 0.9135]) and close(server.params["head.weight"], [[1.0, 1.0]])
    assert float(res[1].metrics["train/loss"]) == pytest.approx(1.125)  # 1/2 * 1.5^2
    assert float(res[1].metrics["train/global_loss"]) == pytest.approx(0.5 * 1.175**2)
    assert states[3] is untouched  # not sampled: its state is not even rebuilt
    frozen1 = {k: v.clone() for k, v in states[1].personal.items()}, states[1].alpha.clone()
    server, _ = one_round(alg, server, states, [2, 3], 2)
    assert all(torch.equal(states[1].personal[k], frozen1[0][k]) for k in frozen1[0])  # client 1 skipped round 2
    assert torch.equal(states[1].alpha, frozen1[1])
    assert not torch.equal(states[3].alpha, untouched.alpha)  # client 3 trained in round 2


def test_predict_mixes_representations() -> None:
    """s_G = (1, 1), s_F = (3, -1), W = (1, 2), b = 0.5, alpha = (0.25, 1), x = (2, 1):
    z_G = (2, 1), z_F = (6, -1), r = (0.25*2 + 0.75*6, 1*1 + 0*(-1)) = (5, 1), logit = 5 + 2 + 0.5 = 7.5."""
    alg = PFedAFM()
    server = ServerState(params())
    personal = params(s=(3.0, -1.0), w=(1.0, 2.0), b=0.5)
    x = torch.tensor([[2.0, 1.0]])
    assert close(alg.predict(server, ClientState(personal, torch.tensor([0.25, 1.0])), MODEL, x), [[7.5]])
    # alpha = 0: the client's own model; alpha = 1: its header on G's features (2*1 + 1*2 + 0.5 = 4.5)
    assert close(alg.predict(server, ClientState(personal, torch.zeros(2)), MODEL, x), MODEL.logits(personal, x))
    assert close(alg.predict(server, ClientState(personal, torch.ones(2)), MODEL, x), [[4.5]])
    assert alg.personalized and alg.eval_params(server, None) is server.params


def test_alpha_is_clipped_to_unit_interval() -> None:
    """eta_alpha = 10: client 1 (e = 1.5) wants alpha_0 = 0.5 - 15 -> 0; y = 10 (e = -7.5) wants 0.5 + 75 -> 1.
    Dimension 1 has z_G = z_F (= 2), so its gradient is 0 and alpha_1 stays 0.5."""
    alg = PFedAFM(lr=0.1, alpha_lr=10.0)
    _, states = start(alg)
    msg = alg.broadcast(ServerState(params()), rnd(1, 1))
    lo = alg.client_update(msg, states[1], data(1), info(0.0, 1.0), rnd(1, 1), MODEL).state.alpha
    hi = alg.client_update(msg, states[1], data(10), info(0.0, 1.0), rnd(1, 1), MODEL).state.alpha
    assert close(lo, [0.0, 0.5]) and close(hi, [1.0, 0.5])
    many = alg.client_update(msg, states[1], data(10, steps=5), info(0.0, 1.0), rnd(1, 1), MODEL).state.alpha
    assert bool(((many >= 0) & (many <= 1)).all())


def test_padding_steps_are_no_ops() -> None:
    alg = PFedAFM(lr=0.1, alpha_lr=0.2)
    server, states = start(alg)
    d = data(1, steps=3)
    d = d._replace(mask=torch.tensor([[1.0], [0.0], [0.0]]))
    res = alg.client_update(alg.broadcast(server, rnd(1, 1)), states[1], d, info(0.0, 1.0), rnd(1, 1), MODEL)
    assert close(res.state.alpha, [0.2, 0.5]) and close(res.upload.delta["s"], [-0.1086875, -0.1645])


def test_fedrep_limit_keeps_feature_extractor_and_alpha() -> None:
    """alpha = 1, eta_alpha = 0: r = z_G, so F_k's extractor s_F gets no gradient; only the header and G train."""
    alg = PFedAFM(lr=0.1, alpha_lr=0.0, alpha_init=1.0)
    st = alg.init_client(params(s=(0.0, 1.0)))
    res = alg.client_update(
        alg.broadcast(ServerState(params()), rnd(1, 1)), st, data(1), info(0.0, 1.0), rnd(1, 1), MODEL
    )
    assert torch.equal(res.state.personal["s"], st.personal["s"]) and torch.equal(res.state.alpha, torch.ones(2))
    assert not torch.equal(res.state.personal["head.weight"], st.personal["head.weight"])


def test_init_client_reads_representation_size_from_the_head() -> None:
    model = FunctionalModel(MLP((4,), 3, hidden=(5,)))
    alg = PFedAFM(alpha_init=0.5)
    st = alg.init_client(model.params())
    assert st.alpha.shape == (5,) and bool((st.alpha == 0.5).all())
    assert st.personal.keys() == model.params().keys()
    x, y = torch.randn(2, 3, 4), torch.tensor([[0, 1, 2], [2, 1, 0]])
    cd = ClientData(x, y, torch.ones(2, 3))
    res = alg.client_update(
        alg.broadcast(alg.init_server(model.params()), rnd(1, 1)), st, cd, info(0.0, 3.0), rnd(1, 1), model
    )
    assert res.upload.delta.keys() == model.params().keys() and res.state.alpha.shape == (5,)
    assert alg.predict(alg.init_server(model.params()), res.state, model, x[0]).shape == (3, 3)


def test_client_update_is_vmap_safe() -> None:
    """Clients 1 and 2 of the hand-computed round, batched with torch.func.vmap, give the same numbers."""
    alg = PFedAFM(lr=0.1, alpha_lr=0.2)
    server, states = start(alg)
    msg = alg.broadcast(server, rnd(1, 2))
    stack = lambda a, b: pytree.tree_map(lambda u, v: torch.stack([u, v]), a, b)
    inf = info(0.0, 1.0)._replace(weight=torch.zeros(2), num_examples=torch.tensor([1.0, 3.0]))
    out = vmap(lambda s, d, i: alg.client_update(msg, s, d, i, rnd(1, 2), MODEL))(
        stack(states[1], states[2]), stack(data(1), data(3)), inf
    )
    assert close(out.state.alpha, [[0.2, 0.5], [0.6, 0.5]])
    assert close(out.upload.delta["s"], [[-0.1086875, -0.1645], [-0.0281875, -0.0605]])
