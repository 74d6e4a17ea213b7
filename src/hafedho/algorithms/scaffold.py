"""SCAFFOLD: Stochastic Controlled Averaging for Federated Learning.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020, arXiv:1910.06378 (Algorithm 1, Eqs. (3)-(5)).

Round t, cohort S of m clients out of N; server state (x, c), client state c_i (0 before its first round):
    client i:  y_i <- x;  K_i steps  y_i <- y_i - eta_l (g_i(y_i) - c_i + c)
               c_i+ = c_i - c + (x - y_i) / (K_i eta_l)            (option II, the default)
               c_i+ = grad f_i(x)  over ALL of the client's local data  (option I: "an additional pass over
                      the local data to compute the gradient at the server model x"; ``data.full``)
               upload (Delta y_i, Delta c_i) = (y_i - x, c_i+ - c_i);  c_i <- c_i+
    server:    x <- x + eta_g (1/m) sum_i Delta y_i
               c <- c + (m/N) (1/m) sum_i Delta c_i                 (= (1/N) sum_i Delta c_i)

Symbols:
    x (``params``)       global model                eta_l (``lr``)         local learning rate
    c (``c``)            server control variate      eta_g (``server_lr``)  global step size
    c_i (``c_i``)        client control variate      K_i                    the client's REAL step count
    m, N                 uploads aggregated, population (``rnd.cohort_size``, ``rnd.num_clients``)

Facts (each is a test): the uploads are averaged uniformly, as Algorithm 1 writes; K_i counts real steps
(padded steps are no-ops and are not counted); a client with K_i = 0 keeps c_i (branch-free guard) and
uploads zeros; clients not sampled keep c_i exactly; c = (1/N) sum_i c_i at every round.
Known bugs avoided: c_i overwritten before Delta c_i is computed (Delta c = 0), the correction applied with
the wrong sign, only the last client's control variate aggregated, K counted in examples instead of steps.
Option I's gradient is the masked mean over every local row once, at x, whatever the round's plan (a partial
last batch weighs per row, rows the steps never drew count); the runtime builds that data for it
(``needs_full_pass``).
The authors released no code; the FedDyn authors' re-implementation (github alpemreacar/FedDyn) scales c by
1/(N p_i) and Delta c_i by N p_i and clips gradients, which is not Algorithm 1 and is not offered here.

Diff from FedAvg: the ``transform`` hook (the shift ``+ c - c_i``), the control variates in the broadcast, the
client state, the upload and the server; weights are uniform (``weighting`` pinned, as Algorithm 1 writes).
Reduces to FedAvg with uniform weights (and eta_g) while c = c_i = 0, e.g. in the first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from hafedho.algorithms.fedavg import FedAvg
from hafedho.core import (
    ClientData,
    ClientInfo,
    ClientResult,
    Model,
    Params,
    RoundInfo,
    Transform,
    aggregation_weight,
    chain,
    full_gradient,
    hp,
    sgd,
    shift,
    tree,
)


class ServerState(NamedTuple):
    params: Params  # x
    c: Params  # server control variate c


Broadcast = ServerState  # the wire payload is (x, c)


class ClientState(NamedTuple):
    c_i: Params  # client control variate, zeros before the client's first round


class Upload(NamedTuple):
    dy: Params  # Delta y_i = y_i - x
    dc: Params  # Delta c_i = c_i+ - c_i


@dataclass(frozen=True, kw_only=True)
class SCAFFOLD(FedAvg):
    """FedAvg's local steps on the corrected gradient ``g - c_i + c``, with control variates."""

    name = "scaffold"
    weighting: ClassVar[str] = "uniform"  # not a setting: Algorithm 1 averages uniformly
    server_lr: float = hp(1.0, "global step size eta_g applied to the mean Delta y", gt=0)
    control: str = hp(
        "option2",
        "c_i+ rule: option2 (from the local trajectory) or option1 (grad f_i(x) over all local data, one extra pass)",
        choices=("option2", "option1"),
    )

    @property
    def needs_full_pass(self) -> bool:
        return self.control == "option1"

    def init_server(self, params: Params) -> ServerState:
        return ServerState(params, tree.zeros_like(params))

    def init_client(self, params: Params) -> ClientState:
        return ClientState(tree.zeros_like(params))

    def broadcast(self, server: ServerState, rnd: RoundInfo) -> Broadcast:
        return server

    def transform(self, msg: Broadcast, state: ClientState, info: ClientInfo, rnd: RoundInfo) -> Transform:
        """``-eta_l (g - c_i + c)``: the shift by the constant ``c - c_i``, then FedAvg's SGD."""
        return chain(shift(tree.sub(msg.c, state.c_i)), sgd(self.lr))

    def client_update(
        self, msg: Broadcast, state: ClientState, data: ClientData, info: ClientInfo, rnd: RoundInfo, model: Model
    ) -> ClientResult:
        x, c, c_i = msg.params, msg.c, state.c_i
        res = self.train(msg, state, data, info, rnd, model)
        k = res.steps  # real steps K_i (0-d float)
        if self.control == "option2":
            new = tree.axpy(1.0 / (k.clamp(min=1.0) * self.lr), tree.sub(x, res.params), tree.sub(c_i, c))
        else:
            new, _ = full_gradient(model, x, self.full_data(data))
        c_plus = tree.where(k > 0, new, c_i)  # K_i = 0: nothing was learnt, keep c_i
        upload = Upload(tree.sub(res.params, x), tree.sub(c_plus, c_i))
        weight = aggregation_weight(info, self.weighting)
        return ClientResult(upload, weight, ClientState(c_plus), self.train_metrics(res))

    def server_update(self, server: ServerState, agg: Upload, rnd: RoundInfo) -> tuple[ServerState, dict[str, float]]:
        params = tree.axpy(self.server_lr, agg.dy, server.params)
        c = tree.axpy(rnd.cohort_size / rnd.num_clients, agg.dc, server.c)
        return ServerState(params, c), {"server/c_norm": float(tree.sq_norm(c).sqrt())}
