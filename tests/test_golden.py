"""Every algorithm x engine (and one Flower run) still computes the recorded golden set (``tests/golden.py``).

On the machine that recorded it, ``python tests/golden.py check`` demands every bit. Here the comparison must
hold on any x86 CPU, so tensors get the float32 bound of ``tests/tolerance.py`` and metrics a matching relative
bound; integer columns (round, cohort size, bytes) must be equal.
"""

from __future__ import annotations

import math

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
