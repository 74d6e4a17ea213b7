"""Experiment presets and multi-seed sweeps: expand a preset into run configs, run the missing ones in parallel.

A preset (``configs/paper/NAME.toml`` or your own file) is TOML::

    extends = "_common"          # optional: a preset in the same folder, deep-merged under this one
    description = "..."
    seeds = 3                    # default for --seeds (seeds 0..n-1)
    out = "runs/paper"           # sweep folder; "-SCALE" is appended (runs/paper-cpu)
    [base]                       # an ordinary hafedho config; dotted keys are allowed anywhere
    [grid]                       # axis -> values; one run per point of the cartesian product and seed
    "data.q" = [0.1, 0.3]        #   a config key, or
    dataset = ["femnist"]        #   a named axis: each value selects the overrides in [bundles.dataset.VALUE]
    [bundles.dataset.femnist]    # overrides for one value of a named axis
    [[variants]]                 # labelled extra points, e.g. the centralised baseline:
    label = "centralized"        #   its row label in reports
    cross = ["dataset"]          #   grid axes it is crossed with (the others do not apply to it)
    reference = true             #   shown, but never bold and never a competitor
    set = {...}                  #   its overrides
    [report]                     # how `hafedho report` shows it (metric, last, targets, names, title)
    [scale.cpu] / [scale.full]   # a partial preset merged over this one for --scale (cpu is the default);
                                 # its [grid] replaces the axes it names

One run's config: base < named-axis bundles < config-key axes < variant ``set`` < command-line overrides;
then ``seed``, ``name`` and ``out`` are set, and only the selected algorithm's ``[algorithm.NAME]`` table is kept
(``hafedho.algorithms.applicable``; the others never apply to the run).

Run directories are ``OUT/LABEL-SOURCE-HASH-sSEED``, the name ``hafedho run`` gives (``Config.run_name`` with
``name = LABEL-SOURCE``; LABEL is the algorithm, or a variant's label): HASH is the experiment's identity
(``hafedho.config.experiment_hash``: data, partition, clients, sampling, model, resolved algorithm; never the
engine, workers, threads, checkpoint cadence or ``rounds``), so identical runs of different presets, and a plain
``hafedho run`` of the same experiment, share one directory, and a changed experiment never resumes a stale
run. ``OUT/sweeps/PRESET.json`` lists the runs of the latest sweep of that preset for ``hafedho report``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hafedho.config import CONFIG_DIR, Config, ConfigError, config_from_table, parse_override, read_toml

PRESET_DIR = CONFIG_DIR / "paper"
SCALES = ("cpu", "full")
_KEYS = {"extends", "description", "seeds", "out", "base", "grid", "bundles", "variants", "report", "scale"}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


# ----------------------------------------------------------------------------- presets


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
    def report(self) -> dict[str, Any]:
        return self.table.get("report", {})


def list_presets(folder: Path = PRESET_DIR) -> list[str]:
    """Names of the runnable presets in ``folder`` (files starting with ``_`` are shared parts)."""
    return sorted(p.stem for p in folder.glob("*.toml") if not p.stem.startswith("_"))


def preset_path(name: str) -> Path:
    """A preset file: a path, or the name of a packaged preset (``table1``)."""
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"preset file not found: {p}")
        return p
    if (PRESET_DIR / f"{name}.toml").is_file():
        return PRESET_DIR / f"{name}.toml"
    raise ConfigError(f"unknown preset {name!r}; packaged presets: {', '.join(list_presets())}, or pass a .toml file")


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``; tables merge key by key, anything else is replaced."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def nest(table: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys to nested tables, at every level: ``{"data.q": 0.1}`` -> ``{"data": {"q": 0.1}}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        value = nest(value) if isinstance(value, dict) else value
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        out = deep_merge(out, {key.split(".")[0]: value})
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
        axis: {value: nest(t) for value, t in values.items()} for axis, values in table.get("bundles", {}).items()
    }
    table["variants"] = [{**v, "set": nest(v.get("set", {}))} for v in table.get("variants", [])]
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
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid.{axis} must be a non-empty list of values")
    return Preset(path.stem, scale, path, table)


# ----------------------------------------------------------------------------- expansion


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

    def index_entry(self) -> dict[str, Any]:
        return {
            "dir": self.name,
            "label": self.label,
            "seed": self.seed,
            "point": self.point,
            "reference": self.reference,
        }


def is_config_key(axis: str) -> bool:
    return axis.split(".")[0] in _CONFIG_FIELDS


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


# ----------------------------------------------------------------------------- running


@dataclass
class Outcome:
    """What happened to one run in this sweep: done, skipped (done before), busy (another sweep has it),
    diverged or failed."""

    name: str
    status: str
    message: str = ""
    acc: float | None = None
    seconds: float = 0.0


@dataclass
class SweepResult:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def summary(self) -> str:
        parts = [f"{self.count(s)} {s}" for s in ("done", "skipped", "busy", "diverged", "failed") if self.count(s)]
        return ", ".join(parts) or "nothing to run"


def run_status(run_dir: Path) -> str:
    """``done``, ``diverged`` (never retried), ``interrupted`` (resumed) or ``new``."""
    if (run_dir / "done").exists():
        return "done"
    if (run_dir / "diverged").exists():
        return "diverged"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        return "interrupted"
    return "new"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_of_cores(jobs: int) -> int:
    """Torch threads of a run with ``threads = 0`` in a sweep of ``jobs`` concurrent runs: jobs x threads = cores,
    no oversubscription (a run's own ``threads`` > 0 replaces it for that run, whatever ``jobs`` is)."""
    return max(1, available_cores() // jobs)


def _init_worker(threads: int, parent: int) -> None:
    import torch

    torch.set_num_threads(threads)  # jobs x threads = cores: no oversubscription
    # Ctrl-C is the sweep's: it terminates its workers (a worker would go on to its next queued run). A thread
    # lock for tqdm, so a terminated worker leaves no multiprocessing semaphore behind.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())

    # SIGTERM or SIGKILL reach the sweep process only; an orphaned worker would go on writing into its run
    # directory. It exits once its parent is gone instead (the next sweep resumes the run from its checkpoint).
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sweep-parent-watch", daemon=True).start()


def run_spec(cfg: Config, run_dir: str) -> Outcome:
    """Run (or resume) one run; never raises for a run's own failure, so one bad run cannot stop a sweep."""
    from hafedho.experiment import build
    from hafedho.results import RunBusy
    from hafedho.sim.runner import Divergence, run

    t0, path = time.perf_counter(), Path(run_dir)
    name = path.name  # the spec's name (Config.run_name)
    if run_status(path) == "done":  # finished by another sweep since this one started
        return Outcome(name, "skipped", "done meanwhile")
    try:  # run() takes the run's lock (RunLock), shared with `hafedho run` and other sweeps
        last = run(build(cfg), path, resume=path.exists(), progress=False)
    except RunBusy:  # another sweep over the same folder is running it (presets share runs)
        return Outcome(name, "busy", "running in another sweep; not counted")
    except Divergence as e:
        return Outcome(name, "diverged", str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # recorded as one line; the sweep goes on and exits non-zero at the end
        line = (str(e).strip().splitlines() or [""])[0]
        return Outcome(name, "failed", f"{type(e).__name__}: {line}", seconds=time.perf_counter() - t0)
    return Outcome(name, "done", acc=last.get("test/acc"), seconds=time.perf_counter() - t0)


def _line(o: Outcome) -> str:
    acc = f"  acc {o.acc:.4f}" if o.acc is not None else ""
    secs = f"  {o.seconds:.0f}s" if o.seconds else ""
    msg = f"  {o.message}" if o.message and o.status != "done" else ""
    return f"{o.status:8s} {o.name}{acc}{secs}{msg}"


def run_sweep(
    specs: list[RunSpec],
    jobs: int = 1,
    progress: bool = True,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> SweepResult:
    """Run every spec that is not done: finished runs are skipped, interrupted ones resumed, diverged ones
    recorded but not retried. ``jobs`` > 1 runs that many spawned processes, one run per task."""
    result = SweepResult()
    todo: list[RunSpec] = []
    for s in specs:
        status = run_status(s.run_dir)
        if status == "done":
            result.outcomes.append(Outcome(s.name, "skipped", "done before"))
        elif status == "diverged":
            text = (s.run_dir / "diverged").read_text().strip()
            result.outcomes.append(Outcome(s.name, "diverged", f"(earlier) {text}"))
        else:
            todo.append(s)
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="sweep", unit="run", disable=not progress)
    echo = bar.write if progress else (lambda _: None)
    if len(specs) > len(todo):
        echo(f"{result.count('skipped')} runs already done, {result.count('diverged')} diverged before (not retried)")

    def record(o: Outcome) -> None:
        result.outcomes.append(o)
        bar.update()
        echo(_line(o))
        if on_outcome is not None:
            on_outcome(o)

    try:
        if jobs <= 1 or len(todo) <= 1:
            import torch

            previous = torch.get_num_threads()
            torch.set_num_threads(share_of_cores(1))  # the rule of jobs > 1, for threads = 0
            try:
                for s in todo:
                    bar.set_postfix_str(s.name)
                    record(run_spec(s.cfg, str(s.run_dir)))
            finally:
                torch.set_num_threads(previous)
        else:
            ctx = multiprocessing.get_context("spawn")  # fork would copy the parent's torch threads and locks
            with ProcessPoolExecutor(
                jobs, mp_context=ctx, initializer=_init_worker, initargs=(share_of_cores(jobs), os.getpid())
            ) as ex:
                futures = {ex.submit(run_spec, s.cfg, str(s.run_dir)): s for s in todo}
                try:
                    for fut in as_completed(futures):
                        try:
                            record(fut.result())
                        except Exception as e:  # the worker process itself died (e.g. out of memory)
                            record(Outcome(futures[fut].name, "failed", f"{type(e).__name__}: {e}"))
                except KeyboardInterrupt:  # stop the workers as a kill would; their runs resume from checkpoints
                    for proc in list(getattr(ex, "_processes", {}).values()):
                        proc.terminate()
                    ex.shutdown(wait=False, cancel_futures=True)
                    raise
    except KeyboardInterrupt:  # one line: what is finished, and that the same command continues
        from hafedho.sim.runner import Interrupted

        done = sum(run_status(s.run_dir) == "done" for s in specs)
        raise Interrupted(
            f"sweep interrupted with {done} of {len(specs)} runs done; run the same command again to continue "
            "(finished runs are skipped, interrupted ones resume from their last checkpoint)"
        ) from None
    finally:
        bar.close()
    return result


def row_axes(preset: Preset) -> list[str]:
    """Axes that pick an algorithm or its hyperparameters (rows of a report); the others are settings (columns)."""
    bundles = preset.table.get("bundles", {})

    def only_algorithm(axis: str) -> bool:
        return all(set(t) <= {"algorithm"} for t in bundles.get(axis, {}).values())

    return [a for a in preset.grid if a.startswith("algorithm.") or (not is_config_key(a) and only_algorithm(a))]


def write_index(preset: Preset, specs: list[RunSpec], out: str | Path, failed: dict[str, str] | None = None) -> Path:
    """``OUT/sweeps/PRESET.json``: the preset's runs (label, grid point, seed) and report settings."""
    from hafedho.results import write_json

    path = Path(out) / "sweeps" / f"{preset.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    index = {
        "preset": preset.name,
        "scale": preset.scale,
        "description": preset.description,
        "axes": list(preset.grid),
        "row_axes": row_axes(preset),
        "report": preset.report,
        "runs": [s.index_entry() for s in specs],
        "failed": failed or {},
    }
    write_json(path, index)
    return path
