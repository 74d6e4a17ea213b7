"""FedML's LDA (ours, ``data.partition = "dirichlet"``) beside Flower's DirichletPartitioner on one data set.

    PYTHONPATH=src python benchmarks/partitions.py [--data ../shared/data/cifar10_jpeg.zip] [--clients 10]
        [--alpha 0.3] [--seeds 0 1 2 3 4]

Prints, per seed and partition, the client sizes, the mean total-variation label skew
(``hafedho.data.partition.label_skew``) and the mean number of classes a client holds; docs/partitions.md quotes it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hafedho.data import partition as P
from hafedho.data.flwr_partition import flwr_partition
from hafedho.data.sources import load_dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="cifar10")
    ap.add_argument("--data", default="../shared/data/cifar10_jpeg.zip")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = ap.parse_args()
    ds = load_dataset(args.source, args.data)
    y, n, c = ds.y_train, args.clients, ds.num_classes
    methods = {
        "ours (FedML LDA)": lambda s: P.dirichlet(y, n, args.alpha, s, min_size=args.min_size),
        "flwr self_balancing=false": lambda s: flwr_partition(
            "flwr:DirichletPartitioner", y, n, s, {"alpha": args.alpha, "min_partition_size": args.min_size}
        ),
        "flwr self_balancing=true": lambda s: flwr_partition(
            "flwr:DirichletPartitioner",
            y,
            n,
            s,
            {"alpha": args.alpha, "min_partition_size": args.min_size, "self_balancing": True},
        ),
    }
    print(f"{args.source}: {len(y)} train examples, {c} classes; {n} clients, alpha = q = {args.alpha}")
    summary: dict[str, list[tuple[float, float, int, int]]] = {m: [] for m in methods}
    for seed in args.seeds:
        for name, fn in methods.items():
            t = time.perf_counter()
            parts = fn(seed)
            wall = time.perf_counter() - t
            sizes = [len(p) for p in parts]
            skew = P.label_skew(y, parts, c)
            classes = float(np.mean([len(np.unique(y[p])) for p in parts]))
            summary[name].append((skew, classes, min(sizes), max(sizes)))
            print(f"seed {seed} {name:26s} skew {skew:.3f} classes/client {classes:.1f} sizes {sizes} ({wall:.1f} s)")
    print(f"mean over seeds {args.seeds}:")
    for name, rows in summary.items():
        a = np.array(rows, dtype=float)
        print(
            f"  {name:26s} skew {a[:, 0].mean():.3f}  classes/client {a[:, 1].mean():.1f}  "
            f"smallest {a[:, 2].mean():.0f}  largest {a[:, 3].mean():.0f}"
        )


if __name__ == "__main__":
    main()
