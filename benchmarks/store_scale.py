"""Full-size client-store check: SCAFFOLD state for 3,400 FEMNIST clients x the 1.2M-parameter CNN.

One c_i per client is 1,206,590 float32 values (4.8 MB), so the store is 16.4 GB: more than is sensible to
hold in RAM beside everything else. The memory-mapped store keeps it in a file; this script gathers and
scatters several 10% cohorts (340 clients) and reports the process's anonymous memory (RssAnon: what cannot
be paged out) and its total resident set (file-backed pages of the map are included there, but the kernel
can drop them at any time).

    python benchmarks/store_scale.py [--clients 3400] [--rounds 3] [--dir /tmp/hafedho-store]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from hafedho.algorithms.scaffold import SCAFFOLD
from hafedho.core.sampling import fixed_cohort
from hafedho.models import build_model
from hafedho.runtime.store import ClientStore


def status(key: str) -> float:
    """A /proc/self/status field in GiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/hafedho-store")
    args = ap.parse_args()
    model = build_model("femnist_cnn", (1, 28, 28), 62)
    params = {k: v.detach() for k, v in model.named_parameters()}
    alg = SCAFFOLD()
    t0 = time.perf_counter()
    store = ClientStore(alg.init_client(params), args.clients, args.dir)
    print(
        f"store: {store.nbytes() / 1024**3:.1f} GiB on disk in {args.dir}, created in {time.perf_counter() - t0:.1f} s"
    )
    m = max(1, args.clients // 10)
    peak_anon = 0.0
    for t in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        for cid in fixed_cohort(0, t, args.clients, m).tolist():
            state = store.gather(cid)
            store.scatter(cid, type(state)({k: v + 1.0 for k, v in state.c_i.items()}))
            peak_anon = max(peak_anon, status("RssAnon"))
        print(
            f"round {t}: {m} clients gathered+scattered in {time.perf_counter() - t0:.1f} s; "
            f"RssAnon {status('RssAnon'):.2f} GiB, VmRSS {status('VmRSS'):.2f} GiB, VmHWM {status('VmHWM'):.2f} GiB"
        )
    sample = store.gather(int(fixed_cohort(0, 1, args.clients, m)[0]))
    assert float(next(iter(sample.c_i.values())).flatten()[0]) >= 1.0
    print(f"peak RssAnon {peak_anon:.2f} GiB for a {store.nbytes() / 1024**3:.1f} GiB client store")
    del store
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
