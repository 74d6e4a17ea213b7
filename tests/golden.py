"""The golden set: what every registered algorithm computes on the smoke config, per engine, plus one Flower run.

    python tests/golden.py record [PATH]        # add the missing entries (default: tests/golden/smoke.pt)
    python tests/golden.py record --all [PATH]  # recompute and rewrite every entry
    python tests/golden.py check [PATH]         # recompute and compare bit for bit; exit 1 on any difference

A change that only moves code (no number moves) must reproduce the recorded set bit for bit on the machine that
recorded it (``check``). Bits differ between CPUs, so the test suite (``tests/test_golden.py``) compares with the
float32 bound of ``tests/tolerance.py`` instead. Each entry holds the metrics rows (wall time dropped) and the
final checkpoint's server state and client store. ``record`` adds only the entries the registry has and the set
lacks (a new algorithm), and drops those of algorithms no longer registered, so an entry added on another CPU
leaves every other entry's bits as recorded; each entry keeps the CPU that recorded it (``check`` names it).

Runs go through the public command (``hafedho run smoke``), so the script keeps working while modules move;
the Flower run uses the ServerApp's strategy with the ClientApp called in-process (``flower_helpers``).
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

DEFAULT = Path(__file__).parent / "golden" / "smoke.pt"
ENGINES = ("loop", "process", "vmap")
RUNTIME = ("workers=2", "threads=1", "--quiet")  # pinned: process workers and threads change float rounding


def _read(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from hafedho.runtime.checkpoint import stored_clients

    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    return {
        "rows": [{k: v for k, v in r.items() if k != "wall_s"} for r in rows],
        "server": ckpt["server"],
        "store": stored_clients(run_dir),
    }


def simulator_run(alg: str, engine: str, tmp: Path) -> dict[str, Any]:
    from hafedho.cli import main

    out = tmp / f"{alg}-{engine}"
    code = main(["run", "smoke", f"algorithm.name={alg}", f"engine={engine}", "--out", str(out), *RUNTIME])
    assert code == 0, f"{alg} on {engine}: exit {code}"
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return _read(run_dir)


def flower_run(alg: str, tmp: Path) -> dict[str, Any]:
    from flower_helpers import LocalGrid

    from hafedho.flower.common import experiment
    from hafedho.flower.strategy import HafedhoStrategy

    rc = {"hafedho-config": "smoke", "overrides": f"algorithm.name={alg} threads=1"}
    strategy = HafedhoStrategy(experiment(rc), tmp / "flower", node_wait=0.0)
    strategy.prepare()
    grid = LocalGrid(rc, strategy.fed.num_clients)
    strategy.start(
        grid, strategy.initial_arrays(), num_rounds=strategy.cfg.rounds, evaluate_fn=strategy.evaluate_global
    )
    strategy.finish()
    return _read(tmp / "flower")


def wanted() -> list[str]:
    """Every entry the set should hold: ``ALGORITHM/ENGINE`` for the registry x engines, and ``hafedho/flower``."""
    from hafedho.algorithms import REGISTRY

    return [f"{a}/{e}" for a in REGISTRY for e in ENGINES] + ["hafedho/flower"]


def compute(keys: list[str] | None = None) -> dict[str, Any]:
    """Every entry (or only ``keys``), keyed ``ALGORITHM/ENGINE`` and ``hafedho/flower``."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="golden_") as d:
        for key in wanted() if keys is None else keys:
            alg, engine = key.split("/")
            tmp = Path(d) / key.replace("/", "-")
            tmp.mkdir()
            out[key] = flower_run(alg, tmp) if engine == "flower" else simulator_run(alg, engine, tmp)
    return out


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Bit-for-bit comparison: the keys whose rows or tensors differ in any bit."""
    bad = []
    for key, w in want.items():
        g = got.get(key)
        same = (
            g is not None
            and g["rows"] == w["rows"]
            and all(
                len(g[part]) == len(w[part]) and all(torch.equal(a, b) for a, b in zip(g[part], w[part], strict=True))
                for part in ("server", "store")
            )
        )
        if not same:
            bad.append(key)
    return bad


def cpu_name() -> str:
    """The CPU model (bits are only comparable on the same one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def entry_meta(saved: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each entry's recorder (CPU, torch); a set written before entries kept their own has one for all."""
    return {key: saved.get("entry_meta", {}).get(key, saved["meta"]) for key in saved["runs"]}


def record(path: Path, everything: bool = False) -> int:
    """Add the missing entries to the set at ``path`` (all of them with ``everything``, or when there is none)."""
    meta = {"cpu": cpu_name(), "torch": str(torch.__version__)}
    saved = {} if everything or not path.exists() else torch.load(path, map_location="cpu", weights_only=True)
    keys = wanted()
    runs = {k: v for k, v in saved.get("runs", {}).items() if k in keys}
    metas = {k: v for k, v in entry_meta(saved).items() if k in keys} if saved else {}
    missing = [k for k in keys if k not in runs]
    dropped = sorted(set(saved.get("runs", {})) - set(keys))
    runs.update(compute(missing) if missing else {})
    metas.update({k: meta for k in missing})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": saved.get("meta", meta), "runs": {k: runs[k] for k in keys}, "entry_meta": metas}, path)
    kept = len(keys) - len(missing)
    gone = f" ({', '.join(dropped)})" if dropped else ""
    print(f"recorded {len(missing)} runs ({meta}), kept {kept}, dropped {len(dropped)}{gone}: {path}")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    everything = "--all" in argv[1:]
    args = [a for a in argv[1:] if a != "--all"]
    path = Path(args[0]) if args else DEFAULT
    if argv[0] == "record":
        return record(path, everything)
    want = torch.load(path, map_location="cpu", weights_only=True)
    got = compute(list(want["runs"]))
    bad = differences(got, want["runs"])
    metas = entry_meta(want)
    for key in bad:
        print(f"differs: {key} (recorded on {metas[key]['cpu']})")
    print(f"{len(want['runs']) - len(bad)} of {len(want['runs'])} runs bit-identical to {path} ({want['meta']})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
