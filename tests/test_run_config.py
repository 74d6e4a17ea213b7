"""The Flower run config is defined once (hafedho.flower.app.RUN_CONFIG); every place that writes it out agrees.

No flwr needed: the App folder, the example, the docs table and ``hafedho flower run``'s defaults are plain text
and argparse.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from hafedho.cli import parser
from hafedho.flower.app import APP_PYPROJECT, RUN_CONFIG, RUN_CONFIG_DEFAULTS, write_app
from hafedho.flower.common import run_setting
from hafedho.flower.flwr_cli import toml_value

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_app_is_the_generated_one() -> None:
    # Regenerate with: hafedho flower app examples/flower
    assert (ROOT / "examples" / "flower" / "pyproject.toml").read_text() == APP_PYPROJECT


def test_the_app_pyproject_holds_every_default_with_its_type(tmp_path: Path) -> None:
    config = tomllib.loads(write_app(tmp_path / "app").joinpath("pyproject.toml").read_text())["tool"]["flwr"]
    assert config["app"]["config"] == RUN_CONFIG_DEFAULTS
    assert all(type(config["app"]["config"][s.key]) is type(s.default) for s in RUN_CONFIG)
    assert list(RUN_CONFIG_DEFAULTS) == [s.key for s in RUN_CONFIG]


def test_the_apps_fall_back_on_the_same_defaults() -> None:
    assert all(run_setting({}, s.key) == s.default for s in RUN_CONFIG)


def test_flower_run_defaults_are_the_run_configs() -> None:
    args = parser().parse_args(["flower", "run", "--superlink", "127.0.0.1:1"])
    flags = {
        k: getattr(args, k.replace("-", "_")) for k in RUN_CONFIG_DEFAULTS if k not in ("hafedho-config", "overrides")
    }
    assert flags == {k: v for k, v in RUN_CONFIG_DEFAULTS.items() if k in flags}


def test_the_docs_table_lists_the_run_config() -> None:
    text = (ROOT / "docs" / "flower.md").read_text()
    table = text[text.index("## Run config") :].split("\n\n")[1].splitlines()[2:]  # skip the header rows
    rows = [[c.strip().strip("`") for c in line.strip("|").split("|")][:2] for line in table]
    assert rows == [[s.key, toml_value(s.default)] for s in RUN_CONFIG]
