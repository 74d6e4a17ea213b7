"""The Flower App folder: a ``pyproject.toml`` naming hafedho's ServerApp and ClientApp, with the run config."""

from __future__ import annotations

from pathlib import Path

# The Flower App: its components are hafedho's; the run config mirrors hafedho.flower.common.RUN_CONFIG_DEFAULTS.
APP_PYPROJECT = """\
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

[tool.flwr.app.config]
hafedho-config = "smoke"
overrides = ""
run-dir = ""
round-timeout = 600.0
node-wait = 120.0
force = false
torch-threads = 0
"""


def write_app(folder: str | Path) -> Path:
    """A Flower App folder (only ``pyproject.toml``) whose components are hafedho's ServerApp and ClientApp."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder
