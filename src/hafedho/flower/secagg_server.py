"""The server's half of SecAgg+ (``flower/secagg.py`` has the protocol, its settings and the client's half):
``SecureRounds`` runs a strategy's rounds with flwr's ``SecAggPlusWorkflow`` in place of the plain train exchange,
through a legacy-strategy shim, and turns SecAgg+'s mean of the clients' vectors back into the algorithm's
weighted aggregate with its quantisation bound."""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import FitIns, FitRes, log, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp import Grid
from torch.utils import _pytree as pytree

from hafedho.config import ConfigError
from hafedho.core import tree
from hafedho.flower import codec
from hafedho.flower.secagg import (
    CLIP,
    CLIPPED,
    PID,
    ROUND,
    STATE_LOST,
    WEIGHT_SCALE,
    SecAggSettings,
    aggregate_error_bound,
    check_algorithm,
    delta,
    weight_scale,
)
from hafedho.runtime.work import CohortResult


def _legacy_strategy() -> Any:
    """The legacy Strategy SecAggPlusWorkflow calls: it hands over the round's FitIns and keeps the results."""
    from flwr.server.strategy import Strategy

    class RoundShim(Strategy):
        def __init__(self) -> None:
            self.fit_ins: list[tuple[Any, FitIns]] = []
            self.results: list[tuple[Any, FitRes]] = []
            self.failures: list[Any] = []

        def initialize_parameters(self, client_manager: Any) -> None:
            return None

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list:
            return self.fit_ins

        def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
            self.results, self.failures = list(results), list(failures)
            return None, {}

        def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any) -> list:
            return []

        def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
            return None, {}

        def evaluate(self, server_round: int, parameters: Any) -> None:
            return None

    return RoundShim()


def aggregate_of(vector: list[np.ndarray], like: Any) -> tuple[Any, float]:
    """``sum_i s_i u_i / sum_i s_i`` from SecAgg+'s mean of the x_i, cast to the upload's dtypes; and mean s_i."""
    leaves, spec = pytree.tree_flatten(like)
    if len(vector) != len(leaves) + 1:
        raise ValueError(f"SecAgg+ returned {len(vector)} arrays, expected {len(leaves) + 1}")
    mean_s = float(vector[0].reshape(-1)[0])
    out = [
        torch.from_numpy(np.asarray(v, dtype=np.float64) / mean_s).reshape(ref.shape).to(ref.dtype)
        for v, ref in zip(vector[1:], leaves, strict=True)
    ]
    return pytree.tree_unflatten(out, spec), mean_s


class SecureRounds:
    """Runs ``strategy``'s rounds with SecAgg+ in place of its plain train exchange (see the module docstring)."""

    def __init__(self, strategy: Any, settings: SecAggSettings, timeout: float) -> None:
        check_algorithm(strategy.exp)
        exp = strategy.exp
        for t in range(1, exp.cfg.rounds + 1):
            settings.quantization_for(len(exp.cohort(t)))  # refuse a cohort too small or a Q too large, up front
        self.strategy, self.settings, self.timeout = strategy, settings, timeout
        self.scale, self.clip = weight_scale(exp), settings.clipping_for(exp)
        self.last: dict[str, Any] = {}  # the last round's figures (tests, logs)

    def start(self, grid: Grid, context: Context) -> None:
        st = self.strategy
        for t in range(st.first_round, st.cfg.rounds + 1):  # > 1: resumed from a checkpoint
            log(INFO, "[ROUND %s/%s] (SecAgg+)", t, st.cfg.rounds)
            self.train_round(t, grid, context)
            arrays = codec.encode(st.server)
            msgs = list(st.configure_evaluate(t, arrays, ConfigRecord(), grid))
            if msgs:
                st.aggregate_evaluate(t, grid.send_and_receive(msgs, timeout=self.timeout))
            st.evaluate_global(t, arrays)

    def train_round(self, t: int, grid: Grid, context: Context) -> dict[str, Any]:
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
        from flwr.server.workflow.constant import Key as WorkflowKey

        st = self.strategy
        cohort: list[int] = st.exp.cohort(t).tolist()
        shim = _legacy_strategy()
        for msg in st.configure_train(t, ArrayRecord(), ConfigRecord(), grid):
            config = {**dict(msg.content.config_records["config"]), WEIGHT_SCALE: self.scale}
            config[CLIP] = self.clip
            params = compat.arrayrecord_to_parameters(msg.content.array_records["broadcast"], keep_input=True)
            proxy = GridClientProxy(msg.metadata.dst_node_id, grid, context.run_id)
            shim.fit_ins.append((proxy, FitIns(params, config)))
        used: list[int] = []
        out = CohortResult(None, {}, 0)
        if len(shim.fit_ins) >= 2:
            legacy = LegacyContext(context, strategy=shim)
            legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: t})
            legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
            self.settings.workflow(len(shim.fit_ins), self.timeout, self.clip)(grid, legacy)
            out, used = self._result(t, shim)
        else:
            log(
                WARNING,
                "round %d: SecAgg+ needs 2 reachable clients, %d were; nothing aggregated",
                t,
                len(shim.fit_ins),
            )
        extra: dict[str, Any] = {}
        if len(used) < len(cohort):
            extra = {"sampled": len(cohort), "dropped": sorted(set(cohort) - set(used))}
            log(WARNING, "round %d: aggregated %d of %d clients (SecAgg+)", t, len(used), len(cohort))
        if used:  # the quantisation bound of this round's aggregate, per entry
            extra["secagg/bound"] = self.last["bound"]
        lost = self.last["lost"] if used else []  # used: _result ran for this round
        return st.finish_train(t, out, used, len(shim.fit_ins), lost, **extra)

    def _result(self, t: int, shim: Any) -> tuple[CohortResult, list[int]]:
        st = self.strategy
        by_cid: dict[int, dict[str, Any]] = {}
        for proxy, res in shim.results:
            cid = int(res.metrics.get(PID, -1))
            if st.nodes.get(proxy.node_id) != cid or int(res.metrics.get(ROUND, -1)) != t:
                raise ConfigError(f"round {t}: a SecAgg+ reply from node {proxy.node_id} names another client/round")
            by_cid[cid] = dict(res.metrics)
        if not by_cid:
            return CohortResult(None, {}, 0), []
        clipped = sum(int(m.get(CLIPPED, 0)) for m in by_cid.values())
        if clipped:
            raise ConfigError(
                f"round {t}: {clipped} upload entries lie beyond secagg-clipping-range={self.clip:g} (or are not "
                "finite) and SecAgg+ would clip them; raise secagg-clipping-range (or lower algorithm.lr)"
            )
        vector = parameters_to_ndarrays(shim.results[0][1].parameters)
        aggregate, mean_s = aggregate_of(vector, st.upload_like[0])
        used = sorted(by_cid)
        sums: dict[str, float] = {}
        for m in by_cid.values():
            for k, v in m.items():
                if not k.startswith("hafedho."):
                    sums[k] = sums.get(k, 0.0) + float(v)
        metrics = {k: v / len(used) for k, v in sums.items()}
        d = delta(self.settings, len(used), self.clip)
        bound = aggregate_error_bound(d, mean_s, max(float(v.abs().max()) for v in pytree.tree_leaves(aggregate)))
        lost = [cid for cid in used if by_cid[cid].get(STATE_LOST)]
        self.last = {"round": t, "used": used, "mean_s": mean_s, "delta": d, "bound": bound, "aggregate": aggregate}
        self.last["lost"] = lost
        bytes_up = len(used) * tree.num_bytes(st.upload_like[0])
        return CohortResult(aggregate, metrics, bytes_up), used


__all__ = ["SecureRounds", "aggregate_of"]
