"""How many torch threads a run should use: one, or one per core, on an idle machine and beside another job.

    python benchmarks/bench_threads.py [--reps 3] [--out docs/benchmarks.md]

Two workloads through ``hafedho.sim.runner.run`` (the path of ``hafedho run``, ``loop`` engine), each at
``threads=1`` and ``threads=<cores>``:

* small: digits, MLP (hidden 64), 10 clients, 3 per round, 3 local steps of batch 16, 10 rounds;
* large: the FEMNIST CNN (1.2M parameters) on FEMNIST-shaped synthetic data (28x28 grey, 62 classes), 2 clients
  per round, 10 local steps of batch 20, 1 round.

Each is timed idle and beside a competing load the benchmark starts itself: one busy-loop process per core
(bounded in time, stopped after each phase). Repetitions are interleaved (rep -> idle/loaded -> workload ->
threads, the thread order alternating) so other jobs on a shared machine hit every setting alike; the figures
are medians and the ratios compare settings measured side by side. About a minute on 2 idle cores; up to
10 minutes on a busy machine, where one-per-core threads crawl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from doc_sections import markers, write_section

from hafedho.config import CONFIG_DIR, load_config
from hafedho.experiment import Experiment, build
from hafedho.runtime.work import available_cores
from hafedho.sim.runner import run

START, END = markers("bench_threads")
# a busy loop that ends after `secs`, or as soon as the benchmark (its parent) is gone
BUSY = "import os, time\nend = time.time() + {secs}\nwhile time.time() < end and os.getppid() == {parent}:\n    pass\n"


def femnist_shaped(path: Path, n_train: int = 2000, n_test: int = 200) -> Path:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n_train + n_test, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 62, n_train + n_test)
    np.savez(path, x_train=x[:n_train], y_train=y[:n_train], x_test=x[n_train:], y_test=y[n_train:])
    return path


def workloads(tmp: Path) -> dict[str, Experiment]:
    common = ["engine='loop'", "eval_every=1", "algorithm.name='fedavg'", "algorithm.lr=0.05"]
    small = [*common, "rounds=10", "checkpoint_every=10", "model.name='mlp'", "model.options={hidden=[64]}"]
    data = femnist_shaped(tmp / "femnist_shaped.npz")
    large = [
        *common,
        "rounds=1",
        "data.source='npz'",
        f"data.path='{data}'",
        "data.num_clients=20",
        "sampling.cohort_size=2",
        "clients.local_steps=10",
        "clients.batch_size=20",
        "model.name='femnist_cnn'",
    ]
    out = {}
    for name, overrides in (("small: digits MLP, 10 rounds", small), ("large: FEMNIST CNN, 1 round", large)):
        cfg = load_config(CONFIG_DIR / "smoke.toml", overrides)
        cfg.out = str(tmp)
        out[name] = build(cfg)
    return out


def timed(exp: Experiment, threads: int, tmp: Path) -> float:
    exp.cfg.threads = threads
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    t0 = time.perf_counter()
    run(exp, run_dir, progress=False)
    return time.perf_counter() - t0


class Load:
    """One busy-loop process per core while in the ``with`` block (each ends by itself after ``secs``)."""

    def __init__(self, cores: int, secs: int = 600) -> None:
        self.cores, self.secs, self.procs = cores, secs, []

    def __enter__(self) -> Load:
        code = BUSY.format(secs=self.secs, parent=os.getpid())
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.cores)]
        time.sleep(0.5)  # let them start spinning
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    cores = available_cores()
    settings = [1, cores] if cores > 1 else [1]
    tmp = Path(tempfile.mkdtemp(prefix="bench_threads_"))
    exps = workloads(tmp)
    load_before = load_average()
    for exp in exps.values():  # warm-up: data on the page cache, kernels chosen
        for t in settings:
            timed(exp, t, tmp)
    times: dict[tuple[str, bool, int], list[float]] = {}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for loaded in (False, True):
            with Load(cores) if loaded else _nothing():
                for name, exp in exps.items():
                    for t in settings if rep % 2 == 0 else settings[::-1]:
                        s = timed(exp, t, tmp)
                        times.setdefault((name, loaded, t), []).append(s)
                        print(f"rep {rep} {'loaded' if loaded else 'idle  '} {name:32s} threads={t}: {s:7.2f} s")
    elapsed = time.perf_counter() - t_start
    report = render(list(exps), times, settings, cores, load_before, load_average(), elapsed, args.reps)
    print(report)
    write_section(Path(args.out), "bench_threads", report)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def render(
    names: list[str],
    times: dict[tuple[str, bool, int], list[float]],
    settings: list[int],
    cores: int,
    before: float,
    after: float,
    elapsed: float,
    reps: int,
) -> str:
    one, many = settings[0], settings[-1]
    lines = [
        START,
        "## Torch threads per run (`threads`)",
        "",
        "Measured with",
        "",
        "    python benchmarks/bench_threads.py",
        "",
        f"{cores} cores, torch {torch.__version__}, the `loop` engine through `hafedho.sim.runner.run`; medians of",
        f"{reps} interleaved repetitions ({elapsed:.0f} s in all). Other jobs share this machine: its 1-minute load",
        f"average was {before:.1f} at the start and {after:.1f} at the end, so *none added* is the machine as found,",
        f"not an idle one. *Busy loops*: {cores} busy-loop processes (one per core), started by the benchmark beside",
        "the run.",
        "",
        f"| workload | competing load | threads={one} (s) | threads={many} (s) | {many} / {one} | range (s) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in names:
        for loaded in (False, True):
            a, b = times[(name, loaded, one)], times[(name, loaded, many)]
            ma, mb = statistics.median(a), statistics.median(b)
            rng = f"{min(a):.2f}-{max(a):.2f} / {min(b):.2f}-{max(b):.2f}"
            where = "busy loops" if loaded else "none added"
            lines.append(f"| {name} | {where} | {ma:.2f} | {mb:.2f} | {mb / ma:.2f}x | {rng} |")
    lines += [
        "",
        "Ratios above 1: the one-thread run is faster. The default (`threads = 1`) and the reasoning are in the",
        "README (Performance).",
        END,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
