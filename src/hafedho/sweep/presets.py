"""Presets: read a preset file (with what it extends), merge its ``[scale.SCALE]`` table, name its axes.

A bundle (``[bundles.AXIS.VALUE]``) may hold ``when`` rules: ``[bundles.AXIS.VALUE.when."KEY=V, KEY2=V2"]`` is a
table of overrides applied only to runs where every condition holds (KEY: a grid axis of the point or a config
key such as ``algorithm.name``), after every bundle and before config-key axes, variant sets and overrides. They
express what depends on two choices, e.g. MOON keeping its head under the main protocol, or a value tuned per
dataset and horizon (``_tuned_long.toml``).

A bundle may also be ``scaled = {of = "VALUE", by = FACTOR}``: bundle VALUE of the same axis with every number
in it (its ``when`` rules too) multiplied by FACTOR, and the bundle's own keys merged over that. A grid of lrs at
0.5x and 2x of tuned ones then states the tuned ones once (``tune-long.toml``). It is resolved as the preset
loads, after ``[scale.SCALE]`` is merged, so every reader sees plain bundles."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hafedho.config import Config, ConfigError
from hafedho.core.plugins import preset_folders
from hafedho.toml_io import deep_merge, is_number, read_toml

SCALES = ("cpu", "full")
_KEYS = {"extends", "description", "seeds", "out", "base", "grid", "bundles", "variants", "report", "scale"}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


@dataclass
class Preset:
    """A preset resolved for one scale (``extends`` and ``[scale.SCALE]`` already merged)."""

    name: str
    scale: str
    path: Path
    table: dict[str, Any]

    @property
    def description(self) -> str:
        return str(self.table.get("description", ""))

    @property
    def seeds(self) -> int:
        return int(self.table.get("seeds", 3))

    @property
    def out(self) -> str:
        return f"{self.table.get('out', f'runs/{self.name}')}-{self.scale}"

    @property
    def grid(self) -> dict[str, list[Any]]:
        return self.table.get("grid", {})

    @property
    def derived(self) -> dict[str, dict[str, str]]:
        """Its derived rows (``[[variants]]`` with ``derive``): label -> ``{"of": the row label it sits beside,
        "derive": the function's reference}``."""
        return {str(v["label"]): derived_row(v) for v in self.table.get("variants", []) if is_derived(v)}

    @property
    def report(self) -> dict[str, Any]:
        return self.table.get("report", {})


def is_derived(variant: dict[str, Any]) -> bool:
    """A ``[[variants]]`` row derived from another row's runs (it names a ``derive`` function)."""
    return "derive" in variant


def derived_row(variant: dict[str, Any]) -> dict[str, str]:
    """``{"of": ..., "derive": ...}`` of a derived variant."""
    return {"of": str(variant.get("of")), "derive": str(variant["derive"])}


def list_presets(folder: Path | None = None) -> list[str]:
    """Names of the runnable presets in ``folder``, or in every installed plugin's (``hafedho.core.plugins``);
    files starting with ``_`` are shared parts."""
    folders = [folder] if folder is not None else preset_folders()
    return sorted({p.stem for f in folders for p in f.glob("*.toml") if not p.stem.startswith("_")})


def preset_path(name: str) -> Path:
    """A preset file: a path, or the name of a preset an installed plugin provides (``table1``: the paper study's,
    ``study/`` in this repository; the first plugin in name order that has it)."""
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"preset file not found: {p}")
        return p
    for folder in preset_folders():
        if (folder / f"{name}.toml").is_file():
            return folder / f"{name}.toml"
    known = ", ".join(list_presets()) or "none (no plugin with presets is installed)"
    raise ConfigError(f"unknown preset {name!r}; installed presets: {known}, or pass a .toml file")


def nest(table: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys to nested tables, at every level: ``{"data.q": 0.1}`` -> ``{"data": {"q": 0.1}}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        value = nest(value) if isinstance(value, dict) else value
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        out = deep_merge(out, {key.split(".")[0]: value})
    return out


def nest_bundle(table: dict[str, Any]) -> dict[str, Any]:
    """``nest`` for a bundle: its ``when`` rules keep their condition text (``"algorithm.name=moon"``) as one key."""
    rest = {k: v for k, v in table.items() if k != "when"}
    out = nest(rest)
    if "when" in table:
        out["when"] = {str(cond): nest(sub) for cond, sub in table["when"].items()}
    return out


def _read_preset(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' forms a cycle")
    table = read_toml(path)
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown preset key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_KEYS))}")
    table = _normalize(table)
    for name, over in table.get("scale", {}).items():
        if name not in SCALES or not isinstance(over, dict):
            raise ConfigError(f"{path}: [scale.{name}]: scales are {', '.join(SCALES)}")
        table["scale"][name] = _normalize(over)
    parent = table.pop("extends", None)
    if parent is None:
        return table
    ppath = path.parent / (parent if parent.endswith(".toml") else f"{parent}.toml")
    base = _read_preset(ppath, (*seen, path.resolve()))
    base.pop("grid", None)  # a grid is never inherited: each preset states its own
    return deep_merge(base, table)


def _normalize(table: dict[str, Any]) -> dict[str, Any]:
    """Nest the dotted keys of config-shaped parts (base, bundles, variant sets) so merges are per key."""
    table = dict(table)
    if "base" in table:
        table["base"] = nest(table["base"])
    table["bundles"] = {
        axis: {value: nest_bundle(t) for value, t in values.items()}
        for axis, values in table.get("bundles", {}).items()
    }
    table["variants"] = [{**v, "set": nest(v["set"])} if "set" in v else dict(v) for v in table.get("variants", [])]
    if not table["variants"]:
        del table["variants"]  # an absent list must not replace an inherited one
    if not table["bundles"]:
        del table["bundles"]
    return table


def load_preset(name: str, scale: str = "cpu") -> Preset:
    """Read a preset (with what it extends) and merge its ``[scale.SCALE]`` table over it."""
    if scale not in SCALES:
        raise ConfigError(f"--scale {scale!r}: choose one of {', '.join(SCALES)}")
    path = preset_path(name)
    table = _read_preset(path)
    over = dict(table.pop("scale", {}).get(scale, {}))
    unknown = sorted(set(over) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: [scale.{scale}] has unknown key(s) {', '.join(unknown)}")
    grid = dict(table.get("grid", {}))
    for axis, values in over.pop("grid", {}).items():
        if axis not in grid:
            raise ConfigError(f"{path}: [scale.{scale}.grid] names {axis!r}, which is not an axis of [grid]")
        grid[axis] = values
    table = deep_merge(table, over)
    table["grid"] = grid
    if "bundles" in table:
        table["bundles"] = {a: _resolve_scaled(path, a, values) for a, values in table["bundles"].items()}
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid.{axis} must be a non-empty list of values")
    return Preset(path.stem, scale, path, table)


def _resolve_scaled(path: Path, axis: str, bundles: dict[str, Any]) -> dict[str, Any]:
    """The axis's bundles with each ``scaled = {of, by}`` replaced by what it names (module docstring)."""
    done: dict[str, dict[str, Any]] = {}

    def resolve(value: str, chain: tuple[str, ...]) -> dict[str, Any]:
        if value in done:
            return done[value]
        table = copy.deepcopy(bundles[value])
        spec = table.pop("scaled", None)
        if spec is not None:
            where = f"{path}: [bundles.{axis}.{value}] scaled"
            by = spec.get("by") if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or set(spec) != {"of", "by"} or not is_number(by):
                raise ConfigError(f'{where}: write scaled = {{of = "VALUE", by = FACTOR}}, FACTOR a number')
            of = str(spec["of"])
            if of not in bundles:
                raise ConfigError(f"{where}: of = {of!r} is not a bundle of {axis}; known: {', '.join(bundles)}")
            if of in (*chain, value):
                raise ConfigError(f"{where}: of = {of!r} forms a cycle ({' -> '.join((*chain, value, of))})")
            table = deep_merge(_times(resolve(of, (*chain, value)), by), table)
        done[value] = table
        return table

    return {value: resolve(value, ()) for value in bundles}


def _times(table: dict[str, Any], factor: float) -> dict[str, Any]:
    """Every number in a nested table multiplied by ``factor`` (strings, booleans and lists left as they are)."""
    return {
        k: _times(v, factor) if isinstance(v, dict) else v * factor if is_number(v) else v for k, v in table.items()
    }


def is_config_key(axis: str) -> bool:
    return axis.split(".")[0] in _CONFIG_FIELDS


def row_axes(preset: Preset) -> list[str]:
    """Axes that pick an algorithm or its hyperparameters (rows of a report); the others are settings (columns)."""
    bundles = preset.table.get("bundles", {})

    def only_algorithm(axis: str) -> bool:
        tables = [t for b in bundles.get(axis, {}).values() for t in (b, *b.get("when", {}).values())]
        return all(set(t) - {"when"} <= {"algorithm"} for t in tables)

    return [a for a in preset.grid if a.startswith("algorithm.") or (not is_config_key(a) and only_algorithm(a))]
