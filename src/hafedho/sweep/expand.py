"""Expansion: a preset's grid points and variants x seeds -> validated run specs, named as `hafedho run` would.

A variant with ``twin_of`` adds HaFedHo's momentum twin beside every run of that row (``momentum_twin``; the
derivation is docs/algorithms.md, "HaFedHo's momentum twin")."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hafedho.config import Config, ConfigError, config_from_table
from hafedho.core.refs import file_name
from hafedho.sweep.presets import Preset, is_config_key, nest, nest_bundle
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
    note: str = ""  # a HaFedHo run without a twin: why (shown under the report's tables)
    rounds: int = 0  # the horizon its own point asks for (cfg.rounds is the largest over its views)
    views: list[tuple[dict[str, Any], int]] = dataclasses.field(default_factory=list)  # other (point, horizon)

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
    twins: dict[str, str] = {}  # twin_of -> the twin's label
    for i, var in enumerate(preset.table.get("variants", [])):
        where = f"{preset.path}: variants[{i}]"
        if "twin_of" in var:
            _twin_variant(var, where, twins)
            continue
        unknown = sorted(set(var) - {"label", "cross", "reference", "set"})
        if unknown or not isinstance(var.get("label"), str):
            raise ConfigError(f"{where}: needs label = '...'; allowed keys: label, cross, reference, set (or twin_of)")
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
            if spec.label in twins:  # the twin right after its HaFedHo run: beside it in every listing
                twin_alg, why = momentum_twin(spec.cfg)
                if twin_alg is None:
                    inner = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items() if k != "algorithm.name")
                    spec.note = f"no {twins[spec.label]} for {spec.label} [{inner}]: {why}"
                    continue
                twin = _spec(preset, twins[spec.label], point, {**table, "algorithm": twin_alg}, out, False, "fedavgm")
                _add(specs, twin)
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
    (a twin is named as any fedavgm run, so an identical fedavgm run elsewhere is the same directory)."""
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


def _twin_variant(var: dict[str, Any], where: str, twins: dict[str, str]) -> None:
    unknown = sorted(set(var) - {"label", "twin_of"})
    if unknown or not isinstance(var.get("label"), str) or not isinstance(var["twin_of"], str):
        raise ConfigError(f"{where}: a twin variant takes only label = '...' and twin_of = '<row label>'")
    if var["twin_of"] in twins:
        raise ConfigError(f"{where}: twin_of = {var['twin_of']!r} is given twice; keep one twin variant per row")
    twins[var["twin_of"]] = var["label"]


# HaFedHo's settings the twin covers; any other one away from its default (e.g. an option added later) has no twin.
_TWIN_COVERS = {"lr", "mu", "eta", "accumulate", "aggregation", "self_correction", "mu_schedule"}


def momentum_twin(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """The ``[algorithm]`` table of a HaFedHo run's momentum twin, or None and why it has none.

    With accumulate = "phi" the uploads obey g^t = G^t + lambda*mu*g^{t-1} (exactly without self-correction), the
    heavy-ball recursion of FedAvgM with beta = lambda*mu (lambda = clients.local_steps, mu = the resolved
    algorithm.hafedho.mu), server_lr = eta / eta_l (1 when eta is unset, its default), the same local lr, and
    FedAvgM's weighting = HaFedHo's aggregation ("uniform" -> "uniform", "data_size" -> "data_size": HaFedHo's
    data-size aggregate is the |D_i|-weighted mean FedAvgM's "data_size" forms). beta is lambda*mu rounded to 12
    significant digits (10 * 0.05 reads 0.5). Defined only for accumulate = "phi", mu_schedule = "constant",
    fixed local_steps (local_epochs = 0) and lambda*mu < 1; see docs/algorithms.md.
    """
    alg = cfg.selected_algorithm()
    if alg.name != "hafedho":
        return None, f"a {alg.name} run has no momentum twin (only hafedho runs do)"
    if alg.accumulate != "phi":
        return None, f'gradient rectification (accumulate = "{alg.accumulate}")'
    if alg.mu_schedule != "constant":
        return None, f'mu_schedule = "{alg.mu_schedule}": the factor lambda*mu_t changes every round'
    if cfg.clients.local_epochs > 0:
        return None, f"clients.local_epochs = {cfg.clients.local_epochs}: lambda differs from client to client"
    for f in dataclasses.fields(alg):
        if f.name not in _TWIN_COVERS and getattr(alg, f.name) != f.default:
            return None, f"{f.name} = {getattr(alg, f.name)!r} is not plain HaFedHo"
    lam = cfg.clients.local_steps
    beta = float(f"{lam * alg.mu:.12g}")
    if beta >= 1:
        return None, f"lambda*mu = {lam}*{alg.mu:g} = {beta:g} >= 1: no heavy-ball twin (FedAvgM needs beta < 1)"
    eta = alg.lr if alg.eta is None else alg.eta
    settings = {"beta": beta, "server_lr": eta / alg.lr, "weighting": alg.aggregation}
    return {"name": "fedavgm", "lr": alg.lr, "fedavgm": settings}, ""


def _point_text(label: str | None, point: dict[str, Any]) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in point.items())
    return f"[{label}: {inner}]" if label else f"[{inner}]"
