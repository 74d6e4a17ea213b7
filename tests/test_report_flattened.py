"""The final table's "flattened" column (`[report] flattened = true`), from hand-made runs: the
slope of the seed-mean curve over the last 20% of rounds, in points per 100 rounds, computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import make_run, write_index

from hafedho.config import ConfigError
from hafedho.report.build import write_report
from hafedho.report.layout import Layout
from hafedho.report.runs import load_sections
from hafedho.report.stats import trend
from hafedho.report.tables import section_tables

RAMP = [0.05 * k for k in range(1, 17)]  # rounds 5..80 (eval_every 5): both curves rise to 0.8 first
# the last 20% of 100 rounds: rounds 85, 90, 95, 100; seed-mean values in points
FLAT = [60.0, 60.0, 60.1, 60.1]  # slope 0.008 pp/round = +0.8 per 100 rounds (< 1: flattened), se 0.28
RISING = [50.0, 52.0, 54.0, 56.0]  # slope 0.4 pp/round = +40 per 100 rounds, no residual


def seeds(tail: list[float]) -> list[list[float]]:
    """Two seeds whose mean over the tail is ``tail`` (points), spread ± 1 point."""
    return [RAMP + [v / 100 + d for v in tail] for d in (0.01, -0.01)]


def sweep(root: Path, report: dict, short: bool = False) -> None:
    """hafedho (flat) and fedavg (rising), 2 seeds, 100 rounds; with ``short``, a second dataset column of
    15-round runs (3 evaluations: too few in their last 20%)."""
    runs = []
    for alg, tail in (("hafedho", FLAT), ("fedavg", RISING)):
        for s, accs in enumerate(seeds(tail)):
            name = f"{alg}-s{s}"
            make_run(root, name, alg, s, accs, eval_every=5, hyper={"mu": 0.05} if alg == "hafedho" else None)
            runs.append({"dir": name, "label": alg, "seed": s, "point": {"dataset": "digits"}})
            if short:
                name = f"{alg}-short-s{s}"
                make_run(root, name, alg, s, [0.1, 0.2, 0.3], eval_every=5, data={"source": "synth"})
                runs.append({"dir": name, "label": alg, "seed": s, "point": {"dataset": "synth"}})
    write_index(root, "conv", runs, {"title": "C", "last": 2, **report}, ["dataset", "algorithm.name"])


def test_flattened_column_from_a_flat_and_a_rising_curve(tmp_path: Path) -> None:
    sweep(tmp_path, {"flattened": True})
    (section,) = load_sections(tmp_path)
    lay = Layout.of(section)
    groups = {g.label: g for g in section.groups}
    flat, rising = trend(groups["hafedho"], "test/acc"), trend(groups["fedavg"], "test/acc")
    assert flat is not None and rising is not None and flat.evals == rising.evals == 4
    assert flat.slope == pytest.approx(0.8) and flat.se == pytest.approx((0.002 / 2 / 125) ** 0.5 * 100) and flat.flat
    assert rising.slope == pytest.approx(40.0) and rising.se == pytest.approx(0.0, abs=1e-9) and not rising.flat
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert final.header[-1] == "flattened (slope, pp/100 rounds)" and len(lay.columns) == 1
    cells = {row[0].text: [c.text for c in row] for row in final.rows}
    assert cells["hafedho"][-1] == "yes (+0.8 ± 0.3)" and cells["fedavg"][-1] == "no (+40.0 ± 0.0)"
    assert cells["HaFedHo lead over best baseline (pp)"][-1] == ""  # lead row: no slope
    assert "flattened = |slope| < 1 points per 100 rounds" in final.note and "last 20%" in final.note
    md = write_report(tmp_path, tmp_path / "rep").markdown.read_text()
    assert "| yes (+0.8 ± 0.3) |" in md and "| no (+40.0 ± 0.0) |" in md


def test_flattened_per_column_off_by_default_and_a_bad_value(tmp_path: Path) -> None:
    sweep(tmp_path / "on", {"flattened": True}, short=True)
    (section,) = load_sections(tmp_path / "on")
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert final.header == ["algorithm", "digits", "digits: flattened", "synth", "synth: flattened"]
    cells = {row[0].text: [c.text for c in row] for row in final.rows}
    assert cells["hafedho"][2] == "yes (+0.8 ± 0.3)" and cells["fedavg"][2] == "no (+40.0 ± 0.0)"
    assert cells["hafedho"][4] == cells["fedavg"][4] == "—"  # 3 evaluations, 1 in the last 20%: not judged
    lead = cells["HaFedHo lead over best baseline (pp)"]
    assert len(lead) == 5 and lead[2] == lead[4] == "" and lead[1] == "+5.10"
    best = next(t for t in section_tables(section) if t.slug == "best")
    assert best.header == ["algorithm", "digits", "synth"]  # the best table has no such column

    sweep(tmp_path / "off", {})
    (section,) = load_sections(tmp_path / "off")
    final = next(t for t in section_tables(section) if t.slug == "final")
    assert not any("flattened" in h for h in final.header) and "flattened" not in final.note

    sweep(tmp_path / "bad", {"flattened": "yes"})
    (section,) = load_sections(tmp_path / "bad")
    with pytest.raises(ConfigError, match=r"^conv-cpu: report.flattened = 'yes': must be true or false$"):
        section_tables(section)
