"""Every algorithm x engine (and one Flower run) still computes the recorded golden set (``tests/golden.py``).

On the machine that recorded it, ``python tests/golden.py check`` demands every bit. Here the comparison must
hold on any x86 CPU, so tensors get the float32 bound of ``tests/tolerance.py`` and metrics a matching relative
bound; integer columns (round, cohort size, bytes) must be equal.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from golden import DEFAULT, compute
from tolerance import fp32_close

REDUCTION = 64  # logistic regression on 8x8 digits: 64 features, batch 16
STEPS = 8  # 2 rounds x 3 local steps, plus the server's average and step
TEST_EXAMPLES = 360  # the digits test split
# A metric is a mean over at most a few hundred examples of float32 values: the bound of tests/tolerance.py
# with that reduction (C eps sqrt(K) T, C = 10).
METRIC_RTOL = 10 * 2.0**-23 * math.sqrt(TEST_EXAMPLES) * STEPS


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    want = torch.load(DEFAULT, map_location="cpu", weights_only=True)["runs"]
    return want, compute(list(want))


def test_the_golden_set_covers_every_algorithm_and_engine() -> None:
    from hafedho.algorithms import REGISTRY

    want = torch.load(DEFAULT, map_location="cpu", weights_only=True)["runs"]
    assert set(want) == {f"{a}/{e}" for a in REGISTRY for e in ("loop", "process", "vmap")} | {"hafedho/flower"}


def test_results_match_the_golden_set(golden: tuple[dict, dict]) -> None:
    want, got = golden
    for key, w in want.items():
        g = got[key]
        assert len(g["rows"]) == len(w["rows"]), key
        for gr, wr in zip(g["rows"], w["rows"], strict=True):
            assert gr.keys() == wr.keys(), key
            for k, wv in wr.items():
                gv = gr[k]
                if isinstance(wv, int) and not isinstance(wv, bool):
                    assert gv == wv, f"{key} round {wr['round']} {k}: {gv} != {wv}"
                elif k.endswith("acc"):  # a rounding difference may flip an example sitting on a decision boundary
                    assert abs(gv - wv) <= 2 / TEST_EXAMPLES + 1e-12, f"{key} round {wr['round']} {k}: {gv} vs {wv}"
                else:
                    assert abs(gv - wv) <= METRIC_RTOL * max(1.0, abs(wv)), f"{key} round {wr['round']} {k}"
        for part in ("server", "store"):
            fp32_close(g[part], w[part], reduction=REDUCTION, steps=STEPS, what=f"{key} {part}")


def test_record_adds_only_the_missing_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``golden.py record`` computes only the entries the set lacks (a new algorithm, on another CPU) and keeps
    every other entry's bits and recorder; an algorithm no longer registered is dropped; ``--all`` rewrites all."""
    import golden

    calls: list[list[str]] = []

    def fake_compute(keys: list[str] | None = None) -> dict:
        calls.append(list(keys or []))
        n = float(len(calls))
        return {k: {"rows": [{"round": 1, "loss": n}], "server": [torch.tensor([n])], "store": []} for k in keys or []}

    keys = ["a/loop", "b/loop"]
    monkeypatch.setattr(golden, "compute", fake_compute)
    monkeypatch.setattr(golden, "wanted", lambda: list(keys))
    path = tmp_path / "set.pt"
    assert golden.main(["record", str(path)]) == 0  # no set yet: every entry
    first = torch.load(path, weights_only=True)
    keys[1:] = ["c/loop"]  # b removed from the registry, c added
    monkeypatch.setattr(golden, "cpu_name", lambda: "another CPU")
    assert golden.main(["record", str(path)]) == 0
    second = torch.load(path, weights_only=True)
    assert calls == [["a/loop", "b/loop"], ["c/loop"]] and list(second["runs"]) == ["a/loop", "c/loop"]
    assert second["runs"]["a/loop"]["rows"] == first["runs"]["a/loop"]["rows"] == [{"round": 1, "loss": 1.0}]
    assert torch.equal(second["runs"]["a/loop"]["server"][0], first["runs"]["a/loop"]["server"][0])
    assert second["entry_meta"]["a/loop"] == first["entry_meta"]["a/loop"] == first["meta"]
    assert second["entry_meta"]["c/loop"]["cpu"] == "another CPU" and second["meta"] == first["meta"]
    assert golden.main(["record", "--all", str(path)]) == 0
    assert calls[-1] == ["a/loop", "c/loop"] and torch.load(path, weights_only=True)["runs"]["a/loop"]["rows"] == [
        {"round": 1, "loss": 3.0}
    ]
