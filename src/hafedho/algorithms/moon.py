"""MOON: Model-Contrastive Federated Learning.

Li, He, Song, CVPR 2021, arXiv:2103.16257 (Sec. 3.3 and Algorithm 1). Each client adds a model-contrastive term
that pulls its representation of x towards the global model's and pushes it away from its own previous local
model's:

    l_con(w; x) = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    l(w; x, y)  = l_sup(w; x, y) + mu * l_con(w; x)        (cross-entropy + mu * contrastive)

Round t, cohort S_t, global model w^t:
    client i:  z = R_w(x), z_glob = R_{w^t}(x), z_prev = R_{w_i^{t-1}}(x)   (the last two are constants)
               K steps  w <- w - eta_l grad l(w; batch), starting from w = w^t
               Delta_i = w - w^t;  the client keeps w_i^{t-1} <- w (its final local model)
    server:    w^{t+1} = w^t + sum_i p_i Delta_i / sum_i p_i                  (FedAvg)

Symbols:
    w^t (``params``)     global model             mu (``mu``)       weight of the contrastive term
    w_i^{t-1} (``prev``) client's last local model tau (``tau``)     temperature
    R_w(x) = z           ``model.features(w, x)[0]``: the representation fed to the final Linear layer
    sim                  cosine similarity        p_i               |D_i| (``weighting="data_size"``) or 1

Both terms are masked means over the batch's real rows (padding rows contribute nothing), like ``model.loss``.

Representation: the paper applies l_con to the output of a projection head (Sec. 3.3; official code
``ModelFedCon``: base encoder -> Linear-ReLU-Linear projection -> final Linear), whose output is the input of the
final Linear. We use the z the model exposes, the input of its final Linear: with the model option
``projection = 256`` (``model.options.projection``, on every model of ``hafedho.models``) that is MOON's head;
without it, the encoder's output. MOON compares every method on the same network (Sec. 4.1), and the official
``main.py`` builds ``ModelFedCon`` (``use_project_head=1``) for every algorithm: the head is a setting of the
comparison, not of MOON, and the paper presets set it once for all rows. Without a head, ``logreg``'s z is the raw
input, so l_con is the constant log 2 and MOON = FedAvg.

Previous model: ``init_client`` stores the initial global model w^0, so in round 1 z_prev = z_glob, l_con is the
constant log 2 and carries no gradient: round 1 is FedAvg's bit for bit (a test) when each client runs on its own
(loop and process engines, Flower) and the model has no dropout (the two extra forwards draw dropout masks of
their own). Under the vmap engine z_prev comes from per-client (batched) weights and z_glob from shared ones, so
they can differ by float rounding, and round 1 then equals FedAvg's up to float rounding. The official code
(github.com/QinbinLi/MOON, ``main.py``) gets the same round 1 differently: its previous-model pool is still
empty (``load_first_net`` builds the copy but never appends it), so its l_con has no negative and is 0. A
client first sampled in a later round contrasts against w^0 here; the official code uses that client's own
random initialisation (every party net is initialised separately).
Other differences of the official code: SGD momentum 0.9 and weight decay 1e-5 (here: plain SGD, weight decay in
the model loss, as FedAvg); global and previous nets run in eval mode (here: the module's current mode, which
differs only for dropout, i.e. ``femnist_cnn``); a FIFO pool of ``model_buffer_size`` previous models, default 1
(here: 1). Hyperparameters: tau = 0.5 (the paper's default); mu = 1 (code default; the paper tunes mu in
{0.1, 1, 5, 10} and reports 5 for CIFAR-10, 1 for CIFAR-100 and Tiny-ImageNet).

Diff from FedAvg: the ``objective`` hook, and a client state (the previous model) that ``next_state`` keeps;
the server is FedAvg's with eta_g = 1 (``server_lr`` pinned, as the paper's). Reduces to FedAvg exactly (bit for
bit, a test) when mu = 0: the contrastive forwards are then skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hafedho.algorithms.fedavg import Broadcast, FedAvg, ServerState, Upload
from hafedho.core import (
    ClientInfo,
    LocalResult,
    Model,
    Params,
    RoundInfo,
    hp,
)
from hafedho.core.types import Objective

__all__ = ["MOON", "Broadcast", "ClientState", "ServerState", "Upload", "model_contrastive_loss"]

# ServerState (w^t), Broadcast (w^t) and Upload (Delta_i = w_i - w^t) are FedAvg's.


class ClientState(NamedTuple):
    prev: Params  # w_i^{t-1}: the client's final local model of the last round it took part in (w^0 before)


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, mask: Tensor, tau: float) -> Tensor:
    """Masked mean over rows of l_con = -log softmax([sim(z, z_glob), sim(z, z_prev)] / tau)[0].

    Written as softplus((sim_prev - sim_glob) / tau), the same value computed without overflow. Both similarities
    come from ONE cosine-similarity call on the stacked pair (z_glob, z_prev): when z_prev equals z_glob (round 1)
    their gradients with respect to z are computed identically and cancel exactly inside that call, so the term
    adds exactly 0 to the cross-entropy's gradient (two separate calls would add (g + a) - a, a rounding apart).
    """
    sims = F.cosine_similarity(z.unsqueeze(-2), torch.stack([z_glob, z_prev], dim=-2), dim=-1)  # [..., B, 2]
    per_row = F.softplus((sims[..., 1] - sims[..., 0]) / tau)
    return (per_row * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass(frozen=True, kw_only=True)
class MOON(FedAvg):
    """FedAvg with the model-contrastive term in the objective; each client keeps its last local model."""

    name = "moon"
    logs_objective = True
    server_lr: ClassVar[float] = 1.0  # not a setting: the paper's server averages
    mu: float = hp(1.0, "weight mu of the model-contrastive term (paper: 5 on CIFAR-10, 1 on CIFAR-100)", ge=0)
    tau: float = hp(0.5, "temperature tau of the contrastive loss", gt=0)

    def init_client(self, params: Params) -> ClientState:
        return ClientState({k: v.detach().clone() for k, v in params.items()})

    def objective(
        self, model: Model, msg: Broadcast, state: ClientState, info: ClientInfo, rnd: RoundInfo
    ) -> Objective:
        """``l(w) = l_sup(w) + mu l_con(w)``; w^t and w_i^{t-1} are constants, w carries the gradient."""
        w_t, prev, mu, tau = msg.params, state.prev, self.mu, self.tau

        def objective(w: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            z, logits = model.features(w, x)
            f = model.loss_from_logits(w, logits, y, m)
            if mu == 0.0:  # a hyperparameter, not a tensor: FedAvg exactly, without the two extra forwards
                return f, f
            # w_t and prev are constants of this objective: grad (w.r.t. w only) never flows into them
            z_glob, _ = model.features(w_t, x)
            z_prev, _ = model.features(prev, x)
            return f + mu * model_contrastive_loss(z, z_glob, z_prev, m, tau), f

        return objective

    def next_state(
        self, state: ClientState, res: LocalResult, delta: Params, info: ClientInfo, rnd: RoundInfo
    ) -> ClientState:
        """The client keeps its final local model as the next round's w_i^{t-1}."""
        return ClientState(res.params)
