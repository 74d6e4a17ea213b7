"""The server's side of every round, one owner for each piece, shared by the simulator and the Flower strategy.

A runtime only moves messages. Per round it calls

    rnd, msg = server_rounds.begin(t, m)             broadcast of the server state (the round's clock starts)
    ... the cohort runs (an engine, or Flower nodes), streamed into a ``CohortStream`` in client-id order ...
    row = server_rounds.finish_round(t, out, m', r)  server_update (skipped when nobody reported), divergence, row
    server_rounds.evaluate(t, row, ...)              global (and pooled personal) accuracy on evaluation rounds
    server_rounds.commit(t, row, store)              the row into metrics.jsonl, a checkpoint on checkpoint rounds

(m: sampled clients, m': those whose uploads were aggregated, r: those the broadcast reached) and writes
``run_facts`` into ``run.json`` once per run.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hafedho.core import ConfigError, RoundInfo, tree
from hafedho.core.model import evaluate
from hafedho.experiment import Experiment
from hafedho.runtime.rundir import RunDir
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult


class Divergence(RuntimeError):
    """Training produced a non-finite loss or model, or blew up early; the last good checkpoint is kept."""


# The early blow-up guard: a local lr too large for the model can send the loss far above its starting value in
# the first rounds and leave accuracy at chance for many rounds without any non-finite number (resnet18_gn at
# lr 0.05: mean local loss 6.47 after round 1, from 2.30). A round among the first BLOWUP_ROUNDS whose mean local
# loss (``train/loss``) exceeds BLOWUP_FACTOR times the initial model's loss ends the run as diverged.
BLOWUP_FACTOR = 2.0
BLOWUP_ROUNDS = 10
START_LOSS_SAMPLES = 1024  # the initial loss: on this many training samples spread evenly over the training set


def run_facts(exp: Experiment, warn: Callable[[str], None], **extra: Any) -> dict[str, Any]:
    """What ``run.json`` records once per run: lambda (the most local steps of any client), the algorithm's
    ``run_notes(lambda)`` and the warnings they raised, each also passed to ``warn``."""
    lam = int(max(exp.plan.steps_for(int(n)) for n in exp.fed.sizes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notes = exp.alg.run_notes(lam)
    texts = [str(w.message) for w in caught]
    s, n = exp.cfg.sampling, exp.fed.num_clients
    if s.mode == "bernoulli" and s.prob * n < 1:  # most rounds would train nobody, without a word
        texts.append(
            f"sampling.prob={s.prob:g} with {n} clients: the expected cohort is {s.prob * n:.2g} clients, so most "
            f"rounds train nobody; raise sampling.prob to at least {1 / n:.2g} for one client a round on average"
        )
    for text in texts:
        warn(text)
    return {"notes": notes, "warnings": texts, "lambda": lam, **extra}


@torch.no_grad()
def client_accuracy(exp: Experiment, server: Any, cid: int, state: Any) -> tuple[int, int]:
    """``(correct, total)`` of client ``cid``'s deployed model (``alg.predict``) on its held-out local data."""
    fed, model = exp.fed, exp.model
    idx = fed.local_test[cid] if fed.local_test is not None else []
    if len(idx) == 0:
        return 0, 0
    was_training = model.module.training
    model.module.eval()
    x, y = fed.rows(idx)
    logits = exp.alg.predict(server, state, model, x)
    model.module.train(was_training)
    return int((logits.argmax(1) == y).sum()), len(idx)


def pooled_accuracy(counts: Iterable[tuple[int, int]]) -> float:
    """Accuracy pooled over clients from their ``(correct, total)``."""
    correct = total = 0
    for c, n in counts:
        correct, total = correct + c, total + n
    return correct / max(total, 1)


def personal_accuracy(exp: Experiment, server: Any, state_of: Callable[[int], Any]) -> float:
    """Accuracy of each client's deployed model on its own held-out data, pooled over clients.

    For personalised algorithms this is the paper's metric; it is not comparable with global-model accuracy.
    """
    local = exp.fed.local_test or []
    return pooled_accuracy(client_accuracy(exp, server, c, state_of(c)) for c in range(len(local)) if len(local[c]))


def _pair(result: Any, name: str) -> tuple[Any, dict[str, float]]:
    """``server_update``'s ``(state, metrics)``, or one line saying what it returned instead."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result
    what = f"a tuple of {len(result)}" if type(result) is tuple else type(result).__name__
    raise ConfigError(
        f"algorithm {name}: server_update returned {what}; it must return (next server state, metrics dict), "
        "e.g. return ServerState(...), {}"
    )


class ServerRounds:
    """The server state of a run and the bookkeeping of each of its rounds (see the module docstring).

    Args:
        exp: the experiment.
        server: the server state to continue from (``alg.init_server``, or a checkpoint's).
        run_dir: where rows and checkpoints go; None = write nothing.
        start: the first round to run (rounds before it are in the checkpoint).
        wall: training seconds so far (evaluation excluded).
        checkpoint_extra: runtime facts saved with each checkpoint beside ``wall_s``.
    """

    def __init__(
        self,
        exp: Experiment,
        server: Any,
        run_dir: RunDir | None,
        start: int = 1,
        wall: float = 0.0,
        checkpoint_extra: dict[str, Any] | None = None,
    ) -> None:
        self.exp, self.server, self.run_dir, self.wall = exp, server, run_dir, wall
        self.checkpointed = start - 1  # the round of the last checkpoint taken, 0 = none
        self.durable = start - 1  # the round of the last checkpoint known to be on disk (the one before is written)
        self.checkpoint_extra = dict(checkpoint_extra or {})
        self.rows: list[dict[str, Any]] = []  # every row committed by this process
        self._t0 = time.perf_counter()
        self._msg_bytes = 0  # of this round's broadcast
        self._test: tuple[torch.Tensor, torch.Tensor] | None = None
        self._start_loss: float | None = None
        self._hook_of: dict[str, str] = {}  # the last round's metrics: the hook that returned each

    def begin(self, t: int, cohort_size: int) -> tuple[RoundInfo, Any]:
        """Round ``t`` starts with ``cohort_size`` sampled clients: its ``RoundInfo`` and the broadcast."""
        self._t0 = time.perf_counter()
        rnd = RoundInfo(t, self.exp.fed.num_clients, cohort_size)
        msg = self.exp.alg.broadcast(self.server, rnd)
        self._msg_bytes = tree.num_bytes(msg)
        return rnd, msg

    def untimed(self, seconds: float) -> None:
        """Leave ``seconds`` of this round (a simulator-only measurement: ``[diagnostics]``) out of ``wall_s``."""
        self._t0 += seconds

    def finish_round(self, t: int, out: CohortResult, reported: int, reached: int, **extra: Any) -> dict[str, Any]:
        """Round ``t``'s cohort is in: ``server_update`` with m = ``reported``, the divergence check, and the
        metrics row (cohort means of the clients' metrics, server metrics, ``extra``, wall time, the bytes
        uploaded and the broadcast's bytes times the ``reached`` clients).

        Nobody reported (``out.aggregate`` is None): the round did not happen, the server state stays.
        """
        alg = self.exp.alg
        server_metrics: dict[str, float] = {}
        if out.aggregate is not None:
            rnd = RoundInfo(t, self.exp.fed.num_clients, reported)
            self.server, server_metrics = _pair(alg.server_update(self.server, out.aggregate, rnd), type(alg).__name__)
        row: dict[str, Any] = {"round": t, "cohort_size": reported, **out.metrics, **server_metrics, **extra}
        # which hook returned each metric, for ``_check_finite``'s message
        self._hook_of = {
            **dict.fromkeys(out.metrics, "client_update"),
            **dict.fromkeys(server_metrics, "server_update"),
        }
        self._check_finite(t, row)
        self._check_blowup(t, row)
        self.wall += time.perf_counter() - self._t0
        row.update({"wall_s": round(self.wall, 4), "bytes_up": out.bytes_up, "bytes_down": reached * self._msg_bytes})
        return row

    def _check_finite(self, t: int, row: dict[str, Any]) -> None:
        """A non-finite number in the row or the global model ends the run as diverged; but a non-finite metric
        beside a finite model and finite losses is the metric's own: one line naming it and the hook that
        returned it, not a hint at the lr."""
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        finite_model = tree.all_finite(self.exp.alg.eval_params(self.server))
        if not bad and finite_model:
            return
        what = f"{bad[0]} is {row[bad[0]]}" if bad else "the global model has non-finite values"
        if finite_model and bad[0] in self._hook_of and not any("loss" in k for k in bad):
            hook = self._hook_of[bad[0]]
            name = type(self.exp.alg).__name__
            self._diverged(
                t,
                what,
                f"algorithm {name}'s {hook} returned it as a metric while the global model and the losses are "
                "finite: fix how the algorithm computes that metric",
                lead="run stopped",
            )
        self._diverged(t, what, "lower algorithm.lr or the algorithm's coefficients")

    def _check_blowup(self, t: int, row: dict[str, Any]) -> None:
        loss = row.get("train/loss")
        if t > BLOWUP_ROUNDS or not isinstance(loss, float):
            return
        start = self.start_loss()
        if loss > BLOWUP_FACTOR * start:
            what = f"the mean local loss {loss:.4g} exceeds {BLOWUP_FACTOR:g}x the initial model's {start:.4g}"
            # the lr is the usual cause, but not the only one (HaFedHo with lambda*mu >= 1 blows up at any lr)
            hint = f"algorithm.lr = {self.exp.alg.lr:g}, or a coefficient of the algorithm, is too large here: lower it"
            self._diverged(t, what, hint)

    def _diverged(self, t: int, what: str, hint: str, lead: str = "run diverged") -> None:
        kept = self.run_dir is not None and self.checkpointed > 0
        # relative to the results root: the marker and the reports quoting it name no machine's path
        good = f"round {self.checkpointed} in {self.run_dir.path.name}/checkpoint.pt" if kept else "none"
        text = f"{lead} at round {t}: {what} ({hint}); last good checkpoint: {good}"
        if self.run_dir is not None:
            self.run_dir.mark_diverged(text)
        raise Divergence(text)

    def start_loss(self) -> float:
        """The initial model's mean cross-entropy on ``START_LOSS_SAMPLES`` training samples spread evenly over the
        training set (computed once; the same on resume, since the model's initial parameters are the seed's)."""
        if self._start_loss is None:
            fed = self.exp.fed
            n = len(fed.y_train)
            rows = torch.linspace(0, n - 1, min(n, START_LOSS_SAMPLES)).round().long()
            ev = evaluate(self.exp.model, self.exp.model.params(), *fed.rows(rows))
            self._start_loss = float(ev["loss"])
        return self._start_loss

    def is_eval_round(self, t: int) -> bool:
        return t % self.exp.cfg.eval_every == 0 or t == self.exp.cfg.rounds

    def evaluate(self, t: int, row: dict[str, Any], state_of: Callable[[int], Any] | None = None) -> dict | None:
        """On evaluation rounds: the global model's test accuracy and loss into ``row`` (returned), and with
        held-out local data and each client's state (``state_of``) the pooled personal accuracy. Else None."""
        if not self.is_eval_round(t):
            return None
        fed = self.exp.fed
        if self._test is None:
            self._test = fed.test_set()
        ev = evaluate(self.exp.model, self.exp.alg.eval_params(self.server), *self._test)
        row.update({"test/acc": ev["acc"], "test/loss": ev["loss"]})
        if fed.local_test is not None and state_of is not None:
            row["test/personal_acc"] = personal_accuracy(self.exp, self.server, state_of)
        return ev

    def commit(self, t: int, row: dict[str, Any], store: ClientStore | None = None) -> None:
        """Log round ``t``'s row; on checkpoint rounds save the server state (and ``store``, the client states)."""
        self.rows.append(row)
        if self.run_dir is None:
            return
        self.run_dir.append(row)
        if t % self.exp.cfg.checkpoint_every == 0 or t == self.exp.cfg.rounds:
            self.run_dir.save_checkpoint(t, self.server, store, {"wall_s": self.wall, **self.checkpoint_extra})
            self.durable, self.checkpointed = self.checkpointed, t  # saving t waited for the previous write
