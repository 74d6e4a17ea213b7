"""`hafedho report` on hand-made run directories: every number in the tables is checked against a hand computation."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import BASE, run_smoke

from hafedho.cli import main
from hafedho.config import ConfigError
from hafedho.report.build import write_report
from hafedho.report.layout import Layout, pct
from hafedho.report.plots import derived_points, figure_name
from hafedho.report.runs import load_sections
from hafedho.report.stats import Stat, final_value, rounds_to
from hafedho.report.summary import summary_rows
from hafedho.report.tables import section_tables
from hafedho.report.tables.to_target import to_target_tables
from hafedho.sweep.index import IndexEntry, SweepIndex, read_index
from hafedho.toml_io import dump_toml

TWIN_ROWS = {"hafedho-twin": {"of": "hafedho", "derive": "hafedho_paper.twin:momentum_twin"}}
PAPER = "hafedho_paper.study:REPORT"  # the paper study (the plugin in study/), as its presets name it


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
    model: dict[str, Any] | None = None,
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
        **({"model": model} if model else {}),
    }
    if not cfg["algorithm"][alg]:
        del cfg["algorithm"][alg]
    (d / "config.toml").write_text(dump_toml(cfg))
    lines = []
    for t in range(1, len(accs) * eval_every + 1):
        row: dict[str, Any] = {"round": t, **BASE, "train/loss": 1.0 / t}
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
    """A sweep index in the format `hafedho sweep` writes (hafedho.sweep.index, its one owner)."""
    row_axes = [a for a in axes if a.startswith("algorithm.")]
    entries = [IndexEntry(**r) for r in runs]
    SweepIndex(preset, "cpu", "hand-made", axes, row_axes, {"study": PAPER, **report}, entries).write(root)


def test_statistics_by_hand() -> None:
    evals = [(1, 0.1), (2, 0.5), (3, 0.4), (4, 0.8)]
    assert final_value(evals, 2) == pytest.approx(0.6) and final_value(evals, 10) == pytest.approx(0.45)
    assert rounds_to(evals, 0.45) == 2 and rounds_to(evals, 0.8) == 4 and rounds_to(evals, 0.81) is None
    st = Stat([3.0, 5.0], total=3)
    assert st.mean == 4.0 and st.std == pytest.approx(np.sqrt(2.0)) and st.n == 2


def test_plain_runs_final_best_and_bold(tmp_path: Path) -> None:
    """Two algorithms x 2 seeds, no sweep index: one summary table with mean ± std (ddof 1) over seeds; no study
    (a plain folder names none), so no lead row and no verdict."""
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
    assert "lead over" not in md and "Verdict" not in md
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
    tables = to_target_tables(lay)
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
    runs = []
    for s in range(2):
        make_run(tmp_path, f"fedavg-s{s}", "fedavg", s, [0.2, 0.4, 0.5, 0.5])
        make_run(tmp_path, f"hafedho-s{s}", "hafedho", s, [0.3, 0.5, 0.6, 0.6])
        runs += [{"dir": f"{a}-s{s}", "label": a, "seed": s} for a in ("fedavg", "hafedho")]
    write_index(tmp_path, "t", runs, {"reference": "fedavg"}, [])  # the study's reference sets the targets
    (section,) = load_sections(tmp_path)
    (table,) = to_target_tables(Layout.of(section))
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
    assert "<b>70.00 ± 7.07 (1/3 diverged)</b>" in page
    assert 'src="http' not in page and "<link" not in page  # nothing from the network
    md = files.markdown.read_text()
    assert "| diverged | 1 |" in md and "hafedho-digits-q0.1-s2: run diverged at round 4" in md


def images(page: Path) -> list[Path]:
    """The files a page's ``<img>`` tags reference, resolved against the page's folder."""
    return [page.parent / src for src in re.findall(r'<img [^>]*src="([^"]+)"', page.read_text())]


def test_the_html_page_references_the_pngs_beside_it(tmp_path: Path) -> None:
    """report.html holds no copy of a figure: each <img> names a PNG written beside it, so a regenerated report
    adds no second copy of its figures to a repository."""
    sweep_fixture(tmp_path)
    files = write_report(tmp_path, tmp_path / "rep")
    assert "data:image" not in files.html.read_text()
    assert images(files.html) == files.figures and all(
        f.is_file() and f.parent == files.html.parent for f in files.figures
    )
    assert files.html.stat().st_size < 20_000  # tables only; the two figures are > 5,000 bytes each


def test_absolute_paths_read_from_runs_are_shown_relative_to_the_folder(tmp_path: Path) -> None:
    """A diverged marker (and a failure the index records) that quotes an absolute path, written here or on a
    machine where the folder lay elsewhere: the report prints it relative to the folder it reports."""
    root = tmp_path / "results" / "paper"
    here, there = "fedavg-digits-s0", "fedavg-digits-s1"
    runs = []
    for s, name in enumerate((here, there)):
        make_run(root, name, "fedavg", s, [0.1, 0.2], status="diverged")
        runs.append({"dir": name, "label": "fedavg", "seed": s, "point": {}})
    runs.append({"dir": "fedavg-digits-s2", "label": "fedavg", "seed": 2, "point": {}})  # never started: failed
    elsewhere = "/home/someone/checkout/results/paper"
    (root / here / "diverged").write_text(
        f"run diverged at round 2; last good checkpoint: round 1 in {root / here}/checkpoint.pt\n"
    )
    (root / there / "diverged").write_text(
        f"run diverged at round 2; checkpoint in {elsewhere}/{there}/checkpoint.pt.\n"
    )
    write_index(root, "t", runs, {"last": 1}, [])
    index = read_index(root / "sweeps" / "t.json")
    index.failed = {"fedavg-digits-s2": f"cannot extend {elsewhere}/fedavg-digits-s2 (no checkpoint); see /etc/hosts"}
    index.write(root)
    files = write_report(root, tmp_path / "rep")
    md = files.markdown.read_text()
    assert f"round 1 in {here}/checkpoint.pt" in md and f"checkpoint in {there}/checkpoint.pt." in md
    assert "cannot extend fedavg-digits-s2 (no checkpoint); see /etc/hosts" in md  # a path elsewhere stays
    for f in (files.markdown, files.html, *files.tables):
        assert str(tmp_path) not in f.read_text() and elsewhere not in f.read_text(), f.name
    assert main(["report", str(root.resolve()), "--out", str(tmp_path / "abs")]) == 0  # an absolute argument
    assert str(tmp_path) not in (tmp_path / "abs" / "results.md").read_text()


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
    assert tables["best_hyper"].rows[0][1].text == "objective mu=0.01: 80.50 ± 0.71"  # 0.1 was tried: no edge
    assert "* = at the edge of its grid" in tables["best_hyper"].note
    final = {r[0].text: r[2].text for r in tables["final"].rows}  # algorithm | seeds | final | best
    assert (
        final["hafedho objective mu=0.1"] == "diverged (1/1)" and final["hafedho gradient mu=0.001"] == "70.50 ± 0.71"
    )


def test_report_names_rename_a_row_label(tmp_path: Path) -> None:
    """[report.names] maps a variant's row label to its display name (converge's "hafedho-exact"); other labels
    keep theirs."""
    runs = []
    for label, h_source, v in (("hafedho", "aggregate", 0.6), ("hafedho-exact", "exact", 0.4)):
        for s in range(2):
            name = f"{label}-s{s}"
            make_run(tmp_path, name, "hafedho", s, [v, v + 0.01 * s], hyper={"h_source": h_source})
            runs.append({"dir": name, "label": label, "seed": s, "point": {}})
    write_index(tmp_path, "ideal", runs, {"names": {"hafedho-exact": "HaFedHo, exact h"}, "last": 1}, [])
    (section,) = load_sections(tmp_path)
    final = {r[0].text for r in {t.slug: t for t in section_tables(section)}["final"].rows}
    assert {"HaFedHo, exact h", "hafedho"} <= final and "hafedho-exact" not in final


def test_best_hyperparameters_at_the_edge_of_their_grid_are_marked() -> None:
    from hafedho.report.tables.best_hyper import _edge

    grid = [(("lr", 0.01), ("mu", 0.1)), (("lr", 0.03), ("mu", 0.1)), (("lr", 0.1), ("mu", 1.0))]
    assert [_edge("lr", v, grid) for v in (0.01, 0.03, 0.1)] == ["*", "", "*"]
    assert _edge("mu", 0.1, grid) == "*" and _edge("mu", 0.1, grid[:2]) == ""  # one value tried: no edge
    assert _edge("accumulate", "phi", [(("accumulate", "phi"),), (("accumulate", "f"),)]) == ""


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


# ----------------------------------------------------------------------------- demo and plain runs


def test_report_after_demo_and_plain_run_has_no_bookkeeping_axes(tmp_path: Path) -> None:
    """`make demo` (model.options.hidden = [64], eval/checkpoint cadence of its own) plus a plain `hafedho run`:
    the list-valued setting is a readable column, runtime settings never become an axis or a figure."""
    assert main(["run", "demo", "rounds=2", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    assert main(["run", "rounds=3", "--out", str(tmp_path), "--quiet"]) == 0
    files = write_report(tmp_path, tmp_path / "rep")
    (section,) = load_sections(tmp_path)
    lay = Layout.of(section)
    assert lay.col_keys == ["model.options.hidden"]
    assert sorted(lay.col_name(c) for c in lay.columns) == ["hidden=None", "hidden=[64]"]
    assert not set(section.axes) & {"rounds", "eval_every", "checkpoint_every", "engine", "threads", "out"}
    assert sorted(f.name for f in files.figures) == ["accuracy.png"]
    assert "| algorithm | hidden=[64] | hidden=None |" in files.markdown.read_text()
    # a run that differs in many settings at once: no figure whose every panel would hold a single point
    assert run_smoke(tmp_path / "smoke") == 0
    files = write_report(tmp_path, tmp_path / "rep")
    (section,) = load_sections(tmp_path)
    assert {"data.q", "data.num_clients", "model.name"} <= set(Layout.of(section).col_keys)
    assert sorted(f.name for f in files.figures) == ["accuracy.png"]


def test_list_and_dict_valued_settings_and_hyperparameters(tmp_path: Path) -> None:
    """Lists and tables as sweep axes and hyperparameters: hashable inside, readable in headers and figures."""
    runs = []
    for hidden, acc in (([64], 0.5), ([32, 32], 0.7)):
        for opts in ({"alpha": 0.5}, {"alpha": 1.0}):
            for s in range(2):
                name = f"h{len(hidden)}-{opts['alpha']}-s{s}"
                model, data = {"name": "mlp", "options": {"hidden": hidden}}, {"options": opts}
                make_run(
                    tmp_path, name, "hafedho", s, [acc, acc + 0.01 * s], hyper={"betas": hidden}, model=model, data=data
                )
                point = {"model.options.hidden": hidden, "data.options": opts, "rounds": 2, "eval_every": 1}
                runs.append({"dir": name, "label": "hafedho", "seed": s, "point": point})
    axes = ["model.options.hidden", "data.options", "rounds", "eval_every"]
    write_index(tmp_path, "lists", runs, {"last": 1}, axes)
    (section,) = load_sections(tmp_path)
    assert section.axes == ["model.options.hidden", "data.options"]  # runtime axes are dropped
    lay = Layout.of(section)
    assert [lay.col_name(c) for c in lay.columns] == [
        "hidden=[64], options={alpha = 0.5}",
        "hidden=[64], options={alpha = 1}",
        "hidden=[32, 32], options={alpha = 0.5}",
        "hidden=[32, 32], options={alpha = 1}",
    ]
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert [c.text for c in final.rows[0][1:]] == ["50.50 ± 0.71", "50.50 ± 0.71", "70.50 ± 0.71", "70.50 ± 0.71"]
    files = write_report(tmp_path, tmp_path / "rep")
    assert [f.name for f in files.figures] == ["accuracy.png"]


def test_sweep_with_variants_all_diverged_cells_and_a_stray_partial_run(tmp_path: Path) -> None:
    """A grid axis plus [[variants]], cells whose every seed diverged, and a stray partial run folder next to
    the sweep: the report is written; a figure with nothing to draw is not, and empty panels carry no legend."""
    runs = []
    for q in (0.1, 0.5):
        for alg in ("hafedho", "fedavg"):
            for s in range(2):
                name = f"{alg}-q{q}-s{s}"
                diverged = alg == "hafedho" and q == 0.5
                make_run(tmp_path, name, alg, s, [0.3, 0.4], status="diverged" if diverged else "done", data={"q": q})
                runs.append({"dir": name, "label": alg, "seed": s, "point": {"data.q": q}})
        for s in range(2):  # a variant crossed with the grid axis, every seed diverged at q=0.1
            name = f"fast-q{q}-s{s}"
            status = "diverged" if q == 0.1 else "done"
            make_run(tmp_path, name, "fedavg", s, [0.2, 0.5], status=status, data={"q": q}, hyper={"x": 1})
            runs.append({"dir": name, "label": "fast", "seed": s, "point": {"data.q": q}})
    for s in range(2):  # a reference variant crossed with nothing
        name = f"centralized-s{s}"
        make_run(tmp_path, name, "fedavg", s, [0.8, 0.9], data={"num_clients": 1})
        runs.append({"dir": name, "label": "centralized", "seed": s, "point": {}, "reference": True})
    write_index(tmp_path, "v", runs, {"last": 1}, ["data.q", "algorithm.name"])
    stray = make_run(tmp_path / "stray", "fedavg-s9", "fedavg", 9, [0.1], status="incomplete")
    (stray / "metrics.jsonl").write_text(json.dumps({"round": 1, **BASE, "train/loss": 2.0}) + "\n")  # no eval yet
    files = write_report(tmp_path, tmp_path / "rep")
    names = sorted(f.name for f in files.figures)
    assert names == ["v-cpu_accuracy.png", "v-cpu_vs_q.png"]  # the stray run's section has nothing to draw
    md = files.markdown.read_text()
    assert "diverged (2/2)" in md and "| incomplete | 1 |" in md


def test_last_must_be_positive_and_unknown_metric_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for s in range(2):
        make_run(tmp_path, f"fedavg-s{s}", "fedavg", s, [0.2, 0.4, 0.5])
    for bad in ("-3", "0"):
        assert main(["report", str(tmp_path), "--last", bad]) == 2
        err = capsys.readouterr().err
        assert (
            err.strip() == f"hafedho: error: --last {bad}: must be at least 1 (final = mean of the last N evaluations)"
        )
    with pytest.raises(ConfigError, match="--last -3"):
        write_report(tmp_path, last=-3)
    assert main(["report", str(tmp_path), "--metric", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metric nope" in err and "test/acc, train/loss" in err
    assert main(["report", str(tmp_path), "--metric", "train/loss", "--out", str(tmp_path / "rep")]) == 0


def test_same_experiment_and_seed_never_counts_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Flower run and a simulator run of the same experiment and seed are one seed, not "2 seeds, ± 0.00"."""
    make_run(tmp_path, "fedavg-digits-s0", "fedavg", 0, [0.2, 0.4])
    flower = make_run(tmp_path / "flower", "fedavg-digits-s0", "fedavg", 0, [0.2, 0.4])
    (flower / "run.json").write_text(json.dumps({"engine": "flower"}))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "same experiment and seed 0" in err and "flower" in err
    assert str(tmp_path / "fedavg-digits-s0") in err and str(flower) in err
    assert main(["report", str(tmp_path / "flower"), "--out", str(tmp_path / "rep")]) == 0  # on its own: fine
    # engines (and other runtime settings) do not make another experiment either
    other = tmp_path / "other"
    make_run(other, "a", "fedavg", 1, [0.2, 0.4])
    b = make_run(other / "b", "a", "fedavg", 1, [0.2, 0.4])
    text = (b / "config.toml").read_text()
    (b / "config.toml").write_text(text.replace("rounds = 2", 'rounds = 2\nengine = "process"'))
    with pytest.raises(ConfigError, match="same experiment and seed 1"):
        write_report(other)
    # centralised runs ignore the partition: two that differ only in data.q are one experiment too
    central = tmp_path / "central"
    for q in (0.1, 0.5):
        make_run(central, f"c-q{q}", "fedavg", 0, [0.5, 0.6], data={"num_clients": 1, "q": q})
    make_run(central, "fedavg-s0", "fedavg", 0, [0.2, 0.4])
    with pytest.raises(ConfigError, match=r"c-q0.1 and .*c-q0.5 are the same experiment and seed 0"):
        write_report(central)


def test_empty_test_set_and_missing_metric_are_not_zero(tmp_path: Path) -> None:
    """A run evaluated on an empty test set (acc 0, loss 0: no example to measure) and a run that never recorded
    the metric count as no data, named in the table note, never as 0%."""
    make_run(tmp_path, "fedavg-s0", "fedavg", 0, [0.4, 0.6])
    empty = make_run(tmp_path, "fedavg-s1", "fedavg", 1, [0.0, 0.0])
    rows = [json.loads(line) for line in (empty / "metrics.jsonl").read_text().splitlines()]
    (empty / "metrics.jsonl").write_text("".join(json.dumps({**r, "test/loss": 0.0}) + "\n" for r in rows))
    bare = make_run(tmp_path, "fedavg-s2", "fedavg", 2, [0.5, 0.5])
    rows = [json.loads(line) for line in (bare / "metrics.jsonl").read_text().splitlines()]
    (bare / "metrics.jsonl").write_text("".join(json.dumps({"round": r["round"], **BASE}) + "\n" for r in rows))
    make_run(tmp_path, "hafedho-s0", "hafedho", 0, [0.0, 0.0])  # a real 0% is still 0%
    hrows = [json.loads(line) for line in (tmp_path / "hafedho-s0" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "hafedho-s0" / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, "test/loss": 9.0}) + "\n" for r in hrows)
    )
    (section,) = load_sections(tmp_path)
    final = next(t for t in section_tables(section) if t.slug == "final")
    cells = {r[0].text: r for r in final.rows}
    assert cells["fedavg"][1].text == "3" and cells["fedavg"][2].text == "50.00 (2/3 no data)"
    assert cells["hafedho"][2].text == "0.00 (n=1)"
    assert "fedavg-s1 (empty test set)" in final.note and "fedavg-s2" in final.note
    assert "no test/acc" in final.note
    summary = {r["row"]: r for r in summary_rows(section)}
    assert summary["fedavg"]["final_mean"] == pytest.approx(0.5) and summary["fedavg"]["finished"] == 1
    assert summary["fedavg"]["no_data"] == 2


def test_seeds_of_different_lengths_are_pooled_and_said_so(tmp_path: Path) -> None:
    """``rounds`` is the horizon, not an axis: seeds that ran 2 and 4 rounds are one row, and the note says so."""
    make_run(tmp_path, "fedavg-s0", "fedavg", 0, [0.2, 0.4])
    make_run(tmp_path, "fedavg-s1", "fedavg", 1, [0.2, 0.4, 0.5, 0.6])
    (section,) = load_sections(tmp_path)
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert [r[1].text for r in final.rows] == ["2"]
    assert "seeds of different lengths pooled (rounds): fedavg 2, 4" in final.note


def test_verdict_rule_by_hand() -> None:
    """A difference counts only above the larger std over >= 3 seeds; the twin decides 'holds' vs 'momentum'."""
    from hafedho.report.study import Study
    from hafedho.report.tables.verdict import FAILS, HOLDS, MATCHES, TIE, matches_text, verdict

    own, base = Stat([0.80, 0.81, 0.82], 3), Stat([0.70, 0.71, 0.72], 3)  # std 0.01, gap 0.10
    assert verdict(own, base, None) == HOLDS and verdict(base, own, None) == FAILS
    assert verdict(own, base, Stat([0.60, 0.61, 0.62], 3)) == HOLDS
    assert verdict(own, base, Stat([0.80, 0.805, 0.81], 3)) == MATCHES
    twin = matches_text(Study.of({"study": PAPER}))  # the paper study's words: its momentum twin
    assert verdict(own, base, Stat([0.80, 0.805, 0.81], 3), twin) == twin
    assert twin == "holds, but the twin matches it (the gain is server momentum)"
    assert verdict(own, Stat([0.70, 0.80, 0.90], 3), None) == TIE  # gap 0.01 < std 0.1
    assert verdict(Stat([0.9, 0.9], 2), base, None).startswith("not judged: 2 seeds")


def test_verdict_table_from_hand_made_runs(tmp_path: Path) -> None:
    """HaFedHo > FedAvg by far more than the spread, the twin within it: the verdict names server momentum; neither
    the centralised reference nor a row running HaFedHo itself (Proposition 1's ideal) is ever the best baseline."""
    runs = []
    accs = {"hafedho": 0.80, "fedavg": 0.70, "hafedho-twin": 0.795, "centralized": 0.95, "exact": 0.97}
    for label, acc in accs.items():
        alg = {"hafedho-twin": "fedavgm", "centralized": "fedavg", "exact": "hafedho"}.get(label, label)
        for s in range(3):
            name = f"{label}-s{s}"
            make_run(tmp_path, name, alg, s, [acc - 0.2, acc + 0.005 * s])
            entry = {"dir": name, "label": label, "seed": s, "point": {}, "reference": label == "centralized"}
            runs.append(entry)
    index = SweepIndex("t1", "cpu", "hand-made", [], [], {"last": 1, "study": PAPER})
    index.runs, index.derived = [IndexEntry(**r) for r in runs], TWIN_ROWS  # as twin_of writes it
    index.write(tmp_path)
    (section,) = load_sections(tmp_path)
    tables = {t.slug: t for t in section_tables(section)}
    (row,) = tables["verdict"].rows
    assert [c.text for c in row[1:]] == [
        "80.50 ± 0.50",
        "fedavg: 70.50 ± 0.50",
        "80.00 ± 0.50",
        "holds, but the twin matches it (the gain is server momentum)",
    ]


def test_momentum_twin_rows_and_notes(tmp_path: Path) -> None:
    """A table1-like sweep with HaFedHo's momentum twin (``hafedho sweep`` lists it as a row of its own, label
    hafedho-twin, with the index's ``twins``): the row reads "FedAvgM, β = λμ", sits beside HaFedHo, competes for
    bold, is no "best baseline" and has its own lead row; the sweep's notes (cells with no twin) follow the table."""
    runs = []
    curves = {  # final = mean of the last 2 evaluations, seeds 0 and 1: + 0.02 * seed
        ("hafedho", "digits"): [0.5, 0.6, 0.7],
        ("hafedho-twin", "digits"): [0.5, 0.7, 0.8],
        ("fedavg", "digits"): [0.4, 0.5, 0.6],
        ("hafedho", "synth"): [0.3, 0.5, 0.5],
        ("hafedho-twin", "synth"): [0.3, 0.4, 0.4],
        ("fedavg", "synth"): [0.2, 0.4, 0.4],
    }
    for (label, ds), accs in curves.items():
        for s in range(2):
            name = f"{label}-{ds}-s{s}"
            alg, hyper = {"hafedho": ("hafedho", {"mu": 0.05}), "fedavg": ("fedavg", {})}.get(
                label, ("fedavgm", {"beta": 0.5, "server_lr": 1.0, "weighting": "uniform"})
            )
            make_run(tmp_path, name, alg, s, [a + 0.02 * s for a in accs], data={"source": ds}, hyper=hyper)
            point = {"dataset": ds, "algorithm.name": "hafedho" if label != "fedavg" else "fedavg"}
            runs.append({"dir": name, "label": label, "seed": s, "point": point})
    note = 'no hafedho-twin for hafedho [dataset=synth, accumulate=f]: gradient rectification (accumulate = "f")'
    entries = [IndexEntry(**r) for r in runs]
    axes = ["dataset", "algorithm.name"]
    index = SweepIndex("t1", "cpu", "hand-made", axes, ["algorithm.name"], {"last": 2, "study": PAPER}, entries)
    index.derived, index.notes = TWIN_ROWS, [note]
    index.write(tmp_path)
    files = write_report(tmp_path, tmp_path / "rep")
    (section,) = load_sections(tmp_path)
    tables = {t.slug: t for t in section_tables(section)}
    final = [[c.text for c in r] for r in tables["final"].rows]
    assert final == [
        ["hafedho", "66.00 ± 1.41", "51.00 ± 1.41"],
        ["FedAvgM, β = λμ", "76.00 ± 1.41", "41.00 ± 1.41"],
        ["fedavg", "56.00 ± 1.41", "41.00 ± 1.41"],
        ["HaFedHo lead over best baseline (pp)", "+10.00", "+10.00"],  # the twin is not a baseline ...
        ["HaFedHo lead over its twin (pp)", "-10.00", "+10.00"],  # ... it has its own lead row
    ]
    assert [c.bold for c in tables["final"].rows[1]] == [False, True, False]  # but it competes for bold
    assert tables["final"].note.endswith(f"docs/algorithms.md, HaFedHo's momentum twin)\n{note}")
    md = files.markdown.read_text()
    assert f"> {note}" in md and "| FedAvgM, β = λμ | **76.00 ± 1.41** | 41.00 ± 1.41 |" in md
    assert (
        "FedAvgM, $\\beta$ = $\\lambda\\mu$ & \\textbf{76.00 $\\pm$ 1.41}"
        in (tmp_path / "rep" / "final.tex").read_text()
    )
    rows = {r["row"] for r in csv.DictReader((tmp_path / "rep" / "summary.csv").open())}
    assert rows == {"hafedho", "FedAvgM, β = λμ", "fedavg"}


def test_momentum_twin_rows_split_by_beta_along_a_mu_axis(tmp_path: Path) -> None:
    """A fig3-like sweep: one column and HaFedHo's mu axis, so beta varies within it and splits the twin's rows
    ("FedAvgM, β = λμ = 0.1"); the accuracy-vs-mu figure draws the twin at mu = beta / lambda."""
    root = tmp_path
    runs = []
    for mu, beta, v, w in ((0.01, 0.1, 0.6, 0.55), (0.05, 0.5, 0.7, 0.72)):
        point = {"algorithm.name": "hafedho", "algorithm.hafedho.mu": mu}
        make_run(root, f"h{mu}", "hafedho", 0, [v], hyper={"mu": mu})
        make_run(root, f"t{mu}", "fedavgm", 0, [w], hyper={"beta": beta, "weighting": "uniform"})
        runs += [
            {"dir": f"h{mu}", "label": "hafedho", "seed": 0, "point": point},
            {"dir": f"t{mu}", "label": "hafedho-twin", "seed": 0, "point": point},
        ]
    axes = ["algorithm.name", "algorithm.hafedho.mu"]
    index = SweepIndex("f3", "cpu", "", axes, axes, {"last": 1, "study": PAPER})
    index.runs, index.derived = [IndexEntry(**r) for r in runs], TWIN_ROWS
    index.write(root)
    (section,) = load_sections(root)
    final = {r[0].text: r[2].text for r in section_tables(section)[0].rows}
    assert final == {
        "hafedho mu=0.01": "60.00",
        "hafedho mu=0.05": "70.00",
        "FedAvgM, β = λμ = 0.1": "55.00",
        "FedAvgM, β = λμ = 0.5": "72.00",
    }
    lay = Layout.of(section)  # HaFedHo's accuracy-vs-mu figure draws the twin at mu = beta / lambda (lambda = 10)
    points = derived_points(lay, "hafedho", "mu", lay.columns[0])
    assert list(points) == ["FedAvgM, β = λμ"]
    assert points["FedAvgM, β = λμ"] == [pytest.approx((0.01, 55.0, 0.0)), pytest.approx((0.05, 72.0, 0.0))]
    assert derived_points(lay, "hafedho", "accumulate", lay.columns[0]) == {}
    figures = {f.name for f in write_report(root, root / "rep").figures}
    assert {"hafedho_vs_mu.png", "hafedho-twin_vs_beta.png"} <= figures


def test_a_run_extended_by_another_preset_reads_at_its_sweeps_horizon(tmp_path: Path) -> None:
    """rounds is a horizon, not identity: a 30-round table's run later extended to 300 by converge (here 3 -> 6),
    or stopped after the horizon (diverged at 6, interrupted at 5), reads as it was at round 3, finished."""
    runs = []
    for name, status, accs in (
        ("ext", "done", [0.1, 0.2, 0.3, 0.9, 0.9, 0.9]),
        ("div", "diverged", [0.1, 0.2, 0.4, 0.9, 0.9]),
        ("cut", "incomplete", [0.1, 0.2, 0.5, 0.9, 0.9]),
        ("short", "diverged", [0.1, 0.2]),
    ):
        make_run(tmp_path, name, "fedavg", 0, accs, status=status, data={"q": {"ext": 0.1, "div": 0.2}.get(name, 0.5)})
        runs.append({"dir": name, "label": name, "seed": 0, "point": {}, "rounds": 3})
    write_index(tmp_path, "t", runs, {"last": 1}, [])
    (section,) = load_sections(tmp_path)
    by = {g.label: g.runs[0] for g in section.groups}
    assert [len(by[k].rows) for k in ("ext", "div", "cut")] == [3, 3, 3]
    assert [by[k].status for k in ("ext", "div", "cut", "short")] == ["done", "done", "done", "diverged"]
    assert [by[k].evals("test/acc")[-1][1] for k in ("ext", "div", "cut")] == [0.3, 0.4, 0.5]
    assert by["ext"].config["rounds"] == 3


def test_hyperparameters_read_defaults_as_values() -> None:
    """A run that leaves a setting at its default reads as that value, so a row never says ``nesterov=None``."""
    from hafedho.report.runs import hyperparameters

    hyper = hyperparameters({"algorithm": {"name": "fedavgm", "lr": 0.05, "fedavgm": {"beta": 0.5}}})
    assert hyper["beta"] == 0.5 and hyper["lr"] == 0.05 and hyper["nesterov"] is False and hyper["server_lr"] == 1.0
    assert hyperparameters({"algorithm": {"name": "no-such-algorithm"}}) == {}


def test_a_reference_labels_figure_is_a_plain_file_and_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user algorithm's row (label ``mymod:MyAlg``) split by a hyperparameter: its figure's file name and its link
    in results.md hold no ':' (which a Markdown viewer reads as a URL scheme), as run directories do."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "mymod.py").write_text(
        "from dataclasses import dataclass\nfrom hafedho.algorithms import FedAvg\nfrom hafedho.core import hp\n\n\n"
        "@dataclass(frozen=True, kw_only=True)\nclass MyAlg(FedAvg):\n    name = 'myalg'\n"
        "    beta: float = hp(0.0, 'a knob')\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    for i, beta in enumerate((0.1, 0.5)):
        for s in (0, 1):
            d = make_run(tmp_path / "runs", f"u-{i}-s{s}", "mymod:MyAlg", s, [0.2, 0.3 + beta])
            cfg = d / "config.toml"  # a resolved config holds a user algorithm's settings in [algorithm]
            cfg.write_text(cfg.read_text().replace("lr = 0.05", f"lr = 0.05\nbeta = {beta}"))
    files = write_report(tmp_path / "runs", tmp_path / "rep")
    assert "mymod.MyAlg_vs_beta.png" in [f.name for f in files.figures]
    assert "![mymod.MyAlg_vs_beta](mymod.MyAlg_vs_beta.png)" in files.text
    assert figure_name("a:b/c d-e_f.g") == "a.b_c_d-e_f.g"
