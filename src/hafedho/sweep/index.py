"""The sweep index ``OUT/sweeps/PRESET.json``: the runs of a preset's latest sweep, for ``hafedho report``."""

from __future__ import annotations

from pathlib import Path

from hafedho.sweep.expand import RunSpec
from hafedho.sweep.presets import Preset, row_axes


def write_index(preset: Preset, specs: list[RunSpec], out: str | Path, failed: dict[str, str] | None = None) -> Path:
    """``OUT/sweeps/PRESET.json``: the preset's runs (label, grid point, seed) and report settings."""
    from hafedho.results import write_json

    path = Path(out) / "sweeps" / f"{preset.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    index = {
        "preset": preset.name,
        "scale": preset.scale,
        "description": preset.description,
        "axes": list(preset.grid),
        "row_axes": row_axes(preset),
        "report": preset.report,
        "runs": [s.index_entry() for s in specs],
        "failed": failed or {},
    }
    write_json(path, index)
    return path
