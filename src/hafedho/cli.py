"""The ``hafedho`` command: run, demo, sweep, report, algorithms, datasets."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hafedho.config import CONFIG_DIR, ConfigError, load_config

if TYPE_CHECKING:  # Ray is optional: the backend's module is imported only for --backend ray
    from hafedho.sweep.expand import RunSpec
    from hafedho.sweep.ray_backend import RayBackend

MAX_SEEDS = 10_000  # --seeds above this is a typo (a sweep of 10,000 seeds per cell is already days of runs)


def cmd_run(args: argparse.Namespace) -> int:
    from hafedho.api import run

    out = args.out or None  # --out "" keeps the config's out, as it always has
    result = run(args.config, *args.overrides, out=out, resume=args.resume, force=args.force, progress=not args.quiet)
    cfg, last = result.config, result.final
    acc = last.get("test/acc")
    acc_text = f"test/acc {acc:.4f}" if isinstance(acc, float) else "not evaluated"
    if result.already_finished:
        print(
            f"{cfg.run_name}: already finished at round {last.get('round')} ({acc_text}); nothing changed in "
            f"{result.run_dir}. To train longer: --resume rounds=N with N > {cfg.rounds}"
        )
    else:
        print(f"{cfg.run_name}: round {last.get('round')}, {acc_text} -> {result.run_dir}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hafedho.api import run
    from hafedho.report.build import write_report
    from hafedho.runfiles import run_state

    if not 1 <= args.seeds <= MAX_SEEDS:
        raise ConfigError(f"--seeds {args.seeds}: give 1 to {MAX_SEEDS:,}")
    out = Path(args.out)
    for alg in ("hafedho", "fedavg"):
        for seed in range(args.seeds):
            overrides = [f"algorithm.name={alg}", f"seed={seed}", *args.overrides]
            cfg = load_config(CONFIG_DIR / "demo.toml", overrides)
            cfg.out = str(out)
            if run_state(cfg.run_dir, cfg.rounds).status == "done":
                continue
            run(cfg, resume=cfg.run_dir.exists(), progress=True)
    title = "digits, Dirichlet q=0.3, 50 clients, 10% participation"
    files = write_report(out, title=f"Demo: {title}")  # the main report: results.md, accuracy.png, report.html
    final = files.pages[-1].tables[0]  # the demo's runs are plain runs: the last section; its first table is final
    print(final.markdown())
    plot = next((f for f in files.figures if f.name.endswith("accuracy.png")), None)
    print(f"table: {files.markdown}\nplot:  {plot}\npage:  {files.html}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hafedho.core.refs import trusting
    from hafedho.report.build import write_report

    with trusting(args.runs_dir, args.allow_code) as refused:  # a results folder's references: plugins' or allowed
        files = write_report(args.runs_dir, args.out, metric=args.metric, last=args.last)
    for line in dict.fromkeys(refused):  # refused, and read without (a run's algorithm defaults): say so
        print(f"hafedho: note: {line}", file=sys.stderr)
    for name, why in files.left_out.items():  # named in the status table too; the other runs are reported
        print(f"hafedho: warning: left out {name}: {why}", file=sys.stderr)
    print(files.text)
    print(f"tables:  {files.markdown} (+ {len(files.tables)} .csv/.tex)\nfigures: {len(files.figures)} PNG")
    print(f"page:    {files.html}")
    return 0


def _skip_rows(text: str | None, specs: list[RunSpec]) -> set[str]:
    """``--skip-rows A,B``: row labels of the preset whose runs this sweep leaves out (the index still lists them)."""
    skip = {t.strip() for t in (text or "").split(",") if t.strip()}
    rows = {s.label for s in specs}
    if unknown := sorted(skip - rows):
        have = ", ".join(sorted(rows))
        raise ConfigError(f"--skip-rows {', '.join(unknown)}: not a row of this sweep (its rows: {have})")
    return skip


def cmd_sweep(args: argparse.Namespace) -> int:
    from hafedho.runfiles import run_state
    from hafedho.sweep.browse import refresh_results_index, write_results_index
    from hafedho.sweep.execute import Outcome, run_sweep
    from hafedho.sweep.expand import expand
    from hafedho.sweep.index import changing_overrides, write_index
    from hafedho.sweep.presets import list_presets, load_preset

    if args.preset == "index":
        print(f"index: {write_results_index(args.out or 'results')}")
        return 0
    if args.preset == "list":
        for name in list_presets():
            p = load_preset(name, args.scale)
            print(f"{name:8s} {len(expand(p)):4d} runs ({args.scale})  {p.description}")
        return 0
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: runs in parallel must be at least 1 (default 1)")
    if args.seeds is not None and args.seeds > MAX_SEEDS:  # a typo: expanding a billion runs takes minutes in silence
        raise ConfigError(f"--seeds {args.seeds}: at most {MAX_SEEDS:,} seeds per sweep; give a smaller count")
    preset = load_preset(args.preset, args.scale)
    specs = expand(preset, args.seeds, args.overrides, args.out)
    skip = _skip_rows(args.skip_rows, specs)
    specs = [s for s in specs if s.label not in skip]
    out = Path(args.out or preset.out)
    if args.dry_run:
        for s in specs:
            point = ", ".join(f"{k}={v}" for k, v in s.point.items())
            print(f"{run_state(s.run_dir, s.cfg.rounds).status:11s} {s.name}  [{point}]")
        for note in dict.fromkeys(s.note for s in specs if s.note):  # e.g. a HaFedHo cell without a twin, and why
            print(f"note: {note}")
        print(f"{len(specs)} runs of {preset.name} ({preset.scale}) in {out}")
        return 0
    backend = _sweep_backend(args)
    failed: dict[str, str] = {}
    # The index lists the whole preset even when this sweep runs part of it (some values of an axis, fewer seeds)
    changing = changing_overrides(preset, args.overrides)
    seeds = None if args.seeds is None else max(args.seeds, preset.seeds)
    partial = changing != list(args.overrides) or seeds != args.seeds or bool(skip)
    listed = expand(preset, seeds, changing, args.out) if partial else specs
    write_index(preset, listed, out)

    def on_outcome(o: Outcome) -> None:  # keep the index's failure list current, so a killed sweep still reports them
        if o.status == "failed":
            failed[o.name] = o.message
            write_index(preset, listed, out, failed)

    result = run_sweep(specs, jobs=args.jobs, progress=not args.quiet, on_outcome=on_outcome, backend=backend)
    on = f", on {backend.where}" if backend is not None and backend.where else ""
    print(f"sweep {preset.name} ({preset.scale}): {result.summary()}; runs in {out}{on}")
    for o in result.failed:
        print(f"hafedho: failed: {o.name}: {o.message}", file=sys.stderr)
    print(f"report: hafedho report {out}")
    if (index := refresh_results_index(out)) is not None:
        print(f"index:  {index}")
    return 1 if result.failed else 0


def _sweep_backend(args: argparse.Namespace) -> RayBackend | None:
    """``--backend ray``'s ``RayBackend``; None for the local backend, which refuses the Ray options."""
    keys = ("address", "cpus_per_run", "gpus_per_run")
    ray_opts = [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k) is not None]
    if args.backend == "local":
        if ray_opts:
            raise ConfigError(f"{', '.join(ray_opts)}: only with --backend ray")
        return None
    if args.jobs != 1:
        raise ConfigError(
            "--jobs is the local backend's; on Ray the cluster's CPUs over --cpus-per-run decide how many runs at once"
        )
    from hafedho.sweep.ray_backend import RayBackend

    cpus = 1 if args.cpus_per_run is None else args.cpus_per_run
    gpus = 0.0 if args.gpus_per_run is None else args.gpus_per_run
    return RayBackend(args.address, cpus, gpus, log_to_driver=not args.quiet)


def cmd_algorithms(args: argparse.Namespace) -> int:
    from hafedho.algorithms import REGISTRY

    for name, cls in REGISTRY.items():
        doc = ((cls.__module__ and sys.modules[cls.__module__].__doc__) or "").strip().splitlines()[0]
        print(f"{name}: {doc}")
        for field, default, help_ in cls.describe():
            print(f"    {field} = {default!r}  # {help_}")
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from hafedho.data.sources import SOURCES

    for name, src in SOURCES.items():
        where = src.default_path or ("no files needed" if not src.needs_files else "your copy: pass data.path=...")
        print(f"{name:12s} {src.description}\n{'':12s} reads: {where}")
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    from hafedho.flower.commands import run_command

    return run_command(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hafedho", description="Federated learning: HaFedHo and baselines.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one experiment")
    r.add_argument(
        "overrides",
        nargs="*",
        metavar="[CONFIG] KEY=VALUE",
        help="a TOML file or embedded config name (default, demo, smoke), then dotted overrides, e.g. data.q=0.1",
    )
    r.add_argument(
        "--resume", action="store_true", help="continue an interrupted run from its checkpoint; extend a finished one"
    )
    r.add_argument("--force", action="store_true", help="delete this run's directory (a hafedho run only); start over")
    r.add_argument("--out", help="folder for run directories (overrides `out`)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)
    d = sub.add_parser("demo", help="HaFedHo vs FedAvg on digits, 3 seeds, table + plot")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--seeds", type=int, default=3)
    d.add_argument("overrides", nargs="*")
    d.set_defaults(func=cmd_demo)
    rep = sub.add_parser("report", help="tables, plots and an HTML page from run directories")
    rep.add_argument("runs_dir", help="a folder of run directories (and sweep indexes), searched recursively")
    rep.add_argument("--out", help="where to write (default: RUNS_DIR)")
    rep.add_argument("--metric", help="metric to tabulate (default: the preset's, else test/acc)")
    rep.add_argument("--last", type=int, help="final value = mean of the last N evaluations (default: preset, else 10)")
    rep.add_argument(
        "--allow-code",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="import the code RUNS_DIR names from this top-level package too (repeatable; default: installed "
        "plugins only, as a results folder may come from anyone)",
    )
    rep.set_defaults(func=cmd_report)
    sw = sub.add_parser("sweep", help="run a preset's grid x seeds (skips done runs, resumes interrupted ones)")
    sw.add_argument(
        "preset",
        help="a packaged preset (table1, ..., synthetic, tune; see `sweep list`), a .toml file, 'list', or 'index' "
        "(write --out's README.md, default results/: per folder and preset its runs and how many are done)",
    )
    sw.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="replaces a grid axis (a TOML list gives several values), else applies to every run",
    )
    sw.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the preset's, usually 3)")
    sw.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel processes (default 1; on one GPU, 2 and 4 runs at once gave 1.07x and 1.08x the "
        "rounds per second of one: docs/benchmarks.md)",
    )
    sw.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local (default: this machine, --jobs processes) or ray (each run a Ray task; needs hafedho[ray])",
    )
    sw.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster of all cores)")
    sw.add_argument("--cpus-per-run", type=int, help="Ray: CPUs a run reserves, its torch threads (default 1)")
    sw.add_argument("--gpus-per-run", type=float, help="Ray: GPUs a run reserves, fractions allowed (default 0)")
    sw.add_argument("--scale", choices=("cpu", "full"), default="cpu", help="cpu (default) or the paper's full scale")
    sw.add_argument("--out", help="folder for the run directories (default: the preset's, e.g. results/paper-cpu)")
    sw.add_argument("--dry-run", action="store_true", help="list the runs and their status; run nothing")
    sw.add_argument(
        "--skip-rows",
        metavar="LABELS",
        help="comma-separated row labels whose runs to leave out (e.g. a costly variant); the index still lists them",
    )
    sw.add_argument("--quiet", action="store_true", help="no progress bar or per-run lines")
    sw.set_defaults(func=cmd_sweep)
    sub.add_parser("algorithms", help="list algorithms and hyperparameters").set_defaults(func=cmd_algorithms)
    sub.add_parser("datasets", help="list data sources and where they read from").set_defaults(func=cmd_datasets)
    from hafedho.flower.commands import add_parser as add_flower_parser

    add_flower_parser(sub).set_defaults(func=cmd_flower)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    # Overrides may also follow options ("run smoke --quiet data.q=0.1"); anything else unknown is an error.
    if extra and (not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *extra]
    if args.command == "run":  # the first item is the config unless it is a key=value
        first = args.overrides[0] if args.overrides else None
        args.config = first if first is not None and "=" not in first else None
        args.overrides = args.overrides[1:] if args.config else args.overrides
    from hafedho.data.partition import PartitionError
    from hafedho.data.sources import DataError
    from hafedho.runfiles import RunDirError
    from hafedho.sim.runner import Divergence

    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left (`| head`) surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:  # the reader of our output has gone; no traceback, and no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Divergence as e:
        print(f"hafedho: {e}", file=sys.stderr)
        return 1
    except (ConfigError, DataError, PartitionError, RunDirError) as e:
        print(f"hafedho: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an output folder we may not write, or a disk that is full
        where = f"{e.filename}: " if e.filename else ""
        fix = "; free some space, then continue with the same command and --resume" if e.errno == errno.ENOSPC else ""
        print(f"hafedho: error: {where}{e.strerror or e}{fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: where the run stopped and how to continue, no traceback
        lead = "\n" if sys.stderr.isatty() else ""  # off the progress bar's line
        print(f"{lead}hafedho: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
