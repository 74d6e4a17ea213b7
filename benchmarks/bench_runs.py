"""Whole-run benchmark: preset-shaped runs of two versions of hafedho, side by side in one run.

    python benchmarks/bench_runs.py --base 61fb7b5            # BASE against the working tree
    python benchmarks/bench_runs.py --base 61fb7b5 --jobs preset,eval --reps 3 --out docs/benchmarks.md

Every job runs in a fresh process (``run_driver.py``) under one version's sources, the versions alternating
job by job, so a change in the machine's load hits both alike; the table gives medians and the ratio
base / new. The base is checked out with ``git worktree`` into a temporary folder, removed at the end. Jobs:

* ``preset``: FEMNIST by writer, LeNet-5 with the CPU presets' projection head, 30 rounds x 10 writers x 10
  steps x batch 20, an evaluation every 3 rounds, one thread, ``loop``: a CPU preset's run.
* ``cifar``: the CIFAR-10 cell of the CPU presets (Dirichlet q = 0.3 over 50 clients, 5 per round, LeNet-5).
* ``sweep``: ``--sweep-runs`` preset-shaped runs (seeds) one after another in one process, as a sweep worker.
* ``eval``: one evaluation of 10,000 CIFAR-10 test images (the test set) by LeNet-5, best of 5.
* ``full``: one full-data gradient pass over the 50 CIFAR-10 clients' training data (LeNet-5).
* ``process``: 5 rounds of 34 FEMNIST writers on the FEMNIST CNN with the ``process`` engine, and the same as a
  FedML-style whole process (``run_driver.py usual``), threads = 1 as in a sweep.
* ``preset-compiled``, ``eval-compiled``: ``preset`` and ``eval`` with the new version's ``compile = "all"``
  (``"eval"``), the base as it is (it has no such setting); compilation time counts (a warm inductor cache).

Each whole run reports its phases: steps (the engine's rounds), evaluation (test set and start-loss guard),
full passes, and the rest (interpreter, imports, data, model, files).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from doc_sections import markers, write_section

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).parent / "run_driver.py"

PRESET = """seed = 0
rounds = 30
eval_every = 3
checkpoint_every = 10
engine = "loop"
threads = 1
[data]
source = "femnist"
partition = "natural"
num_clients = 0
[clients]
local_steps = 10
batch_size = 20
[sampling]
cohort_size = 10
[model]
name = "lenet5"
options = {projection = 256}
[algorithm]
name = "hafedho"
[algorithm.hafedho]
lr = 0.1
mu = 0.08
"""
CIFAR = ["data.source=cifar10", "data.partition=dirichlet", "data.q=0.3", "data.num_clients=50"]
CIFAR += ["sampling.cohort_size=5"]
PROCESS = ["model.name=femnist_cnn", "model.options.projection=0", "sampling.cohort_size=34", "rounds=5"]
PROCESS += ["eval_every=5", "algorithm.name=fedavg", "algorithm.lr=0.05"]


PROSE = """What a preset-shaped run spends outside its local steps, and how the code cuts it (measured below):

- **Evaluation and full-data passes sized by the cache** (`core/sizing.py`): a pass takes the largest number of
  rows whose forward activations (what autograd saves in a two-row forward, measured once per model and input
  shape) fit in half the CPU's last-level cache, between 8 and 1,024 rows; no timing probe, so the chunk is the
  same in every run on a machine. The full-data gradient pass splits each client's rows into equal blocks of at
  most that size (the round's batch size before). Evaluation sums the per-example losses in float64.
- **Idle cores**: the runner evaluates, computes the start-loss guard and runs the full-data pass on every core
  the `process` engine's workers hold (they idle meanwhile); `loop` and `vmap` keep the run's `threads`.
- **Warm sweep workers**: a sweep worker's runs share the decoded data set in memory (the last two, read-only);
  a run's metrics are the same first or after another run in the same process (`tests/test_speed.py`).
- **`compile`** (opt-in runtime setting, `off` by default): `eval`, `steps` or `all` run the model's forward
  through `torch.compile` (loop engine and evaluation), with one warning line and eager where it cannot compile.
  Compilation costs seconds on a warm inductor cache and about a minute cold, per process.

Side by side, in one run of"""


def jobs(args: argparse.Namespace, config: Path, out: Path) -> dict[str, list[str]]:
    runs = str(args.sweep_runs)
    return {
        "preset": ["run", str(config), str(out / "@RUN@")],  # a folder per job, version and rep: a version never
        # has to --force a folder another version wrote
        "cifar": ["run", str(config), str(out / "@RUN@"), *CIFAR],
        "sweep": ["sweep", str(config), str(out / "@RUN@"), runs, f"rounds={args.sweep_rounds}"],
        "eval": ["eval", str(config), "10000", *CIFAR],
        "full": ["full", str(config), *CIFAR],
        "process": ["run", str(config), str(out / "@RUN@"), *PROCESS, "engine=process", "workers=2"],
        "usual": ["usual", str(config), "5", *PROCESS],
    }


COMPILED = {"preset-compiled": ("preset", "compile=all"), "eval-compiled": ("eval", "compile=eval")}


def argv_for(spec: dict[str, list[str]], job: str, version: str) -> list[str]:
    if job not in COMPILED:
        return spec[job]
    plain, setting = COMPILED[job]
    return spec[plain] + ([setting] if version == "new" else [])


def run_job(src: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.run([sys.executable, str(DRIVER), *argv], env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[:2])} under {src} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[str, list[dict]]], names: list[str]) -> list[str]:
    lines = ["| job | version | total s | steps s | evaluation s | full passes s | rest s | base / new |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for job in names:
        med = {}
        for version in ("base", "new"):
            reps = results[job][version]
            m = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            m["rest"] = m["total"] - m["steps"] - m["evaluation"] - m["full_passes"]
            med[version] = m
        key = {"eval": "evaluation", "eval-compiled": "evaluation", "full": "full_passes"}.get(job, "total")
        ratio = med["base"][key] / med["new"][key]
        for version in ("base", "new"):
            m = med[version]
            cells = [f"{m[k]:.2f}" for k in ("total", "steps", "evaluation", "full_passes", "rest")]
            tail = f"**{ratio:.2f}x** ({key})" if version == "new" else ""
            lines.append(f"| {job} | {version} | {' | '.join(cells)} | {tail} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree against")
    ap.add_argument("--jobs", default="preset,cifar,eval,full,sweep,process", help="comma-separated jobs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep-runs", type=int, default=20)
    ap.add_argument("--sweep-rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, help="replace the section after the bench_runs marker in this file")
    args = ap.parse_args()
    names = args.jobs.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_runs: terminated"))  # so the worktree is removed
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        tmp_path = Path(tmp)
        base = tmp_path / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.base], cwd=ROOT, check=True)
        new = tmp_path / "new"
        shutil.copytree(ROOT / "src", new / "src")  # a snapshot: edits during the benchmark do not reach it
        try:
            config = tmp_path / "preset.toml"
            config.write_text(PRESET)
            spec = jobs(args, config, tmp_path / "runs")
            load0 = os.getloadavg()
            results: dict[str, dict[str, list[dict]]] = {j: {"base": [], "new": []} for j in names}
            if "process" in names:
                results["usual"] = {"base": [], "new": []}
            for rep in range(args.reps):
                for job in names:
                    order = ("base", "new") if rep % 2 == 0 else ("new", "base")
                    for version in order:
                        src = (base if version == "base" else new) / "src"
                        argv = [a.replace("@RUN@", f"{job}-{version}-{rep}") for a in argv_for(spec, job, version)]
                        results[job][version].append(run_job(src, argv))  # each job its own run folder
                        print(f"rep {rep + 1} {job} {version}: {results[job][version][-1]}", flush=True)
                    if job == "process":  # the FedML-style whole process, once per rep (same code both columns)
                        u = run_job(new / "src", spec["usual"])
                        results["usual"]["base"].append(u)
                        results["usual"]["new"].append(u)
            load1 = os.getloadavg()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    shown = names + (["usual"] if "process" in names else [])
    head = (
        f"Measured {date.today()} on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {load0[0]:.1f} at the start and {load1[0]:.1f} at the end; medians of {args.reps} "
        f"interleaved repetitions; base = `{args.base}`, new = the working tree (copied at the start); "
        f"sweep = {args.sweep_runs} runs of {args.sweep_rounds} rounds. "
        "`usual` is the FedML-style loop as a whole process (the same in both rows)."
    )
    text = "\n".join([head, "", *table(results, shown)])
    print(text)
    if args.out:
        start, end = markers("bench_runs")
        cmd = " ".join(["python benchmarks/bench_runs.py", *sys.argv[1:]])
        write_section(args.out, "bench_runs", f"{start}\n## Whole runs\n\n{PROSE}\n\n    {cmd}\n\n{text}\n{end}\n")


if __name__ == "__main__":
    main()
