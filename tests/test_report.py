"""`hafedho report` on hand-made run directories: every number in the tables is checked against a hand computation."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hafedho.cli import main
from hafedho.config import dump_toml
from hafedho.report.build import write_report
from hafedho.report.runs import Stat, final_value, load_sections, rounds_to
from hafedho.report.tables import Layout, pct, rounds_tables, section_tables


def make_run(
    root: Path,
    name: str,
    alg: str,
    seed: int,
    accs: list[float],
    *,
    status: str = "done",
    data: dict[str, Any] | None = None,
    hyper: dict[str, Any] | None = None,
    eval_every: int = 1,
) -> Path:
    """A run directory as the runner leaves it: config.toml, metrics.jsonl (test/acc every ``eval_every`` rounds,
    train/loss every round) and the done or diverged marker."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {
        "seed": seed,
        "rounds": len(accs) * eval_every,
        "name": name,
        "out": str(root),
        "data": {"source": "digits", "partition": "dirichlet", "q": 0.3, "num_clients": 10, **(data or {})},
        "algorithm": {"name": alg, "lr": 0.05, alg: dict(hyper or {})},
    }
    if not cfg["algorithm"][alg]:
        del cfg["algorithm"][alg]
    (d / "config.toml").write_text(dump_toml(cfg))
    lines = []
    for t in range(1, len(accs) * eval_every + 1):
        row: dict[str, Any] = {"round": t, "train/loss": 1.0 / t}
        if t % eval_every == 0:
            row["test/acc"] = accs[t // eval_every - 1]
        lines.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if status == "done":
        (d / "done").write_text("")
    elif status == "diverged":
        (d / "diverged").write_text("run diverged at round 4: train/loss is nan\n")
    return d


def write_index(root: Path, preset: str, runs: list[dict[str, Any]], report: dict[str, Any], axes: list[str]) -> None:
    (root / "sweeps").mkdir(exist_ok=True)
    index = {
        "preset": preset,
        "scale": "cpu",
        "description": "hand-made",
        "axes": axes,
        "row_axes": [a for a in axes if a.startswith("algorithm.")],
        "report": report,
        "runs": runs,
        "failed": {},
    }
    (root / "sweeps" / f"{preset}.json").write_text(json.dumps(index))


def test_statistics_by_hand() -> None:
    evals = [(1, 0.1), (2, 0.5), (3, 0.4), (4, 0.8)]
    assert final_value(evals, 2) == pytest.approx(0.6) and final_value(evals, 10) == pytest.approx(0.45)
    assert rounds_to(evals, 0.45) == 2 and rounds_to(evals, 0.8) == 4 and rounds_to(evals, 0.81) is None
    st = Stat([3.0, 5.0], total=3)
    assert st.mean == 4.0 and st.std == pytest.approx(np.sqrt(2.0)) and st.n == 2


def test_plain_runs_final_best_and_bold(tmp_path: Path) -> None:
    """Two algorithms x 2 seeds, no sweep index: one summary table with mean ± std (ddof 1) over seeds."""
    a = {0: [0.2, 0.5, 0.6, 0.7], 1: [0.3, 0.4, 0.8, 0.9]}
    b = {0: [0.1, 0.2, 0.3, 0.4], 1: [0.2, 0.3, 0.4, 0.95]}
    for s in (0, 1):
        make_run(tmp_path, f"hafedho-s{s}", "hafedho", s, a[s], hyper={"mu": 0.01})
        make_run(tmp_path, f"fedavg-s{s}", "fedavg", s, b[s])
    files = write_report(tmp_path, tmp_path / "rep", last=2)
    md = files.markdown.read_text()
    # final = mean of the last 2 evaluations: hafedho 65, 85; fedavg 35, 67.5. best: hafedho 70, 90; fedavg 40, 95
    assert "| hafedho | 2 | **75.00 ± 14.14** | **80.00 ± 14.14** |" in md
    assert "| fedavg | 2 | 51.25 ± 22.98 | 67.50 ± 38.89 |" in md
    assert "| HaFedHo lead over best baseline (pp) |  | +23.75 |  |" in md
    rows = {r["row"]: r for r in csv.DictReader((tmp_path / "rep" / "summary.csv").open())}
    assert float(rows["hafedho"]["final_mean"]) == pytest.approx(0.75) and rows["fedavg"]["seeds"] == "2"
    assert (tmp_path / "rep" / "accuracy.png").stat().st_size > 5000
    tex = (tmp_path / "rep" / "final.tex").read_text()
    assert "\\textbf{75.00 $\\pm$ 14.14}" in tex and "\\begin{tabular}" in tex


def sweep_fixture(root: Path) -> None:
    """A table1-like sweep: datasets {digits, synth} x q {0.1, 0.5} x {hafedho, fedavg} x 3 seeds, plus a
    centralised reference crossed with the dataset only. hafedho's 3rd seed at (digits, 0.1) diverged; fedavg's
    seed 2 at (digits, 0.1) never reaches 0.6."""
    runs = []
    curves = {
        ("hafedho", "digits", 0.1): [[0.3, 0.6, 0.7, 0.8], [0.2, 0.5, 0.6, 0.7], [0.1, 0.2, 0.3, 0.3]],
        ("fedavg", "digits", 0.1): [[0.2, 0.4, 0.6, 0.7], [0.3, 0.5, 0.5, 0.6], [0.1, 0.3, 0.4, 0.5]],
    }
    for ds in ("digits", "synth"):
        for q in (0.1, 0.5):
            for alg in ("hafedho", "fedavg"):
                for s in range(3):
                    accs = curves.get((alg, ds, q), [[0.1 * (s + 1), 0.2, 0.3, 0.4 + 0.01 * s]] * 3)[s]
                    status = "diverged" if (alg, ds, q, s) == ("hafedho", "digits", 0.1, 2) else "done"
                    name = f"{alg}-{ds}-q{q}-s{s}"
                    make_run(root, name, alg, s, accs, status=status, data={"source": ds, "q": q})
                    runs.append({"dir": name, "label": alg, "seed": s, "point": {"dataset": ds, "data.q": q}})
        for s in range(3):
            name = f"centralized-{ds}-s{s}"
            make_run(root, name, "fedavg", s, [0.5, 0.9, 0.95, 0.97], data={"source": ds, "num_clients": 1})
            runs.append({"dir": name, "label": "centralized", "seed": s, "point": {"dataset": ds}, "reference": True})
    report = {"title": "T1", "last": 2, "targets": {"digits": [0.6, 0.75], "default": [0.3]}}
    write_index(root, "t1", runs, report, ["dataset", "data.q", "algorithm.name"])


def test_sweep_tables_columns_references_and_divergence(tmp_path: Path) -> None:
    sweep_fixture(tmp_path)
    (section,) = load_sections(tmp_path)
    lay = Layout.of(section)
    assert lay.col_keys == ["dataset", "data.q"] and len(lay.columns) == 4
    assert [lay.row_name(r) for r in lay.rows] == ["hafedho", "fedavg", "centralized"]
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert final.header[1:] == ["digits, q=0.1", "digits, q=0.5", "synth, q=0.1", "synth, q=0.5"]
    cells = {lay.row_name(r): row for r, row in zip(lay.rows, final.rows, strict=False)}
    # hafedho at (digits, 0.1): seeds 0 and 1 finished (final = mean of last 2: 75, 65); seed 2 diverged
    assert cells["hafedho"][1].text == "70.00 ± 7.07 (1/3 diverged)" and cells["hafedho"][1].bold
    # fedavg: 65, 55, 45 -> 55 ± 10
    assert cells["fedavg"][1].text == "55.00 ± 10.00" and not cells["fedavg"][1].bold
    # the centralised reference fills every column of its dataset and is never bold
    assert all(c.text == "96.00 ± 0.00" and not c.bold for c in cells["centralized"][1:])
    assert final.rows[-1][0].text.startswith("HaFedHo lead") and final.rows[-1][1].text == "+15.00"


def test_rounds_to_target_counts_seeds_that_never_reach(tmp_path: Path) -> None:
    sweep_fixture(tmp_path)
    (section,) = load_sections(tmp_path)
    lay = Layout.of(section)
    tables = rounds_tables(lay)
    first = tables[0]
    assert first.title.endswith("digits, q=0.1") and first.header == ["algorithm", "≥ 60.0%", "≥ 75.0%"]
    rows = {r[0].text: r for r in first.rows}
    # hafedho: seed 0 reaches 0.6 at round 2, seed 1 at 3, the diverged seed 2 never (its curve still counts)
    assert rows["hafedho"][1].text == "2.5 ± 0.7 (2/3)"
    assert rows["hafedho"][2].text == "4 (1/3)"
    # fedavg: seeds 0 (round 3) and 1 (round 4) reach 0.6; seed 2 never; nobody reaches 0.75
    assert rows["fedavg"][1].text == "3.5 ± 0.7 (2/3)" and rows["fedavg"][2].text == "— (0/3)"
    # no competitor brought every seed there: nothing bold; the reference got there in 2 rounds
    assert not any(c.bold for r in first.rows for c in r) and rows["centralized"][1].text == "2.0 ± 0.0 (3/3)"
    # the synth columns use the "default" targets; curves 0.1(s+1), 0.2, 0.3, ...: rounds 3, 3, 1
    assert tables[2].header == ["algorithm", "≥ 30.0%"]
    assert {r[0].text: r[1].text for r in tables[2].rows}["hafedho"] == "2.3 ± 1.2 (3/3)"
    long = list(csv.DictReader((write_report(tmp_path).markdown.parent / "rounds_to_target.csv").open()))
    row = next(r for r in long if r["row"] == "fedavg" and r["target"] == "0.75" and r["setting"] == "digits, q=0.1")
    assert (row["reached"], row["seeds"], row["rounds_mean"]) == ("0", "3", "nan")


def test_auto_targets_from_fedavg(tmp_path: Path) -> None:
    for s in range(2):
        make_run(tmp_path, f"fedavg-s{s}", "fedavg", s, [0.2, 0.4, 0.5, 0.5])
        make_run(tmp_path, f"hafedho-s{s}", "hafedho", s, [0.3, 0.5, 0.6, 0.6])
    (section,) = load_sections(tmp_path)
    (table,) = rounds_tables(Layout.of(section))
    # fedavg's final (mean of all 4, last = 10) = 0.4; targets 80/90/100% -> 32.0, 36.0, 40.0
    assert table.header == ["algorithm", "≥ 32.0%", "≥ 36.0%", "≥ 40.0%"]
    assert "of fedavg's final" in table.note


def test_plots_and_html_are_written(tmp_path: Path) -> None:
    sweep_fixture(tmp_path)
    files = write_report(tmp_path, tmp_path / "rep")
    names = sorted(f.name for f in files.figures)
    assert names == ["accuracy.png", "vs_q.png"]
    for f in files.figures:
        assert f.stat().st_size > 5000
    page = files.html.read_text()
    assert page.count("data:image/png;base64,") == 2 and "<b>70.00 ± 7.07 (1/3 diverged)</b>" in page
    assert 'src="http' not in page and "<link" not in page  # self-contained
    md = files.markdown.read_text()
    assert "| diverged | 1 |" in md and "hafedho-digits-q0.1-s2: run diverged at round 4" in md


def test_hyperparameter_sweep_plot_and_best_table(tmp_path: Path) -> None:
    """A fig3-like sweep: mu x accumulate; rows split by the varying hyperparameters; accuracy-vs-mu figure."""
    runs = []
    value = {("phi", 0.001): 0.6, ("phi", 0.01): 0.8, ("f", 0.001): 0.7, ("f", 0.01): 0.5}
    for (acc_mode, mu), v in value.items():
        for s in range(2):
            name = f"h-{acc_mode}-{mu}-s{s}"
            make_run(tmp_path, name, "hafedho", s, [v - 0.1, v + 0.01 * s], hyper={"mu": mu, "accumulate": acc_mode})
            point = {"algorithm.hafedho.accumulate": acc_mode, "algorithm.hafedho.mu": mu}
            runs.append({"dir": name, "label": "hafedho", "seed": s, "point": point})
    name = "h-phi-0.1-s0"
    make_run(tmp_path, name, "hafedho", 0, [0.2], status="diverged", hyper={"mu": 0.1, "accumulate": "phi"})
    runs.append({"dir": name, "label": "hafedho", "seed": 0, "point": {}})
    names = {"accumulate=phi": "objective", "accumulate=f": "gradient"}
    write_index(tmp_path, "f3", runs, {"names": names, "last": 1}, ["algorithm.hafedho.accumulate"])
    files = write_report(tmp_path, tmp_path / "rep")
    assert sorted(f.name for f in files.figures) == ["accuracy.png", "hafedho_vs_mu.png"]
    (section,) = load_sections(tmp_path)
    tables = {t.slug: t for t in section_tables(section)}
    assert tables["best_hyper"].rows[0][1].text == "objective mu=0.01: 80.50 ± 0.71"
    final = {r[0].text: r[2].text for r in tables["final"].rows}  # algorithm | seeds | final | best
    assert (
        final["hafedho objective mu=0.1"] == "diverged (1/1)" and final["hafedho gradient mu=0.001"] == "70.50 ± 0.71"
    )


def test_hyperparameter_set_per_column_keeps_one_row(tmp_path: Path) -> None:
    """A value tuned per dataset (FedProx mu 0.01 on one, 0.001 on the other) is one row, named in the note."""
    runs = []
    for source, mu, acc in (("digits", 0.01, 0.6), ("synthetic", 0.001, 0.4)):
        for s in range(2):
            name = f"p-{source}-s{s}"
            make_run(tmp_path, name, "fedprox", s, [acc, acc + 0.01 * s], data={"source": source}, hyper={"mu": mu})
            runs.append({"dir": name, "label": "fedprox", "seed": s, "point": {"dataset": source}})
    write_index(tmp_path, "t", runs, {"last": 1}, ["dataset", "algorithm.name"])
    (section,) = load_sections(tmp_path)
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert [[c.text for c in r] for r in final.rows] == [["fedprox", "60.50 ± 0.71", "40.50 ± 0.71"]]
    assert "fedprox mu per column (digits: 0.01; synthetic: 0.001)" in final.note


def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep_fixture(tmp_path)
    make_run(tmp_path / "other", "fedavg-s0", "fedavg", 0, [0.1, 0.2])  # a plain run next to the sweep
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "## T1 (cpu scale)" in out and "## Runs" in out
    assert (tmp_path / "rep" / "t1-cpu_accuracy.png").exists() and (tmp_path / "rep" / "runs_accuracy.png").exists()
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_one_seed_shows_no_spread() -> None:
    assert pct(Stat([0.5], 1)) == "50.00"
    assert pct(Stat([0.5, 0.7], 2)) == "60.00 ± 14.14"
