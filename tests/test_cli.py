"""The ``hafedho`` command end to end (in-process, so failures show tracebacks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_smoke

from hafedho.cli import main
from hafedho.runfiles import read_metrics


def test_run_smoke_config_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_smoke(tmp_path) == 0
    run_dir = next(tmp_path.glob("hafedho-digits-*-s0"))  # PREFIX-HASH-sSEED (Config.run_name)
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2] and (run_dir / "done").exists()
    assert rows[-1]["test/acc"] > 0.1 and "round 2, test/acc" in capsys.readouterr().out
    # overrides without a config file use the embedded default
    assert main(["run", "rounds=1", "algorithm.name=fedavg", "--out", str(tmp_path), "--quiet"]) == 0
    assert (
        json.loads((next(tmp_path.glob("fedavg-digits-*-s0")) / "metrics.jsonl").read_text().splitlines()[0])["round"]
        == 1
    )


def test_hafedho_run_is_the_python_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hafedho run`` is ``hafedho.api.run`` with the command line's arguments: one path for both."""
    import hafedho.api

    calls: list[tuple] = []
    real = hafedho.api.run
    monkeypatch.setattr(hafedho.api, "run", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    assert run_smoke(tmp_path, "rounds=1") == 0
    assert calls == [
        (("smoke", "rounds=1"), {"out": str(tmp_path), "resume": False, "force": False, "progress": False})
    ]
    result = real("smoke", "rounds=1", out=tmp_path)  # resume=True: the finished run, read back
    assert result.already_finished and f"round 1, test/acc {result.final['test/acc']:.4f}" in capsys.readouterr().out
    assert run_smoke(tmp_path, "rounds=1", "--resume") == 0
    assert (
        f"already finished at round 1 (test/acc {result.final['test/acc']:.4f}); nothing changed in {result.run_dir}"
        in (capsys.readouterr().out)
    )


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "smoke", "data.q=0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "hafedho: error: data.q=0.0: must be > 0\n"
    assert main(["run", "smoke", "bogus.key=1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("hafedho: error: bogus: unknown key")


def test_listing_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    assert "hafedho:" in out and "fedavg:" in out and "mu = 0.01" in out
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    for name in ("digits", "synthetic", "femnist", "cifar10", "cifar100", "imagefolder", "npz"):
        assert name in out


def test_report_command(tmp_path: Path) -> None:
    assert run_smoke(tmp_path) == 0
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    assert "| hafedho | 1 |" in (tmp_path / "rep" / "results.md").read_text()
    assert (tmp_path / "rep" / "accuracy.png").stat().st_size > 1000


def test_demo_writes_its_table_and_plot_through_the_main_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hafedho demo`: HaFedHo and FedAvg per seed, then the report's final-accuracy table (printed and in
    results.md) and accuracy.png in the demo folder; a second call reruns nothing."""
    out = tmp_path / "demo"
    assert main(["demo", "--seeds", "1", "--out", str(out), "rounds=2", "eval_every=1"]) == 0
    printed = capsys.readouterr().out
    md = (out / "results.md").read_text()
    assert md.startswith("# Demo: digits, Dirichlet q=0.3, 50 clients, 10% participation\n")
    header = "| algorithm | seeds | final test accuracy (%, mean of last 10 evals) | best (%) |"
    assert header in printed and header in md
    for alg in ("hafedho", "fedavg"):
        row = next(line for line in printed.splitlines() if line.startswith(f"| {alg} | 1 | "))
        assert row in md
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "report.html").exists()
    assert f"table: {out / 'results.md'}" in printed and f"plot:  {out / 'accuracy.png'}" in printed
    assert main(["demo", "--seeds", "1", "--out", str(out), "rounds=2", "eval_every=1"]) == 0
    assert len(list(out.glob("*-s0"))) == 2


def test_output_into_a_closed_pipe_is_quiet() -> None:
    """`hafedho sweep table1 --dry-run | head -1`: once the reader has gone, exit without a traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hafedho", "sweep", "table1", "--dry-run"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.returncode == 1 and proc.stderr == ""
