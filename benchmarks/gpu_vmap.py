"""The GPU check, prepared to run as is when a device is lent: ``vmap`` against the usual loop on the FEMNIST CNN.

    python benchmarks/gpu_vmap.py --out "$OUT"                 # on the GPU machine (about 3-5 minutes)
    python benchmarks/gpu_vmap.py --device cpu --cohorts 2,4 --steps 2 --out /tmp/g   # a dry run on a CPU

Per cohort size (10, 100 and 340 FEMNIST clients per round, then doubling while it fits and time is left):
seconds per round of hafedho's ``vmap`` engine (the whole cohort in one vectorised call) and of the usual
per-client loop (``bench_engines.UsualLoop``: deepcopy, DataLoader, torch.optim) on the same device, the
device's peak memory for each, client-steps per second and the ratio. Before timing, one small cohort checks
that ``vmap`` on the device equals hafedho's reference ``loop`` engine on the CPU within the float32 bound of
``tests/tolerance.py`` (dropout off for the check: the two engines draw other masks). 340 clients need more
than the 105 writers of the shared sample: an iid split of its 14,708 images into 1,400 clients (10 each,
every client trains all 10 steps on batches of its 10 images, padded to 20).

Writes ``gpu_vmap.json`` and ``gpu_vmap.md`` (the table for ``docs/benchmarks.md``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_engines import UsualLoop  # noqa: E402
from doc_sections import markers, write_section  # noqa: E402
from tolerance import fp32_close, longest_reduction  # noqa: E402

from hafedho.config import CONFIG_DIR, load_config  # noqa: E402
from hafedho.core import RoundInfo  # noqa: E402
from hafedho.experiment import build  # noqa: E402
from hafedho.runtime.store import ClientStore  # noqa: E402
from hafedho.runtime.work import RoundWork  # noqa: E402
from hafedho.sim.engines.loop import LoopEngine  # noqa: E402
from hafedho.sim.engines.vmap import VmapEngine  # noqa: E402

DATA: list[str] = []  # data.path=... from --data


def experiment(clients: int, steps: int) -> object:
    cfg = load_config(
        CONFIG_DIR / "smoke.toml",
        [
            *DATA,
            "data.source=femnist",
            "data.partition=iid",
            f"data.num_clients={clients}",
            "model.name=femnist_cnn",
            f"clients.local_steps={steps}",
            "clients.batch_size=20",
            "algorithm.name=fedavg",
            "algorithm.lr=0.05",
        ],
    )
    return build(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def vmap_round(exp, engine: VmapEngine, cohort: np.ndarray, t: int) -> object:
    alg = exp.alg
    server = alg.init_server(exp.model.params())
    store = ClientStore(alg.init_client(exp.model.params()), exp.fed.num_clients)
    rnd = RoundInfo(t, exp.fed.num_clients, len(cohort))
    work = RoundWork(alg, alg.broadcast(server, rnd), exp.fed, exp.plan, exp.model, rnd, exp.cfg.seed)
    return engine(work, cohort, store)


def check_equal(device: torch.device, steps: int) -> str:
    """vmap on ``device`` against loop on the CPU, one round of 8 clients, dropout off."""
    exp = experiment(1400, steps)
    for m in exp.model.module.modules():
        if hasattr(m, "p"):
            m.p = 0.0
    cohort = np.arange(8)
    ref = vmap_round(exp, LoopEngine(), cohort, 1).aggregate
    got = vmap_round(exp, VmapEngine(device=device), cohort, 1).aggregate
    x = exp.fed.preprocess(exp.fed.x_train[:20])
    fp32_close(got, ref, reduction=longest_reduction(exp.model.module, x), steps=steps, what="vmap vs loop")
    return "vmap on the device equals loop on the CPU within the float32 bound (8 clients, one round)"


def measure(exp, cohort_size: int, device: torch.device, reps: int) -> dict:
    out: dict = {"clients": cohort_size}
    engine = VmapEngine(device=device)
    cohorts = [exp.cohort(t)[:cohort_size] for t in range(1, reps + 2)]
    if len(cohorts[0]) < cohort_size:
        cohorts = [
            np.random.default_rng(t).choice(exp.fed.num_clients, cohort_size, replace=False) for t in range(reps + 1)
        ]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    vmap_round(exp, engine, cohorts[0], 1)  # warm-up: kernel choice, allocator
    times = []
    for t, c in enumerate(cohorts[1:], start=2):
        sync(device)
        t0 = time.perf_counter()
        vmap_round(exp, engine, c, t)
        sync(device)
        times.append(time.perf_counter() - t0)
    out["vmap_s"], out["vmap_peak_gib"] = float(np.median(times)), peak(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    usual = UsualLoop(exp)
    usual(cohorts[0][: max(2, cohort_size // 10)])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    usual(cohorts[1])
    sync(device)
    out["usual_s"], out["usual_peak_gib"] = time.perf_counter() - t0, peak(device)
    out["steps_per_s_vmap"] = cohort_size * exp.plan.local_steps / out["vmap_s"]
    out["speedup"] = out["usual_s"] / out["vmap_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cohorts", default="10,100,340")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; stop doubling the cohort after this")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", help="the FEMNIST LEAF copy (default: the source's, ../shared/data)")
    ap.add_argument("--doc", type=Path, help="also write the table into this page's gpu_vmap section")
    args = ap.parse_args()
    if args.data:
        DATA.append(f"data.path={args.data}")
    t_start, device = time.perf_counter(), torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    notes = [check_equal(device, args.steps)]
    exp = experiment(1400, args.steps)
    rows, sizes = [], [int(c) for c in args.cohorts.split(",")]
    while sizes:
        size = sizes.pop(0)
        try:
            rows.append(measure(exp, size, device, args.reps))
        except torch.cuda.OutOfMemoryError:
            notes.append(f"{size} clients per round do not fit in one vectorised call (out of memory)")
            break
        print(json.dumps(rows[-1]), flush=True)
        spent = time.perf_counter() - t_start
        if (
            not sizes
            and size * 2 <= exp.fed.num_clients
            and spent + 3 * (rows[-1]["usual_s"] + rows[-1]["vmap_s"]) < args.budget
        ):
            sizes.append(size * 2)  # the largest cohort that fits, while time is left
    (args.out / "gpu_vmap.json").write_text(json.dumps({"device": name, "rows": rows, "notes": notes}, indent=1))
    lines = [f"Device: {name}, torch {torch.__version__}; FEMNIST CNN, {args.steps} steps x batch 20, FedAvg.", ""]
    head = ("clients per round", "vmap s/round", "usual loop s/round", "vmap speed-up", "vmap client-steps/s")
    lines += ["| " + " | ".join((*head, "vmap peak GiB", "usual peak GiB")) + " |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['vmap_s']:.3f} | {r['usual_s']:.3f} | {r['speedup']:.1f}x | "
            f"{r['steps_per_s_vmap']:.0f} | {r['vmap_peak_gib']:.2f} | {r['usual_peak_gib']:.2f} |"
        )
    lines += ["", *notes, f"Total {time.perf_counter() - t_start:.0f} s."]
    (args.out / "gpu_vmap.md").write_text("\n".join(lines) + "\n")
    if args.doc:
        start, end = markers("gpu_vmap")
        write_section(
            args.doc, "gpu_vmap", "\n".join([start, "## GPU: `vmap` against the usual loop", "", *lines, end])
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
