"""One timed job of ``bench_runs.py``, run in a fresh process under one version's sources (``PYTHONPATH``).

    python benchmarks/run_driver.py run    CONFIG OUT [KEY=VALUE ...]   # a whole `hafedho run`, phases timed
    python benchmarks/run_driver.py sweep  CONFIG OUT RUNS [KEY=VALUE ...]  # RUNS seeds, one after another
    python benchmarks/run_driver.py eval   CONFIG ROWS [KEY=VALUE ...]  # evaluate the initial model on ROWS rows
    python benchmarks/run_driver.py full   CONFIG [KEY=VALUE ...]       # one full-data gradient pass
    python benchmarks/run_driver.py usual  CONFIG ROUNDS [KEY=VALUE ...]  # a FedML-style whole process

It prints one JSON line: seconds in all (from before ``import torch``) and per phase. Phases are timed by
wrapping functions that every version since the benchmark's base has (``rounds.evaluate``,
``fullgrad.full_gradients``, the engine's ``__call__``), so the same driver times old and new code alike.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

PHASES = {"steps": 0.0, "evaluation": 0.0, "full_passes": 0.0}


def timed(phase: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[phase] += time.perf_counter() - t

    return wrapper


def instrument() -> None:
    try:
        import hafedho.runtime.rounds as rounds
    except ImportError:  # versions before runtime/ existed
        import hafedho.rounds as rounds
    import hafedho.sim.fullgrad as fullgrad
    import hafedho.sim.runner as runner

    rounds.evaluate = timed("evaluation", rounds.evaluate)  # test set and the start-loss guard
    fullgrad.full_gradients = timed("full_passes", fullgrad.full_gradients)
    make = runner.engine_for

    def engine_for(cfg, *device):  # versions since the device setting also pass the run's device
        engine = make(cfg, *device)
        call = timed("steps", engine.__call__)

        class Timed:
            name = engine.name
            cores = getattr(engine, "cores", 0)

            def __call__(self, *args):
                return call(*args)

            def close(self) -> None:
                engine.close()

        return Timed()

    runner.engine_for = engine_for


def main(argv: list[str]) -> dict:
    from hafedho.config import load_config

    mode, config = argv[0], argv[1]
    if mode == "run":
        instrument()
        from hafedho.cli import main as cli

        code = cli(["run", config, "--out", argv[2], "--force", "--quiet", *argv[3:]])
        if code:  # a failed run is no timing
            raise SystemExit(f"hafedho run exited {code}")
    elif mode == "sweep":
        instrument()
        from hafedho.sweep.execute import run_spec

        for seed in range(int(argv[3])):
            cfg = load_config(config, [*argv[4:], f"seed={seed}"])
            out = run_spec(cfg, f"{argv[2]}/{cfg.run_name}", threads=1)
            assert out.status == "done", out
    elif mode == "eval":
        from hafedho.core.model import evaluate
        from hafedho.experiment import build

        exp = build(load_config(config, argv[3:]))
        if hasattr(exp.model, "use_compile"):  # versions with the compile setting
            exp.model.use_compile(exp.cfg.compile)
        x, y = exp.fed.x_test(), exp.fed.y_test
        rows = int(argv[2])
        x, y = x.repeat((rows // len(y) + 1,) + (1,) * (x.dim() - 1))[:rows], y.repeat(rows // len(y) + 1)[:rows]
        params = exp.model.params()
        evaluate(exp.model, params, x[:64], y[:64])  # first-call costs (kernel choice, the sizing probe)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            evaluate(exp.model, params, x, y)
            best = min(best, time.perf_counter() - t)
        PHASES["evaluation"] = best
    elif mode == "full":
        from hafedho.experiment import build
        from hafedho.sim.fullgrad import full_gradients

        exp = build(load_config(config, argv[2:]))
        params = exp.model.params()
        t = time.perf_counter()
        full_gradients(exp, params, 1)
        PHASES["full_passes"] = time.perf_counter() - t
    elif mode == "usual":
        usual(load_config(config, argv[3:]), int(argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return {"total": time.perf_counter() - T0, **PHASES}


def usual(cfg, rounds: int) -> None:
    """What FedML/Flower-style simulations do as a whole process: the usual per-client loop of
    ``bench_engines.UsualLoop`` for ``rounds`` rounds and one evaluation of the test set in batches of 1,000."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engines import UsualLoop

    from hafedho.experiment import build

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    exp = build(cfg)
    loop = UsualLoop(exp)
    t = time.perf_counter()
    for r in range(1, rounds + 1):
        loop(exp.cohort(r))
    PHASES["steps"] = time.perf_counter() - t
    t = time.perf_counter()
    x, y = exp.fed.x_test(), exp.fed.y_test
    loop.net.eval()
    with torch.no_grad():
        correct = sum(
            int((loop.net(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum()) for i in range(0, len(y), 1000)
        )
    PHASES["evaluation"] = time.perf_counter() - t
    assert 0 <= correct <= len(y)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
