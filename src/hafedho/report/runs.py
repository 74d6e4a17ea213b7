"""Run directories -> sections of groups (one group = one config over seeds), the input of every table and plot.

A section is one sweep (``OUT/sweeps/PRESET.json`` names its runs, their labels and grid points) or, for run
directories no sweep lists, all of them together. Within a section, runs are grouped by their experiment: the
config minus ``seed`` and the runtime settings (``hafedho.config.RUNTIME_KEYS``: engine, cadence, horizon, output
folder, ...). Two runs of one experiment and seed (a Flower run beside a simulator run, two engines) are refused:
a seed counts once. A group's *row* is its label (algorithm, or a variant such as ``centralized``) plus the
hyperparameters that vary between groups of that label; its *setting* (the column) is its grid point minus the
algorithm axes, or for plain runs its flattened config minus the algorithm; runtime settings are never an axis.
List- and table-valued settings are kept frozen (``FrozenList``, ``FrozenTable``: hashable, shown as ``[64]``,
``{alpha = 1}``). A message read from a run (its ``diverged`` marker, a failure) shows any absolute path into the
run or the folder reported relative to that folder (``relative_paths``), never the absolute path of the machine
that wrote it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from hafedho.config import RUNTIME_KEYS, ConfigError, canonical_json, config_from_table, experiment_identity, flatten
from hafedho.report.paths import relative_paths
from hafedho.report.study import Study
from hafedho.runfiles import DIVERGED, DONE, RunDirError, read_metrics, run_state, why_no_rows
from hafedho.sweep.index import find_indexes, read_index, runs_folder
from hafedho.toml_io import read_toml

# A centralised plain run (one client holding everything) ignores these keys, so it matches every column.
_CENTRAL_FREE = ("data.partition", "data.q", "data.num_clients", "data.min_size", "data.partition_seed")
# The global test metrics; a row with both exactly 0 was measured on no example (cross-entropy is > 0 on any
# misclassified example), so it is no data, never 0%.
TEST_METRICS = ("test/acc", "test/loss")


class FrozenList(tuple):
    """A list-valued setting as a hashable value that reads like TOML: ``[64, 64]``."""

    def __str__(self) -> str:
        return "[" + ", ".join(_text(v) for v in self) + "]"


class FrozenTable(tuple):
    """A table-valued setting as hashable sorted ``(key, value)`` pairs that reads like TOML: ``{alpha = 1}``."""

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k} = {_text(v)}" for k, v in self) + "}"


def _text(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else f'"{v}"' if isinstance(v, str) else str(v)


def freeze(value: Any) -> Any:
    """Lists and tables (at any depth) as hashable values that compare equal when their contents do."""
    if isinstance(value, list | tuple) and not isinstance(value, FrozenList | FrozenTable):
        return FrozenList(freeze(v) for v in value)
    if isinstance(value, dict):
        return FrozenTable(sorted((str(k), freeze(v)) for k, v in value.items()))
    return value


def is_runtime(key: str) -> bool:
    """A (dotted) setting that says how, where or how long a run ran, never what it computes."""
    return key.split(".")[0] in RUNTIME_KEYS


@dataclass
class Run:
    dir: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    status: str  # done | diverged | incomplete | missing
    message: str = ""
    label: str = ""
    setting: dict[str, Any] = field(default_factory=dict)
    reference: bool = False
    engine: str = ""  # where it ran: "flower" (run.json) or the simulator's engine (config)

    def evals(self, metric: str) -> list[tuple[int, float]]:
        """(round, value) of every evaluated round that has ``metric``; a global test metric measured on an empty
        test set (acc and loss both 0) is no value."""
        return [
            (int(r["round"]), float(r[metric]))
            for r in self.rows
            if r.get(metric) is not None and not (metric in TEST_METRICS and all(r.get(k) == 0 for k in TEST_METRICS))
        ]

    @property
    def empty_test(self) -> bool:
        """Every evaluation it made saw an empty test set."""
        evaluated = [r for r in self.rows if r.get("test/acc") is not None]
        return bool(evaluated) and not self.evals("test/acc")


@dataclass
class Group:
    """The runs (seeds) of one configuration."""

    label: str
    setting: dict[str, Any]
    hyper: dict[str, Any]
    reference: bool
    runs: list[Run] = field(default_factory=list)

    def finished(self) -> list[Run]:
        return [r for r in self.runs if r.status == "done"]

    def diverged(self) -> list[Run]:
        return [r for r in self.runs if r.status == "diverged"]

    def ended(self) -> list[Run]:
        """Runs whose curve is complete: finished or stopped by divergence."""
        return [r for r in self.runs if r.status in ("done", "diverged")]


@dataclass
class Section:
    name: str
    title: str
    description: str
    metric: str
    metric_label: str
    last: int
    report: dict[str, Any]
    axes: list[str]
    named_axes: set[str]
    groups: list[Group]
    failed: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)  # a derived row's label -> the row label it sits beside
    notes: list[str] = field(default_factory=list)  # the sweep's lines for the tables (e.g. cells with no derived run)
    left_out: dict[str, str] = field(default_factory=dict)  # run directories without a row -> why (status table)
    unreadable: dict[str, str] = field(default_factory=dict)  # runs left out for a bad metrics.jsonl -> its error

    def names(self) -> dict[str, str]:
        return dict(self.report.get("names", {}))

    @cached_property
    def study(self) -> Study:
        """Its method, reference and derived rows' reading (``report.study``: [report] over the defaults)."""
        return Study.of(self.report)


def hyperparameters(config: dict[str, Any]) -> dict[str, Any]:
    """The selected algorithm's effective settings (``hafedho.algorithms.resolve_algorithm``) over its defaults, so
    a run that leaves a setting at its default reads as that value (``nesterov=False``), never as missing; none
    for a config this version refuses."""
    from hafedho.algorithms import algorithm_class, resolve_algorithm
    from hafedho.config import ConfigError

    try:
        name, settings = resolve_algorithm(config.get("algorithm", {}))
        known = fields(algorithm_class(name))
    except ConfigError:
        return {}
    plain = (bool, int, float, str)
    defaults = {f.name: f.default for f in known if f.init and isinstance(f.default, plain)}
    return flatten({**defaults, **settings})


# An accuracy key: "acc" (or "accuracy") as a word of its last part: test/acc, test/personal_acc, not accumulated_*.
_ACCURACY = re.compile(r"(?:^|_)acc(?:uracy)?(?:_|$)")


def report_rows(run_dir: Path) -> list[dict[str, Any]]:
    """``runfiles.read_metrics`` (which refuses non-finite values), and every value a number or null, every
    accuracy in [0, 1]: a run with another is left out of the report (``RunDirError``), never tabulated."""
    rows = read_metrics(run_dir)
    for row in rows:
        for key, value in row.items():
            if value is None:
                continue
            where = f"{run_dir / 'metrics.jsonl'}: {key}"
            if isinstance(value, bool) or not isinstance(value, int | float):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise RunDirError(
                    f"{where} at round {row['round']} is {shown}, not a number; fix that line, or recompute the "
                    "run with --force"
                )
            if _ACCURACY.search(key.rsplit("/", 1)[-1]) and not 0 <= value <= 1:
                raise RunDirError(
                    f"{where} {value} at round {row['round']} is outside [0, 1], no accuracy; fix that line, or "
                    "recompute the run with --force"
                )
    return rows


# run_state's words as the report's Run.status (and so its status table) has them
_STATUS = {"done": "done", "diverged": "diverged", "short": "incomplete", "interrupted": "incomplete", "new": "missing"}


def read_run(run_dir: Path, rounds: int | None = None) -> Run:
    """One run directory; ``missing`` when it has no config yet (a sweep's run that never started).

    With its sweep's horizon ``rounds`` (not part of a run's identity, so another preset may have extended the run
    since: converge's 300 rounds of table1's runs), it reads as it was at the horizon (``runfiles.run_state``):
    done there, its rows cut there, when it finished or went on past it; one done short of it is incomplete,
    never its result."""
    cfg_path = run_dir / "config.toml"
    if not cfg_path.exists():
        return Run(run_dir, {}, [], "missing")
    rows = report_rows(run_dir)
    state = run_state(run_dir, rounds, rows)
    message = state.message
    if state.status == "short":  # done at a shorter horizon (another preset's): not this sweep's result yet
        message = f"done at round {state.rounds_done}, short of the sweep's {rounds}"
    config = read_toml(cfg_path)
    if rounds and state.rounds_done >= rounds:
        rows, config = [r for r in rows if int(r["round"]) <= rounds], {**config, "rounds": rounds}
    label = str(config.get("algorithm", {}).get("name", "?"))
    run = Run(run_dir, config, rows, _STATUS[state.status], message, label=label)
    try:
        marker = json.loads((run_dir / "run.json").read_text()).get("engine")
    except (OSError, ValueError, AttributeError):
        marker = None
    run.engine = str(marker or config.get("engine", "loop"))
    return run


def _canonical(config: dict[str, Any]) -> str:
    """The experiment a stored config runs, seed left out: ``hafedho.config.experiment_identity`` (the one
    definition runs are named by); a config this version no longer accepts falls back to its raw table minus
    the seed and runtime keys."""
    try:
        ident = experiment_identity(config_from_table(config))
    except ConfigError:
        ident = {k: v for k, v in config.items() if k not in RUNTIME_KEYS}
    ident.pop("seed", None)
    return canonical_json(ident)


def check_seeds(runs: list[Run]) -> None:
    """Refuse two runs of one experiment and seed: averaged as two seeds they would shrink the spread to ± 0."""
    seen: dict[Any, Run] = {}
    for run in runs:
        if not run.config:
            continue
        seed = run.config.get("seed")
        if seed in seen:
            first = seen[seed]
            where = f"{first.engine} and {run.engine}" if first.engine != run.engine else f"both {run.engine}"
            raise ConfigError(
                f"{first.dir} and {run.dir} are the same experiment and seed {seed} ({where}); a seed counts once: "
                "move one of them out of the folder you report, or report each folder on its own"
            )
        seen[seed] = run


def _group(runs: list[Run]) -> list[Group]:
    """One group per row label, setting and experiment: a run a sweep lists at two settings (MOON under both
    protocols) sits in both columns; listed twice in one group (two row points that are one run), it counts once."""
    groups: dict[tuple[str, Any, str], Group] = {}
    for run in runs:
        key = (run.label, freeze(run.setting), _canonical(run.config) if run.config else run.dir.name)
        if key not in groups:
            hyper = hyperparameters(run.config) if run.config else {}
            groups[key] = Group(run.label, run.setting, {k: freeze(v) for k, v in hyper.items()}, run.reference)
        if all(r.dir != run.dir for r in groups[key].runs):
            groups[key].runs.append(run)
    for g in groups.values():
        check_seeds(g.runs)
    return list(groups.values())


def _sweep_section(index_path: Path, metric: str | None, last: int | None) -> tuple[Section, set[Path]]:
    index = read_index(index_path)
    base = runs_folder(index_path)
    report = index.report
    axes = [a for a in index.axes if a not in set(index.row_axes) and not is_runtime(a)]
    runs, used, unreadable = [], set(), {}
    for entry in index.runs:
        try:
            run = read_run(base / entry.dir, entry.rounds)
        except RunDirError as e:  # a bad metrics line: this run is left out (named), never the whole report
            used.add((base / entry.dir).resolve())
            unreadable[entry.dir] = str(e)
            continue
        used.add(run.dir.resolve())
        run.label, run.reference = entry.label if entry.label is not None else run.label, entry.reference
        run.setting = {k: freeze(v) for k, v in entry.point.items() if k in axes}
        if run.status == "missing" and entry.dir in index.failed:
            run.message = index.failed[entry.dir]
        runs.append(run)
    name, scale = index.preset, index.scale
    section = Section(
        name=name if not scale else f"{name}-{scale}",
        title=str(report.get("title", name)) + (f" ({scale} scale)" if scale else ""),
        description=index.description,
        metric=metric or str(report.get("metric", "test/acc")),
        metric_label=metric or str(report.get("metric_label", "test accuracy")),
        last=last if last is not None else _positive(report.get("last", 10), f"{index_path}: report.last"),
        report=report,
        axes=axes,
        named_axes={a for a in axes if "." not in a},
        groups=_group(runs),
        failed=index.failed,
        derived={label: d["of"] for label, d in index.derived.items()},
        notes=index.notes,
        unreadable=unreadable,
    )
    return section, used


def _plain_section(runs: list[Run], metric: str | None, last: int | None) -> Section:
    for run in runs:
        cfg = run.config
        setting = flatten({k: v for k, v in cfg.items() if k not in ("seed", "algorithm") and k not in RUNTIME_KEYS})
        if cfg.get("data", {}).get("num_clients") == 1:  # one client holding all data: centralised training
            run.label, run.reference = "centralized", True
            setting = {k: v for k, v in setting.items() if k not in _CENTRAL_FREE and not k.startswith("sampling.")}
        run.setting = {k: freeze(v) for k, v in setting.items()}
    axes = sorted({k for r in runs for k in r.setting})
    return Section(
        name="runs",
        title="Runs",
        description="",
        metric=metric or "test/acc",
        metric_label=metric or "test accuracy",
        last=last if last is not None else 10,
        report={},
        axes=axes,
        named_axes=set(),
        groups=_group(runs),
    )


def _relative_messages(section: Section, base: Path, root: Path) -> None:
    for g in section.groups:
        for r in g.runs:
            r.message = relative_paths(r.message, r.dir, root)
    section.failed = {name: relative_paths(msg, base / name, root) for name, msg in section.failed.items()}
    section.unreadable = {name: relative_paths(msg, base / name, root) for name, msg in section.unreadable.items()}


def load_sections(root: str | Path, metric: str | None = None, last: int | None = None) -> list[Section]:
    """One section per sweep index under ``root``, then one for the run directories no sweep lists. ``metric``
    must be recorded by some run; ``last`` must be at least 1."""
    if last is not None:
        _positive(last, "--last")
    root = Path(root)
    sections, used = [], set()
    for index_path in find_indexes(root):
        section, dirs = _sweep_section(index_path, metric, last)
        _relative_messages(section, runs_folder(index_path), root)
        sections.append(section)
        used |= dirs
    plain, left_out, unreadable = [], {}, {}
    for d in sorted(p.parent for p in root.rglob("config.toml") if p.parent.resolve() not in used):
        try:
            run = read_run(d)  # its rows read once, here
        except RunDirError as e:  # a bad metrics line: this run is left out (named), never the whole report
            unreadable[str(d.relative_to(root))] = relative_paths(str(e), d, root)
            continue
        if run.rows:
            plain.append(run)
        elif any((d / f).exists() for f in ("env.json", "metrics.jsonl", DONE, DIVERGED)):
            left_out[str(d.relative_to(root))] = why_no_rows(d)
    if plain:
        sections.append(_plain_section(plain, metric, last))
        _relative_messages(sections[-1], root, root)
    if (left_out or unreadable) and not sections:
        out = {**unreadable, **left_out}
        first, more = next(iter(out.items())), f" (and {len(out) - 1} more)" if len(out) > 1 else ""
        raise ConfigError(f"{root}: no run has a metrics row yet; left out: {first[0]}: {first[1]}{more}")
    if left_out:
        sections[-1].left_out = left_out
    if unreadable:
        sections[-1].unreadable = {**sections[-1].unreadable, **unreadable}
    if metric is not None and sections:
        known = sorted(
            {k for s in sections for g in s.groups for r in g.runs for row in r.rows for k in row} - {"round"}
        )
        if metric not in known:
            raise ConfigError(
                f"--metric {metric}: no run under {root} records it; metrics available: {', '.join(known) or 'none'}"
            )
    return sections


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} {value}: must be at least 1 (final = mean of the last N evaluations)")
    return value
