"""The Flower App: its ``pyproject.toml`` (hafedho's ServerApp and ClientApp) and its run config, defined once.

:data:`RUN_CONFIG` is the one list of the run-config keys (``[tool.flwr.app.config]``), their defaults and
meanings. Generated from it: the ``pyproject.toml`` that ``hafedho flower app`` writes, which is also
``examples/flower/pyproject.toml`` (tests/test_run_config.py checks they are the same text), the defaults the
ServerApp and ClientApp fall back on (:data:`RUN_CONFIG_DEFAULTS`) and those of ``hafedho flower run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hafedho.flower.flwr_cli import toml_value

__all__ = [
    "APP_PYPROJECT",
    "RUN_CONFIG",
    "RUN_CONFIG_DEFAULTS",
    "Setting",
    "app_pyproject",
    "flower_run_dir",
    "write_app",
]


@dataclass(frozen=True)
class Setting:
    """One run-config key: its default (which also fixes its type) and what it means."""

    key: str
    default: str | float | int | bool
    help: str


RUN_CONFIG: tuple[Setting, ...] = (
    Setting(
        "hafedho-config", "smoke", "embedded config (default, demo, smoke) or a TOML path readable on every machine"
    ),
    Setting("overrides", "", 'dotted hafedho overrides, space-separated: "algorithm.name=scaffold rounds=20"'),
    Setting("run-dir", "", 'metrics.jsonl etc. on the SuperLink\'s machine; "" = <out>/flower/<run name>'),
    Setting("round-timeout", 600.0, "seconds a round waits for replies; missing ones are dropped"),
    Setting("node-wait", 120.0, "seconds (from round 1) a round waits for its cohort's SuperNodes to connect"),
    Setting("force", False, "replace an existing run directory"),
    Setting("resume", False, "continue the run directory from its checkpoint (SuperNodes keep client state)"),
    Setting("torch-threads", 0, "> 0: torch.set_num_threads on the server and the clients"),
    Setting("secagg", False, "SecAgg+: the server sees only the sum of the uploads (weighted-sum algorithms)"),
    Setting("secagg-num-shares", 0, "SecAgg+ shares of each client's secrets; 0 = the whole cohort"),
    Setting("secagg-reconstruction-threshold", 0, "shares that rebuild a dropped client's mask; 0 = 2/3, >= 2"),
    Setting("secagg-clipping-range", 0.0, "c: bound on each upload entry (scaled by w_i/K); 0 = 2^ceil(log2 4*lambda)"),
    Setting("secagg-quantization-range", 0, "Q levels over [-c, c]; 0 = the largest 2^k <= 2^30 with m*Q < 2^32"),
)
RUN_CONFIG_DEFAULTS: dict[str, str | float | int | bool] = {s.key: s.default for s in RUN_CONFIG}


def flower_run_dir(run_dir: Path) -> Path:
    """A Flower run's directory when ``run-dir`` is "": the config's ``OUT/RUN_NAME`` (``Config.run_dir``) moved to
    ``OUT/flower/RUN_NAME``, so a deployment and a simulation of one experiment never share a directory."""
    return run_dir.parent / "flower" / run_dir.name


_HEADER = """\
# A Flower App that runs hafedho's algorithms: `flwr run . <superlink-connection>` from this folder.
# The components live in the installed hafedho package (`pip install 'hafedho[flower]'` on the SuperLink's
# and every SuperNode's machine); this file only names them and sets the run config.
# Written by `hafedho flower app DIR`; the run config's keys and defaults: hafedho.flower.app.RUN_CONFIG.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hafedho-flower"
version = "0.1.0"
description = "HaFedHo and baselines on Flower's deployment and simulation engines"
license = "Apache-2.0"
dependencies = ["hafedho[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hafedho"

[tool.flwr.app.components]
serverapp = "hafedho.flower.server_app:app"
clientapp = "hafedho.flower.client_app:app"

# Run config: override with `flwr run . CONNECTION -c 'key=value ...'`.
[tool.flwr.app.config]
"""


def app_pyproject() -> str:
    """The App's ``pyproject.toml``: its components, and :data:`RUN_CONFIG` with one comment per key."""
    lines = [f"{s.key} = {toml_value(s.default)}" for s in RUN_CONFIG]
    width = max(map(len, lines)) + 2
    return _HEADER + "".join(f"{line:<{width}}# {s.help}\n" for line, s in zip(lines, RUN_CONFIG, strict=True))


APP_PYPROJECT = app_pyproject()


def write_app(folder: str | Path) -> Path:
    """A Flower App folder (only ``pyproject.toml``) whose components are hafedho's ServerApp and ClientApp."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder
