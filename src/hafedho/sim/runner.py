"""The round loop: sample, broadcast, run the cohort, aggregate, server update, evaluate, log, checkpoint."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hafedho.core import RoundInfo, tree
from hafedho.core.model import evaluate
from hafedho.experiment import Experiment
from hafedho.results import (
    RunBusy,
    RunDirError,
    RunLock,
    append_metrics,
    atomic_write_text,
    environment,
    read_metrics,
    truncate_metrics,
    write_json,
)
from hafedho.rounds import Divergence, personal_accuracy
from hafedho.rundir import prepare_run_dir, save_checkpoint
from hafedho.sim import checkpoint
from hafedho.sim.engines import Engine, RoundWork, make_engine
from hafedho.sim.store import ClientStore

DISK_STORE_ABOVE = 2 * 1024**3  # client_store="auto": memory-map per-client state larger than this


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says which round ``--resume`` continues from."""


def run(exp: Experiment, run_dir: str | Path, resume: bool = False, force: bool = False, progress: bool = True) -> dict:
    """Run (or continue) an experiment in ``run_dir``; returns the last metrics row.

    Only one writer at a time: while another holds the run's ``RunLock``, this one is refused with ``RunBusy``.
    Resuming a run finished at ``cfg.rounds`` changes nothing and returns its last row. Runs with ``cfg.threads``
    torch threads (0: as set before) and restores the caller's setting afterwards.
    """
    run_dir = Path(run_dir)
    lock = RunLock(run_dir)
    with lock as held:
        if not held:
            raise RunBusy(f"{run_dir} is being written by another process (pid {lock.holder}); wait for it to end")
        previous = torch.get_num_threads()
        if exp.cfg.threads:
            torch.set_num_threads(exp.cfg.threads)
        engine = make_engine(exp.cfg.engine, workers=exp.cfg.workers, vmap_chunk=exp.cfg.vmap_chunk)
        try:  # a worker pool never outlives the run, also on Divergence or Ctrl-C
            return _run(exp, run_dir, resume, force, progress, engine)
        except KeyboardInterrupt:
            raise Interrupted(_interrupted_text(run_dir)) from None
        finally:
            engine.close()
            torch.set_num_threads(previous)


def _interrupted_text(run_dir: Path) -> str:
    """Where a Ctrl-C left the run: the last logged round and the checkpoint ``--resume`` continues from."""
    try:
        rows = read_metrics(run_dir)
    except RunDirError:
        rows = []
    try:
        ckpt = int(torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)["round"])
    except Exception:  # no checkpoint yet, or one being replaced: resume starts over / from the older one
        ckpt = 0
    done = rows[-1]["round"] if rows else 0
    if ckpt >= done:
        how = f"it continues after round {ckpt}" if ckpt else "it starts at round 1"
    elif ckpt:
        redo = f"round {done} is" if done == ckpt + 1 else f"rounds {ckpt + 1}-{done} are"
        how = f"from the checkpoint of round {ckpt}; {redo} recomputed identically"
    else:
        how = "no checkpoint yet: it starts over at round 1"
    return f"{run_dir}: interrupted at round {done}; continue with --resume ({how})"


def _run(exp: Experiment, run_dir: Path | str, resume: bool, force: bool, progress: bool, engine: Engine) -> dict:
    cfg, alg, fed, model = exp.cfg, exp.alg, exp.fed, exp.model
    run_dir = Path(run_dir)
    if prepare_run_dir(run_dir, cfg, resume, force):
        return read_metrics(run_dir)[-1]  # finished: nothing to do
    (run_dir / "done").unlink(missing_ok=True)
    (run_dir / "diverged").unlink(missing_ok=True)
    write_json(run_dir / "env.json", environment())
    write_json(run_dir / "partition.json", exp.partition)
    plan = exp.plan
    lam = int(max(plan.steps_for(int(n)) for n in fed.sizes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notes = alg.run_notes(lam)
    for w in caught:
        tqdm.write(f"warning: {w.message}")
    write_json(run_dir / "run.json", {"notes": notes, "warnings": [str(w.message) for w in caught], "lambda": lam})

    params0 = model.params()
    server = alg.init_server(params0)
    template = alg.init_client(params0)
    on_disk = cfg.client_store == "disk" or (
        cfg.client_store == "auto" and fed.num_clients * ClientStore.template_nbytes(template) > DISK_STORE_ABOVE
    )
    store = ClientStore(template, fed.num_clients, run_dir / "client_store" if on_disk else None)
    start, wall = 1, 0.0
    ckpt = run_dir / "checkpoint.pt"
    if resume and ckpt.exists():
        done_round, server, store_leaves, extra = checkpoint.load(ckpt, server)
        if "store_dir" in extra:
            store.restore(run_dir / extra["store_dir"])
        else:
            store.load_state_dict(store_leaves)
        start, wall = done_round + 1, float(extra.get("wall_s", 0.0))
    truncate_metrics(run_dir, start - 1)  # rounds after the checkpoint are recomputed identically

    x_test, y_test = fed.x_test(), fed.y_test
    last: dict[str, Any] = {}
    bar = tqdm(range(start, cfg.rounds + 1), desc=cfg.run_name, disable=not progress, leave=False)
    for t in bar:
        t0 = time.perf_counter()
        cohort = exp.cohort(t)
        rnd = RoundInfo(t, fed.num_clients, len(cohort))
        msg = alg.broadcast(server, rnd)
        out = engine(RoundWork(alg, msg, fed, plan, model, rnd, cfg.seed), cohort, store)
        server, server_metrics = alg.server_update(server, out.aggregate, rnd)
        row: dict[str, Any] = {"round": t, "cohort_size": len(cohort), **out.metrics, **server_metrics}
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad or not tree.all_finite(alg.eval_params(server)):
            what = f"{bad[0]} is {row[bad[0]]}" if bad else "the global model has non-finite values"
            good = f"round {start - 1} in {ckpt}" if start > 1 or ckpt.exists() else "none"
            hint = "lower algorithm.lr or the algorithm's coefficients"
            msg_text = f"run diverged at round {t}: {what} ({hint}); last good checkpoint: {good}"
            atomic_write_text(run_dir / "diverged", msg_text + "\n")
            raise Divergence(msg_text)
        wall += time.perf_counter() - t0
        if t % cfg.eval_every == 0 or t == cfg.rounds:
            ev = evaluate(model, alg.eval_params(server), x_test, y_test)
            row.update({"test/acc": ev["acc"], "test/loss": ev["loss"]})
            if fed.local_test is not None:
                row["test/personal_acc"] = personal_accuracy(alg, server, store, fed, model)
            bar.set_postfix(acc=f"{ev['acc']:.3f}")
        row.update(
            {"wall_s": round(wall, 4), "bytes_up": out.bytes_up, "bytes_down": len(cohort) * tree.num_bytes(msg)}
        )
        append_metrics(run_dir, row)
        last = row
        if t % cfg.checkpoint_every == 0 or t == cfg.rounds:
            save_checkpoint(run_dir, t, server, store, wall)
            start = t + 1
    bar.close()
    atomic_write_text(run_dir / "done", "")
    return last
