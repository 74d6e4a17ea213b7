"""A Flower Strategy (Message API) that runs the server half of any registered hafedho algorithm.

The strategy is transport only: the round's bookkeeping is the simulator's own (``hafedho.runtime.rounds.ServerRounds``
and ``hafedho.runtime.rundir.RunDir``), so a Flower run writes the simulator's rows, checkpoints and markers.
Round t:
    configure_train   the cohort is ``Experiment.cohort(t)`` (pure in seed and round); its clients are the nodes
                      whose node config names those partition ids; each gets the round's broadcast as flat
                      leaves plus N, m and the round.
    aggregate_train   failed, late, foreign or malformed replies are dropped; the rest are decoded and streamed
                      into a ``CohortStream`` in client-id order (so the float sums are the simulator's), then
                      ``finish_round`` runs with m = the uploads actually aggregated.
    evaluate          every known node reports the accuracy of its own deployed model on held-out local data
                      (personalised algorithms), pooled; then the server's global evaluation, the metrics row and
                      the checkpoint at the simulator's cadence (``evaluate_global``).

Node ids are mapped to partition ids by a ``query`` message to every node not yet known; during the first
``node_wait`` seconds a round waits for the nodes of its cohort to connect.

Client states stay on the nodes (``flower/node_store.py``). With each train message the server names the run (its
token, drawn when the run directory is created and kept in every checkpoint), the client's last round whose upload
was aggregated (a node holding an older state lost it: the row lists the client in ``state_reset``) and the round
of the last checkpoint on disk (older state versions are never needed again). The checkpoint keeps the token and
each client's last round, so a resumed ServerApp continues with the states its nodes kept.

``prepare(resume=True)`` continues a run directory from its checkpoint as ``hafedho run --resume`` does; Flower
counts the rounds of this process from 1, so ``start`` shifts them: every method sees the run's own round numbers.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch.utils import _pytree as pytree

from hafedho.config import ConfigError
from hafedho.experiment import Experiment
from hafedho.flower import codec
from hafedho.flower.common import META_KEY, client_template, digest, upload_template
from hafedho.flower.node_store import RUN_TOKEN
from hafedho.runfiles import RunDirError
from hafedho.runtime.rounds import ServerRounds, pooled_accuracy, run_facts
from hafedho.runtime.rundir import RunDir, interrupted_text
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult, CohortStream


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
        self.run_dir = RunDir(run_dir) if run_dir is not None else None
        self.node_wait, self.query_timeout = node_wait, query_timeout
        init = self.alg.init_server(self.model.params())
        self.run_token = secrets.token_hex(8)  # names this run's client states on the nodes (node_store)
        self.client_rounds = [0] * self.fed.num_clients  # client -> the last round its upload was aggregated
        self.server_rounds = ServerRounds(exp, init, self.run_dir, checkpoint_extra=self._facts())
        self.upload_like = upload_template(exp)
        self.param_shapes = {k: tuple(v.shape) for k, v in self.model.params().items()}
        self.digest = digest(exp)
        self.nodes: dict[int, int] = {}  # node id -> partition id (-1: the node failed to say)
        self._deadline: float | None = None
        self._asked: set[int] = set()
        self._foreign: dict[int, int] = {}  # node id -> the N it reported, for nodes of another federation
        self._round: dict[str, Any] = {}
        self.first_round = 1  # the first round this process runs (> 1: resumed from a checkpoint)
        self._shift = 0  # Flower's round number + _shift = the run's, while ``start`` runs
        self._was_done = False  # ``prepare(resume=True)`` found the run finished: nothing to write
        self._phase = "new"  # "running" once prepared, "ended" once finished, abandoned or reported interrupted

    def _facts(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the server state, for a resumed ServerApp and its nodes."""
        return {"engine": "flower", "run_token": self.run_token, "client_rounds": list(self.client_rounds)}

    def _restore_facts(self, path: Path, facts: dict[str, Any], done: int) -> None:
        """The run token and the clients' rounds of a checkpoint of round ``done`` (one written before they
        existed has neither: a new token, and lost states go unnoticed until the client trains once more)."""
        token, rounds = facts.get("run_token"), facts.get("client_rounds")
        if token is None and rounds is None:
            return
        n = self.fed.num_clients
        ok_token = isinstance(token, str) and RUN_TOKEN.fullmatch(token) is not None
        ok_rounds = isinstance(rounds, list) and len(rounds) == n
        ok_rounds = ok_rounds and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= done for r in rounds)
        if not (ok_token and ok_rounds):
            raise RunDirError(
                f"{path}: corrupt checkpoint (its run token or its {n} clients' rounds); restore this run's own "
                "checkpoint.pt, or start over with --force"
            )
        self.run_token, self.client_rounds = token, list(rounds)

    @property
    def server(self) -> Any:
        return self.server_rounds.server

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every metrics row written."""
        return self.server_rounds.rows

    # ----------------------------------------------------------------- run directory

    def prepare(self, force: bool = False, resume: bool = False) -> None:
        """Take the run's lock and create its directory as the simulator does; ``finish`` releases the lock.

        ``resume``: continue the directory from its checkpoint with the simulator's checks (same experiment and
        data, rows covering the checkpoint, the checkpoint's identity), the server state restored and the rows
        after the checkpoint dropped (recomputed). A run already finished at ``rounds`` is left as it is. Without
        ``resume`` an existing run directory is refused (``--resume`` or ``--force``). Every refusal comes before
        anything in the directory changes, and releases the lock."""
        if self.run_dir is None:
            return
        rd = self.run_dir
        rd.acquire()
        try:
            if rd.prepare(self.cfg, resume, force, self.exp.partition):
                self.first_round, self._phase, self._was_done = self.cfg.rounds + 1, "running", True
                log(INFO, "hafedho: %s already holds all %d rounds; nothing to do", rd.path, self.cfg.rounds)
                return
            start, server, wall = 1, self.server, 0.0
            if resume:  # the client states live on the nodes: the store holds none
                start, server, wall = rd.resume(self.server, ClientStore((), self.fed.num_clients))
                if start > 1:
                    self._restore_facts(rd.checkpoint_path, rd.resumed_facts, start - 1)
            warn = lambda text: log(WARNING, "hafedho: %s", text)
            rd.start(self.exp.partition, run_facts(self.exp, warn, engine="flower"))
            rd.truncate(start - 1)  # rounds after the checkpoint are recomputed
        except BaseException:
            rd.release()
            raise
        self._phase = "running"
        if start > 1:
            self.server_rounds = ServerRounds(self.exp, server, rd, start, wall, checkpoint_extra=self._facts())
            self.first_round = start
            log(INFO, "hafedho: resuming %s after the checkpoint of round %d", rd.path, start - 1)
            if pytree.tree_leaves(client_template(self.exp)):
                log(
                    INFO,
                    "hafedho: %s keeps client state on the SuperNodes: nodes with a state-dir continue from it; a "
                    "node without one (each `flwr run` is a new run series there) restarts its clients from "
                    "init_client, and the rows list them in state_reset (docs/flower.md)",
                    self.alg.name,
                )

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, **kwargs: Any) -> Result:
        """Flower's round loop (``Strategy.start``) over rounds ``first_round..num_rounds`` of the run."""
        self._shift = self.first_round - 1
        try:
            return super().start(grid, initial_arrays, max(num_rounds - self._shift, 0), **kwargs)
        finally:
            self._shift = 0

    def interrupted(self) -> str | None:
        """Once, for a prepared run that did not finish: the checkpoint being written is waited for, the lock
        released, and the simulator's line (``interrupted at round N; continue with --resume``) logged and
        returned; None otherwise."""
        if self.run_dir is None or self._phase != "running":
            return None

        self._phase = "ended"
        try:
            self.run_dir.release()  # waits for the checkpoint being written: the one --resume continues from
        except Exception as e:  # the line below still says where the run stands
            log(WARNING, "hafedho: the last checkpoint was not written: %s", e)
        text = interrupted_text(self.run_dir.path)
        log(ERROR, "hafedho: %s", text)
        return text

    def abandon(self) -> None:
        """The run failed: release its lock (its files stay as they are; nothing says it was interrupted)."""
        if self.run_dir is not None and self._phase == "running":
            self._phase = "ended"
            self.run_dir.release()

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
        server_round += self._shift
        cohort = self.exp.cohort(server_round).tolist()
        _, msg = self.server_rounds.begin(server_round, len(cohort))
        self._asked = set()  # a node that failed to report its partition is asked again next round
        found = self.targets(cohort, grid)
        payload = codec.encode(msg)
        base = {
            **dict(config),
            "server-round": server_round,
            "num-clients": self.fed.num_clients,
            "cohort-size": len(cohort),
            "digest": self.digest,
            "run-token": self.run_token,
            "checkpoint-round": self.server_rounds.durable,
        }
        messages = []
        for cid, node in found.items():
            per_client = {"partition-id": cid, "state-round": self.client_rounds[cid]}
            content = RecordDict({"broadcast": payload, "config": ConfigRecord({**base, **per_client})})
            messages.append(
                Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(server_round))
            )
        self._round = {"cohort": cohort, "reached": len(messages)}
        log(INFO, "configure_train: round %d, cohort %s, %d nodes reached", server_round, cohort, len(messages))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self._shift
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
        stream, used, lost = CohortStream(self.alg, 0, self.upload_like[0], self.param_shapes), [], []
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
            stream.add(upload, weight, metrics)
            used.append(cid)
            if int(reply.content.config_records[META_KEY].get("state-lost", 0)):
                lost.append(cid)
        stream.size = len(used)  # cohort means over the uploads that arrived (m = len(used))
        extra: dict[str, Any] = {}
        if len(used) < len(cohort):
            extra = {"sampled": len(cohort), "dropped": sorted(set(cohort) - set(used))}
            log(WARNING, "round %d: aggregated %d of %d clients", server_round, len(used), len(cohort))
        row = self.finish_train(server_round, stream.result(), used, self._round.get("reached", 0), lost, **extra)
        numeric = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        return codec.encode(self.server), MetricRecord(numeric)

    def finish_train(
        self, server_round: int, out: CohortResult, used: list[int], reached: int, lost: list[int], **extra: Any
    ) -> dict:
        """``ServerRounds.finish_round`` on the round's aggregate of the clients ``used`` (plain, or SecAgg+'s from
        ``flower/secagg_server.py``); ``lost``: those whose node had lost their state (listed in ``state_reset``).
        The row waits for ``evaluate_global``."""
        if lost:
            extra["state_reset"] = sorted(lost)
            log(
                WARNING,
                "round %d: the nodes of clients %s had lost their state and trained from init_client (a SuperNode "
                "restarted without a state-dir, or its store deleted); the row lists them in state_reset",
                server_round,
                sorted(lost),
            )
        row = self.server_rounds.finish_round(server_round, out, len(used), reached, **extra)
        for cid in used:
            self.client_rounds[cid] = server_round
        self.server_rounds.checkpoint_extra = self._facts()  # the checkpoint of this round keeps them
        self._round["row"] = row
        return row

    # ----------------------------------------------------------------- evaluate

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """With held-out local data (personalised algorithms by default), every known node reports the accuracy of
        the model it would deploy (``alg.predict``) on its own data, as the simulator's ``personal_accuracy``."""
        server_round += self._shift
        if self.fed.local_test is None or not self.server_rounds.is_eval_round(server_round):
            return []
        online = set(grid.get_node_ids())
        payload = codec.encode(self.server)
        messages = []
        for node, cid in self.nodes.items():
            if node in online and cid >= 0:
                conf = {"server-round": server_round, "num-clients": self.fed.num_clients, "digest": self.digest}
                conf["run-token"] = self.run_token
                conf["partition-id"] = cid
                content = RecordDict({"server": payload, "config": ConfigRecord(conf)})
                messages.append(
                    Message(content, dst_node_id=node, message_type=MessageType.EVALUATE, group_id=str(server_round))
                )
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        server_round += self._shift
        counts = []
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
            counts.append((int(m.get("correct", 0)), int(m.get("total", 0))))
        if not counts:
            return None
        acc, clients = pooled_accuracy(counts), len(counts)
        if "row" in self._round:  # the simulator's metric; the count only when some clients did not answer
            self._round["row"]["test/personal_acc"] = acc
            if clients < self.fed.num_clients:
                self._round["row"]["personal_clients"] = clients
        return MetricRecord({"test/personal_acc": acc, "personal_clients": clients})

    def evaluate_global(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Centralised evaluation (``evaluate_fn`` of ``Strategy.start``); also writes the round's metrics row."""
        if server_round == 0:  # Flower's evaluation of the initial model: no round of the run
            return None
        server_round += self._shift
        row = self._round.pop("row", None)
        if row is None:
            return None
        ev = self.server_rounds.evaluate(server_round, row)  # personal accuracy: from the nodes (aggregate_evaluate)
        self.server_rounds.commit(server_round, row)
        return None if ev is None else MetricRecord({"test/acc": ev["acc"], "test/loss": ev["loss"]})

    def finish(self) -> None:
        """The run ended: its done marker (after the last checkpoint), then the lock released."""
        if self.run_dir is not None and self._phase == "running":
            self._phase = "ended"
            try:
                if not self._was_done:  # a finished run resumed is left as it is
                    self.run_dir.mark_done()
            finally:
                self.run_dir.release()

    def summary(self) -> None:
        log(INFO, "\t├── algorithm: %s (%s)", self.alg.name, type(self.alg).__name__)
        log(INFO, "\t├── clients N = %d, rounds = %d, seed = %d", self.fed.num_clients, self.cfg.rounds, self.cfg.seed)
        log(INFO, "\t└── run directory: %s", self.run_dir.path if self.run_dir else None)

    def final_params(self) -> dict[str, torch.Tensor]:
        return self.alg.eval_params(self.server)
