"""Engine benchmark: the usual framework loop vs hafedho's ``loop``, ``process`` and ``vmap`` engines.

Workloads (FedAvg unless ``--algorithms`` says otherwise):

* FEMNIST CNN (``femnist_cnn``, 1.2M parameters) on the real FEMNIST writers in ../shared/data: 34 clients x
  10 steps x batch 20 per round on a CPU (340 clients on a GPU).
* CIFAR CNN (``cifar_cnn``) on CIFAR-10: 10 clients x 50 steps x batch 50 per round.

"usual" re-creates what most FL frameworks do per client: ``copy.deepcopy`` + ``load_state_dict`` of an
``nn.Module``, a ``DataLoader`` over a ``TensorDataset`` of the client's data, a fresh ``torch.optim.SGD`` and
``loss.backward()``, then a weighted average of the state dicts.

Each engine runs in its own process (so its peak memory is its own), all built from the same config; the
driver asks them for one round at a time, in turn, so slow drifts in machine load hit every engine alike.
Every engine does a short warm-up round first; the table gives medians over ``--reps`` rounds (fewer for an
engine whose warm-up predicts more than ``--budget`` seconds of them). GFLOP/s counts 3 x the forward FLOPs
(``hafedho.models.count_flops``) per real example; the peak is a large fp32 ``torch.mm`` on all cores, best
of several.

    python benchmarks/bench_engines.py                  # writes docs/benchmarks.md and prints it
    python benchmarks/bench_engines.py --workloads femnist --reps 3 --engines usual,process
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from doc_sections import other_sections
from torch.utils.data import DataLoader, TensorDataset

from hafedho.config import CONFIG_DIR, load_config
from hafedho.core import RoundInfo
from hafedho.experiment import build
from hafedho.models import count_flops
from hafedho.runtime.work import RoundWork, available_cores
from hafedho.sim.engines.make import make_engine

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
ENGINES = ("usual", "loop", "process", "vmap")

WORKLOADS: dict[str, dict[str, Any]] = {
    "femnist": {
        "title": "FEMNIST CNN",
        "overrides": [
            "data.source='femnist'",
            "data.partition='natural'",
            "data.num_clients=0",
            "model.name='femnist_cnn'",
            "sampling.cohort_size=34",
            "clients.local_steps=10",
            "clients.batch_size=20",
        ],
        "gpu_overrides": [  # 340 clients need more than the 105 writers of the shared sample: an iid split
            "data.partition='iid'",
            "data.num_clients=700",
            "sampling.cohort_size=340",
        ],
    },
    "cifar": {
        "title": "CIFAR CNN",
        "overrides": [
            "data.source='cifar10'",
            "data.partition='dirichlet'",
            "data.num_clients=100",
            "model.name='cifar_cnn'",
            "sampling.cohort_size=10",
            "clients.local_steps=50",
            "clients.batch_size=50",
        ],
        "gpu_overrides": [],
    },
}


def experiment(workload: str, algorithm: str, *more: str) -> Any:
    spec = WORKLOADS[workload]
    extra = spec["gpu_overrides"] if torch.cuda.is_available() else []
    cfg = load_config(
        CONFIG_DIR / "smoke.toml",
        [*spec["overrides"], *extra, f"algorithm.name='{algorithm}'", "algorithm.lr=0.05", *more],
    )
    return build(cfg)


# ----------------------------------------------------------------------------- the usual loop


class UsualLoop:
    """A faithful re-creation of the per-client loop of common FL frameworks (FedAvg)."""

    def __init__(self, exp: Any) -> None:
        self.exp = exp
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net = copy.deepcopy(exp.model.module).to(self.device)
        fed = exp.fed
        # Built once, as frameworks do at start-up: one TensorDataset of preprocessed tensors per client.
        self.datasets = [
            TensorDataset(fed.preprocess(fed.x_train[torch.from_numpy(p)]), fed.y_train[torch.from_numpy(p)])
            for p in fed.parts
        ]

    def __call__(self, cohort: np.ndarray) -> int:
        plan, lr = self.exp.plan, self.exp.alg.lr
        global_state = copy.deepcopy(self.net.state_dict())
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        total, examples = 0.0, 0
        for cid in cohort.tolist():
            net = copy.deepcopy(self.net)
            net.load_state_dict(global_state)
            net.train()
            loader = DataLoader(self.datasets[cid], batch_size=plan.batch_size, shuffle=True)
            opt = torch.optim.SGD(net.parameters(), lr=lr)
            steps = 0
            while steps < plan.local_steps:
                for x, y in loader:
                    x, y = x.to(self.device), y.to(self.device)
                    opt.zero_grad()
                    loss = F.cross_entropy(net(x), y)
                    loss.backward()
                    opt.step()
                    steps += 1
                    examples += len(y)
                    if steps == plan.local_steps:
                        break
            w = float(len(self.datasets[cid]))
            for k, v in net.state_dict().items():
                acc[k] += w * v
            total += w
        self.net.load_state_dict({k: v / total for k, v in acc.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return examples


# ----------------------------------------------------------------------------- one engine, served to the driver


def real_examples(exp: Any, cohort: np.ndarray) -> int:
    """Real (unpadded) examples a round trains on: S steps of min(B, n_i) each (steps mode)."""
    plan = exp.plan
    return int(sum(plan.steps_for(int(n)) * min(plan.batch_size, int(n)) for n in exp.fed.sizes[cohort]))


def serve(workload: str, engine_name: str, algorithm: str, warm_clients: int) -> None:
    """Build the experiment, warm up, then run one round per ``round T`` line on stdin; print JSON lines."""
    out = sys.stdout
    sys.stdout = sys.stderr  # dataset loaders may print: keep stdout for the protocol
    exp = experiment(workload, algorithm)
    alg, fed, model, plan, seed = exp.alg, exp.fed, exp.model, exp.plan, exp.cfg.seed
    usual = UsualLoop(exp) if engine_name == "usual" else None
    engine = None if usual else make_engine(engine_name, workers=0, vmap_chunk=0)
    server = alg.init_server(model.params())
    from hafedho.runtime.store import ClientStore

    store = ClientStore(alg.init_client(model.params()), fed.num_clients)

    def one_round(t: int, cohort: np.ndarray) -> tuple[float, int, float]:
        nonlocal server
        t0, cpu0 = time.perf_counter(), time.process_time()
        if usual is not None:
            examples = usual(cohort)
        else:
            rnd = RoundInfo(t, fed.num_clients, len(cohort))
            res = engine(RoundWork(alg, alg.broadcast(server, rnd), fed, plan, model, rnd, seed), cohort, store)
            server, _ = alg.server_update(server, res.aggregate, rnd)
            examples = real_examples(exp, cohort)
        return time.perf_counter() - t0, examples, time.process_time() - cpu0

    warm = exp.cohort(1)[:warm_clients]
    warm_seconds = one_round(1, warm)[0]  # warm-up: kernels chosen, workers forked and warmed
    info = {
        "estimate": warm_seconds * len(exp.cohort(2)) / len(warm),  # a round, roughly (from the warm-up)
        "clients": len(exp.cohort(2)),
        "steps": plan.local_steps,
        "batch": plan.batch_size,
        "flops": count_flops(model.module, fed.input_shape),
        "num_clients": fed.num_clients,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(info), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "round":
            t = int(cmd[1])
            seconds, examples, cpu = one_round(t, exp.cohort(t))
            print(json.dumps({"seconds": seconds, "examples": examples, "cpu": cpu}), file=out, flush=True)
        else:
            break
    if engine is not None:
        engine.close()  # workers exit first, so RUSAGE_CHILDREN covers them
    mem = {
        "self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    print(json.dumps(mem), file=out, flush=True)


def step_times(workload: str, algorithm: str, tries: int = 30) -> dict[str, float]:
    """Per-step milliseconds of one real client's local training, best of ``tries`` interleaved runs.

    The best of many short interleaved runs is close to what an idle machine gives, even on a busy one: it is
    the figure to project from when the round medians above are distorted by other jobs.
    """
    exp = experiment(workload, algorithm, "clients.local_steps=10")  # 10 steps per try: a step's cost is the same
    alg, fed, model, plan, seed = exp.alg, exp.fed, exp.model, exp.plan, exp.cfg.seed
    from hafedho.sim.engines.process import _linux_worker_setup, worker_model

    _linux_worker_setup()  # as in a worker (it also helps the usual loop: both allocate per step)
    cid = int(exp.cohort(2)[0])
    data, info = fed.client_data(seed, 2, cid, plan, full=alg.needs_full_pass), fed.client_info(cid)
    rnd = RoundInfo(2, fed.num_clients, 1)
    msg = alg.broadcast(alg.init_server(model.params()), rnd)
    state = alg.init_client(model.params())
    usual = UsualLoop(exp)
    cohort = np.array([cid])
    cl = worker_model(model, None)
    model.train()
    cl.train()
    cores = available_cores()
    variants = {
        f"usual loop, {cores} threads": (lambda: usual(cohort), cores),
        "usual loop, 1 thread": (lambda: usual(cohort), 1),
        f"hafedho client update (`loop`), {cores} threads": (
            lambda: alg.client_update(msg, state, data, info, rnd, model),
            cores,
        ),
        "hafedho client update as a `process` worker runs it, 1 thread": (
            lambda: alg.client_update(msg, state, data, info, rnd, cl),
            1,
        ),
    }
    best = dict.fromkeys(variants, float("inf"))
    for i in range(tries + 1):
        for name, (fn, threads) in variants.items():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            fn()
            if i:  # the first pass warms up
                best[name] = min(best[name], (time.perf_counter() - t0) / plan.local_steps * 1e3)
    return best


def matmul_peak(threads: int, n: int = 4096, tries: int = 7, device: str = "cpu") -> float:
    """Best-of-``tries`` fp32 GFLOP/s of an n x n torch.mm with ``threads`` threads (TF32 off on a GPU)."""
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = 0.0
    for _ in range(tries):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


# ----------------------------------------------------------------------------- the driver


def start(workload: str, engine: str, algorithm: str, warm: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--serve", workload, engine, "--algorithms", algorithm, "--warm", str(warm)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def ask(proc: subprocess.Popen, line: str | None = None) -> dict:
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    reply = proc.stdout.readline()
    if not reply:
        raise RuntimeError(f"benchmark server {proc.args[3:5]} exited with code {proc.wait()}")
    return json.loads(reply)


def measure(
    workload: str, algorithm: str, engines: list[str], reps: int, budget: float
) -> tuple[dict, dict[str, dict]]:
    warm = 2 * available_cores()  # enough clients to warm every worker of the process engine
    procs, info = {}, {}
    for e in engines:  # one at a time: warm-ups must not compete with each other
        procs[e] = start(workload, e, algorithm, warm)
        info[e] = ask(procs[e])
    times: dict[str, list[float]] = {e: [] for e in engines}
    examples: dict[str, list[int]] = {e: [] for e in engines}
    cpu: dict[str, list[float]] = {e: [] for e in engines}
    # an engine far slower than the rest (vmap on a CPU) gets fewer rounds, so one run stays within hours
    rounds = {e: min(reps, max(1, int(budget / info[e]["estimate"]))) for e in engines}
    for r in range(reps):
        for e, p in procs.items():  # interleaved: one round per engine in turn
            if r >= rounds[e]:
                continue
            res = ask(p, f"round {r + 2}")
            times[e].append(res["seconds"])
            examples[e].append(res["examples"])
            cpu[e].append(res["cpu"])
            print(
                f"  {workload} {algorithm} {e:8s} round {r + 2}: {res['seconds']:.2f} s "
                f"(this process's CPU {res['cpu']:.2f} s), load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
            )
    results = {}
    for e, p in procs.items():
        mem = ask(p, "quit")
        p.wait()
        results[e] = {"seconds": times[e], "examples": examples[e], "cpu": cpu[e], **mem}
    return info[engines[0]], results


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") if Path("/proc/cpuinfo").exists() else open(os.devnull) as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (no GPU in this environment)"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3 if hasattr(os, "sysconf") else 0
    return (
        f"- CPU: {cpu}, {available_cores()} cores available to this process, {mem:.0f} GiB RAM\n"
        f"- GPU: {gpu}\n"
        f"- Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


def step_table(info: dict, steps: dict[str, float]) -> str:
    """Best-of-30 per-step times and the round times they project (process: one worker per core)."""
    cores = available_cores()
    total = info["clients"] * info["steps"]
    rows = []
    base = None
    for name, ms in steps.items():
        per_round = total * ms / 1e3 / (cores if "`process`" in name else 1)
        base = base or per_round  # the first variant is the usual loop on all cores
        rows.append(f"| {name} | {ms:.1f} | {per_round:.2f} | {base / per_round:.2f}x |")
    usual_all, usual_one = list(steps.values())[:2]  # the usual loop on all cores, then on one thread
    ceiling = (
        f"\nThe usual loop gains {usual_one / usual_all:.2f}x from {cores} threads, so an engine that runs one client "
        f"per core, each step as fast as the usual loop's one-thread step, beats it by at most {cores} x "
        f"{usual_all:.1f} / {usual_one:.1f} = **{cores * usual_all / usual_one:.2f}x** on this machine; beyond that "
        "only a cheaper step (here: channels-last convolutions) helps.\n"
        if cores > 1
        else ""
    )
    return (
        "\nPer local step, best of 30 interleaved runs of one client (close to an idle machine's figure even on a "
        "busy one), and the round time it projects (`process`: one worker per core, no dispatch cost):\n\n"
        "| variant | ms / step | projected s / round | projected speedup |\n|---|---:|---:|---:|\n"
        + "\n".join(rows)
        + "\n"
        + ceiling
    )


def table(workload: str, algorithm: str, info: dict, results: dict[str, dict], peak: float, gpu_peak: float) -> str:
    """One workload's markdown table; engines that run on a GPU (usual, vmap) are held against its peak."""
    base = statistics.median(results["usual"]["seconds"]) if "usual" in results else None
    head = (
        f"### {WORKLOADS[workload]['title']}, {algorithm}: {info['clients']} clients x {info['steps']} steps x "
        f"batch {info['batch']} per round ({info['num_clients']} clients in all)\n\n"
        "| engine | s / round | client-steps / s | GFLOP/s | % of matmul peak | speedup vs usual | peak RSS (MB) "
        "| rounds |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for e, r in results.items():
        sec = statistics.median(r["seconds"])
        ex = statistics.median(r["examples"])
        gflops = 3 * info["flops"] * ex / sec / 1e9
        steps = info["clients"] * info["steps"] / sec
        mem = f"{r['self_mb']:.0f}" + (f" + {r['children_mb']:.0f} per worker" if r["children_mb"] > 1 else "")
        speed = f"{base / sec:.2f}x" if base else "-"
        label = {"usual": "usual loop (deepcopy, DataLoader, optim.SGD)"}.get(e, f"hafedho `{e}`")
        share = gflops / (gpu_peak if gpu_peak and e in ("usual", "vmap") else peak)
        rows.append(
            f"| {label} | {sec:.2f} | {steps:.1f} | {gflops:.1f} | {100 * share:.0f}% | {speed} | {mem} "
            f"| {len(r['seconds'])} |"
        )
    spread = ", ".join(f"{e} {min(r['seconds']):.2f}-{max(r['seconds']):.2f} s" for e, r in results.items())
    note = f"\n\nRange over rounds: {spread}."
    if "process" in results:
        parent = statistics.median(results["process"]["cpu"])
        note += f" The `process` engine's parent (dispatch, aggregation, store) used {parent:.2f} CPU-s per round."
    return head + "\n".join(rows) + note + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="femnist,cifar")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--algorithms", default="fedavg", help="comma-separated, e.g. fedavg,hafedho")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per engine (after a warm-up round)")
    ap.add_argument("--budget", type=float, default=600, help="seconds of timed rounds per engine at most")
    ap.add_argument("--out", default=str(DOC), help="markdown file to write ('' = only print)")
    ap.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "ENGINE"), help=argparse.SUPPRESS)
    ap.add_argument("--warm", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--steps", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.algorithms, args.warm)
        return
    if args.steps:
        out, sys.stdout = sys.stdout, sys.stderr  # dataset loaders may print: keep stdout for the result
        print(json.dumps(step_times(args.steps, args.algorithms.split(",")[0])), file=out)
        return
    cores = available_cores()
    load0 = os.getloadavg()
    peak = matmul_peak(cores)
    measured = []
    for workload in args.workloads.split(","):
        for algorithm in args.algorithms.split(","):
            engines = args.engines.split(",")
            info, results = measure(workload, algorithm, engines, args.reps, args.budget)
            cmd = [sys.executable, __file__, "--steps", workload, "--algorithms", algorithm]
            steps = {} if torch.cuda.is_available() else json.loads(subprocess.check_output(cmd, text=True))
            measured.append((workload, algorithm, info, results, steps))
    peak = max(peak, matmul_peak(cores))  # again at the end: the best the machine showed
    gpu_peak = matmul_peak(cores, device="cuda") if torch.cuda.is_available() else 0.0
    sections = [table(*m[:4], peak, gpu_peak) + (step_table(m[2], m[4]) if m[4] else "") for m in measured]
    load1 = os.getloadavg()
    cmd = "python benchmarks/bench_engines.py " + " ".join(sys.argv[1:])
    doc = DOC_TEMPLATE.format(
        date=date.today().isoformat(),
        hardware=hardware(),
        cores=cores,
        peak=peak,
        gpu_peak=f"\n- fp32 matmul peak of the GPU (TF32 off): **{gpu_peak:.1f} GFLOP/s**" if gpu_peak else "",
        gpu_note=(
            "Here `usual` and `vmap` ran on the GPU (their % is of the GPU's peak); `loop` and `process` on the CPU."
            if gpu_peak
            else "No GPU was available for this run, so there is no GPU figure; the GPU path of\n"
            "  `vmap` is the same code with each chunk moved to the device, covered on the CPU by\n"
            "  `tests/test_engines.py`."
        ),
        load=f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end",
        reps=args.reps,
        budget=args.budget,
        command=cmd.strip(),
        tables="\n".join(sections),
    )
    if args.out:  # the page's head is this benchmark's; the marked sections below it are the others'
        Path(args.out).write_text(doc.rstrip("\n") + "\n" + other_sections(Path(args.out)))
    print(doc)


DOC_TEMPLATE = """# Engine benchmarks

Measured {date} with

    {command}

(`make bench` runs it with the defaults.) Medians over {reps} rounds (column "rounds": fewer where the warm-up
predicted more than {budget:.0f} s of them) after a short warm-up round (two clients per core); each engine runs
in its own process and the rounds of the engines are interleaved, so load from other jobs hits all alike.

## Hardware

{hardware}
- fp32 matmul peak (4096 x 4096 `torch.mm`, {cores} threads, best of 7): **{peak:.1f} GFLOP/s**{gpu_peak}
- load average (1 min): {load}

## Results

{tables}
## Choosing an engine

`engine = "loop"` stays the default: it is the reference every other engine is tested against, runs any
`nn.Module`, gives bit-identical results on every machine and needs no worker processes. For speed set
`engine = "auto"`: `vmap` on a GPU, `process` on a multi-core CPU, `loop` on one core. `process` agrees with
`loop` up to float rounding (also with dropout: each client keeps its torch seed) and gives bit-identical
results for any `workers`; `vmap` agrees up to float rounding for dropout-free models. For tiny models `vmap`
wins on a CPU too, because per-step Python overhead dominates: a 100-round Synthetic(0.5,0.5) logistic-regression
run (10 clients x 20 steps per round) takes 20.3 s on `loop` and 10.2 s on `vmap` here, so the `synthetic` preset
uses it.

## How to read this

- **usual loop**: per client `copy.deepcopy` + `load_state_dict`, a `DataLoader` over a `TensorDataset`,
  a fresh `torch.optim.SGD`, `loss.backward()`; torch's default intra-op threads (one per core).
- **`loop`**: hafedho's reference engine: one client after another, `alg.client_update` (functional
  `local_train`, differentiated by autograd; `torch.func.grad` only under `vmap`), default threads.
- **`process`**: the cohort over one single-threaded worker process per core (forked once per run; data
  inherited, never pickled), channels-last convolutions; uploads added in cohort order (bit-identical for
  any number of workers, equal to `loop` up to float rounding).
- **`vmap`**: `torch.func.vmap` over the cohort. Meant for GPUs; on a CPU the batched convolutions become
  grouped convolutions, which are slow there. {gpu_note}
- GFLOP/s = 3 x forward FLOPs (`hafedho.models.count_flops`: Linear and Conv2d multiply-adds x 2) x real
  examples / seconds; "% of peak" divides by the matmul peak above. Peak RSS is `getrusage` maxrss of the
  engine's process, plus that of its largest worker for `process` (workers share the data pages with the
  parent copy-on-write, so adding both over-counts).
"""


if __name__ == "__main__":
    main()
