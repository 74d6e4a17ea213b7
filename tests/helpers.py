"""Shared test helpers: the smoke config, a smoke run through the CLI, metrics rows without wall time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hafedho.cli import main
from hafedho.config import CONFIG_DIR, Config, load_config
from hafedho.core import ClientData

SMOKE = CONFIG_DIR / "smoke.toml"


def smoke_config(tmp: Path, *overrides: str, alg: str | None = None) -> Config:
    """The smoke config with ``algorithm.name=alg`` (when given) then ``overrides`` applied, writing under ``tmp``."""
    cfg = load_config(SMOKE, [*([f"algorithm.name={alg}"] if alg is not None else []), *overrides])
    cfg.out = str(tmp)
    return cfg


def run_smoke(out: Path, *args: str) -> int:
    """``hafedho run smoke --out OUT --quiet ARGS...``; its exit code."""
    return main(["run", "smoke", "--out", str(out), "--quiet", *args])


# What every metrics row has beside its round (hafedho.runfiles.REQUIRED_KEYS), for rows written by hand.
BASE = {"cohort_size": 3, "wall_s": 0.1, "bytes_up": 8, "bytes_down": 8}


def no_wall(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without ``wall_s``: the one column that differs between identical runs."""
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


# The smoke setting (digits, 10 clients, logreg) as a preset's [base.*] tables, for the test presets written by hand.
SMOKE_PRESET_TABLES = """
[base.data]
source = "digits"
partition = "dirichlet"
q = 0.5
num_clients = 10

[base.clients]
local_steps = 3
batch_size = 16

[base.sampling]
fraction = 0.3

[base.model]
name = "logreg"
"""


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` grown to ``size`` along its first dimension with copies of its last slice."""
    extra = size - t.shape[0]
    return t if not extra else torch.cat([t, t[-1:].expand(extra, *t.shape[1:])])


def _stack(datas: list[ClientData]) -> ClientData:
    steps = max(d.x.shape[0] for d in datas)
    masks = [torch.cat([d.mask, d.mask.new_zeros(steps - d.mask.shape[0], *d.mask.shape[1:])]) for d in datas]
    return ClientData(
        torch.stack([_grow(d.x, steps) for d in datas]),
        torch.stack([_grow(d.y, steps) for d in datas]),
        torch.stack(masks),
    )


def stack_data(datas: list[ClientData]) -> ClientData:
    """The reference for ``FederatedData.cohort_data``: per-client ``ClientData`` stacked ``[c, S, B, ...]``, clients
    with fewer steps padded by repeats of their last step, masked out (``full`` likewise, when present)."""
    out = _stack(datas)
    if any(isinstance(d.full, ClientData) for d in datas):
        out = out._replace(full=_stack([d.full for d in datas]))
    return out
