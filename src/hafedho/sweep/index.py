"""The sweep index ``OUT/sweeps/PRESET.json``: the runs of a preset's latest sweep, for ``hafedho report``.

This module is the one owner of the format: ``hafedho sweep`` writes it (``write_index``), the report reads it
(``read_index``, ``find_indexes``). An index names each run's directory (relative to the folder that holds
``sweeps/``), its row label, grid point, seed and whether it is a reference, plus the preset's axes, the axes that
are rows, its ``[report]`` settings, the runs that failed in the latest sweep, its derived rows (label -> the row it
sits beside and the function's reference) and notes for the report (e.g. why a cell has no derived run). A key
the format does not have (an index of an older or newer version, e.g. one written before derived rows named their
function) is refused in one line rather than read wrongly: a sweep of the preset rewrites the index.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hafedho.config import ConfigError
from hafedho.runfiles import write_json
from hafedho.sweep.presets import Preset, row_axes
from hafedho.toml_io import parse_override

if TYPE_CHECKING:  # a type only: the report reads indexes without loading the expansion
    from hafedho.sweep.expand import RunSpec

INDEX_DIR = "sweeps"


@dataclass
class IndexEntry:
    """One run of a sweep; ``label`` None (a hand-made index) means the run's algorithm."""

    dir: str
    label: str | None = None
    seed: int | None = None
    point: dict[str, Any] = field(default_factory=dict)
    reference: bool = False
    rounds: int | None = None  # the sweep's horizon for this run: the report reads its rows up to it (None: all)


@dataclass
class SweepIndex:
    preset: str
    scale: str | None = None
    description: str = ""
    axes: list[str] = field(default_factory=list)
    row_axes: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    runs: list[IndexEntry] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # run directory name -> its one-line failure
    derived: dict[str, dict[str, str]] = field(default_factory=dict)  # label -> {"of": row label, "derive": ref}
    notes: list[str] = field(default_factory=list)  # lines shown under the section's tables

    def write(self, out: str | Path) -> Path:
        """Write ``OUT/sweeps/PRESET.json`` (atomically) and return its path."""
        path = index_path(out, self.preset)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dataclasses.asdict(self))
        return path


def index_path(out: str | Path, preset: str) -> Path:
    return Path(out) / INDEX_DIR / f"{preset}.json"


def find_indexes(root: str | Path) -> list[Path]:
    """Every sweep index under ``root``, at any depth, in path order."""
    return sorted(Path(root).rglob(f"{INDEX_DIR}/*.json"))


def runs_folder(path: Path) -> Path:
    """The folder an index's run directories are relative to: the one holding its ``sweeps/``."""
    return path.parent.parent


def read_index(path: Path) -> SweepIndex:
    """An index file; missing keys take their defaults (the preset's name is then the file's); unknown keys are
    refused (module docstring)."""
    data = json.loads(path.read_text())
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(SweepIndex)})
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)} (written by another version of hafedho); run "
            f"`hafedho sweep {data.get('preset', path.stem)} --out {runs_folder(path)}` to rewrite it "
            "(finished runs are kept and skipped)"
        )
    return SweepIndex(
        preset=str(data.get("preset", path.stem)),
        scale=data.get("scale"),
        description=str(data.get("description", "")),
        axes=list(data.get("axes", [])),
        row_axes=list(data.get("row_axes", [])),
        report=dict(data.get("report", {})),
        runs=[
            IndexEntry(
                dir=e["dir"],
                label=e.get("label"),
                seed=e.get("seed"),
                point=dict(e.get("point", {})),
                reference=bool(e.get("reference", False)),
                rounds=e.get("rounds"),
            )
            for e in data.get("runs", [])
        ],
        failed=dict(data.get("failed", {})),
        derived={str(k): {"of": str(v["of"]), "derive": str(v["derive"])} for k, v in data.get("derived", {}).items()},
        notes=list(data.get("notes", [])),
    )


def changing_overrides(preset: Preset, overrides: Iterable[str]) -> list[str]:
    """The overrides that change the preset's runs. One that narrows a grid axis to some of its own values only
    selects which runs a sweep runs, so the index still lists the whole preset (the report shows the rest as not
    run) and a partial sweep never drops the runs of another from the report."""
    changing = []
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        values = preset.grid.get(key)
        if values is not None:
            value: Any = parse_override(text)
            for part in key.split("."):
                value = value[part]
            if all(v in values for v in (value if isinstance(value, list) else [value])):
                continue
        changing.append(text)
    return changing


def write_index(preset: Preset, specs: list[RunSpec], out: str | Path, failed: dict[str, str] | None = None) -> Path:
    """``OUT/sweeps/PRESET.json``: the preset's runs (label, grid point, seed, horizon; a run that stands for several
    rows or points, once per row label and point), report settings, derived rows and notes."""
    index = SweepIndex(
        preset=preset.name,
        scale=preset.scale,
        description=preset.description,
        axes=list(preset.grid),
        row_axes=row_axes(preset),
        report=preset.report,
        runs=[
            IndexEntry(s.name, lab, s.seed, point, s.reference, rounds)
            for s in specs
            for point, rounds in ((s.point, s.rounds or s.cfg.rounds), *s.views)
            for lab in (s.label, *s.aliases)
        ],
        failed=failed or {},
        derived=preset.derived,
        notes=list(dict.fromkeys(s.note for s in specs if s.note)),  # one line per cell, not per seed
    )
    return index.write(out)
