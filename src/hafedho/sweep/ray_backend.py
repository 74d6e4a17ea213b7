"""Sweeps on a Ray cluster (``hafedho sweep PRESET --backend ray``): each run is one Ray task with declared
resources (``num_cpus`` = ``--cpus-per-run``, ``num_gpus`` = ``--gpus-per-run``) that calls the per-run body every
backend calls, ``hafedho.sweep.execute.run_spec``; ``run_sweep`` keeps the skip/resume/diverged logic, the progress
bar and the index. Ray is imported here only, when a sweep uses it (``pip install 'hafedho[ray]'``).

Where runs execute: the results go into the sweep's output folder, which every node must reach at the same path (a
shared filesystem; on one machine it just is). Each task works in the folder the sweep was started from, when the
node has it, so relative paths (``out``, ``data.path``, the data sources' defaults) mean what they mean to the
driver. The nodes need hafedho importable in the Python that runs ``ray start`` (the same venv).

A task lost with its worker or node (a Ray system error, not a run's own failure) is resubmitted up to ``retries``
times; the run resumes from its checkpoint through the ordinary ``--resume`` path, finished runs are skipped. The
run's ``RunLock`` is an ``flock`` that the OS drops when its holder dies; a resubmitted task waits up to
``lock_wait_s`` for it, for the lost worker may take a moment to exit (on NFS a dead host's lock lasts until the
server's lease expires, about 90 s on NFSv4; a filesystem without cross-host ``flock`` does not protect a run from
a second writer, which the driver never starts while a task of the run is alive).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hafedho.config import ConfigError
from hafedho.sweep.execute import Outcome, available_cores, run_spec
from hafedho.sweep.expand import RunSpec

RETRIES = 3  # resubmissions of a task lost with its worker or node
LOCK_WAIT_S = 120.0  # how long a resubmitted task waits for the lost attempt's run lock


def check_feasible(nodes: list[dict[str, Any]], cpus: int, gpus: float, where: str) -> None:
    """Refuse resources that no alive node offers (Ray would queue such tasks for ever)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    if any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in alive):
        return
    have = ", ".join(f"{r.get('CPU', 0):g} CPUs/{r.get('GPU', 0):g} GPUs" for r in alive) or "no alive node"
    raise ConfigError(
        f"no node of {where} offers {cpus} CPUs and {gpus:g} GPUs for one run (nodes: {have}); "
        "lower --cpus-per-run / --gpus-per-run, or add a node that has them"
    )


def check_reachable(address: str, source: str, timeout: float = 5.0) -> None:
    """Refuse a ``HOST:PORT`` that nothing listens on (Ray itself would retry for minutes); other forms
    (``auto``, ``ray://``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(
            f"{source} {address}: no Ray cluster answers there ({e.strerror or e}); start one with "
            "`ray start --head --port=PORT` and pass the address it prints"
        ) from None


def _task(cfg: Any, run_dir: str, threads: int, cwd: str, lock_wait_s: float) -> Outcome:
    """One run on a Ray worker: ``run_spec`` with torch threads = the task's CPUs (a run's own ``threads`` > 0
    wins, as everywhere). A resubmitted task waits for the lost attempt's lock instead of reporting busy."""
    if os.path.isdir(cwd):  # relative paths as the driver means them (the shared folder has the same path)
        os.chdir(cwd)
    deadline = time.monotonic() + lock_wait_s
    while True:
        outcome = run_spec(cfg, run_dir, threads=threads)
        if outcome.status != "busy" or time.monotonic() >= deadline:
            return outcome
        time.sleep(1.0)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


@dataclass
class RayBackend:
    """Where and how a sweep's runs execute on Ray (``execute.Backend``).

    ``address`` None: ``RAY_ADDRESS`` when set, else a local cluster started here with ``num_cpus`` CPUs (default:
    this machine's cores) and stopped at the end. ``log_to_driver``: the workers' output in this terminal."""

    address: str | None = None
    cpus_per_run: int = 1
    gpus_per_run: float = 0.0
    num_cpus: int | None = None
    retries: int = RETRIES
    lock_wait_s: float = LOCK_WAIT_S
    log_to_driver: bool = True
    where: str = field(default="", init=False)  # the cluster, in words, once connected

    def __post_init__(self) -> None:
        if isinstance(self.cpus_per_run, bool) or not isinstance(self.cpus_per_run, int) or self.cpus_per_run < 1:
            raise ConfigError(f"--cpus-per-run {self.cpus_per_run}: need a whole number >= 1 (a run's torch threads)")
        if not self.gpus_per_run >= 0:
            raise ConfigError(f"--gpus-per-run {self.gpus_per_run}: need a number >= 0 (fractions share a GPU)")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"a local Ray cluster needs at least 1 CPU, not {self.num_cpus}")

    def _connect(self) -> tuple[Any, bool]:
        """``(ray, True when this call joined or started the session and so ends it)``."""
        try:
            import ray
        except ImportError:
            raise ConfigError("--backend ray needs Ray: pip install 'hafedho[ray]'") from None
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if ray.is_initialized():  # a script's own session: use it, leave it open
            self.where = "the Ray session this process joined"
            check_feasible(ray.nodes(), self.cpus_per_run, self.gpus_per_run, self.where)
            return ray, False
        env = os.environ.get("RAY_ADDRESS") or None
        address = self.address or env
        common: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": self.log_to_driver}
        with warnings.catch_warnings():  # Ray's FutureWarning about accelerator variables is not ours to act on
            warnings.simplefilter("ignore", FutureWarning)
            if address is None:
                cpus = self.num_cpus or available_cores()
                # "local": never join a cluster `ray start` left on this machine unless asked to
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, **common)
                self.where = (
                    f"a local Ray cluster of {cpus} CPUs, started for this sweep (no --address, no RAY_ADDRESS)"
                )
            else:
                source = "--address" if self.address else "RAY_ADDRESS"
                check_reachable(address, source)
                try:
                    ray.init(address=address, **common)
                except (ConnectionError, ValueError, RuntimeError) as e:
                    raise ConfigError(
                        f"{source} {address}: cannot connect to a Ray cluster ({_first_line(e)}); start one with "
                        "`ray start --head` and pass the address it prints"
                    ) from None
                self.where = f"the Ray cluster at {address} (from {source})"
        try:
            check_feasible(ray.nodes(), self.cpus_per_run, self.gpus_per_run, self.where)
        except ConfigError:
            ray.shutdown()
            raise
        return ray, True

    def run(self, todo: list[RunSpec], record: Callable[[Outcome], None], echo: Callable[[str], None]) -> None:
        """Submit every run as a task, record outcomes as they finish, resubmit lost ones; Ctrl-C cancels the
        tasks (force: their workers end, the runs resume from their checkpoints next time) and re-raises."""
        ray, owned = self._connect()
        from ray.exceptions import RayError, RayTaskError, TaskCancelledError

        echo(f"on {self.where}: {self.cpus_per_run} CPU and {self.gpus_per_run:g} GPU per run")
        remote = ray.remote(_task)
        cwd = os.getcwd()

        def submit(spec: RunSpec, attempt: int) -> Any:
            options = {"num_cpus": self.cpus_per_run, "num_gpus": self.gpus_per_run, "max_retries": 0}
            wait = self.lock_wait_s if attempt else 0.0
            ref = remote.options(name=f"hafedho:{spec.name}", **options).remote(
                spec.cfg, str(spec.run_dir.resolve()), self.cpus_per_run, cwd, wait
            )
            return ref

        pending = {submit(s, 0): (s, 0) for s in todo}
        try:
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                spec, attempt = pending.pop(ref)
                try:
                    outcome = ray.get(ref)
                except TaskCancelledError:  # someone else's `ray cancel` (ours come with Ctrl-C, below)
                    outcome = Outcome(spec.name, "failed", "its Ray task was cancelled; the next sweep resumes it")
                except RayTaskError as e:  # the task itself raised: e.g. hafedho not importable on that node
                    cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
                    hint = "; the Ray nodes need hafedho in the same venv" if isinstance(cause, ImportError) else ""
                    outcome = Outcome(spec.name, "failed", f"{type(cause).__name__}: {_first_line(cause)}{hint}")
                except RayError as e:  # lost with its worker or node: resume it elsewhere from its checkpoint
                    if attempt < self.retries:
                        echo(
                            f"retry    {spec.name}  lost ({type(e).__name__}); resubmitted, resumes from its checkpoint"
                        )
                        pending[submit(spec, attempt + 1)] = (spec, attempt + 1)
                        continue
                    outcome = Outcome(
                        spec.name, "failed", f"lost {attempt + 1} times, last: {type(e).__name__}: {_first_line(e)}"
                    )
                if attempt and outcome.status == "skipped":  # it had finished just before its worker was lost
                    outcome = Outcome(spec.name, "done", "finished before its worker was lost", _last_acc(spec.run_dir))
                record(outcome)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            if owned:
                ray.shutdown()


def _last_acc(run_dir: Path) -> float | None:
    from hafedho.runfiles import read_metrics

    rows = read_metrics(run_dir)
    return rows[-1].get("test/acc") if rows else None
