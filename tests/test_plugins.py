"""Plugins (``hafedho.core.plugins``): the paper study is found through its entry point, never imported by name;
a reference written before the study moved out of the library still resolves; a broken plugin is one line."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from hafedho.config import ConfigError
from hafedho.core import plugins as plug
from hafedho.core.plugins import Plugin, PluginError, plugins, renamed
from hafedho.core.refs import import_reference
from hafedho.sweep import presets


def test_the_paper_study_is_an_installed_plugin() -> None:
    import hafedho_paper

    assert plugins()["paper"] is hafedho_paper.PLUGIN and (hafedho_paper.PRESETS / "table1.toml").is_file()
    assert presets.preset_path("table1") == hafedho_paper.PRESETS / "table1.toml"
    assert "table1" in presets.list_presets() and "_common" not in presets.list_presets()


def test_old_references_follow_the_plugin_that_moved_them() -> None:
    from hafedho_paper.twin import momentum_twin

    assert renamed("hafedho.paper.twin") == "hafedho_paper.twin" and renamed("hafedho.paper") == "hafedho_paper"
    assert renamed("hafedho.papers.twin") is None and renamed("hafedho.report") is None
    assert import_reference("derive", "hafedho.paper.twin:momentum_twin", ConfigError) is momentum_twin
    with pytest.raises(ConfigError, match=r"^derive='hafedho\.paper\.nope:f': module 'hafedho\.paper' not found"):
        import_reference("derive", "hafedho.paper.nope:f", ConfigError)  # renamed, and still missing: the old name


class FakeEntryPoint:
    def __init__(self, name: str, value: str, load: object) -> None:
        self.name, self.value, self._load = name, value, load

    def load(self) -> object:
        if isinstance(self._load, Exception):
            raise self._load
        return self._load


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch):
    """Replace the installed entry points by the given ones (the plugin cache cleared before and after)."""

    def use(*eps: FakeEntryPoint) -> None:
        monkeypatch.setattr(metadata, "entry_points", lambda group: list(eps) if group == plug.GROUP else [])
        plugins.cache_clear()

    yield use
    plugins.cache_clear()


def test_a_broken_plugin_is_one_line(entry_points) -> None:
    entry_points(FakeEntryPoint("bad", "bad_pkg:PLUGIN", ImportError("No module named 'torchvision'")))
    with pytest.raises(PluginError, match=r"^plugin 'bad' \(bad_pkg:PLUGIN\) failed to load: ImportError: .*uninstall"):
        plugins()
    entry_points(FakeEntryPoint("odd", "odd_pkg:PLUGIN", {"presets": "x"}))
    with pytest.raises(PluginError, match=r"^plugin 'odd' \(odd_pkg:PLUGIN\) is not a hafedho\.core\.plugins\.Plugin"):
        plugins()
    assert issubclass(PluginError, ConfigError)  # the command prints it as one line


def test_presets_come_from_every_plugin_in_name_order(entry_points, tmp_path: Path) -> None:
    """Two plugins' folders: the first in name order wins a name both have; with none, a preset name is one line."""
    for folder, names in (("a", ["mine", "shared"]), ("b", ["shared", "theirs", "_part"])):
        (tmp_path / folder).mkdir()
        for n in names:
            (tmp_path / folder / f"{n}.toml").write_text("")
    entry_points(
        FakeEntryPoint("zz", "b:P", Plugin(presets=tmp_path / "b")), FakeEntryPoint("aa", "a:P", Plugin(tmp_path / "a"))
    )
    assert presets.list_presets() == ["mine", "shared", "theirs"]
    assert presets.preset_path("shared") == tmp_path / "a" / "shared.toml"
    entry_points()
    with pytest.raises(ConfigError, match=r"^unknown preset 'table1'; installed presets: none \(no plugin"):
        presets.preset_path("table1")
