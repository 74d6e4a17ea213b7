"""The ``threads`` runtime setting: torch's intra-op threads for a run, applied by ``run`` and restored after it,
the same rule for ``hafedho run`` and sweeps of any ``--jobs``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SMOKE, smoke_config

from hafedho.config import RUNTIME_KEYS, Config, load_config
from hafedho.core import ConfigError
from hafedho.experiment import build
from hafedho.runtime import rounds
from hafedho.sim import runner
from hafedho.sweep import execute as sweep


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records torch's thread count at each evaluation of a run."""
    seen: list[int] = []
    evaluate = rounds.evaluate

    def spying(*args: Any, **kw: Any) -> Any:
        seen.append(torch.get_num_threads())
        return evaluate(*args, **kw)

    monkeypatch.setattr(rounds, "evaluate", spying)
    return seen


def test_threads_is_a_checked_runtime_setting() -> None:
    assert Config().threads == 1 and "threads" in RUNTIME_KEYS
    assert load_config(SMOKE, ["threads=0"]).threads == 0
    with pytest.raises(ConfigError, match=r"^threads=-1: must be >= 0$"):
        load_config(SMOKE, ["threads=-1"])


@pytest.mark.parametrize(("threads", "expected"), [(2, 2), (1, 1), (0, 3)])  # 0: the caller's setting stays
def test_run_uses_its_threads_and_restores_the_callers(
    tmp_path: Path, spy: list[int], threads: int, expected: int
) -> None:
    torch.set_num_threads(3)
    try:
        runner.run(build(smoke_config(tmp_path, f"threads={threads}")), tmp_path / "run", progress=False)
        # 3 evaluations: the initial model's loss (the early blow-up guard) and the 2 evaluation rounds
        assert spy == [expected] * 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)  # as conftest sets it


def test_threads_are_restored_when_a_run_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(rounds, "evaluate", boom)
    with pytest.raises(KeyboardInterrupt):
        runner.run(build(smoke_config(tmp_path, "threads=2")), tmp_path / "run", progress=False)
    assert torch.get_num_threads() == 1


def test_sweep_with_one_job_follows_the_rule_of_many(
    tmp_path: Path, spy: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """threads = 0 shares the cores among the jobs (all of them for one job, as for jobs > 1); a run's own
    threads replace that."""
    monkeypatch.setattr(sweep, "available_cores", lambda: 2)
    assert sweep.share_of_cores(1) == 2 and sweep.share_of_cores(2) == 1 and sweep.share_of_cores(3) == 1
    specs = [
        sweep.RunSpec(name, name, 0, {}, smoke_config(tmp_path, f"threads={t}", "rounds=1"))
        for name, t in (("auto", 0), ("one", 1))
    ]
    result = sweep.run_sweep(specs, jobs=1, progress=False)
    assert [o.status for o in result.outcomes] == ["done", "done"]
    assert spy == [2, 2, 1, 1] and torch.get_num_threads() == 1  # the initial loss, then round 1, per run
