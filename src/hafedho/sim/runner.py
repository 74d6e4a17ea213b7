"""The simulator's round loop: sample, broadcast, run the cohort on an engine, then the shared bookkeeping
(``hafedho.runtime.rounds.ServerRounds``: server update, divergence check, evaluation, metrics row, checkpoint) into the
run directory (``hafedho.runtime.rundir.RunDir``).

A run lives on its ``device`` (``core.device``): the runner moves the model and the data there once, keeps the
server state, the client store (where ``client_store`` places it) and every pass there, and applies the run's
``precision`` to every round."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import torch
from tqdm import tqdm

from hafedho.core import ConfigError, tree
from hafedho.core.device import describe, free_bytes, precision, resolve_device
from hafedho.experiment import Experiment
from hafedho.runfiles import RunDirError
from hafedho.runtime.rounds import BLOWUP_ROUNDS, Divergence, ServerRounds, run_facts
from hafedho.runtime.rundir import Interrupted, RunDir, interrupted_text
from hafedho.runtime.store import ClientStore, placement
from hafedho.runtime.work import Engine, RoundWork, WorkerLost, available_cores
from hafedho.sim.engines.make import engine_for, engine_label
from hafedho.sim.fullgrad import fresh, params_dtype, prepare_round

__all__ = ["Divergence", "Interrupted", "run"]  # raised by run(), so callers catch them from here

DATA_ON_GPU_SHARE = 0.25  # the data moves to the GPU while its arrays take at most this share of the GPU's memory


def run(exp: Experiment, run_dir: str | Path, resume: bool = False, force: bool = False, progress: bool = True) -> dict:
    """Run (or continue) an experiment in ``run_dir``; returns the last metrics row.

    Only one writer at a time: while another holds the run's ``RunLock``, this one is refused with ``RunBusy``.
    Resuming a run finished at ``cfg.rounds`` changes nothing and returns its last row. Runs with ``cfg.threads``
    torch threads (0: as set before) and restores the caller's setting afterwards.
    """
    fresh = not Path(run_dir).exists()
    try:
        device = resolve_device(exp.cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # The engine and its options, as the registry declares them (or a user's, by reference): built before the
    # run's lock is taken, so a bad one is refused before anything is written; closed with the run (a worker
    # pool never outlives it, also on Divergence or Ctrl-C).
    engine = engine_for(exp.cfg, device)
    with closing(engine), RunDir(run_dir) as rd:
        previous = torch.get_num_threads()
        if exp.cfg.threads:
            torch.set_num_threads(exp.cfg.threads)
        try:
            with precision(exp.cfg.precision):
                return _run(exp, rd, resume, force, progress, engine, device)
        except KeyboardInterrupt:
            rd.wait()  # the checkpoint being written, if any, is the one --resume continues from
            raise Interrupted(interrupted_text(rd.path)) from None
        except Divergence:
            raise  # its marker and checkpoint stay
        except WorkerLost as e:  # a killed worker: the run is as resumable as after a Ctrl-C
            rd.wait()
            raise RunDirError(f"{e}; {interrupted_text(rd.path)}") from None
        except torch.cuda.OutOfMemoryError:
            if fresh:
                rd.discard_unstarted()
            raise ConfigError(_out_of_memory_text(device, rd.path)) from None
        except Exception:
            if fresh:  # e.g. a user's server_update that failed in round 1: no directory left behind
                rd.discard_unstarted()
            raise
        finally:
            torch.set_num_threads(previous)


def _out_of_memory_text(device: torch.device, run_dir: Path) -> str:
    """One line for a run that did not fit on its GPU: what it held, what was free, and the settings that help."""
    held = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        held = (
            f" (this run held up to {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB of {total:.1f}; "
            f"{free_bytes(device) / 2**30:.1f} GiB free now, other processes hold the rest)"
        )
    return (
        f"{run_dir.name}: out of GPU memory on {device}{held}: run fewer runs on this GPU at once (sweep --jobs), "
        "set vmap_chunk, client_store=memory, or device=cpu; --resume continues from the last checkpoint"
    )


class _Threads:
    """A reusable ``with`` block that runs under ``n`` torch threads and restores the setting after."""

    def __init__(self, n: int) -> None:
        self.n, self.previous = n, n

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


def server_threads(engine: Engine) -> int:
    """Torch threads for the runner's own passes (evaluation, the full-data pass, the start loss): the run's,
    or every core an engine's workers hold (``engine.cores``, the process engine's), since they idle meanwhile."""
    return max(torch.get_num_threads(), min(int(getattr(engine, "cores", 0)), available_cores()))


def _run(
    exp: Experiment, rd: RunDir, resume: bool, force: bool, progress: bool, engine: Engine, device: torch.device
) -> dict:
    cfg, alg, fed, model = exp.cfg, exp.alg, exp.fed, exp.model
    if rd.prepare(cfg, resume, force, exp.partition):
        return rd.rows()[-1]  # finished: nothing to do
    model.use_compile(cfg.compile, on_fallback=lambda text: tqdm.write(f"warning: {text}"))
    model.to(device)
    gpu = device.type == "cuda"  # the data moves too, while it takes at most DATA_ON_GPU_SHARE of the GPU
    fed.to(device, int(DATA_ON_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory) if gpu else None)

    params0 = model.params()
    shapes = {k: tuple(v.shape) for k, v in params0.items()}  # what uploads keyed by a parameter must fit
    server = tree.to(alg.init_server(params0), device)
    template = tree.to(alg.init_client(params0), device)
    need = fed.num_clients * ClientStore.template_nbytes(template)
    place = placement(cfg.client_store, need, device, free_bytes(device))
    store = ClientStore(template, fed.num_clients, rd.path / "client_store" if place == "disk" else None, device, place)
    label = engine_label(cfg, engine)
    where = _where(device, label, cfg.precision, place, need)
    if progress:
        tqdm.write(f"{cfg.run_name}: {where}")
    facts = {"device": describe(device), "engine": label, "precision": cfg.precision, "client_store": place}
    start, server, wall = rd.resume(server, store) if resume else (1, server, 0.0)  # checked before any write
    rd.start(exp.partition, run_facts(exp, warn=lambda text: tqdm.write(f"warning: {text}"), **facts))
    rd.truncate(start - 1)  # rounds after the checkpoint are recomputed identically

    server_rounds = ServerRounds(exp, server, rd, start, wall)
    plan, idle = exp.plan, _Threads(server_threads(engine))
    bar = tqdm(range(start, cfg.rounds + 1), desc=cfg.run_name, disable=not progress, leave=False)
    for t in bar:
        cohort = exp.cohort(t)
        rnd, msg = server_rounds.begin(t, len(cohort))
        # the full-data pass where the algorithm or [diagnostics] asks for it (sim/fullgrad.py); else nothing
        with idle:
            params = alg.eval_params(server_rounds.server)
            msg, diag, untimed, full = prepare_round(exp, params, msg, rnd, cohort.tolist(), store)
        server_rounds.untimed(untimed)
        out = engine(RoundWork(alg, msg, fed, plan, model, rnd, cfg.seed, shapes), cohort, store)
        if t <= BLOWUP_ROUNDS:
            with idle:  # the early blow-up guard's reference loss, once per run
                server_rounds.start_loss()
        row = server_rounds.finish_round(t, out, len(cohort), len(cohort), **diag)
        if full is not None and out.aggregate is not None:  # after wall_s was taken: the uploads against w_t
            with idle:
                row.update(fresh(exp, server_rounds.server, rnd, cohort.tolist(), store, full, params_dtype(params)))
        with idle:
            ev = server_rounds.evaluate(t, row, store.gather)
        if ev is not None:
            bar.set_postfix(acc=f"{ev['acc']:.3f}")
        server_rounds.commit(t, row, store)
    bar.close()
    rd.mark_done()
    return server_rounds.rows[-1] if server_rounds.rows else {}


def _where(device: torch.device, engine: str, policy: str, place: str, store_bytes: int) -> str:
    """A run's first line: where it runs, on which engine, at which precision, and where its client store is."""
    store = {"device": "on the GPU", "memory": "in RAM", "disk": "memory-mapped on disk"}[place]
    size = f"client store {_size(store_bytes)} {store}" if store_bytes else "no client state"
    return f"device {describe(device)}, engine {engine}, precision {policy}, {size}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
