"""Expansion: a preset's grid points and variants x seeds -> validated run specs, named as `hafedho run` would."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hafedho.config import Config, ConfigError, config_from_table, parse_override
from hafedho.sweep.presets import Preset, deep_merge, is_config_key, nest


@dataclass
class RunSpec:
    """One run of a sweep: its directory name, row label, grid point, seed and validated config."""

    name: str
    label: str
    seed: int
    point: dict[str, Any]
    cfg: Config
    reference: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.out) / self.name


def _split_overrides(
    overrides: Iterable[str], grid: dict[str, list[Any]]
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Overrides of a grid axis replace that axis (a TOML list gives several values); others apply to every run."""
    grid, extra = dict(grid), {}
    for text in overrides:
        nested = parse_override(text)
        key = text.split("=", 1)[0].strip()
        if key in grid:
            parsed = _leaf(nested, key)
            grid[key] = parsed if isinstance(parsed, list) else [parsed]
        else:
            extra = deep_merge(extra, nested)
    return grid, extra


def _leaf(nested: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        nested = nested[part]
    return nested


def _bundle(preset: Preset, axis: str, value: Any) -> dict[str, Any]:
    bundles = preset.table.get("bundles", {}).get(axis)
    if bundles is None:
        raise ConfigError(
            f"{preset.path}: grid axis {axis!r} is neither a config key nor a named axis with [bundles.{axis}.*] tables"
        )
    if str(value) not in bundles:
        raise ConfigError(
            f"{preset.path}: {axis}={value!r} has no [bundles.{axis}.{value}]; known: {', '.join(bundles)}"
        )
    return nest(bundles[str(value)])


def _point_table(preset: Preset, point: dict[str, Any], sets: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    table = nest(copy.deepcopy(preset.table.get("base", {})))
    for axis, value in point.items():  # named axes first, so an explicit config-key axis wins over a bundle
        if not is_config_key(axis):
            table = deep_merge(table, _bundle(preset, axis, value))
    for axis, value in point.items():
        if is_config_key(axis):
            table = deep_merge(table, nest({axis: value}))
    return deep_merge(deep_merge(table, nest(sets)), extra)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


def expand(
    preset: Preset,
    seeds: int | None = None,
    overrides: Iterable[str] = (),
    out: str | None = None,
) -> list[RunSpec]:
    """Every run of the preset: grid points (then variants) x seeds, validated; duplicates removed.

    ``overrides`` are ``key=value`` strings: a grid axis is replaced by the value (or list of values); any other
    key applies to every run, variants included. Each config is checked as it is loaded (its algorithm too).
    """
    grid, extra = _split_overrides(overrides, preset.grid)
    n_seeds = preset.seeds if seeds is None else seeds
    if n_seeds < 1:
        raise ConfigError(f"--seeds {n_seeds}: need at least 1")
    out = str(Path(out or preset.out))
    points: list[tuple[str | None, dict[str, Any], dict[str, Any], bool]] = []
    for values in itertools.product(*grid.values()):
        points.append((None, dict(zip(grid, values, strict=True)), {}, False))
    for i, var in enumerate(preset.table.get("variants", [])):
        where = f"{preset.path}: variants[{i}]"
        unknown = sorted(set(var) - {"label", "cross", "reference", "set"})
        if unknown or not isinstance(var.get("label"), str):
            raise ConfigError(f"{where}: needs label = '...'; allowed keys: label, cross, reference, set")
        cross = var.get("cross", [])
        missing = [a for a in cross if a not in grid]
        if missing:
            raise ConfigError(f"{where}: cross names {', '.join(missing)}, not axes of [grid]")
        for values in itertools.product(*(grid[a] for a in cross)):
            points.append(
                (var["label"], dict(zip(cross, values, strict=True)), var.get("set", {}), var.get("reference", False))
            )
    specs: dict[str, RunSpec] = {}
    for label, point, sets, reference in points:
        base = _point_table(preset, point, sets, extra)
        for seed in range(n_seeds):
            table = {**base, "seed": seed}
            try:
                cfg = config_from_table(table)
            except ConfigError as e:
                raise ConfigError(f"{preset.name} {_point_text(label, point)}: {e}") from None
            row = label or str(cfg.algorithm["name"])
            cfg.name, cfg.out = f"{_slug(row)}-{_slug(cfg.data.source)}", out  # a prefix: see Config.run_name
            try:
                name = cfg.run_name
            except ConfigError as e:
                raise ConfigError(f"{preset.name} {_point_text(label, point)}: {e}") from None
            specs.setdefault(name, RunSpec(name, row, seed, point, cfg, reference))
    return list(specs.values())


def _point_text(label: str | None, point: dict[str, Any]) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in point.items())
    return f"[{label}: {inner}]" if label else f"[{inner}]"
