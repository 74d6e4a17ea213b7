"""A Flower Strategy (Message API) that runs the server half of any registered hafedho algorithm.

Round t, as in the simulator (``hafedho.sim.runner.run``):
    configure_train   the cohort is ``Experiment.cohort(t)`` (pure in seed and round); its clients are the nodes
                      whose node config names those partition ids; each gets ``alg.broadcast(server, rnd)``
                      as flat leaves plus N, m and the round.
    aggregate_train   failed, late, foreign or malformed replies are dropped; the rest are decoded and streamed
                      into ``alg.new_aggregator()`` in client-id order (so the float sums are the simulator's),
                      then ``alg.server_update`` runs with m = the uploads actually aggregated.
    evaluate          centralised: the global model on the server's test set, every ``eval_every`` rounds;
                      with held-out local data (personalised algorithms) every known node also reports the
                      accuracy of its own deployed model.
Each round appends one row to ``metrics.jsonl`` in the simulator's format and checkpoints the server state,
so ``hafedho report`` reads Flower runs as it reads simulated ones.

Node ids are mapped to partition ids by a ``query`` message to every node not yet known; during the first
``node_wait`` seconds a round waits for the nodes of its cohort to connect.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from hafedho.config import ConfigError
from hafedho.core import RoundInfo, tree
from hafedho.core.model import evaluate
from hafedho.experiment import Experiment
from hafedho.flower import codec
from hafedho.flower.common import META_KEY, digest, upload_template
from hafedho.results import RunBusy, RunLock, append_metrics, atomic_write_text, environment, write_json
from hafedho.rounds import Divergence
from hafedho.rundir import prepare_run_dir
from hafedho.sim import checkpoint


class HafedhoStrategy(Strategy):
    """Server half of ``exp.alg`` on a Flower grid.

    Args:
        exp: the Experiment (algorithm, data, model, config) built from the run config.
        run_dir: where metrics.jsonl, config.toml and checkpoint.pt go; None = write nothing.
        node_wait: seconds, counted from the first round, during which a round waits for its cohort's nodes.
        query_timeout: seconds to wait for nodes to report their partition.
    """

    def __init__(
        self, exp: Experiment, run_dir: str | Path | None = None, node_wait: float = 120.0, query_timeout: float = 120.0
    ) -> None:
        self.exp, self.alg, self.fed, self.model, self.cfg = exp, exp.alg, exp.fed, exp.model, exp.cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.node_wait, self.query_timeout = node_wait, query_timeout
        self.server = self.alg.init_server(self.model.params())
        self.upload_like = upload_template(exp)
        self.digest = digest(exp)
        self.nodes: dict[int, int] = {}  # node id -> partition id (-1: the node failed to say)
        self.rows: list[dict[str, Any]] = []  # every metrics row written
        self.wall = 0.0
        self._deadline: float | None = None
        self._asked: set[int] = set()
        self._foreign: dict[int, int] = {}  # node id -> the N it reported, for nodes of another federation
        self._round: dict[str, Any] = {}
        self._lock: RunLock | None = None

    # ----------------------------------------------------------------- run directory

    def prepare(self, force: bool = False) -> None:
        """Create the run directory like the simulator does (config.toml, env.json, partition.json, run.json)."""
        if self.run_dir is None:
            return
        self._lock = RunLock(self.run_dir)  # one writer per run, as in the simulator; released by finish()
        if not self._lock.__enter__():
            raise RunBusy(
                f"{self.run_dir} is being written by another process (pid {self._lock.holder}); wait for it to end"
            )
        prepare_run_dir(self.run_dir, self.cfg, resume=False, force=force)
        write_json(self.run_dir / "env.json", environment())
        write_json(self.run_dir / "partition.json", self.exp.partition)
        lam = int(max(self.exp.plan.steps_for(int(n)) for n in self.fed.sizes))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            notes = self.alg.run_notes(lam)
        for w in caught:
            log(WARNING, "hafedho: %s", w.message)
        run = {"notes": notes, "warnings": [str(w.message) for w in caught], "lambda": lam, "engine": "flower"}
        write_json(self.run_dir / "run.json", run)

    def initial_arrays(self) -> ArrayRecord:
        return codec.encode(self.server)

    # ----------------------------------------------------------------- nodes

    def discover(self, grid: Grid) -> set[int]:
        """Ask every connected node not yet known for its partition id; returns the connected node ids."""
        online = set(grid.get_node_ids())
        unknown = sorted(n for n in online if n not in self.nodes or (self.nodes[n] < 0 and n not in self._asked))
        self._asked.update(unknown)
        if unknown:
            content = RecordDict({"config": ConfigRecord({"digest": self.digest})})
            msgs = [
                Message(content, dst_node_id=n, message_type=MessageType.QUERY, group_id="partition") for n in unknown
            ]
            for reply in grid.send_and_receive(msgs, timeout=self.query_timeout):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    log(WARNING, "node %d did not report its partition: %s", node, reply.error.reason)
                    self.nodes[node] = -1
                    continue
                meta = reply.content.config_records.get(META_KEY)
                if meta is None or int(meta.get("num-partitions", -1)) != self.fed.num_clients:
                    log(
                        WARNING,
                        "node %d belongs to another federation (num-partitions != %d)",
                        node,
                        self.fed.num_clients,
                    )
                    self.nodes[node] = -1
                    if meta is not None:
                        self._foreign[node] = int(meta.get("num-partitions", -1))
                    continue
                self._foreign.pop(node, None)
                self.nodes[node] = int(meta["partition-id"])
        return online

    def targets(self, cohort: list[int], grid: Grid) -> dict[int, int]:
        """client id -> node id for the cohort's clients that are connected (waiting during the grace period)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.node_wait
        while True:
            online = self.discover(grid)
            by_pid = {pid: node for node, pid in self.nodes.items() if node in online and pid >= 0}  # newest wins
            found = {cid: by_pid[cid] for cid in cohort if cid in by_pid}
            if len(found) == len(cohort):
                break
            self._check_federation(online, by_pid, final=time.monotonic() >= self._deadline)
            if time.monotonic() >= self._deadline:
                break
            time.sleep(1.0)
        missing = sorted(set(cohort) - found.keys())
        if missing:
            log(WARNING, "round clients without a connected node (skipped): %s", missing)
        return found

    def _check_federation(self, online: set[int], ours: dict[int, int], final: bool) -> None:
        """Refuse, before any training, SuperNodes that all describe another N (a simulation whose num-supernodes
        is not the config's N would otherwise train no client in any round): at once when they form a whole
        federation of another size, else when the node wait ends with none of this federation's nodes online."""
        sizes = sorted({n for node, n in self._foreign.items() if node in online})
        if ours or not sizes:
            return
        whole = any(sum(1 for node, n in self._foreign.items() if node in online and n == k) >= k for k in sizes)
        if whole or final:
            n = self.fed.num_clients
            raise ConfigError(
                f"the SuperNodes have num-partitions={', '.join(map(str, sizes))} but this run has N={n} clients "
                f"(data.num_clients); start {n} SuperNodes with num-partitions={n} (simulation: num-supernodes = "
                f"{n}, `hafedho flower run --simulation {n}`) or set data.num_clients to match"
            )

    # ----------------------------------------------------------------- train

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        t0 = time.perf_counter()
        cohort = self.exp.cohort(server_round).tolist()
        rnd = RoundInfo(server_round, self.fed.num_clients, len(cohort))
        msg = self.alg.broadcast(self.server, rnd)
        self._asked = set()  # a node that failed to report its partition is asked again next round
        found = self.targets(cohort, grid)
        payload = codec.encode(msg)
        base = {
            **dict(config),
            "server-round": server_round,
            "num-clients": self.fed.num_clients,
            "cohort-size": len(cohort),
            "digest": self.digest,
        }
        messages = []
        for cid, node in found.items():
            content = RecordDict({"broadcast": payload, "config": ConfigRecord({**base, "partition-id": cid})})
            messages.append(
                Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(server_round))
            )
        self._round = {"cohort": cohort, "t0": t0, "bytes_down": len(messages) * tree.num_bytes(msg)}
        log(INFO, "configure_train: round %d, cohort %s, %d nodes reached", server_round, cohort, len(messages))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        cohort: list[int] = self._round.get("cohort") or self.exp.cohort(server_round).tolist()
        by_cid: dict[int, Message] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(
                    WARNING, "round %d: dropped a failed reply from node %d: %s", server_round, node, reply.error.reason
                )
                continue
            meta = reply.content.config_records.get(META_KEY)
            cid = int(meta.get("partition-id", -1)) if meta is not None else -1
            if cid not in cohort or cid in by_cid or self.nodes.get(node) != cid:
                log(
                    WARNING,
                    "round %d: dropped an unexpected reply from node %d (partition %d)",
                    server_round,
                    node,
                    cid,
                )
                continue
            if meta is None or int(meta.get("server-round", -1)) != server_round:
                log(WARNING, "round %d: dropped a reply of another round from node %d", server_round, node)
                continue
            by_cid[cid] = reply
        agg = self.alg.new_aggregator()
        sums: dict[str, float] = {}
        like, bytes_up, used = None, 0, []
        for cid in cohort:  # the simulator's order: the float sums match bit for bit when every client replies
            reply = by_cid.pop(cid, None)
            if reply is None:
                continue
            try:
                upload, weight = codec.decode(reply.content.array_records["upload"], self.upload_like)
                metrics = {k: float(v) for k, v in reply.content.metric_records.get("metrics", {}).items()}
            except (codec.CodecError, KeyError, TypeError, ValueError) as e:
                log(WARNING, "round %d: dropped a malformed reply of client %d: %s", server_round, cid, e)
                continue
            agg.add(upload, weight)
            like = upload
            bytes_up += tree.num_bytes(upload)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            used.append(cid)
        rnd = RoundInfo(server_round, self.fed.num_clients, len(used))
        self.server, server_metrics = self.alg.server_update(self.server, agg.result(like) if used else None, rnd)
        n = max(len(used), 1)
        row: dict[str, Any] = {
            "round": server_round,
            "cohort_size": len(used),
            **{k: v / n for k, v in sums.items()},
            **server_metrics,
        }
        if len(used) < len(cohort):
            row["sampled"] = len(cohort)
            row["dropped"] = sorted(set(cohort) - set(used))
            log(WARNING, "round %d: aggregated %d of %d clients", server_round, len(used), len(cohort))
        self._check_finite(server_round, row)
        self.wall += time.perf_counter() - self._round.get("t0", time.perf_counter())
        row.update(
            {"wall_s": round(self.wall, 4), "bytes_up": bytes_up, "bytes_down": self._round.get("bytes_down", 0)}
        )
        self._round["row"] = row
        numeric = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        return codec.encode(self.server), MetricRecord(numeric)

    def _check_finite(self, t: int, row: dict[str, Any]) -> None:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad or not tree.all_finite(self.alg.eval_params(self.server)):
            what = f"{bad[0]} is {row[bad[0]]}" if bad else "the global model has non-finite values"
            text = f"run diverged at round {t}: {what} (lower algorithm.lr or the algorithm's coefficients)"
            if self.run_dir is not None:
                atomic_write_text(self.run_dir / "diverged", text + "\n")
            raise Divergence(text)

    # ----------------------------------------------------------------- evaluate

    def _eval_round(self, t: int) -> bool:
        return t % self.cfg.eval_every == 0 or t == self.cfg.rounds

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """With held-out local data (personalised algorithms by default), every known node reports the accuracy of
        the model it would deploy (``alg.predict``) on its own data, as the simulator's ``personal_accuracy``."""
        if self.fed.local_test is None or not self._eval_round(server_round):
            return []
        online = set(grid.get_node_ids())
        payload = codec.encode(self.server)
        messages = []
        for node, cid in self.nodes.items():
            if node in online and cid >= 0:
                conf = {"server-round": server_round, "num-clients": self.fed.num_clients, "digest": self.digest}
                conf["partition-id"] = cid
                content = RecordDict({"server": payload, "config": ConfigRecord(conf)})
                messages.append(
                    Message(content, dst_node_id=node, message_type=MessageType.EVALUATE, group_id=str(server_round))
                )
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        correct = total = clients = 0
        for reply in replies:
            if reply.has_error():
                log(
                    WARNING,
                    "round %d: dropped a failed evaluation from node %d",
                    server_round,
                    reply.metadata.src_node_id,
                )
                continue
            m = reply.content.metric_records.get("metrics", {})
            correct, total, clients = correct + int(m.get("correct", 0)), total + int(m.get("total", 0)), clients + 1
        if not clients:
            return None
        acc = correct / max(total, 1)
        if "row" in self._round:  # the simulator's metric; the count only when some clients did not answer
            self._round["row"]["test/personal_acc"] = acc
            if clients < self.fed.num_clients:
                self._round["row"]["personal_clients"] = clients
        return MetricRecord({"test/personal_acc": acc, "personal_clients": clients})

    def evaluate_global(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Centralised evaluation (``evaluate_fn`` of ``Strategy.start``); also writes the round's metrics row."""
        row = self._round.pop("row", None)
        if server_round == 0 or row is None:
            return None
        out = None
        if self._eval_round(server_round):
            ev = evaluate(self.model, self.alg.eval_params(self.server), self.fed.x_test(), self.fed.y_test)
            row.update({"test/acc": ev["acc"], "test/loss": ev["loss"]})
            out = MetricRecord({"test/acc": ev["acc"], "test/loss": ev["loss"]})
        self.rows.append(row)
        if self.run_dir is not None:
            append_metrics(self.run_dir, row)
            if server_round % self.cfg.checkpoint_every == 0 or server_round == self.cfg.rounds:
                extra = {"wall_s": self.wall, "engine": "flower"}
                checkpoint.save(self.run_dir / "checkpoint.pt", server_round, self.server, [], extra)
        return out

    def finish(self) -> None:
        if self.run_dir is not None:
            atomic_write_text(self.run_dir / "done", "")
        if self._lock is not None:
            self._lock.__exit__()
            self._lock = None

    def summary(self) -> None:
        log(INFO, "\t├── algorithm: %s (%s)", self.alg.name, type(self.alg).__name__)
        log(INFO, "\t├── clients N = %d, rounds = %d, seed = %d", self.fed.num_clients, self.cfg.rounds, self.cfg.seed)
        log(INFO, "\t└── run directory: %s", self.run_dir)

    def final_params(self) -> dict[str, torch.Tensor]:
        return self.alg.eval_params(self.server)
