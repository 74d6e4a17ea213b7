"""HaFedHo: Harmonizing Federated Heterogeneous Optimization via Adaptive Objective Rectification.

Algorithm 1 of the paper, as written. Each sampled client minimises a *rectified* objective built from the
previous round's aggregated gradient, so local steps imitate centralised training:

    phi_i(w) = f_i(w) + mu * ( f_hat + h^T (w - w_t) )

Round t, broadcast (w_t, g^{t-1}, f_hat^{t-1}); client i with weight p_i = |D_i| / |D|:
    if i was sampled in round t-1 (self-correction: remove the client's own contribution):
        h = g^{t-1} - p_i g_i^{t-1},     f_hat = f_hat^{t-1} - p_i f_hat_i^{t-1}
    else:
        h = g^{t-1},                     f_hat = f_hat^{t-1}
    lambda local SGD steps  w^{(t,k+1)} = w^{(t,k)} - eta_l grad phi_i(w^{(t,k)})
    upload  g_i^t = sum_k grad phi_i(w^{(t,k)}),   f_hat_i^t = mean_k f_i(w^{(t,k)})
Server:
    g^t = (1/m) sum_i g_i^t,   f_hat^t = (1/m) sum_i f_hat_i^t,   w_{t+1} = w_t - eta g^t

Symbols:
    w_t (``params``)      global model             mu (``mu``)         rectification strength
    g^t (``g``)           aggregated gradient      lambda              local steps (the runtime's local_steps)
    f_hat^t (``f_hat``)   aggregated mean loss     eta_l (``lr``)      local learning rate
    h                     rectification direction  eta (``eta``)       server step; None = eta_l
    g_i, f_hat_i          client's last upload     p_i                 client weight |D_i|/|D|

Facts (each is a test):
    * grad phi_i = grad f_i + mu h: the mu f_hat term is a constant and never moves a parameter; it only
      changes the logged objective value.
    * With eta = eta_l and accumulate="phi", w_{t+1} is the mean of the clients' final models (up to float
      rounding, as below).
    * Since g_i contains lambda mu h, g^t ~ G^t + lambda mu g^{t-1} (G^t: the mean over the cohort of
      sum_k grad f_i along the local steps; exact, to float64 round-off, with self_correction off): the literal
      algorithm is heavy-ball momentum with factor lambda*mu and is stable only while lambda*mu < 1 (logged;
      warned at >= 1).
    * mu = 0 reduces to FedAvg with uniform weights (``fedavg`` with weighting="uniform") up to float rounding,
      not bit for bit: the local steps are identical (the rectification adds 0 * h, exactly 0), but FedAvg
      averages y_i - w_t while HaFedHo steps w_t - eta g^t along the averaged gradient sums, and the two round
      differently. One round from the same w_t (eta = eta_l) differs per entry by at most (3 lambda + 8) u S,
      u = eps/2 the unit roundoff of the dtype (2^-24 in float32) and S the largest magnitude among w_t, the
      clients' local iterates and eta times their gradient sums (the rounding of lambda local steps, the delta,
      the average and the server step on each side).

Momentum twin: with accumulate="phi" this is FedAvgM's server recursion (``fedavgm``, beta = lambda*mu, uniform
weights, server_lr = eta / eta_l, the same lr), except that the local steps also move along -eta_l mu h (a
look-ahead, which on a quadratic turns the momentum into mu sum_{k<lambda} (I - eta_l H)^k) and the
self-correction term. The paper study puts that twin beside every HaFedHo run (``hafedho_paper.twin``, study/); the
derivation and measured gap are in docs/algorithms.md, "HaFedHo's momentum twin" (tests/test_twin.py).

Switches for the paper's inconsistencies and ablations (defaults follow Algorithm 1):
    accumulate       "phi": g_i sums grad phi_i (objective rectification, Algorithm 1);
                     "f": g_i sums grad f_i (gradient rectification, the ablation of Fig. 3). Local steps
                     are identical; only the upload differs.
    aggregation      "uniform": 1/m as Algorithm 1 writes; "data_size": weights |D_i| as in the analysis.
    self_correction  remove the client's own stale contribution when it was sampled in round t-1.
    mu_schedule      "constant" (the experiments) or "inverse_round": mu_t = mu / t (the analysis).
    h_source         "aggregate": h from the stale aggregate g^{t-1} (Algorithm 1); "exact": Proposition 1's ideal,
                     the method Algorithm 1 approximates, simulation only: h = lambda (G(w_t) - r_i a_i grad f_i(w_t))
                     with G(w_t) = sum_j a_j grad f_j(w_t) over ALL N clients' training data at w_t (a_j = 1/N for
                     aggregation="uniform", p_j for "data_size"), r_i = 1 with self_correction (always: the exact
                     G contains every client's share), lambda the client's local steps; f_hat likewise,
                     sum_j a_j f_j(w_t) - r_i a_i f_i(w_t). The simulator delivers (G, sum_j a_j f_j) with the
                     broadcast (``ExactBroadcast``, ``attach_full_gradient``, handed over by ``diagnostics()``);
                     the client removes its own share from its whole local data (one extra pass,
                     ``needs_full_pass``). docs/algorithms.md, "Theorem 1 measured / Proposition 1's ideal".
                     "exact_matched": the same ideal at the practical h's strength, h = lambda (G(w_t) - r_i a_i
                     grad f_i(w_t)) / (1 - lambda mu_t) (its fixed point below); refused for lambda mu >= 1.

Theorem 1 measured: ``estimate`` (handed over by ``diagnostics()``, the contract's optional extension
``core.diagnostics``) gives the ``[diagnostics]`` pass (``hafedho.sim.fullgrad``) the h a client uses, the target it
stands for, T_i = G(w_t) - r_i a_i grad f_i(w_t) (the other clients' share; r_i = 1 when h removes the client's own),
and h's steady-state reference h_i^*: Algorithm 1's recursion frozen at w_t with every client uploading its exact
gradients every round (noise-free, full participation, local iterates at w_t):
    g_j = lambda_j (grad f_j + mu h_j),   h_j = g - r p_j g_j,   g = sum_j a_j g_j      (mu = mu_{t-1}, r = 1 with
                                                                                          self-correction, else 0)
    => g_j = beta_j lambda_j (grad f_j + mu g),  beta_j = 1 / (1 + r lambda_j mu p_j)
    => g^* = sum_j a_j beta_j lambda_j grad f_j / (1 - mu sum_j a_j beta_j lambda_j)
    => h_i^* = g^* - r_i p_i g_i^* = beta_i (g^* - r_i p_i lambda_i grad f_i)
(accumulate="f": the mu h term is not uploaded, so mu = 0 in g_j and beta_j = 1; no fixed point when the
denominator is <= 0: it is replaced by 1). h_i^* is not s T_i for any scalar s: h removes its own share at
lambda_i p_i, the aggregate grows by the momentum 1 / (1 - lambda mu), and the whole is shrunk by beta_i; the legacy
scale s = lambda / (1 - lambda mu) (``Estimate.scale``, diag/h_rel_err) leaves that mismatch as an error floor.

Diff from FedAvg: the objective adds mu (f_hat + h^T (w - w_t)); everything else differs too (the broadcast carries
g and f_hat, clients upload gradient sums and keep their last upload, the server steps along g with its own
``eta`` and ``aggregation``), so HaFedHo shares no state with FedAvg and subclasses ``FedAlgorithm`` directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    Diagnostics,
    Estimate,
    FedAlgorithm,
    Model,
    Params,
    RoundInfo,
    aggregation_weight,
    full_gradient,
    hp,
    local_train,
    sgd,
    tree,
)


class ServerState(NamedTuple):
    params: Params  # w_t
    g: Params  # g^{t-1}
    f_hat: Tensor  # f_hat^{t-1}, 0-d


Broadcast = ServerState  # the wire payload is the whole server state (w_t, g^{t-1}, f_hat^{t-1})


class ExactBroadcast(NamedTuple):
    """The broadcast of h_source="exact": w_t and the simulator's full-data target at w_t (``attach_full_gradient``)."""

    params: Params  # w_t
    grad: Params  # G(w_t) = sum_j a_j grad f_j(w_t) over all N clients
    f: Tensor  # sum_j a_j f_j(w_t), 0-d


class ClientState(NamedTuple):
    g_i: Params  # g_i from the last round this client took part in
    f_hat_i: Tensor  # f_hat_i from that round, 0-d
    last_round: Tensor  # that round (int64, 0-d); -1 = never


class Upload(NamedTuple):
    g_i: Params
    f_hat_i: Tensor


@dataclass(frozen=True, kw_only=True)
class HaFedHo(FedAlgorithm):
    name = "hafedho"
    mu: float = hp(0.01, "rectification strength mu", ge=0)
    eta: float | None = hp(None, "server step eta in w <- w - eta g; None = the local lr", gt=0)
    accumulate: str = hp("phi", "what g_i sums: grad phi (objective) or grad f (gradient)", choices=("phi", "f"))
    aggregation: str = hp("uniform", "server weights: 1/m or |D_i|", choices=("uniform", "data_size"))
    self_correction: bool = hp(True, "subtract p_i g_i when the client was sampled in round t-1")
    mu_schedule: str = hp("constant", "mu_t = mu or mu / t", choices=("constant", "inverse_round"))
    h_source: str = hp(
        "aggregate",
        "h: the stale aggregate g^{t-1} (Algorithm 1), the exact lambda * gradient of the other clients' share at "
        "w_t (Proposition 1's ideal; simulation only), or that ideal / (1 - lambda mu), the practical h's strength",
        choices=("aggregate", "exact", "exact_matched"),
    )

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, tree.zeros_like(params), torch.zeros(()))

    def init_client(self, params: Params) -> ClientState:
        return ClientState(tree.zeros_like(params), torch.zeros(()), torch.tensor(-1, dtype=torch.int64))

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return server

    def mu_at(self, t: int) -> float:
        return self.mu / t if self.mu_schedule == "inverse_round" else self.mu

    @property
    def needs_full_pass(self) -> bool:
        return self.h_source != "aggregate"  # the client's own share grad f_i(w_t), from its whole local data

    def diagnostics(self) -> Diagnostics:
        """Theorem 1 measured (``estimate``, ``diagnostic_weightings``) and, for the exact sources, the simulator's
        full-data gradient in the broadcast (``attach_full_gradient``)."""
        exact = self.attach_full_gradient if self.h_source != "aggregate" else None
        return Diagnostics(self.estimate, self.diagnostic_weightings, exact, name="h")  # diag/h_cos, ...

    def attach_full_gradient(self, msg: Broadcast, full: dict[str, tuple[Params, Tensor]]) -> ExactBroadcast:
        grad, f = full[self.aggregation]
        return ExactBroadcast(msg.params, grad, f)

    def share(self, info: ClientInfo, rnd: RoundInfo) -> Tensor:
        """a_i, client i's share of the target G = sum_j a_j grad f_j: p_i ("data_size") or 1/N ("uniform")."""
        return info.weight if self.aggregation == "data_size" else torch.full_like(info.weight, 1 / rnd.num_clients)

    def rectification(
        self,
        msg: Broadcast | ExactBroadcast,
        state: ClientState,
        info: ClientInfo,
        rnd: RoundInfo,
        own: tuple[Params, Tensor] | None = None,
        steps: Tensor | float = 0.0,
    ) -> tuple[Params, Tensor, Tensor]:
        """``(h, f_hat, removed)``: the rectification the client uses in round ``rnd``; ``removed`` (bool, 0-d) says
        whether the client's own share was taken out. The exact sources need ``own = (grad f_i(w_t), f_i(w_t))`` and
        ``steps`` = lambda."""
        if self.h_source != "aggregate":
            if not isinstance(msg, ExactBroadcast) or own is None:
                raise ValueError(
                    "hafedho: h_source='exact' needs the simulator's full-data gradient in the broadcast "
                    "(attach_full_gradient; simulation only): run it with `hafedho run`, or set h_source='aggregate'"
                )
            removed = torch.tensor(self.self_correction)
            a = self.share(info, rnd) * float(self.self_correction)
            if self.h_source == "exact_matched":  # the practical h's fixed point lambda T / (1 - lambda mu)
                steps = steps / (1 - steps * self.mu_at(rnd.round))
            h = tree.scale(tree.axpy(-a, own[0], msg.grad), steps)
            return h, msg.f - a * own[1], removed
        # Branch-free self-correction (vmap-safe): c = p_i if sampled in round t-1, else 0.
        prev = (state.last_round == rnd.round - 1) & torch.tensor(self.self_correction)
        c = torch.where(prev, info.weight, torch.zeros_like(info.weight))
        h = tree.axpy(-c, state.g_i, msg.g)
        return h, msg.f_hat - c * state.f_hat_i, prev

    def diagnostic_weightings(self, p: np.ndarray, steps: np.ndarray, rnd: RoundInfo) -> dict[str, np.ndarray]:
        """w_j = a_j beta_j lambda_j (module docstring), for the steady-state reference's sum; none for the exact
        sources, whose reference is their definition."""
        if self.h_source != "aggregate":
            return {}
        a = p if self.aggregation == "data_size" else np.full_like(p, 1.0 / len(p))
        mu = self.mu_at(max(rnd.round - 1, 1)) if self.accumulate == "phi" else 0.0  # h was uploaded with mu_{t-1}
        beta = 1.0 / (1.0 + float(self.self_correction) * steps * mu * p)
        return {"hafedho/steady": a * beta * steps}

    def estimate(
        self,
        msg: Broadcast | ExactBroadcast,
        state: ClientState,
        info: ClientInfo,
        rnd: RoundInfo,
        full: dict[str, tuple[Params, Tensor]],
        own: tuple[Params, Tensor],
        steps: int,
    ) -> Estimate:
        """Theorem 1 measured: h as ``client_update`` uses it, T_i = G(w_t) - r_i a_i grad f_i(w_t), the legacy
        scalar scale s (lambda / (1 - lambda mu_{t-1}) for accumulate="phi" while lambda mu < 1, else lambda; for
        the exact sources their own factor), the steady-state reference h_i^* of the module docstring (for the exact
        sources their definition, s T_i) and coef = mu_t, the factor h enters phi_i with."""
        h, _, removed = self.rectification(msg, state, info, rnd, own, float(steps))
        grad, _ = full[self.aggregation]
        r = removed.to(info.weight.dtype)
        target = tree.axpy(-(r * self.share(info, rnd)), own[0], grad)
        mu_prev = self.mu_at(max(rnd.round - 1, 1))
        lam_mu = steps * mu_prev
        coef = self.mu_at(rnd.round)
        if self.h_source != "aggregate":
            scale = steps / (1 - steps * coef) if self.h_source == "exact_matched" else float(steps)
            return Estimate(h, target, scale, tree.scale(target, scale), coef)
        steady = self.accumulate == "phi" and lam_mu < 1
        scale = steps / (1 - lam_mu) if steady else float(steps)
        mu = mu_prev if self.accumulate == "phi" else 0.0
        wsum, total = full["hafedho/steady"]
        den = 1 - mu * float(total)
        g_star = tree.scale(wsum, 1 / den if den > 0 else 1.0)  # no fixed point when den <= 0
        beta = 1 / (1 + r * steps * mu * info.weight)
        reference = tree.scale(tree.axpy(-(r * info.weight * steps), own[0], g_star), beta)
        return Estimate(h, target, scale, reference, coef)

    def client_update(
        self, msg: Broadcast, state: ClientState, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        w_t, mu = msg.params, self.mu_at(rnd.round)
        own, steps = None, 0.0
        if self.h_source != "aggregate":  # the client's own share at w_t, and lambda = its real local steps
            own = full_gradient(model, w_t, self.full_data(data))
            steps = (data.mask.flatten(1).sum(1) > 0).to(info.weight.dtype).sum()
        h, f_hat, _ = self.rectification(msg, state, info, rnd, own, steps)

        def phi(w: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            f = model.loss(w, x, y, m)
            return f + mu * (f_hat + tree.dot(h, tree.sub(w, w_t))), f

        res = local_train(phi, w_t, data, sgd(self.lr))
        # grad phi = grad f + mu h at every real step, so sum grad f = sum grad phi - K mu h (up to rounding).
        g_i = res.grad_sum if self.accumulate == "phi" else tree.axpy(-mu * res.steps, h, res.grad_sum)
        weight = aggregation_weight(info, self.aggregation)
        new_state = ClientState(g_i, res.loss, torch.full_like(state.last_round, rnd.round))
        metrics = {"train/loss": res.loss, "train/objective": res.objective}
        return ClientResult(Upload(g_i, res.loss), weight, new_state, metrics)

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        eta = self.lr if self.eta is None else self.eta
        params = tree.axpy(-eta, agg.g_i, server.params)
        return ServerState(params, agg.g_i, agg.f_hat_i), {"server/g_norm": float(tree.sq_norm(agg.g_i).sqrt())}

    def run_notes(self, local_steps: int) -> dict[str, float]:
        lam_mu = local_steps * self.mu
        if self.h_source == "exact_matched" and lam_mu >= 1:
            raise ValueError(
                f"hafedho: h_source='exact_matched' scales h by 1 / (1 - lambda*mu), undefined at lambda*mu = "
                f"{local_steps}*{self.mu} = {lam_mu:g} >= 1; lower algorithm.hafedho.mu or clients.local_steps"
            )
        if lam_mu >= 1:
            warnings.warn(
                f"hafedho: lambda*mu = {local_steps}*{self.mu} = {lam_mu:g} >= 1: the rectified update acts as "
                "heavy-ball momentum with that factor and may diverge; lower mu where it is set "
                "(algorithm.hafedho.mu or algorithm.mu) or clients.local_steps",
                stacklevel=2,
            )
        return {"lambda_mu": lam_mu}
