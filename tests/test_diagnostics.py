"""Theorem 1 measured, each quantity on a problem computed by hand, and Proposition 1's ideal at
the practical h's strength (item 5): both pairings, Definition 1's absolute error, the steady-state reference
h_i^* of ``algorithms/hafedho.py`` (so a noise-free, full-participation run scores ~0), the mu = 0 control, and
h_source = "exact_matched".

The toy: f_j(w) = 1/2 ||w - xbar_j||^2 + const (``test_theory.QuadModel``), two clients with rows
[(1, 0)] and [(-1, 0), (-1, 2)]: p = (1/3, 2/3), a = (1/2, 1/2) under uniform aggregation, and at w_t = 0
grad f_0 = (-1, 0), grad f_1 = (1, -1), G = (0, -1/2), T_0 = G - grad f_0 / 2 = (1/2, -1/2), T_1 = (-1/2, 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction as Fr

import numpy as np
import pytest
import torch
from helpers import SMOKE
from test_theory import F64, IDENTICAL, hand_exact_rounds, quad_experiment, vec

import hafedho
from hafedho.algorithms import REGISTRY, FedAvg
from hafedho.algorithms.hafedho import ClientState, ExactBroadcast, HaFedHo, ServerState
from hafedho.config import ConfigError, load_config
from hafedho.core import ClientInfo, Diagnostics, Estimate, RoundInfo
from hafedho.experiment import build
from hafedho.runfiles import read_metrics
from hafedho.runtime.store import ClientStore
from hafedho.sim import fullgrad
from hafedho.sim.runner import run
from hafedho.sweep.expand import expand
from hafedho.sweep.presets import load_preset

TOY = [[(1.0, 0.0)], [(-1.0, 0.0), (-1.0, 2.0)]]
T = 3  # the round measured
MU = 0.5  # with lambda = 1: lambda mu = 1/2


def toy(*overrides: str):
    return quad_experiment(
        "data.num_clients=2", "clients.local_steps=1", "clients.batch_size=4", f"algorithm.hafedho.mu={MU}",
        *overrides, rows=TOY,
    )  # fmt: skip


def t64(*v: float) -> dict:
    return {"w": torch.tensor(v, dtype=F64)}


def toy_store(exp, g: dict[int, tuple[float, float]], last: dict[int, int]) -> ClientStore:
    store = ClientStore(exp.alg.init_client(t64(0.0, 0.0)), 2)
    for c in (0, 1):
        store.scatter(c, ClientState(t64(*g[c]), torch.tensor(0.0, dtype=F64), torch.tensor(last[c])))
    return store


def toy_pass(exp, cohort: list[int]):
    rnd = RoundInfo(T, 2, len(cohort))
    return rnd, fullgrad.full_gradients(exp, t64(0.0, 0.0), T, keep=cohort, extra=fullgrad.diagnostic_weights(exp, rnd))


# The steady state of algorithms/hafedho.py at w_t = 0, by hand (lambda = 1, mu = 1/2, r = 1):
# beta = (1 / (1 + 1/6), 1 / (1 + 1/3)) = (6/7, 3/4); sum_j a_j beta_j lambda_j = 45/56; 1 - mu * 45/56 = 67/112;
# g^* = (112/67) (1/2) (6/7 (-1, 0) + 3/4 (1, -1)) = (-6, -42) / 67;
# h_0^* = 6/7 (g^* - 1/3 (-1, 0)) = (14, -36) / 67,  h_1^* = 3/4 (g^* - 2/3 (1, -1)) = (-38, 2) / 67.
G_STAR = (Fr(-6, 67), Fr(-42, 67))
H_STAR = {0: (Fr(14, 67), Fr(-36, 67)), 1: (Fr(-38, 67), Fr(2, 67))}


def test_steady_state_is_the_frozen_recursion() -> None:
    """h^* by hand is the fixed point of g_j = lambda (grad f_j + mu h_j), h_j = g - p_j g_j, g = mean_j g_j."""
    grads, p = np.array([[-1.0, 0.0], [1.0, -1.0]]), np.array([1 / 3, 2 / 3])
    h = np.zeros((2, 2))
    for _ in range(200):
        g_j = grads + MU * h
        h = g_j.mean(0) - p[:, None] * g_j
    assert np.allclose(h, np.array([H_STAR[0], H_STAR[1]], dtype=float), atol=1e-14)
    assert np.allclose(g_j.mean(0), np.array(G_STAR, dtype=float), atol=1e-14)


def ss_err(h: tuple[float, float], c: int) -> float:
    ref = np.array(H_STAR[c], dtype=float)
    return float(np.linalg.norm(np.array(h) - ref) / np.linalg.norm(ref))


def test_used_h_by_hand() -> None:
    """Pairing (a): the h a client uses in round t against the target at w_t. Client 0 was sampled in round t-1
    (h = g - p_0 g_0 = (2, -2) - (1, 0) = (1, -2)); client 1 was not (h = g = (2, -2), target G)."""
    exp = toy()
    store = toy_store(exp, {0: (3.0, 0.0), 1: (1.0, -4.0)}, {0: T - 1, 1: T - 3})
    msg = ServerState(t64(0.0, 0.0), t64(2.0, -2.0), torch.tensor(1.0, dtype=F64))
    want = {
        0: {"cos": 3 / math.sqrt(10), "def1": 0.5, "rel": 0.5 / math.sqrt(0.5), "ss": ss_err((1, -2), 0)},
        # client 1 keeps its own share: its reference is g^* itself (beta = 1); ||h/2 - T|| = ||(1, -1/2)||
        1: {"cos": 1 / math.sqrt(2), "def1": math.sqrt(1.25), "rel": math.sqrt(1.25) / 0.5, "ss": 0.0},
    }
    # ||(2, -2) - (-6, -42)/67|| / ||(-6, -42)/67|| = ||(140, -92)|| / ||(6, 42)||
    g_star = np.array(G_STAR, dtype=float)
    want[1]["ss"] = math.hypot(140, -92) / math.hypot(6, 42)
    assert math.isclose(want[1]["ss"], float(np.linalg.norm(np.array([2.0, -2.0]) - g_star) / np.linalg.norm(g_star)))
    for c in (0, 1):
        rnd, full = toy_pass(exp, [c])
        got = fullgrad.diagnose(exp, msg, rnd, [c], store, full, F64)
        assert math.isclose(got["diag/h_cos"], want[c]["cos"], rel_tol=1e-12)
        assert math.isclose(got["diag/h_def1_abs_err"], want[c]["def1"], rel_tol=1e-12)  # ||mu h - T||
        assert math.isclose(got["diag/h_rel_err"], want[c]["rel"], rel_tol=1e-12)  # legacy: ||h/2 - T|| / ||T||
        assert math.isclose(got["diag/h_ss_rel_err"], want[c]["ss"], rel_tol=1e-12)


def test_fresh_aggregate_by_hand() -> None:
    """Pairing (b): after round t, g^t = (2, -2), g_0^t = (3, 0), g_1^t = (3/2, -3); round t+1 builds
    h_0 = (1, -2) and h_1 = (2, -2) - 2/3 (3/2, -3) = (1, 0), both against the targets at w_t: T_1 = (-1/2, 0), so
    cos(h_1, T_1) = -1 and ||mu h_1 - T_1|| = 1."""
    exp = toy()
    rnd, full = toy_pass(exp, [0, 1])
    store = toy_store(exp, {0: (3.0, 0.0), 1: (1.5, -3.0)}, {0: T, 1: T})
    server = ServerState(t64(0.25, 0.25), t64(2.0, -2.0), torch.tensor(1.0, dtype=F64))
    got = fullgrad.fresh(exp, server, rnd, [0, 1], store, full, F64)
    assert math.isclose(got["diag/fresh_cos"], (3 / math.sqrt(10) - 1) / 2, rel_tol=1e-12)
    assert math.isclose(got["diag/fresh_def1_abs_err"], (0.5 + 1.0) / 2, rel_tol=1e-12)
    assert math.isclose(got["diag/fresh_ss_rel_err"], (ss_err((1, -2), 0) + ss_err((1, 0), 1)) / 2, rel_tol=1e-12)
    assert math.isclose(got["diag/fresh_norm"], (math.sqrt(5) + 1) / 2, rel_tol=1e-12)


def noise_free_run(tmp_path, *overrides: str) -> dict:
    """Full participation (4 of 4), identical rows per client (every batch is f_i: no noise), lambda = 4, a tiny
    local lr (the local iterates stay at w_t) and a server step that converges in 300 rounds."""
    exp = quad_experiment(
        "sampling.cohort_size=4", "clients.batch_size=8", "clients.local_steps=4", "algorithm.lr=0.0001",
        "algorithm.hafedho.eta=0.05", "rounds=300", "diagnostics.every=100", "eval_every=300", *overrides,
        rows=IDENTICAL,
    )  # fmt: skip
    run(exp, tmp_path, progress=False)
    return [r for r in read_metrics(tmp_path) if "diag/h_cos" in r][-1]


@pytest.mark.parametrize(("lam_mu", "aggregation"), [(0.2, "uniform"), (0.8, "data_size")])
def test_noise_free_full_participation_scores_zero(tmp_path, lam_mu: float, aggregation: str) -> None:
    """The steady-state error is ~0 (measured 1.4e-4 and 1.0e-4: what is left is the local iterates' drift,
    O(lr lambda)); the legacy scalar scale keeps its floor (measured 0.37 and 0.85)."""
    row = noise_free_run(tmp_path, f"algorithm.hafedho.mu={lam_mu / 4}", f"algorithm.hafedho.aggregation={aggregation}")
    assert row["diag/h_ss_rel_err"] < 1e-3 and row["diag/fresh_ss_rel_err"] < 1e-3
    assert row["diag/h_rel_err"] > 0.3


def test_mu_zero_control_measures_fedavg_aggregate(tmp_path) -> None:
    """mu = 0: the recursion is FedAvg's (g_i sums grad f_i, 1/m), h is still built and measured; Definition 1's
    error is then ||T|| exactly (mu h = 0), and the reference is the plain aggregate (beta = 1)."""
    exp = quad_experiment("algorithm.hafedho.mu=0", "clients.local_steps=2", "rounds=4", "diagnostics.every=1")
    run(exp, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    assert all(r["diag/h_def1_abs_err"] == r["diag/target_norm"] for r in rows)
    assert rows[-1]["diag/h_norm"] > 0 and rows[-1]["diag/fresh_norm"] > 0


def test_estimation_preset_has_the_mu_zero_row() -> None:
    specs = expand(load_preset("estimation", "cpu"))
    zero = [s for s in specs if s.label == "hafedho-mu-0"]
    assert zero and all(s.cfg.algorithm["hafedho"]["mu"] == 0.0 for s in zero)
    assert all(s.cfg.diagnostics.every == 5 for s in zero)


# ----------------------------------------------------------------------------- Proposition 1 at matched strength


def test_exact_matched_h_by_hand() -> None:
    """h = lambda (G - a_i grad f_i) / (1 - lambda mu): on the toy at w_t = 0 with lambda = 2, mu = 0.1,
    client 0: 2 (1/2, -1/2) / 0.8 = (1.25, -1.25); "exact" gives 2 (1/2, -1/2) = (1, -1)."""
    msg = ExactBroadcast(t64(0.0, 0.0), t64(0.0, -0.5), torch.tensor(0.0, dtype=F64))
    own = (t64(-1.0, 0.0), torch.tensor(0.5, dtype=F64))
    info = ClientInfo(torch.tensor(1 / 3, dtype=F64), torch.tensor(1.0))
    state = HaFedHo().init_client(t64(0.0, 0.0))
    for source, want in (("exact_matched", (1.25, -1.25)), ("exact", (1.0, -1.0))):
        alg = HaFedHo(h_source=source, mu=0.1)
        h, _, _ = alg.rectification(msg, state, info, RoundInfo(2, 2, 2), own, 2.0)
        assert np.allclose(vec(h), want, atol=1e-15, rtol=0)
    assert HaFedHo(h_source="exact_matched").diagnostics().needs_full_gradient
    assert not HaFedHo().diagnostics().needs_full_gradient  # Algorithm 1: the estimate only


def test_exact_matched_run_is_its_definition(tmp_path) -> None:
    """The runner's strength-matched ideal after two rounds against the hand computation of test_theory with h
    scaled by 1 / (1 - lambda mu) (lambda = 3, mu = 0.05: by 1 / 0.85)."""
    over = ("algorithm.hafedho.mu=0.05", "algorithm.lr=0.1", "clients.local_steps=3", "clients.batch_size=2")
    exp = quad_experiment("algorithm.hafedho.h_source=exact_matched", *over, "rounds=2", rows=IDENTICAL)
    want = hand_exact_rounds(exp, 2, strength=1 / (1 - 3 * 0.05))
    run(exp, tmp_path, progress=False)
    w = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["server"][0]
    assert np.allclose(w.numpy(), want[-1], atol=1e-12, rtol=0)


def test_exact_matched_refuses_lambda_mu_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"^hafedho: h_source='exact_matched' scales h by 1 / \(1 - lambda\*mu\)"):
        HaFedHo(h_source="exact_matched", mu=0.1).run_notes(10)


def test_tune_ideal_preset_tunes_each_ideals_mu_on_validation() -> None:
    """tune_ideal: exact and exact_matched at their mu grids, HaFedHo's CIFAR-10 lr, validation split, 100 rounds."""
    preset = load_preset("tune_ideal", "cpu")
    specs = expand(preset)
    got = {(s.cfg.algorithm["hafedho"]["h_source"], s.cfg.algorithm["hafedho"]["mu"]) for s in specs}
    assert got == {("exact", m) for m in (0.01, 0.02, 0.08)} | {("exact_matched", m) for m in (0.02, 0.05)}
    assert all(s.cfg.data.local_test_fraction == 0.1 and s.cfg.data.source == "cifar10" for s in specs)
    assert all(s.cfg.rounds == 100 and s.cfg.algorithm["lr"] == 0.05 for s in specs)
    assert all(10 * s.cfg.algorithm["hafedho"]["mu"] < 1 for s in specs if "matched" in str(s.point))
    assert preset.report["metric"] == "test/personal_acc"


def test_report_tables_both_pairings(tmp_path) -> None:
    """Hand-made runs that logged the new keys get the pairings table (the old table is unchanged beside it)."""
    import json

    from hafedho_paper.diagnostics import diagnostics_table

    from hafedho.report.build import write_report
    from hafedho.report.layout import Layout
    from hafedho.report.runs import load_sections
    from hafedho.toml_io import dump_toml

    for mu in (0.0, 0.08):
        for seed in (0, 1):
            d = tmp_path / f"h-{mu}-s{seed}"
            d.mkdir()
            cfg = {"seed": seed, "rounds": 8, "name": d.name, "diagnostics": {"every": 2}}
            cfg["algorithm"] = {"name": "hafedho", "hafedho": {"mu": mu}}
            (d / "config.toml").write_text(dump_toml(cfg))
            rows = []
            for t in range(1, 9):
                row = {"round": t, "cohort_size": 3, "wall_s": 0.1, "bytes_up": 8, "bytes_down": 8, "train/loss": 1.0}
                if t % 2 == 0:
                    e = 1.0 / t + 0.01 * seed
                    row.update({"diag/h_cos": -0.3, "diag/h_rel_err": 0.5, "diag/h_norm": 1.0, "diag/fresh_cos": 0.4})
                    row.update({"diag/h_ss_rel_err": e, "diag/h_def1_abs_err": 2 * e})
                rows.append(json.dumps(row))
            (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")
            (d / "done").write_text("")
    assert "Estimation error" not in write_report(tmp_path, tmp_path / "rep").text  # a plain folder has no study
    (section,) = load_sections(tmp_path)  # so the study's builder is called here, as a study's section calls it
    tables = {t.slug: t for t in diagnostics_table(Layout.of(section))}
    lines = tables["diagnostics_pairings"].csv().splitlines()
    assert lines[0].split(",")[3:6] == ["ss error early", "ss error late", "error"]
    assert len(lines) == 3 and all(",decays," in line for line in lines[1:])
    # ss early: round 2 (1/2 + 0.01 s), late: round 8 (1/8 + 0.01 s), means over seeds 0, 1; cos fresh 0.4 throughout
    assert all("0.505 ± 0.007,0.130 ± 0.007,decays,1.010 ± 0.014,0.260 ± 0.014" in line for line in lines[1:])
    assert all(line.endswith("-0.300 ± 0.000,0.400 ± 0.000,0.400 ± 0.000") for line in lines[1:])
    assert "diagnostics" in tables


# ------------------------------------------------------------------ the extension, from a user's algorithm


@dataclass(frozen=True, kw_only=True)
class ExactAvg(FedAvg):
    """A user's FedAvg whose "estimate" is the exact full-data gradient itself, against a reference of half of it
    (the pass's extra weighting p_j / 2): cos 1, errors 0 and a steady-state error of exactly 1. It names no
    estimate, so its metrics take the default name ``e``."""

    name = "exactavg"

    def diagnostics(self) -> Diagnostics:
        return Diagnostics(estimate=self.estimate, weightings=lambda p, steps, rnd: {"half": p / 2})

    def estimate(self, msg, state, info, rnd, full, own, steps) -> Estimate:
        grad, half = full["data_size"][0], full["half"][0]
        return Estimate(grad, grad, 1.0, half, 1.0)


def test_a_user_algorithm_provides_diagnostics_and_fedavg_none(tmp_path, request) -> None:
    """``FedAlgorithm.diagnostics()`` is the one way in: FedAvg provides none (and the config refuses
    ``diagnostics.every`` for it), a FedAvg subclass defined here gets ``diag/*`` rows from a 2-round run."""
    assert FedAvg().diagnostics() is None and not Diagnostics.of(FedAvg()).needs_full_gradient
    hafedho.register(ExactAvg)  # as a user would
    request.addfinalizer(lambda: REGISTRY.pop(ExactAvg.name))
    cfg = load_config(SMOKE, ["algorithm.name=exactavg", "diagnostics.every=1"])
    assert not Diagnostics.of(cfg.selected_algorithm()).needs_full_gradient
    run(build(cfg), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert set(fullgrad.diag_keys("e")) <= set(row), sorted(set(fullgrad.diag_keys("e")) - set(row))
        assert not any(k.startswith("diag/h_") for k in row)
        assert row["diag/e_cos"] == pytest.approx(1.0) and row["diag/fresh_cos"] == pytest.approx(1.0)
        assert row["diag/e_rel_err"] == pytest.approx(0.0, abs=1e-12) and row["diag/e_def1_abs_err"] == 0.0
        assert row["diag/e_ss_rel_err"] == pytest.approx(1.0) and row["diag/ref_norm"] > 0
    with pytest.raises(ConfigError, match=r"^diagnostics.every=1: fedavg keeps no estimate"):
        load_config(SMOKE, ["algorithm.name=fedavg", "diagnostics.every=1"])
