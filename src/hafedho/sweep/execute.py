"""Execution: run the specs that are not done, in this process, in spawned workers or as Ray tasks
(``hafedho.sweep.ray_backend``), one outcome per run.

``run_sweep`` owns what every backend shares: which runs are skipped (done before) or kept (diverged before),
the progress bar, the per-run lines and Ctrl-C. ``run_spec`` is the one per-run body that every backend calls.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from hafedho.config import Config
from hafedho.runfiles import run_state
from hafedho.sweep.expand import RunSpec


@dataclass
class Outcome:
    """What happened to one run in this sweep: done, skipped (done before), busy (another sweep has it),
    diverged or failed."""

    name: str
    status: str
    message: str = ""
    acc: float | None = None
    seconds: float = 0.0


@dataclass
class SweepResult:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def summary(self) -> str:
        parts = [f"{self.count(s)} {s}" for s in ("done", "skipped", "busy", "diverged", "failed") if self.count(s)]
        return ", ".join(parts) or "nothing to run"


class Backend(Protocol):
    """Runs the specs that ``run_sweep`` left to do elsewhere (``hafedho.sweep.ray_backend.RayBackend``): each one
    through ``run_spec``, each outcome handed to ``record`` once; ``echo`` prints a line under the progress bar.
    On KeyboardInterrupt it stops its runs (they resume from their checkpoints) and re-raises."""

    def run(self, todo: list[RunSpec], record: Callable[[Outcome], None], echo: Callable[[str], None]) -> None: ...


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_of_cores(jobs: int) -> int:
    """Torch threads of a run with ``threads = 0`` in a sweep of ``jobs`` concurrent runs: jobs x threads = cores,
    no oversubscription (a run's own ``threads`` > 0 replaces it for that run, whatever ``jobs`` is)."""
    return max(1, available_cores() // jobs)


def _init_worker(threads: int, parent: int) -> None:
    import torch

    torch.set_num_threads(threads)  # jobs x threads = cores: no oversubscription
    # Ctrl-C is the sweep's: it terminates its workers (a worker would go on to its next queued run). A thread
    # lock for tqdm, so a terminated worker leaves no multiprocessing semaphore behind.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())

    # SIGTERM or SIGKILL reach the sweep process only; an orphaned worker would go on writing into its run
    # directory. It exits once its parent is gone instead (the next sweep resumes the run from its checkpoint).
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sweep-parent-watch", daemon=True).start()


def run_spec(cfg: Config, run_dir: str, threads: int | None = None) -> Outcome:
    """Run (or resume) one run; never raises for a run's own failure, so one bad run cannot stop a sweep.

    ``threads``: torch threads for a run with ``threads = 0`` (its own ``threads`` > 0 wins), the caller's setting
    restored afterwards; None keeps the current setting (a pool worker's initializer has set it)."""
    if threads is None:
        return _run_spec(cfg, Path(run_dir))
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_spec(cfg, Path(run_dir))
    finally:
        torch.set_num_threads(previous)


def _run_spec(cfg: Config, path: Path) -> Outcome:
    from hafedho.experiment import build
    from hafedho.runfiles import RunBusy
    from hafedho.sim.runner import Divergence, run

    t0, name = time.perf_counter(), path.name  # the spec's name (Config.run_name)
    if run_state(path, cfg.rounds).status == "done":  # finished by another sweep since this one started
        return Outcome(name, "skipped", "done meanwhile")
    try:  # run() takes the run's lock (RunLock), shared with `hafedho run` and other sweeps
        last = run(build(cfg), path, resume=path.exists(), progress=False)
    except RunBusy:  # another sweep over the same folder is running it (presets share runs)
        return Outcome(name, "busy", "running in another sweep; not counted")
    except Divergence as e:
        return Outcome(name, "diverged", str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # recorded as one line; the sweep goes on and exits non-zero at the end
        line = (str(e).strip().splitlines() or [""])[0]
        return Outcome(name, "failed", f"{type(e).__name__}: {line}", seconds=time.perf_counter() - t0)
    return Outcome(name, "done", acc=last.get("test/acc"), seconds=time.perf_counter() - t0)


def _line(o: Outcome) -> str:
    acc = f"  acc {o.acc:.4f}" if o.acc is not None else ""
    secs = f"  {o.seconds:.0f}s" if o.seconds else ""
    msg = f"  {o.message}" if o.message and o.status != "done" else ""
    return f"{o.status:8s} {o.name}{acc}{secs}{msg}"


def run_sweep(
    specs: list[RunSpec],
    jobs: int = 1,
    progress: bool = True,
    on_outcome: Callable[[Outcome], None] | None = None,
    backend: Backend | None = None,
) -> SweepResult:
    """Run every spec that is not done: finished runs are skipped, interrupted ones resumed, diverged ones
    recorded but not retried. ``jobs`` > 1 runs that many spawned processes, one run per task; a ``backend``
    (``RayBackend``) runs each as a task on a Ray cluster instead (``jobs`` then does not apply)."""
    result = SweepResult()
    todo: list[RunSpec] = []
    for s in specs:
        state = run_state(s.run_dir, s.cfg.rounds)  # "short": extended, or one line if it has no checkpoint
        if state.status == "done":
            result.outcomes.append(Outcome(s.name, "skipped", "done before"))
        elif state.status == "diverged":
            result.outcomes.append(Outcome(s.name, "diverged", f"(earlier) {state.message}"))
        else:
            todo.append(s)
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="sweep", unit="run", disable=not progress)
    echo = bar.write if progress else (lambda _: None)
    if len(specs) > len(todo):
        echo(f"{result.count('skipped')} runs already done, {result.count('diverged')} diverged before (not retried)")

    def record(o: Outcome) -> None:
        result.outcomes.append(o)
        bar.update()
        echo(_line(o))
        if on_outcome is not None:
            on_outcome(o)

    try:
        if backend is not None:
            if todo:
                backend.run(todo, record, echo)
        elif jobs <= 1 or len(todo) <= 1:
            for s in todo:
                bar.set_postfix_str(s.name)
                record(run_spec(s.cfg, str(s.run_dir), threads=share_of_cores(1)))  # the rule of jobs > 1
        else:
            ctx = multiprocessing.get_context("spawn")  # fork would copy the parent's torch threads and locks
            with ProcessPoolExecutor(
                jobs, mp_context=ctx, initializer=_init_worker, initargs=(share_of_cores(jobs), os.getpid())
            ) as ex:
                futures = {ex.submit(run_spec, s.cfg, str(s.run_dir)): s for s in todo}
                try:
                    for fut in as_completed(futures):
                        try:
                            record(fut.result())
                        except Exception as e:  # the worker process itself died (e.g. out of memory)
                            record(Outcome(futures[fut].name, "failed", f"{type(e).__name__}: {e}"))
                except KeyboardInterrupt:  # stop the workers as a kill would; their runs resume from checkpoints
                    for proc in list(getattr(ex, "_processes", {}).values()):
                        proc.terminate()
                    ex.shutdown(wait=False, cancel_futures=True)
                    raise
    except KeyboardInterrupt:  # one line: what is finished, and that the same command continues
        from hafedho.sim.runner import Interrupted

        done = sum(run_state(s.run_dir, s.cfg.rounds).status == "done" for s in specs)
        raise Interrupted(
            f"sweep interrupted with {done} of {len(specs)} runs done; run the same command again to continue "
            "(finished runs are skipped, interrupted ones resume from their last checkpoint)"
        ) from None
    finally:
        bar.close()
    return result
