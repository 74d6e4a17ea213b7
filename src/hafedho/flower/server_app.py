"""The Flower ServerApp: builds the Experiment from the run config and runs :class:`HafedhoStrategy`.

Run-config keys (``[tool.flwr.app.config]``, overridable with ``flwr run -c``) are listed in
``hafedho.flower.app.RUN_CONFIG``. ``resume = true`` continues the run directory from its checkpoint; a SIGINT or
SIGTERM of the ServerApp ends with the simulator's ``interrupted at round N; continue with --resume`` line.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler

from hafedho.config import ConfigError
from hafedho.data.partition import PartitionError
from hafedho.data.sources import DataError
from hafedho.flower.app import flower_run_dir
from hafedho.flower.common import experiment, run_setting, set_threads
from hafedho.flower.secagg import SecAggSettings
from hafedho.flower.secagg_server import SecureRounds
from hafedho.flower.strategy import HafedhoStrategy
from hafedho.runfiles import RunDirError
from hafedho.runtime.rounds import Divergence
from hafedho.runtime.rundir import Interrupted

SUPERLINK_GONE_S = 30.0  # a SuperLink refusing connections this long is gone: the ServerApp stops (watch_superlink)
ERROR_PREFIX = "hafedho: error: "
# hafedho's errors that name the problem and its fix in one line (as the CLI prints them)
ONE_LINE = (ConfigError, DataError, PartitionError, RunDirError, Divergence)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        _main(grid, context)
    except ONE_LINE as e:  # Flower logs the traceback after this; `hafedho flower run --wait` ends with this line
        log(ERROR, "%s%s", ERROR_PREFIX, e)
        raise


def _main(grid: Grid, context: Context) -> None:
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
    watch_superlink(sys.argv, SUPERLINK_GONE_S)
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


def watch_superlink(argv: list[str], patience: float, every: float = 5.0) -> threading.Thread | None:
    """Stop this ServerApp (SIGINT: the run's checkpoint is waited for, its lock released, the "interrupted at round
    N; continue with --resume" line logged) once the SuperLink it was started by (``--runtime-api-address`` in
    ``argv``, flwr-serverapp's) has refused connections for ``patience`` seconds: Flower 1.42's ServerApp would
    otherwise retry a killed SuperLink forever, holding the run's lock. None when ``argv`` names no SuperLink
    (in process, in tests)."""
    if "--runtime-api-address" not in argv[:-1]:
        return None
    host, _, port = argv[argv.index("--runtime-api-address") + 1].rpartition(":")
    address = (host.strip("[]") or "127.0.0.1", int(port))

    def watch() -> None:
        gone_since: float | None = None
        while True:
            time.sleep(every)
            try:
                socket.create_connection(address, timeout=every).close()
                gone_since = None
            except OSError:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since >= patience:
                    log(ERROR, "hafedho: the SuperLink at %s:%d has been gone for %.0f s", *address, patience)
                    signal.raise_signal(signal.SIGINT)
                    return

    thread = threading.Thread(target=watch, name="hafedho-superlink-watch", daemon=True)
    thread.start()
    return thread


def server_error(log_text: str) -> str | None:
    """The one-line error a ServerApp logged (``main``) in a run's log, without Flower's decoration; None if none."""
    lines = [line for line in log_text.splitlines() if ERROR_PREFIX in line]
    return lines[-1].split(ERROR_PREFIX, 1)[1].strip() if lines else None
