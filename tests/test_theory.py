"""Theorem 1 measured ([diagnostics]) and Proposition 1's ideal (HaFedHo h_source="exact"), by hand on a quadratic.

The quadratic here has f(w; x) = 1/2 ||w - x||^2 per row, so client j's loss over its rows is
f_j(w) = mean_r 1/2 ||w - x_jr||^2 + const with the closed-form gradient grad f_j(w) = w - xbar_j, xbar_j the mean of
its rows, whatever blocks the full pass cuts them into.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import no_wall, smoke_config
from tolerance import fp32_close
from torch import Tensor, nn

from hafedho.algorithms.hafedho import ClientState, ExactBroadcast, HaFedHo, ServerState
from hafedho.config import Config, ConfigError, experiment_hash, load_config
from hafedho.core import ClientInfo, FunctionalModel, Params, RoundInfo
from hafedho.data.federated import FederatedData
from hafedho.experiment import Experiment, build
from hafedho.flower.common import check_deployable
from hafedho.runfiles import read_metrics
from hafedho.runtime.store import ClientStore
from hafedho.sim import fullgrad
from hafedho.sim.runner import run
from hafedho.sweep.index import IndexEntry, SweepIndex

F64 = torch.float64


class QuadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -0.25], dtype=F64))

    def forward(self, x: Tensor) -> Tensor:  # logits for the (unused here) evaluation: 2 classes
        return x - self.w


class QuadModel(FunctionalModel):
    """``FunctionalModel`` whose loss is the masked mean of 1/2 ||w - x||^2 over real rows."""

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        per = 0.5 * ((params["w"] - x) ** 2).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)


# Four clients with 1, 3, 5 and 2 distinct rows (unequal, so p_j != 1/N and a partial last block for B = 2).
ROWS = [
    [(1.0, 0.0)],
    [(0.0, 2.0), (1.0, 1.0), (-1.0, 3.0)],
    [(-1.0, -1.0), (2.0, 0.5), (0.0, 0.0), (1.5, -2.0), (-0.5, 1.0)],
    [(3.0, 1.0), (-2.0, 0.0)],
]


def quad_experiment(*overrides: str, rows: list = ROWS) -> Experiment:
    """An Experiment on the quadratic in float64 (hand-checkable), built around the runner's real pipeline."""
    x = np.array([r for client in rows for r in client], dtype=np.float64)
    sizes = [len(c) for c in rows]
    parts = [np.arange(sum(sizes[:j]), sum(sizes[: j + 1])) for j in range(len(rows))]
    fed = FederatedData(x, np.zeros(len(x)), x[:2], np.array([0, 1]), parts, dtype=F64)
    cfg = load_config(None, ["data.num_clients=4", "sampling.cohort_size=2", "algorithm.name=hafedho", *overrides])
    return Experiment(cfg, cfg.selected_algorithm(), fed, QuadModel(QuadNet()), {"hash": "quad"})


def xbar(j: int) -> np.ndarray:
    return np.mean(np.array(ROWS[j]), axis=0)


def vec(t: Params | Tensor) -> np.ndarray:
    return (t["w"] if isinstance(t, dict) else t).detach().double().numpy()


# ----------------------------------------------------------------------------- the full-data pass


@pytest.mark.parametrize("batch", [8, 2])  # full batch (one block per client); blocks of 2 with a partial last one
def test_full_gradients_are_the_closed_form(batch: int) -> None:
    exp = quad_experiment(f"clients.batch_size={batch}")
    w = {"w": torch.tensor([0.3, -0.7], dtype=F64)}
    full = fullgrad.full_gradients(exp, w, t=1, keep=[1, 3])
    n = np.array([len(c) for c in ROWS], dtype=float)
    p = n / n.sum()
    grads = [vec(w) - xbar(j) for j in range(4)]
    assert np.allclose(vec(full.grad["uniform"]), np.mean(grads, axis=0), atol=1e-14)
    assert np.allclose(vec(full.grad["data_size"]), sum(pj * g for pj, g in zip(p, grads, strict=True)), atol=1e-14)
    assert sorted(full.own) == [1, 3]  # only the kept clients' own gradients are held
    for j in (1, 3):
        assert np.allclose(vec(full.own[j][0]), grads[j], atol=1e-14)
        f = np.mean([0.5 * np.sum((vec(w) - np.array(r)) ** 2) for r in ROWS[j]])
        assert math.isclose(float(full.own[j][1]), f, rel_tol=1e-14)
    assert full.grad["uniform"]["w"].dtype == F64


# ----------------------------------------------------------------------------- Theorem 1 measured, by hand


def hand_measure(h: np.ndarray, target: np.ndarray, s: float) -> dict[str, float]:
    hn, tn = np.linalg.norm(h), np.linalg.norm(target)
    return {
        "diag/h_cos": float(h @ target / (hn * tn)),
        "diag/h_rel_err": float(np.linalg.norm(h / s - target) / tn),
        "diag/h_norm": float(hn),
        "diag/target_norm": float(tn),
    }


@pytest.mark.parametrize(
    ("plan", "aggregation", "accumulate"),
    [
        (("clients.batch_size=8", "clients.local_steps=4"), "uniform", "phi"),  # full batch, lambda = 4
        (("clients.batch_size=2", "clients.local_epochs=1"), "data_size", "phi"),  # lambda_i = ceil(n_i / 2)
        (("clients.batch_size=2", "clients.local_steps=3"), "uniform", "f"),
        (
            ("clients.batch_size=2", "clients.local_steps=3", "algorithm.hafedho.mu_schedule=inverse_round"),
            "uniform",
            "phi",
        ),
    ],
)
def test_diagnostic_values_by_hand(plan: tuple[str, ...], aggregation: str, accumulate: str) -> None:
    mu = 0.05
    exp = quad_experiment(
        *plan,
        f"algorithm.hafedho.mu={mu}",
        f"algorithm.hafedho.aggregation={aggregation}",
        f"algorithm.hafedho.accumulate={accumulate}",
    )
    t, cohort = 3, [1, 2]
    w_t = np.array([0.3, -0.7])
    g_prev, gi = np.array([1.0, -2.0]), {1: np.array([0.5, 0.25]), 2: np.array([-1.0, 3.0])}
    last = {1: 2, 2: 1}  # client 1 was sampled in round t-1 (self-correction applies), client 2 was not
    alg: HaFedHo = exp.alg  # type: ignore[assignment]
    store = ClientStore(alg.init_client({"w": torch.zeros(2, dtype=F64)}), 4)
    for c in cohort:
        store.scatter(c, ClientState({"w": torch.tensor(gi[c])}, torch.tensor(0.0, dtype=F64), torch.tensor(last[c])))
    params = {"w": torch.tensor(w_t)}
    msg = ServerState(params, {"w": torch.tensor(g_prev)}, torch.tensor(1.0, dtype=F64))
    rnd = RoundInfo(t, 4, len(cohort))
    full = fullgrad.full_gradients(exp, params, t, keep=cohort, extra=fullgrad.diagnostic_weights(exp, rnd))
    got = fullgrad.diagnose(exp, msg, rnd, cohort, store, full, F64)

    n = np.array([len(c) for c in ROWS], dtype=float)
    p = n / n.sum()
    a = p if aggregation == "data_size" else np.full(4, 0.25)
    G = sum(a[j] * (w_t - xbar(j)) for j in range(4))
    lam_all = np.array([exp.plan.steps_for(int(nj)) for nj in n], dtype=float)
    mu_h = mu / (t - 1) if "inverse_round" in str(plan) else mu  # h was accumulated with mu_{t-1}
    mu_ss = mu_h if accumulate == "phi" else 0.0  # "f" uploads no mu h
    beta = 1 / (1 + lam_all * mu_ss * p)  # the steady state of algorithms/hafedho.py's docstring
    g_star = sum(a[j] * beta[j] * lam_all[j] * (w_t - xbar(j)) for j in range(4)) / (1 - mu_ss * a @ (beta * lam_all))
    want: dict[str, float] = {}
    for c in cohort:
        removed = last[c] == t - 1
        h = g_prev - (p[c] * gi[c] if removed else 0.0)  # Algorithm 1's self-correction subtracts p_i g_i
        target = G - (a[c] * (w_t - xbar(c)) if removed else 0.0)
        lam = exp.plan.steps_for(int(n[c]))
        s = lam / (1 - lam * mu_h) if accumulate == "phi" else lam
        b_c = 1 / (1 + lam * mu_ss * p[c]) if removed else 1.0
        ref = b_c * (g_star - (p[c] * lam * (w_t - xbar(c)) if removed else 0.0))
        mu_t = mu / t if "inverse_round" in str(plan) else mu
        extra = {
            "diag/h_ss_rel_err": float(np.linalg.norm(h - ref) / np.linalg.norm(ref)),
            "diag/h_def1_abs_err": float(np.linalg.norm(mu_t * h - target)),
            "diag/ref_norm": float(np.linalg.norm(ref)),
        }
        for k, v in {**hand_measure(h, target, s), **extra}.items():
            want[k] = want.get(k, 0.0) + v / len(cohort)
    want["diag/grad_norm"] = float(np.linalg.norm(sum(p[j] * (w_t - xbar(j)) for j in range(4))))
    assert set(got) == set(want)
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-12), (k, got[k], v)
    if "clients.local_epochs=1" in plan:  # unequal clients: lambda_i = ceil(n_i / B) = 2 and 3 here
        assert [exp.plan.steps_for(int(n[c])) for c in cohort] == [2, 3]


def test_measure_is_finite_for_zero_vectors() -> None:
    """Round 1's h is 0 (g^0 = 0): the row must stay finite (a NaN would stop the run as diverged)."""
    zero, v = {"w": torch.zeros(2)}, {"w": torch.tensor([3.0, 4.0])}
    assert fullgrad.measure(zero, v, 2.0) == {"cos": 0.0, "rel_err": 1.0, "norm": 0.0, "target_norm": 5.0}


# ----------------------------------------------------------------------------- diagnostics never move a run


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_diagnostics_on_and_off_give_bit_identical_runs(tmp_path, engine: str) -> None:
    rows, ckpts = {}, {}
    for every in (0, 1):
        cfg = smoke_config(tmp_path / str(every), f"diagnostics.every={every}", f"engine={engine}", "rounds=3")
        exp = build(cfg)
        run(exp, tmp_path / str(every) / cfg.run_name, progress=False)
        rows[every] = read_metrics(tmp_path / str(every) / cfg.run_name)
        ckpts[every] = torch.load(tmp_path / str(every) / cfg.run_name / "checkpoint.pt", weights_only=True)
    assert all("diag/h_cos" in r for r in rows[1]) and not any("diag/h_cos" in r for r in rows[0])
    plain = [{k: v for k, v in r.items() if not k.startswith("diag/")} for r in no_wall(rows[1])]
    assert plain == no_wall(rows[0])
    for key in ("server", "store"):
        a, b = ckpts[0][key], ckpts[1][key]
        flat_a = torch.utils._pytree.tree_leaves(a)
        flat_b = torch.utils._pytree.tree_leaves(b)
        assert len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b, strict=True))


def test_diagnostics_are_part_of_the_run_identity() -> None:
    """Off (the default) renames nothing; on is another experiment (its rows hold more)."""
    assert experiment_hash(load_config(None)) == experiment_hash(load_config(None, ["diagnostics.every=0"]))
    assert experiment_hash(load_config(None)) != experiment_hash(load_config(None, ["diagnostics.every=5"]))
    assert "diagnostics" not in __import__("hafedho.config", fromlist=["RUNTIME_KEYS"]).RUNTIME_KEYS


# ----------------------------------------------------------------------------- Proposition 1's ideal


def hand_exact_rounds(exp: Experiment, rounds: int, strength: float = 1.0) -> list[np.ndarray]:
    """The ideal's models w_2, ..., w_{rounds+1}, from its definition: h_i = strength lambda (G(w_t) - a_i grad
    f_i(w_t)), lambda local steps of w <- w - lr (grad f_i(w) + mu h_i) on identical rows (so any batch is f_i),
    upload the sum of grad phi, server w <- w - lr * mean of uploads."""
    alg: HaFedHo = exp.alg  # type: ignore[assignment]
    lam, lr, mu = exp.cfg.clients.local_steps, alg.lr, alg.mu
    pts = [np.array(c[0]) for c in IDENTICAL]
    a = np.full(len(pts), 1 / len(pts))
    w = vec(exp.model.params())
    out = []
    for t in range(1, rounds + 1):
        G = sum(a[j] * (w - pts[j]) for j in range(len(pts)))
        ups = []
        for i in exp.cohort(t).tolist():
            h = strength * lam * (G - a[i] * (w - pts[i]))
            y, g = w.copy(), np.zeros(2)
            for _ in range(lam):
                d = (y - pts[i]) + mu * h
                g, y = g + d, y - lr * d
            ups.append(g)
        w = w - lr * np.mean(ups, axis=0)
        out.append(w)
    return out


IDENTICAL = [[(1.0, 0.0)] * 2, [(0.0, 2.0)] * 3, [(-1.0, -1.0)] * 4, [(2.0, 1.0)] * 1]
EXACT = ("algorithm.hafedho.h_source=exact", "algorithm.hafedho.mu=0.05", "algorithm.lr=0.1", "clients.local_steps=3")


@pytest.mark.parametrize("rounds", [1, 2])
def test_exact_h_is_its_definition_in_float64(tmp_path, rounds: int) -> None:
    """The runner's ideal (loop engine, float64) against the hand computation, after round 1 and after round 2."""
    exp = quad_experiment(*EXACT, "clients.batch_size=2", f"rounds={rounds}", rows=IDENTICAL)
    want = hand_exact_rounds(exp, rounds)
    run(exp, tmp_path, progress=False)
    w = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["server"][0]  # ServerState's first leaf: w
    assert np.allclose(w.numpy(), want[-1], atol=1e-12, rtol=0)
    # and not Algorithm 1, whose h is 0 in round 1 (plain local SGD)
    plain = quad_experiment(*EXACT[1:], "clients.batch_size=2", "rounds=1", rows=IDENTICAL)
    run(plain, tmp_path / "plain", progress=False)
    w_plain = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=True)["server"][0]
    assert np.abs(w_plain.numpy() - hand_exact_rounds(exp, 1)[0]).max() > 1e-3


def test_exact_engines_agree(tmp_path) -> None:
    """h_source="exact" on loop, vmap and process: the same trajectory up to tests/tolerance.py's bound."""
    out = {}
    for engine in ("loop", "vmap", "process"):
        cfg = smoke_config(tmp_path / engine, "algorithm.hafedho.h_source=exact", f"engine={engine}", "workers=2")
        exp = build(cfg)
        run(exp, tmp_path / engine / cfg.run_name, progress=False)
        out[engine] = torch.load(tmp_path / engine / cfg.run_name / "checkpoint.pt", weights_only=True)["server"]
    for engine in ("vmap", "process"):
        fp32_close(out[engine], out["loop"], reduction=16 * 64, steps=2 * 3, what=engine)


def test_exact_differs_from_algorithm_1(tmp_path) -> None:
    rows = {}
    for src in ("aggregate", "exact"):
        cfg = smoke_config(tmp_path / src, f"algorithm.hafedho.h_source={src}")
        run(build(cfg), tmp_path / src / cfg.run_name, progress=False)
        rows[src] = read_metrics(tmp_path / src / cfg.run_name)
    assert rows["aggregate"][0]["train/objective"] == rows["aggregate"][0]["train/loss"]  # round 1: h = 0, f_hat = 0
    assert rows["exact"][0]["train/objective"] != rows["exact"][0]["train/loss"]  # the ideal's h is never 0


# ----------------------------------------------------------------------------- refusals, one line each


def test_refusals_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^diagnostics.every=5: fedavg keeps no estimate") as e:
        load_config(None, ["algorithm.name=fedavg", "diagnostics.every=5"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^diagnostics.every=-1: must be >= 0"):
        load_config(None, ["diagnostics.every=-1"])
    with pytest.raises(ConfigError, match=r"h_source='bogus'"):
        load_config(None, ["algorithm.h_source=bogus"])
    with pytest.raises(ConfigError, match=r"^diagnostics.every=2: diagnostics are simulation only") as e:
        check_deployable(load_config(None, ["diagnostics.every=2"]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^hafedho: .*h_source='exact'.*simulation only") as e:
        check_deployable(load_config(None, ["algorithm.h_source=exact"]))
    assert "\n" not in str(e.value)
    assert isinstance(check_deployable(load_config(None)), Config)


def test_exact_client_without_the_simulator_refuses() -> None:
    """A runtime that never attached the full-data gradient (a plain broadcast) gets one line, not a wrong h."""
    alg = HaFedHo(h_source="exact")
    w = {"w": torch.zeros(2)}
    info = ClientInfo(torch.tensor(0.5), torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"^hafedho: h_source='exact' needs the simulator's full-data gradient"):
        alg.rectification(alg.broadcast(alg.init_server(w), RoundInfo(1, 2, 1)), alg.init_client(w), info,
                          RoundInfo(1, 2, 1), own=(w, torch.tensor(0.0)), steps=1.0)  # fmt: skip
    attach = alg.diagnostics().attach_full_gradient
    assert isinstance(attach(alg.init_server(w), {"uniform": (w, torch.tensor(0.0))}), ExactBroadcast)


# ----------------------------------------------------------------------------- the report


def test_report_plots_and_tables_the_diagnostics(tmp_path) -> None:
    """Hand-made run directories (three rows, two seeds) with diag rows every 2 rounds: the report draws
    diagnostics.png and tables early vs late, with the decay verdict by the larger-std rule; a decay that ends near
    1, the error of h = 0, is said to be no better than h = 0."""
    import json

    from hafedho.report.build import write_report
    from hafedho.toml_io import dump_toml

    errs = {
        ("constant", 0.05): [0.9, 0.8, 0.85, 0.9],
        ("inverse_round", 0.05): [0.9, 0.6, 0.4, 0.2],
        ("constant", 0.02): [1.5, 1.3, 1.1, 0.995],  # late 0.995 + 0.005 +- 0.007: within the margin of 1
    }
    for (sched, mu), err in errs.items():
        for seed in (0, 1):
            d = tmp_path / f"h-{sched}-{mu}-s{seed}"
            d.mkdir()
            cfg = {"seed": seed, "rounds": 8, "name": d.name, "diagnostics": {"every": 2}}
            cfg["algorithm"] = {"name": "hafedho", "hafedho": {"mu_schedule": sched, "mu": mu}}
            (d / "config.toml").write_text(dump_toml(cfg))
            rows = []
            for t in range(1, 9):
                row = {"round": t, "cohort_size": 3, "wall_s": 0.1, "bytes_up": 8, "bytes_down": 8}
                row.update({"train/loss": 1.0 / t, "test/acc": 0.1 * t})
                if t % 2 == 0:
                    e = err[t // 2 - 1] + 0.01 * seed
                    row.update({"diag/h_cos": 1 - e / 2, "diag/h_rel_err": e, "diag/h_norm": 1.0})
                rows.append(json.dumps(row))
            (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")
            (d / "done").write_text("")
    assert "diagnostics.png" not in [f.name for f in write_report(tmp_path, tmp_path / "plain").figures]  # no study
    runs = [IndexEntry(d.name, seed=int(d.name[-1])) for d in sorted(tmp_path.glob("h-*"))]
    SweepIndex("est", report={"study": "hafedho_paper.study:REPORT"}, runs=runs).write(tmp_path)  # the paper's
    files = write_report(tmp_path, tmp_path / "rep")
    assert "diagnostics.png" in [f.name for f in files.figures]
    assert (tmp_path / "rep" / "diagnostics.png").stat().st_size > 5000
    table = (tmp_path / "rep" / "diagnostics.csv").read_text().splitlines()
    verdicts = {line.split(",")[0]: line.rsplit(",", 1)[1] for line in table[1:]}
    assert verdicts == {
        "hafedho mu=0.05 mu_schedule=constant": "flat",
        "hafedho mu=0.05 mu_schedule=inverse_round": "decays",
        "hafedho mu=0.02 mu_schedule=constant": "decays to no better than h = 0",
    }
    assert "0.905 ± 0.007,0.205 ± 0.007" in (tmp_path / "rep" / "diagnostics.csv").read_text()


def test_estimation_preset() -> None:
    """The `estimation` preset at cpu scale: FEMNIST and CIFAR-10 at q = 0.3, constant mu and mu / t at the tuned mu
    and constant mu at a quarter of it, the mu = 0 control, 3 seeds, 100 rounds, diagnostics every 5 rounds."""
    from hafedho.sweep.expand import expand
    from hafedho.sweep.presets import load_preset

    specs = expand(load_preset("estimation", "cpu"))
    assert len(specs) == 2 * 4 * 3
    cells = {
        (s.cfg.data.source, s.cfg.algorithm["hafedho"]["mu_schedule"], s.cfg.algorithm["hafedho"]["mu"]) for s in specs
    }
    rows = (("constant", 0.08), ("inverse_round", 0.08), ("constant", 0.02), ("constant", 0.0))
    assert cells == {(d, m, mu) for d in ("femnist", "cifar10") for m, mu in rows}
    assert all(s.cfg.diagnostics.every == 5 and s.cfg.rounds == 100 and s.cfg.data.q == 0.3 for s in specs)
    assert {s.cfg.seed for s in specs} == {0, 1, 2}


def test_ideal_preset_reads_converges_cifar10_runs() -> None:
    """`ideal` at cpu scale is converge's CIFAR-10 HaFedHo, twin, exact and FedAvg runs (the same run directories,
    so neither preset reruns the other's runs) read at 100 rounds instead of 300, plus its own ideals at mu = 0.02
    and at the practical h's strength (h_source = "exact_matched"), at HaFedHo's mu and at its own tuned 0.02."""
    from hafedho.sweep.expand import expand
    from hafedho.sweep.presets import load_preset

    ideal = expand(load_preset("ideal", "cpu"))
    converge = {s.name: s for s in expand(load_preset("converge", "cpu"))}
    labels = {"hafedho", "hafedho-twin", "hafedho-exact", "fedavg", "hafedho-exact-mu-0.02", "hafedho-exact-matched"}
    labels.add("hafedho-exact-matched-mu-0.02")
    assert len(ideal) == 7 * 3 and {s.label for s in ideal} == labels
    small = [s for s in ideal if s.label == "hafedho-exact-mu-0.02"]  # the exact ideal's tuned mu, ideal's own
    matched = [s for s in ideal if s.label.startswith("hafedho-exact-matched")]  # ideal's own too
    assert all(s.cfg.algorithm["hafedho"]["h_source"] == "exact_matched" for s in matched)
    assert {s.cfg.algorithm["hafedho"]["mu"] for s in matched} == {0.08, 0.02}
    small += matched
    assert all(
        s.cfg.algorithm["hafedho"]["mu"] == 0.02 and s.cfg.algorithm["hafedho"]["h_source"] == "exact"
        for s in small
        if s not in matched
    )
    for s in (s for s in ideal if s not in small):
        assert s.name in converge and converge[s.name].label == s.label, s.name
        assert s.cfg.rounds == 100 and converge[s.name].cfg.rounds == 300
    exact = [s for s in ideal if s.label == "hafedho-exact"]
    assert all(s.cfg.algorithm["hafedho"]["h_source"] == "exact" and s.cfg.data.source == "cifar10" for s in exact)
