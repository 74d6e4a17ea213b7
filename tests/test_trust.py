"""The trust model of ``module:Name`` references (``hafedho.core.refs``): a reference names the user's own code,
never the standard library's, and its kind is checked before it is called; the working directory is never
searched; ``hafedho report`` imports what a results folder names only from installed plugins, or with
``--allow-code``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMOKE, SMOKE_PRESET_TABLES
from test_report import make_run

from hafedho.cli import main
from hafedho.config import ConfigError
from hafedho.core.refs import import_reference, trusting
from hafedho.sweep.index import IndexEntry, SweepIndex

REPO = Path(__file__).resolve().parents[1]
STDLIB = ["os:system", "subprocess:getoutput", "builtins:eval", "posix:system", "shutil:rmtree"]
OWN_CODE = "a reference must name your own code, not the standard library's"


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hafedho: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's module on ``sys.path`` that re-exports standard-library callables and defines a dict and a
    non-function callable; forgotten after the test."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "reexports.py").write_text(
        "from os import system\nfrom subprocess import Popen\nSTUDY = {'own': 'fedavg'}\nSTEP = print\n\n\n"
        "class Callable:\n    def __call__(self, cfg):\n        return None, ''\n\n\nCALL = Callable()\n"
    )
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "reexports", raising=False)
    yield code
    sys.modules.pop("reexports", None)


@pytest.mark.parametrize("ref", STDLIB)
def test_a_standard_library_data_source_is_refused_before_it_is_called(
    ref: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """issue 33: ``data.source=os:system data.path='touch FILE'`` created FILE; now one line, nothing called."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "FILE"
    args = ["run", "smoke", f"data.source={ref}", f"data.path=touch {marker}", "--out", str(tmp_path / "o"), "--quiet"]
    assert main(args) == 2
    err = one_line_error(capsys)
    assert f"data.source={ref!r}: {OWN_CODE}" in err and "name a function or class" in err
    assert not marker.exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "override",
    ["algorithm.name=os:system", "model.name=subprocess:getoutput", "engine=builtins:eval", "engine=posix:system"],
)
def test_a_standard_library_reference_is_refused_for_every_key(
    override: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, ref = override.split("=")
    assert main(["run", "smoke", override, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert f"{key}={ref!r}: {OWN_CODE}" in one_line_error(capsys)
    assert not (tmp_path / "o").exists()


def test_a_standard_library_reference_in_a_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same from a TOML config: the reference is text wherever it is written."""
    marker = tmp_path / "FILE"
    cfg = tmp_path / "evil.toml"
    smoke = SMOKE.read_text()
    cfg.write_text(smoke.replace('source = "digits"', f'source = "subprocess:getoutput"\npath = "touch {marker}"'))
    assert main(["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert f"data.source='subprocess:getoutput': {OWN_CODE}" in one_line_error(capsys)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.source=reexports:system", "(it is posix.system)"),  # `from os import system` in the user's module
        ("algorithm.name=reexports:Popen", "(it is subprocess.Popen)"),
        ("model.name=reexports:STEP", "(it is builtins.print)"),
        ("model.name=reexports:CALL", "Callable is not an nn.Module factory"),  # callable, yet no class or def
        ("data.source=reexports:CALL", "Callable is not a data source"),
        ("engine=reexports:STUDY", "names an object of type dict, not a class"),
    ],
)
def test_what_a_users_module_imported_or_is_no_kind_of_the_key_is_refused(
    override: str, expected: str, user_code: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = expected.replace("posix", "posix" if sys.platform != "win32" else "nt")
    assert main(["run", "smoke", override, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert expected in one_line_error(capsys)


@pytest.mark.parametrize("derive", ["os:system", "reexports:system", "reexports:CALL"])
def test_a_presets_standard_library_derive_is_refused(
    derive: str, user_code: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep preset's derived row: ``derive`` must be a ``def`` of the user's, checked before the sweep runs."""
    preset = tmp_path / "evil.toml"
    preset.write_text(
        'description = "a derived row"\nseeds = 1\n\n[base]\nrounds = 1\n'
        + SMOKE_PRESET_TABLES
        + '\n[base.algorithm]\nname = "fedavg"\nlr = 0.1\n\n[grid]\n"algorithm.name" = ["fedavg"]\n\n'
        + f'[[variants]]\nlabel = "shadow"\nof = "fedavg"\nderive = "{derive}"\n'
    )
    assert main(["sweep", str(preset), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = one_line_error(capsys)
    assert "evil.toml: variants[0]: derive" in err and repr(derive) in err
    assert (OWN_CODE in err) if derive != "reexports:CALL" else ("is not a function of the run's config" in err)


def test_the_working_directory_is_never_searched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A module beside the user (the working directory) is not imported by the ``hafedho`` command (``python -P``
    is what the installed script does): the user puts it on PYTHONPATH, and then it is."""
    (tmp_path / "cwdmod.py").write_text(
        "from hafedho.algorithms import FedAvg\n\n\nclass Mine(FedAvg):\n    name = 'mine'\n"
    )
    cmd = [sys.executable, "-P", "-m", "hafedho", "run", "smoke", "algorithm.name=cwdmod:Mine", "rounds=1"]
    env = {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([*cmd, "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "module 'cwdmod' not found; make its package importable" in proc.stderr
    env["PYTHONPATH"] += f"{os.pathsep}{tmp_path}"
    proc = subprocess.run([*cmd, "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------ hafedho report


EVIL = "from pathlib import Path\nPath(__file__).with_name('MARKER').write_text('ran')\nREPORT = {'own': 'fedavg'}\n"


@pytest.fixture
def shared_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A results folder from someone else: a sweep index naming ``report.study = "evilmod:REPORT"`` and, beside
    it, ``evilmod.py``, which writes MARKER when imported. The user reports from inside it."""
    root = tmp_path / "shared"
    for s in (0, 1):
        make_run(root, f"fedavg-s{s}", "fedavg", s, [0.2, 0.3, 0.4])
    entries = [IndexEntry(dir=f"fedavg-s{s}", label="fedavg", seed=s, point={}, rounds=3) for s in (0, 1)]
    SweepIndex("shared", "cpu", "", [], [], {"last": 1, "study": "evilmod:REPORT"}, entries).write(root)
    (root / "evilmod.py").write_text(EVIL)
    monkeypatch.chdir(root)
    monkeypatch.delitem(sys.modules, "evilmod", raising=False)
    yield root
    sys.modules.pop("evilmod", None)


def test_report_imports_no_code_a_results_folder_names(
    shared_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not even with the folder on sys.path (``python -m hafedho`` from it puts it there): one line naming the
    folder, the reference and the flag; no marker, no report."""
    monkeypatch.syspath_prepend(str(shared_folder))
    assert main(["report", ".", "--out", "rep"]) == 2
    err = one_line_error(capsys)
    assert "report.study='evilmod:REPORT', named in results folder '.'" in err
    assert "'evilmod' is not; if you trust it, pass --allow-code evilmod" in err
    assert not (shared_folder / "MARKER").exists() and not (shared_folder / "rep" / "results.md").exists()


def test_report_imports_what_the_user_allows(
    shared_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--allow-code evilmod``, with the folder on PYTHONPATH as a user puts it: imported, the report is written."""
    monkeypatch.syspath_prepend(str(shared_folder))
    assert main(["report", ".", "--out", "rep", "--allow-code", "other", "--allow-code", "evilmod"]) == 0
    assert (shared_folder / "MARKER").read_text() == "ran" and (shared_folder / "rep" / "results.md").exists()


def test_report_reads_a_refused_runs_algorithm_without_importing_it_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's ``algorithm.name = "evilmod:Alg"``: the report reads its rows without the algorithm's defaults and
    says on stderr what it did not import."""
    root = tmp_path / "shared"
    make_run(root, "evil-s0", "evilmod:Alg", 0, [0.2, 0.3])
    (root / "evilmod.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "evilmod", raising=False)
    assert main(["report", str(root), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert (
        err.startswith("hafedho: note: algorithm.name='evilmod:Alg', named in results folder") and err.count("\n") == 1
    ), err
    assert not (root / "MARKER").exists()


def test_installed_plugins_and_hafedho_are_trusted_in_a_results_folder() -> None:
    """The paper study (an installed plugin), also under its old name (``renamed``), and hafedho itself resolve
    inside ``trusting``; anything else is refused, with its line kept for the caller."""
    with trusting("runs", ["mine"]) as refused:
        for ref in ("hafedho_paper.study:REPORT", "hafedho.paper.study:REPORT", "hafedho.report.study:KEYS"):
            assert import_reference("report.study", ref, ConfigError)
        with pytest.raises(ConfigError, match=r"named in results folder 'runs': .* pass --allow-code theirs"):
            import_reference("report.study", "theirs.report:REPORT", ConfigError)
        with pytest.raises(ConfigError, match="module 'mine' not found"):  # allowed: imported, here missing
            import_reference("report.study", "mine.x:Y", ConfigError)
    assert len(refused) == 1 and "theirs.report:REPORT" in refused[0]
    with pytest.raises(ConfigError, match="pass --allow-code zzz"):  # read from a folder outside trusting: plugins
        import_reference("report.study", "zzz:Y", ConfigError, from_folder=True)
