"""Plugins: packages installed beside the library that add presets, and say where their references moved.

A plugin is an installed distribution with an entry point in the group ``hafedho.plugins`` whose object is a
``Plugin``. The library never imports a plugin by name: it reads the entry points, so a study (the HaFedHo paper's,
``study/hafedho_paper`` in this repository) lives outside ``src/hafedho`` and the library stays generic::

    [project.entry-points."hafedho.plugins"]
    paper = "hafedho_paper:PLUGIN"

What a plugin's code does (algorithms, derived rows, report studies, tables and figures) is named by reference
(``hafedho.core.refs``) from its presets, like any user code; ``Plugin`` only holds what no reference can carry.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from hafedho.core.algorithm import ConfigError

GROUP = "hafedho.plugins"


@dataclass(frozen=True)
class Plugin:
    """What an installed plugin adds.

    ``presets``: a folder of preset files (``NAME.toml``; a leading ``_`` marks a shared part), run by name like
    ``hafedho sweep NAME``. ``renamed``: old module prefix -> new one, so references written before a module
    moved (in a results folder's sweep index, a preset of one's own) still resolve.
    """

    presets: Path | None = None
    renamed: Mapping[str, str] = field(default_factory=dict)


class PluginError(ConfigError):
    """An installed plugin that cannot be loaded (one line, naming the entry point and the fix)."""


@functools.cache
def plugins() -> dict[str, Plugin]:
    """Every installed plugin, by entry-point name (sorted, so the search order never depends on install order)."""
    out = {}
    for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not end every command in its traceback
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}; fix or uninstall it"
            ) from None
        if not isinstance(obj, Plugin):
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) is not a hafedho.core.plugins.Plugin; fix its entry point"
            )
        out[ep.name] = obj
    return out


def preset_folders() -> list[Path]:
    """The installed plugins' preset folders, in ``plugins()`` order."""
    return [p.presets for p in plugins().values() if p.presets is not None]


def renamed(module: str) -> str | None:
    """``module`` under the name a plugin says it moved to, or None (longest old prefix wins)."""
    best = None
    for plugin in plugins().values():
        for old, new in plugin.renamed.items():
            if (module == old or module.startswith(f"{old}.")) and (best is None or len(old) > len(best[0])):
                best = (old, new)
    return None if best is None else best[1] + module[len(best[0]) :]


@functools.cache
def packages() -> frozenset[str]:
    """The installed plugins' top-level packages (``hafedho_paper`` of ``hafedho_paper:PLUGIN``), read from their
    entry points without importing them: the code ``hafedho report`` may import from a results folder
    (``hafedho.core.refs.trusting``)."""
    return frozenset(ep.value.split(":")[0].split(".")[0].strip() for ep in metadata.entry_points(group=GROUP))
