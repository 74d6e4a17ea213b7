"""The Flower ServerApp: builds the Experiment from the run config and runs :class:`HafedhoStrategy`.

Run-config keys (``[tool.flwr.app.config]``, overridable with ``flwr run -c``) are listed in
``hafedho.flower.app.RUN_CONFIG``. ``resume = true`` continues the run directory from its checkpoint; a SIGINT or
SIGTERM of the ServerApp ends with the simulator's ``interrupted at round N; continue with --resume`` line.
"""

from __future__ import annotations

from logging import INFO
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler

from hafedho.flower.app import flower_run_dir
from hafedho.flower.common import experiment, run_setting, set_threads
from hafedho.flower.secagg import SecAggSettings
from hafedho.flower.secagg_server import SecureRounds
from hafedho.flower.strategy import HafedhoStrategy
from hafedho.runtime.rundir import Interrupted

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    set_threads(rc)
    exp = experiment(rc)
    run_dir = str(run_setting(rc, "run-dir")) or str(flower_run_dir(exp.cfg.run_dir))
    timeout = float(run_setting(rc, "round-timeout"))
    node_wait = float(run_setting(rc, "node-wait"))
    strategy = HafedhoStrategy(exp, run_dir, node_wait=node_wait, query_timeout=min(timeout, 120.0))
    settings = SecAggSettings.from_run_config(rc)
    secure = SecureRounds(strategy, settings, timeout) if settings is not None else None  # refuses before any file
    strategy.prepare(force=bool(run_setting(rc, "force")), resume=bool(run_setting(rc, "resume")))
    # SIGINT / SIGTERM of the ServerApp process: Flower's handler runs this before it exits
    add_exit_handler(strategy.interrupted, run_before_force_exit=True)
    try:
        if secure is not None:
            secure.start(grid, context)
        else:
            strategy.start(
                grid,
                strategy.initial_arrays(),
                num_rounds=exp.cfg.rounds,
                timeout=timeout,
                evaluate_fn=strategy.evaluate_global,
            )
    except KeyboardInterrupt:
        raise Interrupted(strategy.interrupted() or "interrupted") from None
    except BaseException:
        strategy.abandon()
        raise
    strategy.finish()
    how = " (SecAgg+)" if secure is not None else ""
    log(INFO, "hafedho: %d rounds%s written to %s", len(strategy.rows), how, Path(run_dir).resolve())
