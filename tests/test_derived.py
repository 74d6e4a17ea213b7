"""The generic extension points the paper's study stands on, used by a method of one's own on hand-made inputs:
a derived row (``[[variants]]`` with ``of`` and ``derive``, a function named by reference) and the report's study
settings (``[report] own``, ``reference``, ``[report.derived]``). The paper's own use of them (HaFedHo's momentum
twin) is tests/test_twin.py, tests/test_sweep.py and tests/test_report.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_report import make_run
from test_sweep import tiny

from hafedho.config import Config, ConfigError
from hafedho.report.runs import load_sections
from hafedho.report.study import Study
from hafedho.report.tables import section_tables
from hafedho.sweep.expand import expand
from hafedho.sweep.index import IndexEntry, SweepIndex, read_index, write_index
from hafedho.sweep.presets import load_preset

DERIVE = "test_derived:with_momentum"


def with_momentum(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """A user's derived row: a FedAvg run's FedAvgM twin with beta = 0.5, none for any other algorithm."""
    alg = cfg.selected_algorithm()
    if alg.name != "fedavg":
        return None, f"{alg.name} has no momentum shadow"
    return {"name": "fedavgm", "lr": alg.lr, "fedavgm": {"beta": 0.5}}, ""


def shadow_preset(tmp: Path, derive: str = DERIVE) -> Any:
    extra = f'\n[[variants]]\nlabel = "shadow"\nof = "fedavg"\nderive = "{derive}"\n'
    return load_preset(str(tiny(tmp, grid='"algorithm.name" = ["fedavg", "fedprox"]', extra=extra)))


def test_a_derived_row_of_ones_own(tmp_path: Path) -> None:
    """Beside every run of the row ``of`` names, one run from ``derive(cfg)``: that run's config with the returned
    ``[algorithm]``, named as any run of its algorithm; the index keeps the row and its reference."""
    preset = shadow_preset(tmp_path)
    specs = expand(preset, seeds=2)
    assert [s.label for s in specs] == ["fedavg", "shadow", "fedavg", "shadow", "fedprox", "fedprox"]
    for base, der in zip(specs[0:4:2], specs[1:4:2], strict=True):
        assert der.name.startswith("fedavgm-") and der.seed == base.seed and der.point == base.point
        assert der.cfg.algorithm == {"name": "fedavgm", "lr": 0.1, "fedavgm": {"beta": 0.5}}
    assert preset.derived == {"shadow": {"of": "fedavg", "derive": DERIVE}}
    index = read_index(write_index(preset, specs, tmp_path / "runs"))
    assert index.derived == preset.derived and index.notes == []


def test_a_derived_row_says_why_a_run_has_none(tmp_path: Path) -> None:
    """``of`` the fedprox row: the function refuses every run, and each cell gets a note, never a run."""
    preset = shadow_preset(tmp_path)
    preset.table["variants"][0]["of"] = "fedprox"
    specs = expand(preset, seeds=1)
    assert [s.label for s in specs] == ["fedavg", "fedprox"]
    assert specs[1].note == "no shadow for fedprox []: fedprox has no momentum shadow"


@pytest.mark.parametrize(
    ("derive", "match"),
    [
        ("test_derived:nothing_here", "has no attribute 'nothing_here'"),
        ("no_such_module_here:f", "module 'no_such_module_here' not found"),
        ("test_derived:DERIVE", "is not a function of the run's config"),
        ("not a reference", "a reference reads 'package.module:Name'"),
    ],
)
def test_a_bad_derive_reference_is_one_line(tmp_path: Path, derive: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        expand(shadow_preset(tmp_path, derive), seeds=1)


def test_a_removed_sugar_and_an_old_index_are_refused_in_one_line(tmp_path: Path) -> None:
    """The old sugar for the paper's derived row (a variant with ``twin_of`` and no ``derive``) is an ordinary
    variant with an unknown key now; an index with a key of another version is refused, naming the fix."""
    with pytest.raises(ConfigError, match=r"variants\[0\]: .*allowed keys"):
        expand(load_preset(str(tiny(tmp_path, extra='\n[[variants]]\nlabel = "t"\ntwin_of = "hafedho"\n'))))
    old = tmp_path / "sweeps" / "old.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"preset": "old", "runs": [], "twins": {"hafedho-twin": "hafedho"}}))
    with pytest.raises(ConfigError, match=r"old\.json: unknown key\(s\) twins .* `hafedho sweep old --out "):
        read_index(old)


def test_study_settings_and_the_neutral_default() -> None:
    """A section with no study settings has none (no own row, no derived reading, no added kinds); the paper's
    (``hafedho_paper.study:REPORT``, the plugin) is taken by reference, and an old reference to it still resolves
    through the plugin's ``renamed``; set keys win; own = "" is no study."""
    assert Study.of({}) == Study()
    for ref in ("hafedho_paper.study:REPORT", "hafedho.paper.study:REPORT"):
        paper = Study.of({"study": ref})
        assert (paper.own, paper.own_name, paper.reference, paper.derived.noun) == (
            "hafedho",
            "HaFedHo",
            "fedavg",
            "twin",
        )
        assert set(paper.tables) == set(paper.figures) == {"diagnostics"}
    mine = Study.of({"own": "fedprox", "reference": "fedavg", "derived": {"name": "Shadow", "noun": "shadow"}})
    assert (mine.own, mine.own_name, mine.reference_name, mine.derived.name, mine.derived.note) == (
        "fedprox",
        "fedprox",
        "fedavg",
        "Shadow",
        "",
    )
    assert mine.derived_name("fedprox") == "Shadow" and mine.derived_name("fedavg") == "Shadow (fedavg)"
    with pytest.raises(ConfigError, match=r"report\.derived: unknown key"):
        Study.of({"derived": {"colour": "red"}})


STUDY = {
    "last": 1,
    "own": "fedprox",
    "own_name": "FedProx",
    "reference": "fedavg",
    "reference_name": "FedAvg",
    "derived": {"name": "Shadow", "noun": "shadow", "matches": "it is the shadow's", "note": "the shadow of FedProx"},
}


ACCS = {"fedprox": 0.80, "fedavg": 0.70, "scaffold": 0.60, "shadow": 0.795, "hafedho": 0.9}


def _section(root: Path, report: dict[str, Any], accs: dict[str, float] = ACCS) -> dict[str, Any]:
    runs = []
    for label, acc in accs.items():
        alg = {"shadow": "fedavgm"}.get(label, label)
        for s in range(3):
            make_run(root, f"{label}-s{s}", alg, s, [acc - 0.2, acc + 0.005 * s])
            runs.append(IndexEntry(f"{label}-s{s}", label, s))
    index = SweepIndex("mine", None, "", [], [], report, runs)
    index.derived = {"shadow": {"of": "fedprox", "derive": "my_pkg.rows:shadow"}}
    index.write(root)
    (section,) = load_sections(root)
    return {t.slug: t for t in section_tables(section)}


def test_a_study_of_ones_own_method(tmp_path: Path) -> None:
    """The verdict and the lead rows judge ``own`` (not HaFedHo, here just one more baseline that wins) against
    the best baseline and its derived row, in the study's own words."""
    tables = _section(tmp_path, STUDY)
    (row,) = tables["verdict"].rows
    assert tables["verdict"].header == ["setting", "FedProx", "best baseline", "shadow (Shadow)", "verdict"]
    assert [c.text for c in row[1:]] == [
        "80.50 ± 0.50",
        "hafedho: 90.50 ± 0.50",
        "80.00 ± 0.50",
        "does not hold",
    ]
    final = {r[0].text: r[2].text for r in tables["final"].rows}
    assert final["Shadow"] == "80.00 ± 0.50"
    assert final["FedProx lead over best baseline (pp)"] == "-10.00"
    assert final["FedProx lead over its shadow (pp)"] == "+0.50"
    assert "\nShadow: the shadow of FedProx" in tables["final"].note


def test_a_study_where_own_wins_but_its_derived_row_matches(tmp_path: Path) -> None:
    """Without HaFedHo's runs, FedProx beats the best baseline but not its shadow: the study's wording; rounds'
    automatic targets come from the study's reference."""
    accs = {k: v for k, v in ACCS.items() if k != "hafedho"}
    tables = _section(tmp_path / "a", {**STUDY, "reference": "scaffold"}, accs)
    assert tables["verdict"].rows[0][-1].text == "holds, but the shadow matches it (it is the shadow's)"
    assert "of scaffold's final test accuracy" in tables["rounds"].note
    tables = _section(tmp_path / "b", STUDY, accs)
    assert "of fedavg's final test accuracy" in tables["rounds"].note


def test_own_empty_means_no_study(tmp_path: Path) -> None:
    """``own = ""``: no verdict table, no lead rows; the derived row still reads by its name."""
    tables = _section(tmp_path, {**STUDY, "own": ""})
    assert "verdict" not in tables
    names = [r[0].text for r in tables["final"].rows]
    assert "Shadow (fedprox)" in names and not any("lead" in n for n in names)
