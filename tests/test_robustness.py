"""Protocols: the robustness table from hand-made runs, and the presets' protocol axis as expanded."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import PAPER as PAPER_STUDY
from test_report import make_run

from hafedho.config import ConfigError
from hafedho.report.build import write_report
from hafedho.report.layout import Layout
from hafedho.report.runs import load_sections
from hafedho.report.tables.robustness import ROBUST, robust_verdict, robustness_table
from hafedho.report.tables.verdict import HOLDS, TIE, judge
from hafedho.sweep.expand import expand
from hafedho.sweep.index import IndexEntry, SweepIndex, index_path, read_index, write_index
from hafedho.sweep.presets import load_preset

# final accuracy per (dataset, protocol, row) for seeds 0-2 (one evaluation per run, so final = that value)
FINAL = {
    ("digits", "main"): {"hafedho": 0.60, "feddyn": 0.50, "fedavg": 0.40, "twin": 0.45},
    ("digits", "head"): {"hafedho": 0.50, "feddyn": 0.40, "fedavg": 0.30, "twin": 0.40},
    ("synth", "main"): {"hafedho": 0.60, "feddyn": 0.50, "fedavg": 0.40, "twin": 0.50},
    ("synth", "head"): {"hafedho": 0.50, "feddyn": 0.50, "fedavg": 0.30, "twin": 0.35},  # a tie with FedDyn
}
PAPER = {"study": PAPER_STUDY}  # the paper study's settings, as its presets name them
SPREAD = (-0.01, 0.0, 0.01)  # std 0.01: every gap above is 5+ std, the tie is exact


def protocol_sweep(root: Path, rows: tuple[str, ...] = ("hafedho", "feddyn", "fedavg", "twin")) -> None:
    runs = []
    for (ds, proto), finals in FINAL.items():
        for row, acc in finals.items():
            if row not in rows:
                continue
            alg = "fedavgm" if row == "twin" else row
            label = "hafedho-twin" if row == "twin" else row
            for seed, d in enumerate(SPREAD):
                name = f"{label}-{ds}-{proto}-s{seed}"
                model = {"options": {"projection": 256 if proto == "head" else 0}}
                make_run(root, name, alg, seed, [acc + d], data={"source": ds}, model=model)
                point = {"dataset": ds, "protocol": proto, "algorithm.name": alg}
                runs.append(IndexEntry(name, label, seed, point))
    axes = ["dataset", "protocol", "algorithm.name"]
    twins = {"hafedho-twin": {"of": "hafedho", "derive": "hafedho_paper.twin:momentum_twin"}}
    SweepIndex("table1", "cpu", "hand-made", axes, ["algorithm.name"], PAPER, runs, derived=twins).write(root)


def test_robust_rule() -> None:
    assert robust_verdict({"main": HOLDS, "head": HOLDS}) == ROBUST
    assert robust_verdict({"main": HOLDS, "head": TIE}) == f"not robust: {HOLDS} under main; {TIE} under head"
    assert robust_verdict({"main": HOLDS, "main-long": "not run"}).startswith("not robust")


def test_a_claim_that_fails_in_one_column_is_not_robust(tmp_path: Path) -> None:
    protocol_sweep(tmp_path)
    (section,) = load_sections(tmp_path, last=1)
    (table,) = robustness_table(Layout.of(section))
    assert table.header == ["setting", "main", "head", "twin share, main", "twin share, head", "across protocols"]
    rows = {r[0].text: [c.text for c in r[1:]] for r in table.rows}
    # digits: holds under both; twin share (0.45 - 0.40) / (0.60 - 0.40) = 25%, (0.40 - 0.30) / (0.50 - 0.30) = 50%
    assert rows["digits"] == [HOLDS, HOLDS, "25%", "50%", ROBUST]
    # synth: HaFedHo ties FedDyn under head, so the claim is not robust there: (0.5 - 0.4) / 0.2 = 50%, 0.05 / 0.2
    assert rows["synth"] == [HOLDS, TIE, "50%", "25%", f"not robust: {HOLDS} under main; {TIE} under head"]
    assert rows["all settings"][-1] == f"{ROBUST} in 1 of 2"
    md = write_report(tmp_path, tmp_path / "rep", last=1).markdown.read_text()
    assert "Robustness: table1 (cpu scale)" in md and "| synth | holds | tie |" in md


def test_a_protocol_not_run_yet_is_not_robust(tmp_path: Path) -> None:
    protocol_sweep(tmp_path)
    index = read_index(index_path(tmp_path, "table1"))
    point = {"dataset": "digits", "protocol": "main-long", "algorithm.name": "hafedho"}
    index.runs.append(IndexEntry("hafedho-digits-long-s0", "hafedho", 0, point))  # listed, never started
    index.write(tmp_path)
    (section,) = load_sections(tmp_path, last=1)
    rows = {r[0].text: [c.text for c in r[1:]] for r in robustness_table(Layout.of(section))[0].rows}
    assert rows["digits"][2] == "not run" and rows["digits"][-1].endswith("not run under main-long")


def test_a_section_without_baselines_gets_no_robustness_table(tmp_path: Path) -> None:
    """fig3's shape: HaFedHo and its twin only, under two protocols. There is no baseline to judge against, so the
    table would read "not run" in every column; it is left out, and the verdict table too."""
    protocol_sweep(tmp_path, rows=("hafedho", "twin"))
    (section,) = load_sections(tmp_path, last=1)
    assert robustness_table(Layout.of(section)) == []
    md = write_report(tmp_path, tmp_path / "rep", last=1).markdown.read_text()
    assert "Robustness:" not in md and "Verdict:" not in md and "| hafedho |" in md


@pytest.mark.parametrize("others", ["diverged", "not started"])
def test_a_baseline_that_diverged_in_most_seeds_is_not_the_best(tmp_path: Path, others: str) -> None:
    """FedAvgM's seed 0 scores 0.90, far above HaFedHo; its seeds 1-2 diverged (it failed: FedDyn is the best
    baseline, and HaFedHo beats it) or have not run yet (then the verdict waits: 1 seed is not judged)."""
    runs = []
    for label, acc in (("hafedho", 0.60), ("feddyn", 0.50), ("fedavgm", 0.90)):
        for seed, d in enumerate(SPREAD):
            name = f"{label}-s{seed}"
            if label == "fedavgm" and seed and others == "not started":
                runs.append(IndexEntry(name, label, seed, {"algorithm.name": label}))
                continue
            status = "diverged" if label == "fedavgm" and seed else "done"
            make_run(tmp_path, name, label, seed, [acc + d], status=status)
            runs.append(IndexEntry(name, label, seed, {"algorithm.name": label}))
    SweepIndex("table1", "cpu", "hand-made", ["algorithm.name"], ["algorithm.name"], PAPER, runs).write(tmp_path)
    (section,) = load_sections(tmp_path, last=1)
    (j,) = [judge(Layout.of(section), col) for col in Layout.of(section).columns]
    if others == "diverged":
        assert j.base_label == "feddyn" and j.text == HOLDS
    else:
        assert j.base_label == "fedavgm" and j.text == "not judged: 1 seed (needs 3)"


CURVES = {  # test/acc per round, the same for seeds 0-2; FedAvg's final (last = 1) is 0.40, the 100% target
    "fedavg": [0.1, 0.2, 0.3, 0.4],  # reaches 0.40 at round 4
    "hafedho": [0.2, 0.45, 0.5, 0.5],  # at 2
    "feddyn": [0.1, 0.3, 0.41, 0.5],  # at 3: the fastest baseline that every seed brought there
    "twin": [0.1, 0.3, 0.45, 0.5],  # at 3
}


def test_a_rounds_verdict_judges_fewer_rounds_and_skips_rows_some_seed_never_brought_there(tmp_path: Path) -> None:
    """``[report] verdict = "rounds"`` (Table 2): HaFedHo reaches FedAvg's final accuracy at round 2, FedDyn at 3,
    so it holds; FedProx reaches it at round 1 in two seeds but never in the third, so it is not the fastest.
    Under head the twin reaches it at round 2 too, so there the twin matches HaFedHo."""
    runs = []
    for protocol in ("main", "head"):
        curves = {**CURVES, "fedprox": [0.5, 0.5, 0.5, 0.5]}
        if protocol == "head":
            curves["twin"] = [0.2, 0.45, 0.5, 0.5]
        for label, accs in curves.items():
            alg = "fedavgm" if label == "twin" else label
            name_label = "hafedho-twin" if label == "twin" else label
            for seed in range(3):
                bad = label == "fedprox" and seed == 2
                name = f"{name_label}-{protocol}-s{seed}"
                model = {"options": {"projection": 256 if protocol == "head" else 0}}
                make_run(tmp_path, name, alg, seed, [0.1] * 4 if bad else accs, model=model)
                runs.append(IndexEntry(name, name_label, seed, {"protocol": protocol, "algorithm.name": alg}))
    twins = {"hafedho-twin": {"of": "hafedho", "derive": "hafedho_paper.twin:momentum_twin"}}
    axes = ["protocol", "algorithm.name"]
    SweepIndex(
        "table2", "cpu", "", axes, ["algorithm.name"], {**PAPER, "verdict": "rounds"}, runs, derived=twins
    ).write(tmp_path)
    (section,) = load_sections(tmp_path, last=1)
    lay = Layout.of(section)
    main, head = (judge(lay, col) for col in lay.columns)
    assert main.base_label == "feddyn" and (-main.own.mean, -main.base.mean, -main.derived.mean) == (2, 3, 3)
    assert main.text == HOLDS and head.text.startswith("holds, but the twin matches it")
    (table,) = robustness_table(lay)
    # the twin's share of the rounds HaFedHo saves over FedAvg: (4 - 3) / (4 - 2) = 50% under main, 100% under head
    assert [c.text for c in table.rows[0][1:3]] == [HOLDS, head.text]
    assert [c.text for c in table.rows[0][3:5]] == ["50%", "100%"]
    md = write_report(tmp_path, tmp_path / "rep", last=1).markdown.read_text()
    assert "| main | 2 rounds | feddyn: 3 rounds | 3 rounds | holds |" in md.replace(".0 ± 0.0", "")


def test_an_unknown_verdict_measure_is_one_config_error(tmp_path: Path) -> None:
    protocol_sweep(tmp_path)
    index = read_index(index_path(tmp_path, "table1"))
    index.report = {**PAPER, "verdict": "speed"}
    index.write(tmp_path)
    (section,) = load_sections(tmp_path, last=1)
    with pytest.raises(ConfigError, match=r'report.verdict: .speed. is not a measure; use "final" or "rounds"'):
        robustness_table(Layout.of(section))


def test_protocols_main_head_and_moon_keeps_its_head(tmp_path: Path) -> None:
    """main: no head but MOON's; head: the base's head (the committed runs' names); MOON's two runs are one
    directory, listed under both protocols and read in both columns."""
    preset = load_preset("table1")
    specs = expand(preset, seeds=1, overrides=["dataset=femnist", "data.q=0.3", 'algorithm.name=["hafedho", "moon"]'])
    proj = {(s.label, p["protocol"]): s.cfg.model.options.get("projection") for s in specs for p in _points(s)}
    assert proj[("hafedho", "main")] == 0 and proj[("hafedho", "head")] == 256
    assert proj[("moon", "main")] == proj[("moon", "head")] == 256
    moon = {p["protocol"]: s for s in specs if s.label == "moon" for p in _points(s)}
    assert moon["main"] is moon["head"] and moon["main"].rounds == 30  # one run, read at 30 rounds in both
    assert moon["main-long"].cfg.rounds == 150  # its own run, or (placeholder values) the same run carried on
    entries = read_index(write_index(preset, specs, tmp_path)).runs
    assert {e.point["protocol"] for e in entries if e.label == "moon"} == {"main", "head", "main-long"}
    long = {e.rounds for e in entries if e.point["protocol"] == "main-long"}
    assert long == {150}


@pytest.mark.parametrize("name", ["table1", "converge"])
def test_main_long_reads_the_horizon_tuned_values(name: str) -> None:
    specs = expand(load_preset(name), seeds=1, overrides=["protocol=main-long"])
    hafedho = [s for s in specs if s.label == "hafedho"]
    assert hafedho and all(s.cfg.model.options.get("projection") == 0 for s in hafedho)
    assert {s.rounds for s in hafedho} == {300 if name == "converge" else 150}
    assert any(s.label == "fedavgm" for s in specs)  # the tuned momentum row beside the twin


def _points(spec) -> list[dict]:
    return [spec.point, *(p for p, _ in spec.views)]
