"""Presets and sweeps: every preset expands to valid configs at both scales; a sweep skips finished runs, resumes
interrupted ones, records diverged and failed ones; each preset's CPU variant runs two rounds."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hafedho_paper import PRESETS as PRESET_DIR  # the paper study's presets, a plugin (study/)
from helpers import SMOKE, SMOKE_PRESET_TABLES

from hafedho.algorithms import resolve_algorithm
from hafedho.cli import main
from hafedho.config import ConfigError, load_config
from hafedho.flower.deploy import descendants, is_running
from hafedho.report.build import write_report
from hafedho.runfiles import RunLock, read_metrics, run_state
from hafedho.sweep.execute import run_spec, run_sweep
from hafedho.sweep.expand import expand
from hafedho.sweep.index import IndexEntry, changing_overrides, read_index, write_index
from hafedho.sweep.presets import SCALES, Preset, list_presets, load_preset, preset_path
from hafedho.toml_io import dump_toml, read_toml

# Every paper preset, read off the presets folder (a new preset is one file there: no list to extend here).
PAPER = sorted(p.stem for p in PRESET_DIR.glob("*.toml") if not p.stem.startswith("_"))

TINY = """
seeds = 2
out = "{out}"
description = "tiny"

[base]
rounds = 3
eval_every = 1
checkpoint_every = 1
engine = "loop"

{smoke}
[base.algorithm]
name = "hafedho"
lr = 0.1

[grid]
{grid}
"""


def tiny(tmp: Path, grid: str = '"algorithm.name" = ["hafedho", "fedavg"]', extra: str = "") -> Path:
    path = tmp / "tiny.toml"
    path.write_text(TINY.format(out=tmp / "runs", grid=grid, smoke=SMOKE_PRESET_TABLES) + extra)
    return path


def test_packaged_presets() -> None:
    """`hafedho sweep list` finds every preset file and none of the shared parts (``_common``, ``_tuned``)."""
    assert list_presets() == PAPER and {"table1", "tune"} <= set(PAPER)
    assert (PRESET_DIR / "_common.toml").exists() and "_common" not in list_presets()
    assert preset_path("table1") == PRESET_DIR / "table1.toml"  # found through the installed plugin


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", PAPER)
def test_every_preset_expands_to_valid_configs(name: str, scale: str) -> None:
    """Every grid point x seed is a valid config whose algorithm builds (no data is loaded)."""
    preset = load_preset(name, scale)
    specs = expand(preset)
    assert specs and len({s.name for s in specs}) == len(specs)
    assert [s.name for s in expand(load_preset(name, scale))] == [s.name for s in specs]  # deterministic names
    for s in specs:
        assert s.cfg.run_name == s.name and s.cfg.out == f"results/paper-{scale}"
        alg = s.cfg.algorithm
        assert not [k for k, v in alg.items() if isinstance(v, dict) and k != alg["name"]]  # pruned tables
    if scale == "cpu":
        # one core per run (the sweep parallelises over runs); the tiny synthetic model runs its cohort as one vmap
        assert all(s.cfg.engine == ("vmap" if s.cfg.data.source == "synthetic" else "loop") for s in specs)
        assert all(s.cfg.data.source in ("femnist", "cifar10", "synthetic") for s in specs)
        assert {s.cfg.data.path for s in specs} == {None}  # the copies in ../shared/data


def test_scales_and_bundles() -> None:
    full = {s.point["dataset"]: s.cfg for s in expand(load_preset("table1", "full")) if s.label == "hafedho"}
    cpu = {s.point["dataset"]: s.cfg for s in expand(load_preset("table1", "cpu")) if s.label == "hafedho"}
    assert set(full) == {"femnist", "cifar10", "cifar100"} and set(cpu) == {"femnist", "cifar10"}
    assert full["femnist"].data.num_clients == 3400 and full["femnist"].model.name == "femnist_cnn"
    assert full["cifar10"].model.name == "resnet18_gn" and full["cifar10"].sampling.fraction == 0.1
    assert cpu["cifar10"].model.name == "lenet5" and cpu["cifar10"].rounds == 30
    full_t1 = expand(load_preset("table1", "full"))
    moon = {s.cfg.data.source: s.cfg.algorithm["moon"]["mu"] for s in full_t1 if s.label == "moon"}
    assert moon == {"cifar10": 5.0, "femnist": 1.0, "cifar100": 1.0}  # the paper's values at full scale
    t1 = expand(load_preset("table1"), overrides=["protocol=main"])  # main-long has values of its own
    tuned = {s.cfg.data.source: s.cfg.algorithm for s in t1 if s.label == "hafedho"}
    chosen = _tuned_cpu()["femnist"]
    assert tuned["femnist"]["hafedho"]["mu"] == chosen["algorithm.hafedho.mu"] != 0.01  # CPU's tuned value ...
    fig3 = {s.cfg.algorithm["hafedho"]["mu"] for s in expand(load_preset("fig3")) if s.label == "hafedho"}
    assert fig3 == {0.0001, 0.001, 0.01, 0.05, 0.08, 0.1}  # ... which a grid axis still overrides
    t3 = expand(load_preset("table3"), seeds=1, overrides=["protocol=head"])  # main-long runs 150 rounds
    fixed = [s.cfg for s in t3 if s.point["population"] == "fixed" and s.point["participation"] == 0.002]
    assert fixed[0].data.num_clients == 1000 and fixed[0].sampling.cohort_size == 2 and fixed[0].rounds == 100
    bern = [s.cfg for s in t3 if s.point["population"] == "bernoulli" and s.point["participation"] == 0.01]
    assert bern[0].sampling.mode == "bernoulli" and bern[0].sampling.prob == 0.01 and bern[0].data.num_clients == 100
    fig2 = {s.cfg.sampling.cohort_size for s in expand(load_preset("fig2"))}
    assert fig2 == {15, 32} and {s.cfg.sampling.cohort_size for s in expand(load_preset("fig2", "full"))} == {500, 1020}


def test_centralized_variant_and_shared_runs() -> None:
    specs = expand(load_preset("table1"))
    central = [s for s in specs if s.label == "centralized"]  # per dataset and protocol (main, head, main-long) ...
    assert sum(1 + len(s.views) for s in central) == 2 * 3 * 3  # ... main-long a view of main while placeholders
    assert all(s.reference and set(s.point) == {"dataset", "protocol"} for s in central)
    c = central[0].cfg
    assert (c.data.partition, c.data.num_clients, c.sampling.cohort_size, c.algorithm["name"]) == (
        "iid",
        1,
        1,
        "fedavg",
    )
    fl = next(s.cfg for s in specs if s.label == "fedavg" and s.point["dataset"] == central[0].point["dataset"])
    assert (c.rounds, c.clients.local_steps, c.model.name) == (fl.rounds, fl.clients.local_steps, fl.model.name)
    # identical configs get identical directories: table2 is table1's q = 0.3 column
    assert {s.name for s in expand(load_preset("table2"))} <= {s.name for s in specs}
    shared = {s.name for s in expand(load_preset("fig3"))} & {s.name for s in specs}
    assert shared and all(n.startswith(("hafedho-cifar10-", "fedavgm-cifar10-")) for n in shared)  # the tuned mu, phi
    assert {n.split("-")[0] for n in shared} == {"hafedho", "fedavgm"}  # ... and its momentum twin


def test_overrides_replace_axes_or_apply_to_all() -> None:
    preset = load_preset("table1")
    overrides = ["dataset=cifar10", "protocol=head", 'algorithm.name=["hafedho", "fedavg"]', "rounds=2"]
    specs = expand(preset, seeds=1, overrides=overrides)
    assert {(s.label, s.point.get("dataset")) for s in specs} == {
        ("hafedho", "cifar10"),
        ("fedavg", "cifar10"),
        ("centralized", "cifar10"),
        ("hafedho-twin", "cifar10"),
    }
    assert len(specs) == 3 * 3 + 1 and all(s.cfg.rounds == 2 for s in specs)
    assert all(s.name.endswith("-s0") for s in specs)


TWIN = '\n[[variants]]\nlabel = "hafedho-twin"\nof = "hafedho"\nderive = "hafedho_paper.twin:momentum_twin"\n'


def twin_preset(tmp: Path) -> Preset:
    """HaFedHo (mu x accumulate x mu_schedule, lambda = 3) and FedAvgM with a twin variant."""
    grid = (
        '"algorithm.name" = ["hafedho", "fedavgm"]\n"algorithm.hafedho.mu" = [0.1, 0.2, 0.4]\n'
        '"algorithm.hafedho.accumulate" = ["phi", "f"]\n"algorithm.hafedho.mu_schedule" = ["constant", "inverse_round"]'
    )
    extra = TWIN + '[base.algorithm.fedavgm]\nbeta = 0.3\nweighting = "uniform"\n'  # = the twin of mu = 0.1
    return load_preset(str(tiny(tmp, grid=grid, extra=extra)))


def test_momentum_twin_rows(tmp_path: Path) -> None:
    """A twin beside every HaFedHo run where it is defined: FedAvgM, beta = lambda*mu of that run, uniform weights,
    server_lr 1, the same lr, everything else identical, named as any fedavgm run (an identical grid run is shared,
    listed under both labels); elsewhere a note says why there is none."""
    preset = twin_preset(tmp_path)
    specs = expand(preset, seeds=1)
    twins = [s for s in specs if s.label == "hafedho-twin"]
    haf = {s.name: s for s in specs if s.label == "hafedho"}
    # lambda = 3: mu 0.1 and 0.2 have twins (beta 0.3, 0.6); mu = 0.4 (lambda*mu = 1.2), "f" and inverse_round none
    assert sorted(t.cfg.algorithm["fedavgm"]["beta"] for t in twins) == [0.3, 0.6]
    (shared,) = [s for s in specs if s.aliases]  # the grid's fedavgm run is the twin of mu = 0.1: one directory
    assert shared.label == "hafedho-twin" and shared.aliases == ["fedavgm"]
    assert len(specs) == 12 + 2 and len({s.name for s in specs}) == len(specs)
    for t in twins:
        assert t.name.startswith("fedavgm-digits-")
        h = next(s for s in haf.values() if s.point == t.point)
        assert specs.index(t) == specs.index(h) + 1  # right beside its HaFedHo run
        a, b = h.cfg.to_dict(), t.cfg.to_dict()
        beta = 3 * a.pop("algorithm")["hafedho"]["mu"]
        assert b.pop("algorithm") == {
            "name": "fedavgm",
            "lr": 0.1,
            "fedavgm": {"beta": pytest.approx(beta), "server_lr": 1.0, "weighting": "uniform"},
        }
        assert {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    notes = [s.note for s in haf.values() if s.note]
    assert len(notes) == 12 - 2
    assert sum("lambda*mu = 3*0.4 = 1.2 >= 1" in n for n in notes) == 1
    assert sum('gradient rectification (accumulate = "f")' in n for n in notes) == 6
    assert sum('mu_schedule = "inverse_round"' in n for n in notes) == 3  # phi only: "f" is named first
    assert "no hafedho-twin for hafedho [mu=0.4, accumulate=phi, mu_schedule=constant]" in "\n".join(notes)
    index = read_index(write_index(preset, specs, tmp_path / "runs"))
    assert index.derived == {"hafedho-twin": {"of": "hafedho", "derive": "hafedho_paper.twin:momentum_twin"}}
    assert index.notes == notes
    assert [e.label for e in index.runs if e.dir == shared.name] == ["hafedho-twin", "fedavgm"]


def test_a_twin_takes_hafedhos_weighting_and_server_step(tmp_path: Path) -> None:
    """data_size aggregation maps to data_size weighting; eta sets server_lr = eta / lr. A twin variant with other
    keys, or two of them, is refused in one line."""
    preset = twin_preset(tmp_path)
    other = expand(
        preset,
        seeds=1,
        overrides=[
            'algorithm.name="hafedho"',
            "algorithm.hafedho.mu=0.1",
            'algorithm.hafedho.accumulate="phi"',
            'algorithm.hafedho.mu_schedule="constant"',
            'algorithm.hafedho.aggregation="data_size"',
            "algorithm.hafedho.eta=0.2",
        ],
    )
    assert other[1].cfg.algorithm["fedavgm"] == {"beta": 0.3, "server_lr": 2.0, "weighting": "data_size"}
    for bad in (TWIN.replace("derive", "cross = []\nderive"), TWIN + TWIN):
        with pytest.raises(
            ConfigError, match=r"variants\[[01]\]: (a derived variant takes only|of = 'hafedho' is given twice)"
        ):
            expand(load_preset(str(tiny(tmp_path, extra=bad))))


def test_a_sweep_run_has_the_name_hafedho_run_gives_it(tmp_path: Path) -> None:
    """TINY is the smoke config (plus defaults written out, another horizon): its runs are `hafedho run smoke`'s
    directories, whatever the engine; a shared key that a selected algorithm's table contradicts is refused."""
    specs = expand(load_preset(str(tiny(tmp_path))))
    by_run = {load_config(SMOKE, [f"algorithm.name={s.label}", f"seed={s.seed}"]).run_name: s for s in specs}
    assert set(by_run) == {s.name for s in specs} and len(specs) == 4
    assert all(by_run[s.name].run_dir == Path(s.cfg.out) / s.name for s in specs)
    assert [s.name for s in expand(load_preset(str(tiny(tmp_path))), overrides=["engine=process"])] == [
        s.name for s in specs
    ]
    over = tiny(tmp_path, extra="[base.algorithm.hafedho]\nmu = 0.01\n")
    with pytest.raises(ConfigError, match=r"algorithm.mu=0.5 conflicts with algorithm.hafedho.mu=0.01"):
        expand(load_preset(str(over)), overrides=["algorithm.mu=0.5"])


def test_preset_errors_are_one_line(tmp_path: Path) -> None:
    typo = tiny(tmp_path, extra="[scale.cpu.base.data]\nqq = 1\n")
    with pytest.raises(ConfigError, match=r"^tiny \[algorithm.name=hafedho\]: data.qq: unknown key"):
        expand(load_preset(str(typo)))
    bad = tiny(tmp_path, grid='dataset = ["x"]')
    with pytest.raises(ConfigError, match="neither a config key nor a named axis"):
        expand(load_preset(str(bad)))
    with pytest.raises(
        ConfigError, match=r"^tiny \[algorithm.hafedho.mu=-1.0\]: algorithm.hafedho.mu=-1.0: must be >= 0"
    ):
        expand(load_preset(str(tiny(tmp_path, grid='"algorithm.hafedho.mu" = [0.01, -1.0]'))))
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_preset("nope")
    with pytest.raises(ConfigError, match="not an axis of"):
        expand(load_preset(str(tiny(tmp_path, extra='[scale.cpu.grid]\n"data.q" = [0.1]\n'))))


def _hand_diverged(spec) -> None:
    spec.run_dir.mkdir(parents=True)
    (spec.run_dir / "config.toml").write_text(dump_toml(spec.cfg.to_dict()))
    (spec.run_dir / "diverged").write_text("run diverged at round 2: train/loss is nan\n")


def test_sweep_skips_done_resumes_interrupted_keeps_diverged(tmp_path: Path) -> None:
    preset = load_preset(str(tiny(tmp_path)))
    specs = expand(preset)
    h0, h1, f0, f1 = specs
    assert [s.label for s in specs] == ["hafedho", "hafedho", "fedavg", "fedavg"]
    # h1 interrupted after round 2 (checkpoint at 2, no done marker); f0 stopped by divergence earlier
    assert run_spec(dataclasses.replace(h1.cfg, rounds=2), str(h1.run_dir)).status == "done"
    (h1.run_dir / "done").unlink()
    before = read_metrics(h1.run_dir)
    _hand_diverged(f0)
    assert [run_state(s.run_dir).status for s in specs] == ["new", "interrupted", "diverged", "new"]
    result = run_sweep(specs, jobs=1, progress=False)
    status = {o.name: o.status for o in result.outcomes}
    assert status == {h0.name: "done", h1.name: "done", f0.name: "diverged", f1.name: "done"}
    after = read_metrics(h1.run_dir)
    assert after[:2] == before and [r["round"] for r in after] == [1, 2, 3]  # resumed, not restarted
    assert not (f0.run_dir / "done").exists() and not (f0.run_dir / "metrics.jsonl").exists()  # not retried
    again = run_sweep(specs, jobs=1, progress=False)
    assert again.summary() == "3 skipped, 1 diverged" and not again.failed
    (h0.run_dir / "done").unlink()
    with RunLock(h0.run_dir):  # another sweep over the same folder holds this run
        assert run_spec(h0.cfg, str(h0.run_dir)).status == "busy"
    index = write_index(preset, specs, preset.out)
    assert json.loads(index.read_text())["runs"][2] == {
        "dir": f0.name,
        "label": "fedavg",
        "seed": 0,
        "point": {"algorithm.name": "fedavg"},
        "reference": False,
        "rounds": f0.cfg.rounds,
    }
    entry = IndexEntry(f0.name, "fedavg", 0, {"algorithm.name": "fedavg"}, False, f0.cfg.rounds)
    assert read_index(index).runs[2] == entry
    md = write_report(preset.out).markdown.read_text()
    assert "diverged (1/2)" not in md and "| diverged | 1 |" in md


def test_sweep_cli_parallel_failures_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two processes; the runs with an unknown model fail at build time, the others finish; exit code 1."""
    path = tiny(tmp_path, grid='"model.name" = ["logreg", "no_such_model"]')
    assert main(["sweep", str(path), "--jobs", "2", "--quiet", "rounds=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("hafedho: failed:") == 2 and "no_such_model" in err
    index = json.loads((tmp_path / "runs-cpu" / "sweeps" / "tiny.json").read_text())
    assert len(index["runs"]) == 4 and len(index["failed"]) == 2
    done = [r for r in index["runs"] if (tmp_path / "runs-cpu" / r["dir"] / "done").exists()]
    assert len(done) == 2 and all(r["point"] == {"model.name": "logreg"} for r in done)
    assert main(["sweep", str(path), "--dry-run", "rounds=2", "model.name=logreg"]) == 0
    out = capsys.readouterr().out
    assert out.count("done ") == 2 and "2 runs of tiny (cpu)" in out
    assert main(["sweep", "list"]) == 0 and "table1" in capsys.readouterr().out
    assert main(["sweep", "nope"]) == 2


def test_sweep_skip_rows_leaves_a_row_out_but_keeps_it_in_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--skip-rows``: the named row's runs are not run (nor listed by --dry-run), the index lists the whole preset,
    and a label that is not a row ends in one line naming the rows."""
    path = tiny(tmp_path)
    assert main(["sweep", str(path), "--quiet", "--skip-rows", "hafedho", "rounds=2"]) == 0
    index = json.loads((tmp_path / "runs-cpu" / "sweeps" / "tiny.json").read_text())
    runs = {r["dir"]: r["label"] for r in index["runs"]}
    done = {d for d in runs if (tmp_path / "runs-cpu" / d / "done").exists()}
    assert {runs[d] for d in done} == {"fedavg"} and "hafedho" in runs.values()
    capsys.readouterr()
    assert main(["sweep", str(path), "--dry-run", "--skip-rows", "hafedho", "rounds=2"]) == 0
    out = capsys.readouterr().out
    assert "hafedho-" not in out and out.count("done ") == len(done)
    assert main(["sweep", str(path), "--skip-rows", "fedavg,nope", "rounds=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--skip-rows nope: not a row" in err and "fedavg, hafedho" in err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_sweep_workers_exit_when_the_sweep_is_killed(tmp_path: Path) -> None:
    """SIGKILL reaches the sweep process only; its busy worker must not go on writing into a run directory."""
    script = tmp_path / "sweep_like.py"
    script.write_text(
        "import multiprocessing, os, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from hafedho.sweep.execute import _init_worker\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    ex = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker, initargs=(1, os.getpid()))\n"
        "    print(ex.submit(os.getpid).result(), flush=True)\n"
        "    ex.submit(time.sleep, 120)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    worker = next(p for p in descendants(proc.pid) if p[0] == pid)  # (pid, start time): no recycled-pid confusion
    assert is_running(worker)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while is_running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not is_running(worker)


def _smoke_specs(name: str, overrides: list[str]) -> list:
    """A preset's first grid point, its first reference point, its first momentum twin, its first Proposition 1
    ideal (converge's hafedho-exact) and the first point of each other protocol (main, head, main-long), seed 0;
    estimation's diagnostics every 2 rounds, so one is taken."""
    if name == "estimation":
        overrides = [*overrides, "diagnostics.every=2"]
    specs = expand(load_preset(name), seeds=1, overrides=overrides)
    first = [specs[0]]
    first += [s for s in specs if s.label != specs[0].label and s.reference][:1]
    first += [s for s in specs if s.label == "hafedho-twin"][:1]
    first += [s for s in specs if s.label == "hafedho-exact"][:1]
    protocols = dict.fromkeys(s.point["protocol"] for s in specs if "protocol" in s.point)  # main, head, main-long
    first += [
        next(s for s in specs if s.point.get("protocol") == p) for p in protocols if p != first[0].point["protocol"]
    ]
    return first


@pytest.mark.parametrize("name", PAPER)
def test_cpu_preset_runs_two_rounds(name: str, shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.getbasetemp() / "smoke"
    overrides = ["rounds=2", "eval_every=2", "checkpoint_every=2"]
    specs = [
        dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, out=str(out))) for s in _smoke_specs(name, overrides)
    ]
    result = run_sweep(specs, progress=False)
    assert not result.failed, result.failed
    for s in specs:
        rows = read_metrics(s.run_dir)
        assert [r["round"] for r in rows] == [1, 2] and "test/acc" in rows[-1] and run_state(s.run_dir).status == "done"
        assert ("diag/h_cos" in rows[-1]) == (name == "estimation")
    assert name not in ("converge", "ideal") or {"hafedho-twin", "hafedho-exact"} <= {s.label for s in specs}


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER)
def test_cpu_preset_full_grid_two_rounds(name: str, shared_data: Path, tmp_path: Path) -> None:
    """Every point of every CPU preset (one seed) for two rounds: no run fails, report covers every run. tune's lr
    axis only changes a number, so one lr of it stands for all five (the grid is every candidate x dataset)."""
    overrides = ["rounds=2", "eval_every=2", "checkpoint_every=2"]
    if name == "tune":
        overrides.append("algorithm.lr=[0.05]")
    specs = expand(load_preset(name), seeds=1, overrides=overrides, out=str(tmp_path))
    result = run_sweep(specs, jobs=2, progress=False)
    assert not result.failed, [(o.name, o.message) for o in result.failed]
    write_index(load_preset(name), specs, tmp_path)
    files = write_report(tmp_path)
    assert files.figures and all(f'src="{f.name}"' in files.html.read_text() for f in files.figures)


def test_ctrl_c_ends_a_sweep_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hafedho.runtime.rundir as rundir

    path = tiny(tmp_path)
    real = rundir.append_metrics
    calls = []

    def append(run_dir: Path, row: dict) -> None:
        calls.append(row["round"])
        if len(calls) == 5:  # Ctrl-C in the second run's second round
            raise KeyboardInterrupt
        real(run_dir, row)

    monkeypatch.setattr(rundir, "append_metrics", append)
    assert main(["sweep", str(path), "--quiet"]) == 130
    assert capsys.readouterr().err == (
        "hafedho: sweep interrupted with 1 of 4 runs done; run the same command again to continue "
        "(finished runs are skipped, interrupted ones resume from their last checkpoint)\n"
    )
    monkeypatch.setattr(rundir, "append_metrics", real)
    assert main(["sweep", str(path), "--quiet"]) == 0
    assert "3 done, 1 skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_ctrl_c_stops_a_parallel_sweep_and_its_workers(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group: the sweep stops its workers (which would go on to their next queued
    run), prints one line and exits 130; no worker is left running."""
    import os
    import signal

    path = tiny(tmp_path).rename(tmp_path / "long.toml")
    path.write_text(path.read_text().replace("rounds = 3\n", "rounds = 5000\n"))
    cmd = [sys.executable, "-m", "hafedho", "sweep", str(path), "--jobs", "2", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((tmp_path / "runs-cpu").glob("*/metrics.jsonl"))) < 2:
        time.sleep(0.1)
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == (
        "hafedho: sweep interrupted with 0 of 4 runs done; run the same command again to continue "
        "(finished runs are skipped, interrupted ones resume from their last checkpoint)\n"
    )
    assert workers
    deadline = time.monotonic() + 60  # the sweep has exited; its helpers (e.g. multiprocessing's resource tracker)
    while time.monotonic() < deadline and [w for w in workers if is_running(w)]:  # end on their own, soon after
        time.sleep(0.1)
    assert not [w for w in workers if is_running(w)]


def test_dry_run_says_which_cells_have_no_twin_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    """fig3's gradient-rectification cells and its mu = 0.1 cell (lambda*mu = 1) have no momentum twin."""
    assert main(["sweep", "fig3", "--dry-run"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert any('gradient rectification (accumulate = "f")' in n for n in notes)
    assert any("lambda*mu = 10*0.1 = 1 >= 1" in n for n in notes) and len(notes) == len(set(notes))


def _tuned_cpu() -> dict:
    """_tuned.toml's CPU bundles per dataset: the values tune chose."""
    return read_toml(PRESET_DIR / "_tuned.toml")["scale"]["cpu"]["bundles"]["dataset"]


def test_tuned_lr_is_each_algorithms_own() -> None:
    """At CPU scale every row runs at its own tuned lr (_tuned.toml; main-long's from _tuned_long.toml); tune
    itself extends _common, so its lr axis never meets a tuned lr; the twin takes HaFedHo's lr."""
    long = read_toml(PRESET_DIR / "_tuned_long.toml")["scale"]["cpu"]["bundles"]["protocol"]["main-long"]["when"]
    for s in expand(load_preset("table1"), seeds=1):
        name, settings = resolve_algorithm(s.cfg.algorithm)
        d = s.point["dataset"]
        chosen = long[f"dataset={d}"] if s.point["protocol"] == "main-long" else _tuned_cpu()[d]  # the horizon's own
        if s.label == "hafedho-twin":
            assert settings["lr"] == chosen["algorithm.hafedho.lr"]
        else:
            assert "lr" not in s.cfg.algorithm and settings["lr"] == chosen[f"algorithm.{name}.lr"]
    lrs = {resolve_algorithm(s.cfg.algorithm)[1]["lr"] for s in expand(load_preset("tune"), seeds=1)}
    assert lrs == set(read_toml(PRESET_DIR / "tune.toml")["grid"]["algorithm.lr"])


def test_scaled_bundles(tmp_path: Path) -> None:
    """``scaled = {of, by}``: the named bundle's numbers (its ``when`` rules' too) times the factor, the bundle's own
    keys over that, resolved per scale; a bad form, an unknown bundle or a cycle is one error naming the bundle."""
    extra = """
[bundles.lr."1x"]
"clients.local_steps" = 4
"sampling.mode" = "fixed"
[bundles.lr."1x".when."algorithm.name=fedavg"]
"algorithm.lr" = 0.3
[bundles.lr."0.5x"]
scaled = {of = "1x", by = 0.5}
"clients.local_steps" = 3
[bundles.lr."0.25x"]
scaled = {of = "0.5x", by = 0.5}
"clients.local_steps" = 2
[scale.full.bundles.lr."1x".when."algorithm.name=fedavg"]
"algorithm.lr" = 0.7
"""
    path = tiny(tmp_path, grid='"algorithm.name" = ["hafedho", "fedavg"]\nlr = ["1x", "0.5x", "0.25x"]', extra=extra)
    for scale, fedavg_lr in (("cpu", 0.3), ("full", 0.7)):
        got = {
            (s.label, s.point["lr"]): (s.cfg.algorithm.get("lr"), s.cfg.clients.local_steps, s.cfg.sampling.mode)
            for s in expand(load_preset(str(path), scale), seeds=1)
        }
        assert got[("fedavg", "1x")] == (fedavg_lr, 4, "fixed")
        assert got[("fedavg", "0.5x")] == (fedavg_lr / 2, 3, "fixed")  # its own local_steps wins; strings stay
        assert got[("fedavg", "0.25x")] == (fedavg_lr / 4, 2, "fixed")  # a chain scales the resolved bundle
        assert got[("hafedho", "0.5x")] == (0.1, 3, "fixed")  # base's lr: not part of any bundle
    bad = {
        'scaled = {of = "1x"}': "write scaled = {of",
        'scaled = {of = "1x", by = true}': "FACTOR a number",
        'scaled = {of = "3x", by = 2}': "of = '3x' is not a bundle of lr; known: 1x, 0.5x",
        'scaled = {of = "0.5x", by = 2}': "forms a cycle (0.5x -> 0.5x)",
    }
    for line, message in bad.items():
        text = f'[bundles.lr."1x"]\n[bundles.lr."0.5x"]\n{line}\n'
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_preset(str(tiny(tmp_path, grid='lr = ["1x", "0.5x"]', extra=text)))


def test_tune_long_lrs_are_multiples_of_the_30_round_picks() -> None:
    """tune-long's lr axis is {0.125x, ..., 2x} of each method's 30-round lr in _tuned.toml, on every data set."""
    chosen = _tuned_cpu()
    specs = expand(
        load_preset("tune-long-writers"), seeds=1, overrides=['dataset=["femnist", "cifar10", "femnist_writers"]']
    )
    seen = set()
    for s in specs:
        name, settings = resolve_algorithm(s.cfg.algorithm)
        factor = float(s.point["lr"].rstrip("x"))
        assert settings["lr"] == factor * chosen[s.point["dataset"]][f"algorithm.{name}.lr"], s.name
        seen.add((s.point["dataset"], s.point["lr"]))
    assert len(seen) == 3 * 5


def test_momentum_runs_fedavgm_at_hafedhos_lr() -> None:
    """momentum.toml writes HaFedHo's tuned lr out per dataset (a preset cannot refer to another key): it must
    equal _tuned.toml's, so its beta = lambda*mu heavy-ball point stays table1's twin run."""
    chosen = _tuned_cpu()
    specs = expand(load_preset("momentum"), seeds=1)
    for s in specs:
        lr = resolve_algorithm(s.cfg.algorithm)[1]["lr"]
        assert lr == chosen[s.point["dataset"]]["algorithm.hafedho.lr"], s.name
    twins = {
        s.name
        for s in expand(load_preset("table1"), seeds=1, overrides=["protocol=head"])  # momentum's protocol
        if s.label == "hafedho-twin" and s.point["data.q"] == 0.3
    }
    assert twins and twins <= {s.name for s in specs}


def test_a_partial_sweep_lists_the_whole_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep of some values of an axis (or fewer seeds) runs only those, but its index lists the whole preset, so
    it never drops another sweep's runs from the report; an override that changes runs changes the index."""
    path = tiny(tmp_path, grid='"algorithm.name" = ["hafedho", "fedavg"]\n"data.q" = [0.3, 0.6]')
    preset = load_preset(str(path))
    assert changing_overrides(preset, ["data.q=[0.3]", "algorithm.name=fedavg", "rounds=2", "data.q=[0.3, 1.0]"]) == [
        "rounds=2",
        "data.q=[0.3, 1.0]",
    ]
    assert main(["sweep", str(path), "data.q=[0.3]", "algorithm.name=fedavg", "--seeds", "1", "--quiet"]) == 0
    index = read_index(tmp_path / "runs-cpu" / "sweeps" / "tiny.json")
    assert len(index.runs) == 2 * 2 * 2 and {e.dir for e in index.runs} == {s.name for s in expand(preset)}
    done = {p.name for p in (tmp_path / "runs-cpu").iterdir() if (p / "done").exists()}
    assert len(done) == 1 and done < {e.dir for e in index.runs}
    assert main(["sweep", str(path), "rounds=2", "--dry-run"]) == 0  # changing overrides: nothing written
    capsys.readouterr()
    assert "| not started | 7 |" in write_report(tmp_path / "runs-cpu", tmp_path / "rep").text  # not absent
