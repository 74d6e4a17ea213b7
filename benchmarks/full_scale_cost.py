"""What each full-scale preset costs on one GPU, projected from the measured seconds per round of the GPU check.

    python benchmarks/full_scale_cost.py benchmarks/measured/h200-2026-12-04-call1.jsonl \\
        benchmarks/measured/h200-2026-12-04-call2.jsonl --doc docs/benchmarks.md

Every run of a preset (``hafedho sweep NAME --scale full``, expanded as the sweep expands it) costs its rounds times
the whole-run seconds per round that ``benchmarks/gpu_check.py`` measured at fp32 for its network: HaFedHo on the
FEMNIST CNN at 340 clients a round and ResNet-18-GN at 10, evaluations and checkpoints counted. Other cohort sizes
are interpolated linearly between the measured ones (340 and 1,020 clients on the FEMNIST CNN), or scaled in
proportion to the cohort below the smallest (ResNet-18-GN: 10). What the projection leaves out, and says so: the
other algorithms' own costs (measured only for HaFedHo: MOON's extra forward passes, the full-pass algorithms'
extra pass), the full-data passes of ``[diagnostics]`` and of ``h_source = "exact"``, start-up, and networks that
were not measured on the GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "src")]

from doc_sections import markers, write_section  # noqa: E402
from gpu_check import merged  # noqa: E402

from hafedho.sweep.expand import expand  # noqa: E402
from hafedho.sweep.presets import list_presets, load_preset  # noqa: E402

FEMNIST_WRITERS = 3400  # the full FEMNIST split (natural partition): m = fraction x 3,400


def measured_points(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Network -> [(clients a round, whole-run seconds per round at fp32)], from the check's records."""
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        if r.get("what") != "run" or r.get("precision") != "fp32":
            continue
        if r["part"] == "femnist":
            points["femnist_cnn"].append((340, r["per_round_s"]))
        elif r["part"] == "big":  # measured before checkpoints were written in the background: its training
            points["femnist_cnn"].append((r["clients"], r["train_s"] + r["eval_s"] / 5))  # round and evaluations
        elif r["part"] == "cifar":
            points["resnet18_gn"].append((10, r["per_round_s"]))
    return {k: sorted(v) for k, v in points.items()}


def seconds_per_round(points: list[tuple[int, float]], m: float) -> float:
    """Linear between measured cohort sizes, proportional below the smallest, the last slope above the largest."""
    if len(points) == 1 or m <= points[0][0]:
        return points[0][1] * m / points[0][0]
    for (m0, s0), (m1, s1) in itertools.pairwise(points):
        if m <= m1:
            return s0 + (s1 - s0) * (m - m0) / (m1 - m0)
    (m0, s0), (m1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) * (m - m1) / (m1 - m0)


def cohort(cfg: Any) -> float:
    s, n = cfg.sampling, cfg.data.num_clients or (FEMNIST_WRITERS if cfg.data.source == "femnist" else 0)
    if s.mode == "bernoulli":
        return s.prob * n
    return s.cohort_size or max(1, round(s.fraction * n))


def table(points: dict[str, list[tuple[int, float]]]) -> str:
    head = "| preset | runs | rounds per run | GPU-hours (one H200, fp32, one run at a time) | not in the projection |"
    lines = [head, "|---|---:|---|---:|---|"]
    total = 0.0
    for name in list_presets():
        specs = expand(load_preset(name, "full"))
        hours, missing, rounds = 0.0, set(), set()
        for s in specs:
            cfg, rounds_ = s.cfg, s.cfg.rounds
            rounds.add(rounds_)
            net = cfg.model.name
            if net not in points:
                missing.add(f"{net} (not measured)")
                continue
            hours += rounds_ * seconds_per_round(points[net], cohort(cfg)) / 3600
            alg = cfg.algorithm.get("name")
            if cfg.diagnostics.every or str(cfg.algorithm.get(alg, {}).get("h_source", "aggregate")) != "aggregate":
                missing.add("full-data passes")
        total += hours
        spent = f"{hours:,.1f}" if hours else "-"
        lines.append(
            f"| `{name}` | {len(specs)} | {', '.join(map(str, sorted(rounds)))} | {spent} | "
            f"{', '.join(sorted(missing)) or ''} |"
        )
    lines.append(f"| all | | | {total:,.0f} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="+", help="gpu_check.jsonl files, later ones win")
    ap.add_argument("--doc", type=Path)
    args = ap.parse_args()
    records = merged([json.loads(line) for f in args.records for line in f.read_text().splitlines()])
    points = measured_points(records)
    device = next((r["device"] for r in records if r.get("part") == "device"), "?")
    basis = "; ".join(
        f"{net}: " + ", ".join(f"{m:,} clients a round {s:.3f} s" for m, s in pts) for net, pts in points.items()
    )
    text = "\n".join(
        [
            f"Projected from the whole-run seconds per round measured on {device} at fp32 ({basis}); every "
            "algorithm costed as HaFedHo. Run a preset with `hafedho sweep NAME --scale full` (add `--seeds N` "
            "to change its seeds).",
            "",
            table(points),
            "",
        ]
    )
    print(text)
    if args.doc:
        start, end = markers("full_scale")
        section = "\n".join([start, "## Full scale on one GPU: what each preset costs", "", text, end]) + "\n\n"
        write_section(args.doc, "full_scale", section)


if __name__ == "__main__":
    main()
