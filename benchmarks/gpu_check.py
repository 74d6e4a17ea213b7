"""The prepared GPU check: equality with the CPU reference, whole runs against a device-resident reference and the
usual per-client loop, the largest cohort, and several runs on one GPU, side by side in one process tree.

    python benchmarks/gpu_check.py --out "$OUT"                      # on the lent GPU (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/g  # the dry run on a CPU (about 2 minutes)
    python benchmarks/gpu_check.py --render OUT/gpu_check.jsonl --doc docs/benchmarks.md   # the table, here

Parts (``--parts``, in this order; each appends JSON lines to ``OUT/gpu_check.jsonl`` as it finishes, so a run
stopped by its time limit still returns what it measured):

* ``algorithms``: every registered algorithm as a whole run on the device (``vmap`` and ``loop``) against the CPU
  reference, the final test loss (the smoke experiment with an MLP, 3 rounds).
* ``check``: hafedho's ``vmap`` on the device against its ``loop`` engine on the CPU, one round, on the FEMNIST CNN
  (8 clients, 10 steps) and ResNet-18-GN on CIFAR-10 (4 clients, 3 steps), within the float32 bound of
  ``tests/tolerance.py`` (dropout off: the engines draw other masks; the models smoothed as the tests smooth them,
  softplus for ReLU and average for max pooling, since a kink turns a rounding difference into an O(1) one), under
  the default precision (fp32) and, for comparison, under tf32. The ratio error / bound is reported: <= 1 passes.
* ``femnist``: HaFedHo on the FEMNIST CNN, 340 clients a round (an iid split of the shared 14,708-image sample into
  1,400 clients), an evaluation every 5 rounds and a checkpoint every 50, as a whole run (``sim.runner.run``, what
  ``hafedho run`` calls), at fp32 and tf32; beside it, the device-resident reference (``Reference``) and the usual
  per-client loop (``bench_engines.UsualLoop``) on the same device.
* ``cifar``: the same for HaFedHo on CIFAR-10 with ResNet-18-GN (100 clients, Dirichlet q = 0.3, 10 a round,
  lr 0.02).
* ``evaluation``: one evaluation of the 10,000 CIFAR-10 test images on ResNet-18-GN on its own.
* ``big``: Fig. 2's 1,020 clients a round (FEMNIST CNN, HaFedHo), with its peak memory.
* ``jobs``: K = 1, 2, 4 CIFAR-10 runs side by side on one GPU (``hafedho run`` processes), seconds per round each.

A whole run's cost per round = a training round (median over rounds 2.., evaluation and checkpoint excluded) +
one evaluation / eval_every + what one checkpoint holds the run up for / checkpoint_every, each measured in the run
itself. A checkpoint holds the run up while its state is taken; its writing runs in the background over the next
checkpoint_every rounds, and any part of it those rounds would not cover counts too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "src")]

from bench_engines import UsualLoop  # noqa: E402
from doc_sections import markers, write_section  # noqa: E402
from tolerance import bound, longest_reduction, smooth  # noqa: E402

from hafedho.config import CONFIG_DIR, load_config  # noqa: E402
from hafedho.core import RoundInfo  # noqa: E402
from hafedho.core.device import precision  # noqa: E402
from hafedho.experiment import build  # noqa: E402
from hafedho.runtime.rounds import ServerRounds  # noqa: E402
from hafedho.runtime.rundir import RunDir  # noqa: E402
from hafedho.runtime.store import ClientStore  # noqa: E402
from hafedho.runtime.work import RoundWork  # noqa: E402
from hafedho.sim.engines.loop import LoopEngine  # noqa: E402
from hafedho.sim.engines.vmap import VmapEngine  # noqa: E402
from hafedho.sim.runner import run  # noqa: E402

OUT: Path = Path(".")
QUICK = False
PRECISIONS = ["fp32", "tf32"]
USUAL = True


def emit(record: dict[str, Any]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(OUT / "gpu_check.jsonl", "a") as f:
        f.write(line + "\n")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


# ----------------------------------------------------------------------------- the workloads


def femnist(data: str, clients: int, cohort: int, **extra: str) -> list[str]:
    return [
        "data.source=femnist",
        f"data.path={data}",
        "data.partition=iid",
        f"data.num_clients={clients}",
        "model.name=femnist_cnn",
        "clients.local_steps=10",
        "clients.batch_size=20",
        f"sampling.cohort_size={cohort}",
        "algorithm.name=hafedho",
        "algorithm.lr=0.05",
        *(f"{k}={v}" for k, v in extra.items()),
    ]


def cifar(data: str, clients: int = 100, cohort: int = 10, **extra: str) -> list[str]:
    return [
        "data.source=cifar10",
        f"data.path={data}",
        "data.partition=dirichlet",
        "data.q=0.3",
        f"data.num_clients={clients}",
        "model.name=resnet18_gn",
        "clients.local_steps=10",
        "clients.batch_size=20",
        f"sampling.cohort_size={cohort}",
        "algorithm.name=hafedho",
        "algorithm.lr=0.02",
        *(f"{k}={v}" for k, v in extra.items()),
    ]


def experiment(overrides: list[str]) -> Any:
    quick = ["clients.local_steps=2"] if QUICK else []  # a dry run on a CPU exercises the code, not the sizes
    return build(load_config(CONFIG_DIR / "smoke.toml", [*overrides, *quick]))


def no_dropout(exp: Any) -> Any:
    for m in exp.model.module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return exp


# ----------------------------------------------------------------------------- check: vmap on the device = loop


def one_round(exp: Any, engine: Any, cohort: np.ndarray, dev: torch.device) -> Any:
    """One round of ``engine`` on ``dev``: the aggregate, on the CPU."""
    exp.model.to(dev)
    exp.fed.to(dev)
    alg = exp.alg
    params = exp.model.params()
    server = alg.init_server(params)
    store = ClientStore(alg.init_client(params), exp.fed.num_clients, device=dev, place="device")
    rnd = RoundInfo(1, exp.fed.num_clients, len(cohort))
    out = engine(RoundWork(alg, alg.broadcast(server, rnd), exp.fed, exp.plan, exp.model, rnd, 0), cohort, store)
    leaves = torch.utils._pytree.tree_leaves(out.aggregate)
    return [t.detach().cpu() for t in leaves], store


def ratio(got: list[torch.Tensor], ref: list[torch.Tensor], reduction: int, steps: int) -> float:
    """The largest ||a - b|| / bound over the tensors (tests/tolerance.py's float32 bound)."""
    floats = [b for b in ref if b.is_floating_point()]
    n = sum(b.numel() for b in floats)
    rms = math.sqrt(sum(float(b.double().square().sum()) for b in floats) / n)
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        err = float((a.double() - b.double()).norm())
        worst = max(worst, err / bound(b, rms, reduction=reduction, steps=steps))
    return worst


@contextlib.contextmanager
def smooth_relu() -> Iterator[None]:
    """``F.relu`` is softplus inside the zoo's model modules for the block (``tests/tolerance.py``: a ReLU kink or a
    max-pool tie turns a rounding difference into an O(1) one, which no float bound covers)."""
    import hafedho.models.cnn as cnn
    import hafedho.models.resnet as resnet

    class _F:
        def __getattr__(self, name: str) -> Any:
            return F.softplus if name == "relu" else getattr(F, name)

    saved = [(m, m.F) for m in (cnn, resnet)]
    for m, _ in saved:
        m.F = _F()
    try:
        yield
    finally:
        for m, f in saved:
            m.F = f


def check(dev: torch.device, fem: str, cif: str) -> None:
    cases = [
        ("FEMNIST CNN", femnist(fem, 1400, 8, **{"algorithm.name": "fedavg"}), 8, 10),
        ("ResNet-18-GN", cifar(cif, 20, 4, **{"algorithm.name": "fedavg", "clients.local_steps": "3"}), 4, 3),
    ]
    for name, overrides, m, steps in cases:
        if QUICK:
            m, steps = 2, 2
            overrides = [*overrides, f"clients.local_steps={steps}"]
        exp = no_dropout(experiment(overrides))
        smooth(exp.model.module)  # ReLU modules softplus, max pools average pools; F.relu: smooth_relu
        cohort = np.arange(m)
        with smooth_relu(), precision("fp32"):
            ref, _ = one_round(copy.deepcopy(exp), LoopEngine(), cohort, torch.device("cpu"))
        x = exp.fed.preprocess(exp.fed.x_train[:20])
        reduction = longest_reduction(exp.model.module, x)
        for policy in ("fp32", "tf32"):
            with smooth_relu(), precision(policy):
                got, _ = one_round(copy.deepcopy(exp), VmapEngine(), cohort, dev)
            r = ratio(got, ref, reduction, steps + 1)
            emit({"part": "check", "model": name, "precision": policy, "clients": m, "steps": steps, "ratio": r})


def algorithms(dev: torch.device) -> None:
    """Every registered algorithm as a whole run on the device (vmap and loop) against the CPU reference (loop):
    the smoke experiment with an MLP, 3 rounds; the final test loss's relative difference."""
    from hafedho.algorithms import REGISTRY

    def final(alg: str, *extra: str) -> float:
        cfg = load_config(CONFIG_DIR / "smoke.toml", [f"algorithm.name={alg}", "model.name=mlp", "rounds=3", *extra])
        with tempfile.TemporaryDirectory(prefix="gpu_alg_") as d:
            return float(run(build(cfg), Path(d) / "run", progress=False)["test/loss"])

    worst, failed = {}, {}
    for alg in sorted(REGISTRY):
        try:
            ref = final(alg, "device=cpu", "engine=loop")
            got = [final(alg, f"device={dev}", f"engine={e}") for e in ("vmap", "loop")]
            worst[alg] = max(abs(g - ref) / abs(ref) for g in got)
        except Exception as e:  # one algorithm's failure must not hide the others'
            failed[alg] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1:] if str(e).strip() else ''}"
    emit({"part": "algorithms", "relative_test_loss_difference": worst, "failed": failed})


# ----------------------------------------------------------------------------- whole runs and their parts


class Clock:
    """Wall-clock marks of a run's rows, evaluations and checkpoints (the runner's own methods, wrapped)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.rows: list[float] = []
        self.evals: list[float] = []
        self.ckpts: list[float] = []  # what a checkpoint holds the run up for (taking its state)
        self.writes: list[float] = []  # writing it, in the background
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, into: list[float] | None) -> None:
        real = getattr(owner, name)
        dev = self.dev

        def timed(*args: Any, **kw: Any) -> Any:
            sync(dev)
            t0 = time.perf_counter()
            out = real(*args, **kw)
            sync(dev)
            if into is None:
                self.rows.append(time.perf_counter())
            elif out is not None or name != "evaluate":
                into.append(time.perf_counter() - t0)
            return out

        self._saved.append((owner, name, real))
        setattr(owner, name, timed)

    def __enter__(self) -> Clock:
        self.wrap(ServerRounds, "evaluate", self.evals)
        self.wrap(RunDir, "save_checkpoint", self.ckpts)
        self.wrap(RunDir, "_write", self.writes)
        self.wrap(RunDir, "append", None)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def whole_run(label: str, overrides: list[str], rounds: int, dev: torch.device, policy: str) -> dict[str, Any]:
    """A run through ``sim.runner.run`` (``hafedho run`` minus argument parsing), timed part by part."""
    ev, ck = 5, 50
    t0 = time.perf_counter()
    exp = experiment(
        [
            *overrides,
            f"rounds={rounds}",
            f"eval_every={ev}",
            f"checkpoint_every={ck}",
            f"precision={policy}",
            f"device={dev}",
            "engine=vmap",
        ]
    )
    built = time.perf_counter() - t0
    reset_peak(dev)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as d, Clock(dev) as clock:
        t1 = time.perf_counter()
        run(exp, Path(d) / "run", progress=False)
        total = time.perf_counter() - t1
    marks = [t1, *clock.rows]
    rounds_s = np.diff(marks)
    # a row's interval includes its round's evaluation (rounds 5, 10, ... and the last), never a checkpoint
    # (written after the row); subtract the evaluations to get the training rounds
    ev_rounds = [t for t in range(1, rounds + 1) if t % ev == 0 or t == rounds]
    train = [s - (clock.evals[ev_rounds.index(t)] if t in ev_rounds else 0.0) for t, s in enumerate(rounds_s, 1)]
    train_s = float(np.median(train[1:])) if len(train) > 1 else float(train[0])
    eval_s = float(np.median(clock.evals)) if clock.evals else 0.0
    ckpt_s = float(np.median(clock.ckpts)) if clock.ckpts else 0.0
    write_s = float(np.median(clock.writes)) if clock.writes else 0.0
    # the write overlaps the next ck rounds; what it would not hide (a disk slower than ck rounds) counts too
    unhidden = max(0.0, write_s - ck * train_s)
    return {
        "label": label,
        "precision": policy,
        "rounds": rounds,
        "build_s": built,
        "run_s": total,
        "first_round_s": float(train[0]),
        "train_s": train_s,
        "eval_s": eval_s,
        "ckpt_s": ckpt_s,
        "write_s": write_s,
        "per_round_s": train_s + eval_s / ev + (ckpt_s + unhidden) / ck,
        "peak_gib": peak_gib(dev),
    }


class Reference:
    """The device-resident reference: the cohort's parameters stacked on the device, ``vmap(grad(loss))`` for the S
    steps with HaFedHo's rectified gradient (grad f + mu h, summed as g_i), one mean at the end; batches drawn and
    gathered on the device. No host work, no store, no bookkeeping: the floor a round can approach."""

    def __init__(self, exp: Any, dev: torch.device, mu: float = 0.01) -> None:
        fed, plan = exp.fed, exp.plan
        self.module = copy.deepcopy(exp.model.module).to(dev).train()
        self.params = {k: v.detach().clone() for k, v in self.module.named_parameters()}
        self.g = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.x = fed.preprocess(fed.x_train).to(dev)
        self.y = fed.y_train.to(dev)
        width = int(fed.sizes.max())
        table = np.zeros((fed.num_clients, width), dtype=np.int64)
        for i, p in enumerate(fed.parts):
            table[i, : len(p)] = p
        self.table, self.sizes = torch.from_numpy(table).to(dev), torch.from_numpy(fed.sizes).to(dev)
        self.steps, self.batch, self.lr, self.mu, self.dev = plan.local_steps, plan.batch_size, exp.alg.lr, mu, dev

        def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(self.module, p, (x,)), y)

        self.grad = vmap(grad(loss), randomness="different")

    def round(self, cohort: np.ndarray) -> None:
        c = len(cohort)
        ids = torch.from_numpy(cohort).to(self.dev)
        draw = torch.randint(0, 2**31 - 1, (c, self.steps, self.batch), device=self.dev) % self.sizes[ids].view(c, 1, 1)
        rows = self.table[ids].gather(1, draw.view(c, -1)).view(c, self.steps, self.batch)
        xs, ys = self.x[rows], self.y[rows]
        w = {k: v.unsqueeze(0).expand(c, *v.shape).clone() for k, v in self.params.items()}
        gsum = {k: torch.zeros_like(v) for k, v in w.items()}
        for s in range(self.steps):
            g = self.grad(w, xs[:, s], ys[:, s])
            for k in w:
                step = g[k] + self.mu * self.g[k]
                w[k] = w[k] - self.lr * step
                gsum[k] = gsum[k] + step
        self.g = {k: v.mean(0) for k, v in gsum.items()}
        self.params = {k: self.params[k] - self.lr * self.g[k] for k in self.params}
        sync(self.dev)


def timed_rounds(fn: Any, cohorts: list[np.ndarray], dev: torch.device) -> float:
    """Median seconds of ``fn(cohort)`` over the cohorts after the first (a warm-up)."""
    times = []
    for i, c in enumerate(cohorts):
        sync(dev)
        t0 = time.perf_counter()
        fn(c)
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def baselines(label: str, overrides: list[str], dev: torch.device, policy: str, usual: bool) -> None:
    exp = experiment([*overrides, "engine=loop", "device=cpu"])
    cohorts = [exp.cohort(t) for t in range(1, 4)]
    with precision(policy):
        reset_peak(dev)
        ref = Reference(exp, dev)
        ref_s = timed_rounds(ref.round, cohorts, dev)
        ref_peak = peak_gib(dev)
        del ref
        usual_s = None
        if usual:  # the usual per-client loop: deepcopy, DataLoader, torch.optim, on the same device
            loop = UsualLoop(exp)
            loop.device, loop.net = dev, loop.net.to(dev)
            usual_s = timed_rounds(loop, [cohorts[0][:2], cohorts[1]], dev)
            del loop
    emit(
        {
            "part": label,
            "what": "baselines",
            "precision": policy,
            "reference_s": ref_s,
            "reference_peak_gib": ref_peak,
            "usual_s": usual_s,
        }
    )


def workload(label: str, overrides: list[str], dev: torch.device, rounds: int) -> None:
    for policy in PRECISIONS:
        emit({"part": label, "what": "run", **whole_run(label, overrides, rounds, dev, policy)})
        baselines(label, overrides, dev, policy, usual=USUAL)


def evaluation(cif: str, dev: torch.device) -> None:
    """One evaluation of the CIFAR-10 test set on ResNet-18-GN, as a run's evaluation rounds do it."""
    from hafedho.core.model import evaluate

    exp = experiment([*cifar(cif), f"device={dev}"])
    exp.model.to(dev)
    exp.fed.to(dev)
    x, y = exp.fed.test_set()
    if QUICK:
        x, y = x[:64], y[:64]
    for policy in ("fp32", "tf32"):
        with precision(policy):
            evaluate(exp.model, exp.model.params(), x, y)  # warm-up (kernel choice)
            sync(dev)
            t0 = time.perf_counter()
            evaluate(exp.model, exp.model.params(), x, y)
            sync(dev)
            chunk = exp.model.rows_per_pass(tuple(x.shape[1:]), x.dtype)
            emit(
                {
                    "part": "cifar",
                    "what": "evaluation",
                    "precision": policy,
                    "images": len(y),
                    "chunk": chunk,
                    "seconds": time.perf_counter() - t0,
                }
            )


def big(fem: str, dev: torch.device, cohort: int) -> None:
    label = f"femnist-{cohort}"
    emit(
        {
            "part": "big",
            "what": "run",
            "clients": cohort,
            **whole_run(label, femnist(fem, 1400, cohort), 3, dev, "fp32"),
        }
    )


def side_by_side(cif: str, dev: torch.device, ks: list[int], rounds: int) -> None:
    """K CIFAR-10 runs at once, each its own ``hafedho run`` process on the same device."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FLWR_TELEMETRY_ENABLED": "0"}
    for k in ks:
        with tempfile.TemporaryDirectory(prefix="gpu_jobs_") as d:
            t0 = time.perf_counter()
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hafedho.cli",
                        "run",
                        str(CONFIG_DIR / "smoke.toml"),
                        *cifar(cif),
                        f"seed={i}",
                        f"rounds={rounds}",
                        f"eval_every={rounds}",
                        f"checkpoint_every={rounds}",
                        f"device={dev}",
                        "--out",
                        d,
                        "--quiet",
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                for i in range(k)
            ]
            outs = [p.communicate() for p in procs]
            wall = time.perf_counter() - t0
            per_round, failed = [], []
            for (_, err), p in zip(outs, procs, strict=True):
                if p.returncode:
                    failed.append(err.decode().strip().splitlines()[-1:])
            for m in Path(d).glob("*/metrics.jsonl"):
                rows = [json.loads(line) for line in m.read_text().splitlines()]
                w = [r["wall_s"] for r in rows]
                per_round.append((w[-1] - w[0]) / max(len(w) - 1, 1))  # rounds 2..R, no evaluation in wall_s
            emit({"part": "jobs", "k": k, "rounds": rounds, "wall_s": wall, "per_round_s": per_round, "failed": failed})


# ----------------------------------------------------------------------------- the table


def render(records: list[dict[str, Any]], device: str) -> str:
    by = lambda **kw: [r for r in records if all(r.get(k) == v for k, v in kw.items())]
    lines = [f"Device: {device}.", ""]
    for r in by(part="error"):
        lines += [f"- part {r['name']} failed: {r['error']}", ""]
    for r in by(part="algorithms"):
        if r.get("failed"):
            lines += [f"- failed on the GPU: {r['failed']}", ""]
        if not r["relative_test_loss_difference"]:
            continue
        worst = max(r["relative_test_loss_difference"].items(), key=lambda kv: kv[1])
        lines += [
            f"All {len(r['relative_test_loss_difference'])} algorithms as whole runs on the GPU (`vmap` and `loop`, "
            f"3 rounds of the smoke experiment with an MLP) against `loop` on the CPU: final test loss within "
            f"{worst[1]:.1e} (relative; largest: {worst[0]}).",
            "",
        ]
    checks = by(part="check")
    if checks:
        lines += ["**vmap on the GPU against loop on the CPU**, one round (error / float32 bound; <= 1 passes):", ""]
        lines += ["| model | clients x steps | fp32 (default) | tf32 |", "|---|---|---|---|"]
        for model in dict.fromkeys(r["model"] for r in checks):
            rs = {r["precision"]: r for r in checks if r["model"] == model}
            first = next(iter(rs.values()))
            cells = [
                f"{rs[p]['ratio']:.3g} ({'pass' if rs[p]['ratio'] <= 1 else 'FAIL'})" if p in rs else ""
                for p in ("fp32", "tf32")
            ]
            lines.append(f"| {model} | {first['clients']} x {first['steps']} | {cells[0]} | {cells[1]} |")
        lines.append("")
    for label, title in (
        ("femnist", "HaFedHo, FEMNIST CNN, 340 clients a round"),
        ("cifar", "HaFedHo, CIFAR-10, ResNet-18-GN, 10 clients a round"),
    ):
        runs = by(part=label, what="run")
        if not runs:
            continue
        lines += [f"**{title}** (eval every 5, checkpoint every 50; seconds):", ""]
        head = "| precision | whole run s/round | training round | evaluation | checkpoint (taken / written) | "
        head += "reference s/round | whole / reference | usual loop s/round | usual / whole | peak GiB |"
        lines += [head, "|" + "---|" * 10]
        for r in runs:
            b = next(iter(by(part=label, what="baselines", precision=r["precision"])), {})
            ref, usual = b.get("reference_s"), b.get("usual_s")
            rr = f"{r['per_round_s'] / ref:.2f}x" if ref else ""
            uu = f"{usual / r['per_round_s']:.1f}x" if usual else ""
            lines.append(
                f"| {r['precision']} | **{r['per_round_s']:.3f}** | {r['train_s']:.3f} | {r['eval_s']:.3f} | "
                f"{r['ckpt_s']:.2f} / {r.get('write_s', r['ckpt_s']):.1f} | {ref or 0:.3f} | {rr} | {usual or 0:.3f} | "
                f"{uu} | {r['peak_gib'] or 0:.2f} |"
            )
        lines.append("")
    for r in by(part="cifar", what="evaluation"):
        lines.append(
            f"- Evaluation of {r['images']:,} CIFAR-10 test images on ResNet-18-GN ({r['precision']}, chunks of "
            f"{r['chunk']}): **{r['seconds']:.3f} s**."
        )
    for r in by(part="big"):
        lines.append(
            f"- HaFedHo, FEMNIST CNN, {r['clients']:,} clients a round (fp32): {r['train_s']:.2f} s a training round, "
            f"peak {r['peak_gib'] or 0:.1f} GiB of GPU memory (the 1,400-client store on the GPU included)."
        )
    jobs = by(part="jobs")
    if jobs:
        lines += ["", "**Runs side by side on one GPU** (CIFAR-10 ResNet-18-GN runs, 10 clients a round):", ""]
        lines += ["| runs at once | s/round each | rounds/s in all | vs one run |", "|---|---|---|---|"]
        one = None
        for r in jobs:
            if not r["per_round_s"]:
                lines.append(f"| {r['k']} | failed: {r['failed']} | | |")
                continue
            each = float(np.median(r["per_round_s"]))
            total = len(r["per_round_s"]) / each
            one = one or total
            lines.append(f"| {r['k']} | {each:.3f} | {total:.2f} | {total / one:.2f}x |")
    return "\n".join(lines) + "\n"


def merged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of several calls, in order: a later record replaces an earlier one of the same part, kind, precision
    and size, keeping the earlier one's measures that the later one left out (None)."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in records:
        key = (r.get("part"), r.get("what"), r.get("model"), r.get("precision"), r.get("k"), r.get("name"))
        old = out.get(key, {})
        out[key] = {**old, **{k: v for k, v in r.items() if v is not None or k not in old}}
    return list(out.values())


def main() -> None:
    global OUT, QUICK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--femnist", default=".gpu-data/femnist_leaf_sf05.tar.gz")
    ap.add_argument("--cifar", default=".gpu-data/cifar10_sub.zip")
    ap.add_argument("--parts", default="check,femnist,cifar,evaluation,big,algorithms,jobs")
    ap.add_argument("--quick", action="store_true", help="small sizes: a dry run on the CPU")
    ap.add_argument("--precisions", default="fp32,tf32", help="of the femnist and cifar parts")
    ap.add_argument("--no-usual", action="store_true", help="leave the usual per-client loop out of those parts")
    ap.add_argument(
        "--render", type=Path, nargs="+", help="only write the table of these gpu_check.jsonl (later ones win)"
    )
    ap.add_argument("--doc", type=Path, help="write the table into this page's gpu_check section")
    args = ap.parse_args()
    if args.render:
        records = merged([json.loads(line) for f in args.render for line in f.read_text().splitlines()])
        device = next((r["device"] for r in records if r.get("part") == "device"), "?")
        text = render([r for r in records if r.get("part") != "device"], device)
    else:
        global PRECISIONS, USUAL
        OUT, QUICK, PRECISIONS, USUAL = args.out, args.quick, args.precisions.split(","), not args.no_usual
        OUT.mkdir(parents=True, exist_ok=True)
        dev = torch.device(args.device)
        name = f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}" if dev.type == "cuda" else "cpu"
        emit({"part": "device", "device": name})
        t0, parts = time.perf_counter(), args.parts.split(",")
        m = 8 if QUICK else 340
        for part in parts:
            t = time.perf_counter()
            try:
                run_part(part, dev, args, m)
            except Exception as e:  # the next parts still run; the table says what failed
                emit({"part": "error", "name": part, "error": f"{type(e).__name__}: {str(e).strip()[:500]}"})
                traceback.print_exc()
            print(f"# {part}: {time.perf_counter() - t:.0f} s (total {time.perf_counter() - t0:.0f} s)", flush=True)
        records = [json.loads(line) for line in (OUT / "gpu_check.jsonl").read_text().splitlines()]
        text = render([r for r in records if r.get("part") != "device"], name)
        (OUT / "gpu_check.md").write_text(text)
    print(text)
    if args.doc:
        start, end = markers("gpu_check")
        section = "\n".join([start, "## GPU: a run that lives on the device", "", text, end]) + "\n\n"
        write_section(args.doc, "gpu_check", section)


def run_part(part: str, dev: torch.device, args: argparse.Namespace, m: int) -> None:
    quick = QUICK
    if part == "algorithms":
        algorithms(dev)
    elif part == "check":
        check(dev, args.femnist, args.cifar)
    elif part == "femnist":
        workload("femnist", femnist(args.femnist, 40 if quick else 1400, m), dev, 3 if quick else 11)
    elif part == "cifar":
        workload("cifar", cifar(args.cifar, 20 if quick else 100, 2 if quick else 10), dev, 3 if quick else 11)
    elif part == "evaluation":
        evaluation(args.cifar, dev)
    elif part == "big":
        big(args.femnist, dev, 12 if quick else 1020)
    elif part == "jobs":
        side_by_side(args.cifar, dev, [1, 2] if quick else [1, 2, 4], 3 if quick else 6)
    else:
        raise ValueError(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
