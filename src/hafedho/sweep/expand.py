"""Expansion: a preset's grid points and variants x seeds -> validated run specs, named as `hafedho run` would.

A variant with ``derive`` (a ``"package.module:function"`` reference, ``hafedho.core.refs``) and ``of`` (a row label)
adds one run derived from every run of that row, right beside it: ``function(cfg)`` gives the derived run's
``[algorithm]`` table, or None and why it has none."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hafedho.config import Config, ConfigError, config_from_table
from hafedho.core.refs import file_name, import_reference
from hafedho.sweep.presets import Preset, derived_row, is_config_key, is_derived, nest, nest_bundle
from hafedho.toml_io import deep_merge, parse_override


@dataclass
class RunSpec:
    """One run of a sweep: its directory name, row label, grid point, seed and validated config."""

    name: str
    label: str
    seed: int
    point: dict[str, Any]
    cfg: Config
    reference: bool = False
    aliases: list[str] = dataclasses.field(default_factory=list)  # other row labels this same run stands for
    note: str = ""  # a run of a row with a derived row but no derived run: why (shown under the report's tables)
    rounds: int = 0  # the horizon its own point asks for (cfg.rounds is the largest over its views)
    views: list[tuple[dict[str, Any], int]] = dataclasses.field(default_factory=list)  # other (point, horizon)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.out) / self.name  # a spec's name is its directory's (expand: cfg.run_name)


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
    return nest_bundle(copy.deepcopy(bundles[str(value)]))


def _point_table(preset: Preset, point: dict[str, Any], sets: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Base, then named-axis bundles and the ``when`` rules that hold (each at a bundle's precedence), then
    config-key axes, variant sets and the command line's overrides: an explicit axis or set always wins."""
    bundles, rules = nest(copy.deepcopy(preset.table.get("base", {}))), []
    for axis, value in point.items():  # named axes first, so an explicit config-key axis wins over a bundle
        if not is_config_key(axis):
            bundle = _bundle(preset, axis, value)
            rules += list(bundle.pop("when", {}).items())
            bundles = deep_merge(bundles, bundle)

    def explicit(table: dict[str, Any]) -> dict[str, Any]:
        for axis, value in point.items():
            if is_config_key(axis):
                table = deep_merge(table, nest({axis: value}))
        return deep_merge(table, nest(sets))

    assembled = explicit(bundles)  # the run without its rules: what their conditions read
    for cond, over in rules:
        if _holds(preset, cond, point, assembled):
            bundles = deep_merge(bundles, over)
    return deep_merge(explicit(bundles), extra)


def _holds(preset: Preset, cond: str, point: dict[str, Any], table: dict[str, Any]) -> bool:
    """Whether every ``KEY=VALUE`` of a ``when`` rule holds for this run: KEY a grid axis of the point (a named
    axis the point lacks never holds) or a config key, read from the assembled table."""
    for part in cond.split(","):
        key, sep, want = (x.strip() for x in part.partition("="))
        if not sep or not key:
            raise ConfigError(f"{preset.path}: when {cond!r}: write each condition as KEY=VALUE, joined by ','")
        if key in point:
            have: Any = point[key]
        elif is_config_key(key):
            have = table
            for k in key.split("."):
                have = have.get(k) if isinstance(have, dict) else None
        else:
            have = None
        if have is None or str(have) != want:
            return False
    return True


def _slug(text: str) -> str:
    """``text`` as part of a folder name: a reference's ':' as '.' (``file_name``, as ``hafedho run`` writes it,
    so a sweep's run and a plain run of one experiment share a directory), any other odd character as '_'."""
    return "".join(c if c.isalnum() or c in "._" else "_" for c in file_name(text))


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
    derived: dict[str, tuple[str, Derive]] = {}  # of -> (the derived row's label, its function)
    for i, var in enumerate(preset.table.get("variants", [])):
        where = f"{preset.path}: variants[{i}]"
        if is_derived(var):
            _derived_variant(var, where, derived)
            continue
        unknown = sorted(set(var) - {"label", "cross", "reference", "set"})
        if unknown or not isinstance(var.get("label"), str):
            raise ConfigError(
                f"{where}: needs label = '...'; allowed keys: label, cross, reference, set (or of and derive)"
            )
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
            spec = _add(specs, _spec(preset, label, point, table, out, reference))
            if spec.label in derived:  # the derived run right after its row's run: beside it in every listing
                row, derive = derived[spec.label]
                alg, why = derive(spec.cfg)
                if alg is None:
                    inner = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items() if k != "algorithm.name")
                    spec.note = f"no {row} for {spec.label} [{inner}]: {why}"
                    continue
                _add(specs, _spec(preset, row, point, {**table, "algorithm": alg}, out, False, str(alg["name"])))
    return list(specs.values())


def _spec(
    preset: Preset,
    label: str | None,
    point: dict[str, Any],
    table: dict[str, Any],
    out: str,
    reference: bool,
    prefix: str | None = None,
) -> RunSpec:
    """One run: its validated config, named ``PREFIX-SOURCE-HASH-sSEED``; PREFIX is the row label unless given
    (a derived run is named as any run of its algorithm, so an identical run elsewhere is the same directory)."""
    try:
        cfg = config_from_table(table)
    except ConfigError as e:
        raise ConfigError(f"{preset.name} {_point_text(label, point)}: {e}") from None
    row = label or str(cfg.algorithm["name"])
    prefix = prefix or row
    cfg.name, cfg.out = f"{_slug(prefix)}-{_slug(cfg.data.source)}", out  # a prefix: see Config.run_name
    try:
        name = cfg.run_name
    except ConfigError as e:
        raise ConfigError(f"{preset.name} {_point_text(label, point)}: {e}") from None
    return RunSpec(name, row, int(table["seed"]), point, cfg, reference)


def _add(specs: dict[str, RunSpec], spec: RunSpec) -> RunSpec:
    """Keep one spec per run directory (returned). The same run under another row label is an alias of the first;
    under the same label at another grid point or horizon (MOON under both protocols, a value the longer horizon
    keeps), it is a view: listed at each point, run to the longest horizon, read at each one's own."""
    spec.rounds = spec.rounds or spec.cfg.rounds
    first = specs.setdefault(spec.name, spec)
    if first is spec:
        return first
    if spec.label != first.label:
        if spec.label not in first.aliases:
            first.aliases.append(spec.label)
    elif (spec.point, spec.rounds) != (first.point, first.rounds) and (spec.point, spec.rounds) not in first.views:
        first.views.append((spec.point, spec.rounds))
        first.cfg.rounds = max(first.cfg.rounds, spec.rounds)
    return first


Derive = Callable[[Config], tuple[dict[str, Any] | None, str]]


def _derived_variant(var: dict[str, Any], where: str, derived: dict[str, tuple[str, Derive]]) -> None:
    """Check a derived variant (``label``, ``of``, ``derive``) and resolve its function by reference."""
    keys = {"label", "of", "derive"}
    if set(var) != keys or not all(isinstance(var[k], str) for k in keys):
        raise ConfigError(
            f"{where}: a derived variant takes only label = '...', of = '<row label>' and "
            "derive = 'package.module:function'"
        )
    row = derived_row(var)
    if row["of"] in derived:
        raise ConfigError(f"{where}: of = {row['of']!r} is given twice; keep one derived variant per row")
    fn = import_reference(f"{where}: derive", row["derive"], ConfigError)
    if not inspect.isfunction(fn):  # a def of the user's (refs: never a builtin), called with the run's config
        raise ConfigError(f"{where}: derive = {row['derive']!r} is not a function of the run's config")
    derived[row["of"]] = (var["label"], fn)  # type: ignore[assignment]


def _point_text(label: str | None, point: dict[str, Any]) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in point.items())
    return f"[{label}: {inner}]" if label else f"[{inner}]"
