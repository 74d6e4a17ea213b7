"""The committed results folder: a finished run's small files only (config, metrics, partition,
run facts, env, the done/diverged marker; never checkpoints, client stores, locks or temporary files, which
.gitignore keeps out) are enough: a sweep over them skips the runs, never reruns or rewrites them; `hafedho report`
rebuilds the same tables from them; a run that must be extended without its checkpoint stops with one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import SMOKE_PRESET_TABLES, no_wall

from hafedho.cli import main
from hafedho.report.build import write_report
from hafedho.runfiles import read_metrics, run_state
from hafedho.sweep.browse import results_index

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"config.toml", "env.json", "partition.json", "run.json", "metrics.jsonl", "done", "diverged"}

PRESET = """
seeds = 1
out = "{out}"
description = "a done and a diverged run"

[base]
rounds = 3
eval_every = 1
checkpoint_every = 1
engine = "loop"
client_store = "disk"  # so the run writes client_store/ and store_rT/ snapshots too (the full-scale case)

{smoke}
[base.algorithm]
name = "scaffold"  # per-client control variates: a client store
lr = 0.1

[grid]
"algorithm.lr" = [0.1, 1e38]  # 1e38 overflows in round 1: a diverged run

[report]
title = "committed"
last = 2
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(preset file, its sweep folder) after one sweep: one run done, one diverged, checkpoints still there."""
    tmp = tmp_path_factory.mktemp("committed")
    preset = tmp / "committed.toml"
    preset.write_text(PRESET.format(out=tmp / "runs", smoke=SMOKE_PRESET_TABLES))
    assert main(["sweep", str(preset), "--quiet"]) == 0
    out = tmp / "runs-cpu"
    markers = sorted(p.name for p in out.glob("*/done")) + sorted(p.name for p in out.glob("*/diverged"))
    assert markers == ["done", "diverged"]
    return preset, out


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_copy(src: Path, dst: Path) -> Path:
    """What a fresh clone holds of ``src``: each run's small files and the sweep indexes."""
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_file() and (rel.parts[0] == "sweeps" or (len(rel.parts) == 2 and rel.name in SMALL)):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst / rel)
    return dst


def test_gitignore_keeps_exactly_the_big_files_out(swept: tuple[Path, Path]) -> None:
    """Of what a sweep writes under results/, git ignores checkpoints, client stores, store snapshots and locks,
    and nothing else."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse"]).returncode:
        pytest.skip("needs git and a git checkout of the project")
    _, out = swept
    rel = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    names = "\n".join(f"results/paper-cpu/{r}" for r in rel)
    res = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input=names, capture_output=True, text=True
    )
    ignored = {line.removeprefix("results/paper-cpu/") for line in res.stdout.splitlines()}
    kept = set(rel) - ignored
    assert {Path(r).parts[-1] for r in kept} - {"committed.json"} == SMALL  # committed.json: the sweep index
    assert all(r.startswith("sweeps/") or Path(r).name in SMALL for r in kept)
    kinds = {Path(r).parts[0] if r.startswith(".locks") else Path(r).parts[1].split("_r")[0] for r in ignored}
    assert kinds == {".locks", "checkpoint.pt", "client_store", "store"}, kinds


def test_a_sweep_skips_committed_runs_and_the_report_rebuilds_from_them(
    swept: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset, out = swept
    committed = commit_copy(out, tmp_path / "clone")
    assert not list(committed.rglob("checkpoint.pt"))
    before = files(committed)
    assert main(["sweep", str(preset), "--out", str(committed), "--quiet"]) == 0
    assert "1 skipped, 1 diverged" in capsys.readouterr().out
    assert files(committed) == before  # nothing rerun, rewritten, deleted or added (no checkpoint, no lock)

    # `hafedho report` on the committed folder: the same tables as from the full sweep folder
    a = write_report(committed, tmp_path / "rep_committed", title="t")
    b = write_report(out, tmp_path / "rep_full", title="t")
    assert a.text == b.text and "scaffold" in a.text and "diverged" in a.text
    assert [p.read_text() for p in a.tables] == [p.read_text() for p in b.tables] and a.tables
    assert main(["report", str(committed), "--out", str(tmp_path / "rep_cli")]) == 0
    assert (tmp_path / "rep_cli" / "results.md").read_text().count("| scaffold") >= 1


def test_extending_a_committed_run_stops_with_one_line(
    swept: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """More rounds than a committed run holds and no checkpoint: never a restart over its metrics, one line."""
    preset, out = swept
    committed = commit_copy(out, tmp_path / "clone")
    runs = {p.name for p in committed.iterdir() if p.is_dir() and p.name != "sweeps"}
    done = next(committed / n for n in runs if (committed / n / "done").exists())
    before = {n: files(committed / n) for n in runs}

    assert main(["sweep", str(preset), "--out", str(committed), "--dry-run", "rounds=5"]) == 0
    assert f"short       {done.name}" in capsys.readouterr().out
    assert main(["sweep", str(preset), "--out", str(committed), "--quiet", "rounds=5"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith(f"hafedho: failed: {done.name}: RunDirError: ")
    assert "finished 3 rounds and has no checkpoint.pt" in err[0] and "cannot be extended to 5" in err[0]
    assert main(["run", str(done / "config.toml"), "--resume", "rounds=5", "--out", str(committed), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checkpoint.pt" in err[0] and "--force" in err[0]
    assert {n: files(committed / n) for n in runs} == before  # the committed metrics are untouched

    # with its checkpoint (the machine that ran it), the same sweep extends the run: rounds 1-3 kept, 4-5 added
    full = tmp_path / "full"
    shutil.copytree(out, full)
    rows = read_metrics(full / done.name)
    assert run_state(full / done.name, 5).status == "short" and run_state(full / done.name, 3).status == "done"
    assert main(["sweep", str(preset), "--out", str(full), "--quiet", "rounds=5"]) == 0
    after = read_metrics(full / done.name)
    assert [r["round"] for r in after] == [1, 2, 3, 4, 5] and no_wall(after[:3]) == no_wall(rows)
    assert run_state(full / done.name, 5).status == "done" and run_state(full / done.name, 3).status == "done"


def test_the_results_index_lists_each_presets_runs(
    swept: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hafedho sweep index` writes ROOT/README.md: per folder and preset its claim, its runs and how many are done
    or diverged; a later sweep into a folder of that root refreshes it, and leaves a hand-written README alone."""
    preset, out = swept
    root = tmp_path / "results"
    committed = commit_copy(out, root / "paper-cpu")
    assert main(["sweep", "index", "--out", str(root)]) == 0
    text = (root / "README.md").read_text()
    assert "| [committed](#paper-cpu-committed-cpu) | committed | 2 | 1 | 1 | 0 | 0 | 0 |" in text
    assert "### paper-cpu: committed (cpu)\n\n**committed.** a done and a diverged run" in text
    for run in (p for p in committed.iterdir() if p.name != "sweeps"):
        status = "done" if (run / "done").exists() else "diverged"
        (line,) = [x for x in text.splitlines() if x.startswith(f"| [{run.name}](paper-cpu/{run.name}/) | scaffold")]
        assert line.endswith(f" | 0 | {status} |")
    (root / "README.md").write_text(text + "stale\n")
    assert main(["sweep", str(preset), "--out", str(committed), "--quiet"]) == 0
    assert (root / "README.md").read_text() == text and "index:" in capsys.readouterr().out
    (root / "README.md").write_text("# notes by hand\n")
    assert main(["sweep", str(preset), "--out", str(committed), "--quiet"]) == 0
    assert (root / "README.md").read_text() == "# notes by hand\n"


def test_the_committed_results_index_is_current() -> None:
    """results/README.md says what results/ holds: regenerate it with `hafedho sweep index` after a sweep."""
    assert (ROOT / "results" / "README.md").read_text() == results_index(ROOT / "results"), "hafedho sweep index"
