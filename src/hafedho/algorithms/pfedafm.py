"""pFedAFM: Adaptive Feature Mixture for Batch-Level Personalization in Heterogeneous Federated Learning.

Yi, Yu, Ren, Zhang, Wang, Liu, Li, arXiv:2404.17847 (method section: feature mixture, iterative training; the
steps below follow the abstract and the authors' code, github.com/LipingYi/pFedAFM ``FLHetero/pFedAFM.py``).

Client k holds a shared global feature extractor G(theta), its own model F_k(omega_k) + header H_k(phi_k) and a
per-dimension mixing vector alpha_k. The representation fed to the header mixes the two extractors:
    r = alpha_k (.) G(x; theta) + (1 - alpha_k) (.) F_k(x; omega_k),   y_hat = H_k(r; phi_k)
Round t, client k (S local steps in each phase, same batches):
    step 1, theta frozen:   (omega_k, phi_k) <- (omega_k, phi_k) - eta grad l(H_k(r), y)
                            alpha_k <- clip_[0,1](alpha_k - eta_alpha grad_alpha l(H_k(r), y))
    step 2, F_k, H_k frozen: theta <- theta - eta grad_theta l(H_k(G(x; theta)), y)
    upload Delta_k = theta_k - theta_t
Server: theta_{t+1} = theta_t + sum_k n_k Delta_k / sum_k n_k (FedAvg on G). Deployed model: H_k(r) above.

Symbols:
    theta (``params``)            G, the global model       eta (``lr``)                 lr of omega, phi, theta
    omega_k, phi_k (``personal``) F_k and H_k, kept local  eta_alpha (``alpha_lr``)     lr of alpha_k
    alpha_k (``alpha``)           weight of G per dim d    alpha_k^0 (``alpha_init``)   initial alpha_k
    n_k                           |D_k|, aggregation weight

Our simplification: G and F_k are both the run's model (z = ``model.features(params, x)[0]``); G is the whole
global parameter dict (the server sees no model, so it averages every tensor; G's own head is never used and
gets no gradient, only weight decay), F_k + H_k is the client's full copy with H_k = ``model.head``. alpha_k has
the dimension d of z, read at ``init_client`` from the head weight, the last 2-D parameter ([classes, d]).
With ``logreg`` (z = x, no extractor) z_G = z_F: alpha and G never move and this is local training.

Authors' code vs this file: the code writes r = a (.) z_F + (1 - a) (.) z_G, so its a = 1 - alpha_k; it starts
from a = 1 (pure local, here ``alpha_init=0``) and trains (F_k, H_k, a) jointly in step 1 (clamping a to [0, 1]),
then G through the frozen header with a = 0 (r = z_G) in step 2. It uses SGD with momentum 0.9, weight decay
1e-3 (on a too), gradient clipping at 50 and alpha lr 0.1 (0.01 in ``pFedAFM_mh.py``); here plain SGD, no decay
on alpha. Not FedAvg: with ``alpha_init=1, alpha_lr=0`` it is FedRep (shared body, personal head trained first);
with ``alpha_init=0, alpha_lr=0`` the deployed model is local training alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    FedAlgorithm,
    Model,
    Params,
    RoundInfo,
    Transform,
    hp,
    local_train,
    sgd,
    tree,
)

ALPHA = "pfedafm/alpha"  # alpha's key while it trains alongside omega, phi ("/" never occurs in parameter names)


class ServerState(NamedTuple):
    params: Params  # theta_t (G)


class Broadcast(NamedTuple):
    params: Params  # theta_t


class ClientState(NamedTuple):
    personal: Params  # omega_k, phi_k (the client's F_k + H_k)
    alpha: Tensor  # alpha_k, [d]


class Upload(NamedTuple):
    delta: Params  # Delta_k = theta_k - theta_t


def mixed_logits(model: Model, g: Params, personal: Params, alpha: Tensor, x: Tensor) -> Tensor:
    """H_k(alpha (.) G(x) + (1 - alpha) (.) F_k(x))."""
    z_g, z_f = model.features(g, x)[0], model.features(personal, x)[0]
    return model.head(personal, alpha * z_g + (1 - alpha) * z_f)


@dataclass(frozen=True, kw_only=True)
class PFedAFM(FedAlgorithm):
    name = "pfedafm"
    personalized: ClassVar[bool] = True
    alpha_lr: float = hp(0.1, "learning rate eta_alpha of the mixing vector alpha_k (authors' code: 0.1)", ge=0)
    alpha_init: float = hp(0.0, "initial alpha_k, the weight of G's features (authors' code: 0, all local)", ge=0, le=1)

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params)

    def init_client(self, params: Params) -> ClientState:
        head_w = [v for v in params.values() if v.dim() == 2][-1]  # [classes, d]
        alpha = torch.full((head_w.shape[1],), self.alpha_init, dtype=head_w.dtype)
        return ClientState({k: v.clone() for k, v in params.items()}, alpha)

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return Broadcast(server.params)

    def step1_transform(self) -> Transform:
        """SGD on (omega, phi); projected SGD alpha <- clip_[0,1](alpha - eta_alpha g) on alpha (branch-free)."""

        def update(g: Params, s: Any, p: Params) -> tuple[Params, Any]:
            u = {k: -self.lr * g[k] for k in g if k != ALPHA}
            u[ALPHA] = (p[ALPHA] - self.alpha_lr * g[ALPHA]).clamp(0.0, 1.0) - p[ALPHA]
            return u, s

        return Transform(lambda p: (), update)

    def client_update(
        self, msg: Broadcast, state: ClientState, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        theta = msg.params

        def mixed(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:  # step 1, theta frozen
            personal = {k: v for k, v in p.items() if k != ALPHA}
            f = model.loss_from_logits(personal, mixed_logits(model, theta, personal, p[ALPHA], x), y, m)
            return f, f

        res1 = local_train(mixed, {**state.personal, ALPHA: state.alpha}, data, self.step1_transform())
        alpha = res1.params[ALPHA]
        personal = {k: v for k, v in res1.params.items() if k != ALPHA}

        def through_header(g: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:  # step 2
            f = model.loss_from_logits(g, model.head(personal, model.features(g, x)[0]), y, m)
            return f, f

        res2 = local_train(through_header, theta, data, sgd(self.lr))
        metrics = {"train/loss": res1.loss, "train/global_loss": res2.loss, "train/alpha_mean": alpha.mean()}
        upload = Upload(tree.sub(res2.params, theta))
        return ClientResult(upload, info.num_examples, ClientState(personal, alpha), metrics)

    def server_update(
        self, server: ServerState, agg: Upload | None, rnd: RoundInfo
    ) -> tuple[ServerState, dict[str, float]]:
        return ServerState(tree.add(server.params, agg.delta)), {}

    def predict(self, server: ServerState, client_state: ClientState, model: Model, x: Tensor) -> Tensor:
        """The deployed personalised model H_k(alpha_k (.) G(x; theta) + (1 - alpha_k) (.) F_k(x)).

        ``eval_params`` keeps the default (theta = G with its unused, untrained head): that "global" accuracy
        is not what the paper reports.
        """
        return mixed_logits(model, server.params, client_state.personal, client_state.alpha, x)
