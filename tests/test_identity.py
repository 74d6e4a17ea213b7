"""Run identity and the meaning of ``[algorithm]``: a run's directory name is a hash of what it computes (never of
how, where or how long it runs), the same for ``hafedho run``, sweeps and Flower; one resolver gives every
``[algorithm]`` key one meaning; a user module is built after seeding and recorded as itself."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import SMOKE, no_wall
from tolerance import fp32_close, longest_reduction
from torch import nn

from hafedho.algorithms import HaFedHo, algorithm_from_table, resolve_algorithm
from hafedho.cli import main
from hafedho.config import ConfigError, experiment_identity, load_config
from hafedho.experiment import build
from hafedho.report.runs import hyperparameters
from hafedho.runfiles import RunDirError, read_metrics
from hafedho.sim.runner import run


def name_of(*overrides: str, path: Path = SMOKE) -> str:
    return load_config(path, list(overrides)).run_name


# ---------------------------------------------------------------------------------------------- run names


def test_runs_that_differ_in_one_setting_never_share_a_directory(tmp_path: Path) -> None:
    """`run smoke data.q=0.1` then `data.q=0.5`: two directories, both finished; neither refused nor replaced."""
    for q in ("0.1", "0.5"):
        assert main(["run", "smoke", f"data.q={q}", "--out", str(tmp_path), "--quiet"]) == 0
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(dirs) == 2 and all((d / "done").exists() and len(read_metrics(d)) == 2 for d in dirs)
    assert {d.name for d in dirs} == {name_of("data.q=0.1"), name_of("data.q=0.5")}


def test_runtime_settings_and_the_horizon_are_not_part_of_the_name() -> None:
    base = name_of()
    assert base.startswith("hafedho-digits-") and base.endswith("-s0") and len(base.split("-")[2]) == 8
    for same in (
        ["engine=process", "workers=2"],
        ["engine=vmap", "vmap_chunk=4"],
        ["client_store=disk"],
        ["checkpoint_every=7", "eval_every=3"],
        ["rounds=50"],
        ["out='elsewhere'"],
    ):
        assert name_of(*same) == base, same
    for other in (
        ["data.q=0.1"],
        ["data.num_clients=20"],
        ["clients.local_steps=4"],
        ["sampling.fraction=0.5"],
        ["model.name='mlp'"],
        ["algorithm.lr=0.2"],
        ["algorithm.hafedho.mu=0.02"],
        ["data.partition_seed=3"],
    ):
        assert name_of(*other) != base, other
    s1 = name_of("seed=1")
    assert s1.endswith("-s1") and s1[: -len("-s1")] == base[: -len("-s0")]  # seeds of one experiment share a hash
    assert name_of("name='mine'") == "mine-" + base[len("hafedho-digits-") :]  # a given name is the prefix


def test_one_experiment_one_name_however_it_is_spelled(tmp_path: Path) -> None:
    """Defaults written out, a key at the shared level or in the algorithm's own table, and the tables of other
    algorithms do not change the experiment."""
    base = name_of()  # smoke: [algorithm.hafedho] mu = 0.01 (the default)
    assert name_of("algorithm.hafedho.accumulate='phi'", "algorithm.fedprox.mu=1.0") == base
    plain = tmp_path / "plain.toml"
    plain.write_text(SMOKE.read_text().replace("[algorithm.hafedho]\nmu = 0.01\n", ""))
    assert name_of(path=plain) == base and name_of("algorithm.mu=0.01", path=plain) == base
    assert name_of("algorithm.mu=0.05", path=plain) == name_of("algorithm.hafedho.mu=0.05")
    assert experiment_identity(load_config(plain))["algorithm"]["mu"] == 0.01


def test_a_setting_added_later_with_its_default_never_renames_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash covers only non-default settings: a new algorithm option (added here to HaFedHo's field list with
    its default) leaves every existing run name as it was, while a non-default value of it renames."""
    import dataclasses

    from hafedho import config as config_mod

    before = name_of("algorithm.name=hafedho")
    plain = config_mod._non_default(
        {"a": 1, "algorithm": {"name": "x", "mu": 0.01, "new": False}},
        {"a": 1, "algorithm": {"mu": 0.01, "new": False}},
    )
    assert plain == {"algorithm": {"name": "x"}}  # defaults dropped, the name always kept
    grown = dataclasses.make_dataclass(
        "Grown", [("new", bool, dataclasses.field(default=False))], bases=(HaFedHo,), frozen=True, kw_only=True
    )
    alg = load_config(SMOKE, ["algorithm.name=hafedho"]).selected_algorithm()
    grown_alg = grown(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    monkeypatch.setattr(config_mod.Config, "selected_algorithm", lambda self: grown_alg)
    assert name_of("algorithm.name=hafedho") == before
    monkeypatch.setattr(config_mod.Config, "selected_algorithm", lambda self: dataclasses.replace(grown_alg, new=True))
    assert name_of("algorithm.name=hafedho") != before


def test_names_are_the_same_in_every_process() -> None:
    """No hash randomisation: another interpreter (another PYTHONHASHSEED) names the run identically."""
    code = "from hafedho.config import CONFIG_DIR, load_config; print(load_config(CONFIG_DIR / 'smoke.toml').run_name)"
    names = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        names.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip())
    assert names == {name_of()}


def test_resume_compares_experiments_not_runtime_settings(tmp_path: Path) -> None:
    """Continuing with other runtime settings and more rounds is allowed; another experiment in the same
    directory is refused, naming the key that differs."""
    run_dir = tmp_path / "run"
    run(build(load_config(SMOKE)), run_dir, progress=False)
    more = load_config(SMOKE, ["rounds=3", "eval_every=2", "checkpoint_every=2", "client_store=disk"])
    assert run(build(more), run_dir, resume=True, progress=False)["round"] == 3
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3]
    with pytest.raises(RunDirError, match=r"holds another experiment \(differs in: data.q\)"):
        run(build(load_config(SMOKE, ["rounds=4", "data.q=0.1"])), run_dir, resume=True, progress=False)
    assert len(read_metrics(run_dir)) == 3


def final_state(run_dir: Path) -> list[torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    return ckpt["server"] + ckpt["store"]


@pytest.mark.parametrize(
    ("first", "then"), [("loop", "loop"), ("process", "process"), ("loop", "process"), ("process", "loop")]
)
def test_a_run_started_on_one_engine_resumes_on_any(tmp_path: Path, first: str, then: str) -> None:
    """Two rounds on ``first``, resumed to four on ``then``: on the same engine bit for bit the uninterrupted run;
    on another equal to it up to float32 rounding (tests/tolerance.py; engines only reorder float operations)."""
    runtime = ["workers=2", "threads=1"]
    ref = tmp_path / "ref"
    run(build(load_config(SMOKE, ["rounds=4", f"engine={first}", *runtime])), ref, progress=False)
    part = tmp_path / "part"
    run(build(load_config(SMOKE, ["rounds=2", f"engine={first}", *runtime])), part, progress=False)
    exp = build(load_config(SMOKE, ["rounds=4", f"engine={then}", *runtime]))
    assert run(exp, part, resume=True, progress=False)["round"] == 4
    got, want = read_metrics(part), read_metrics(ref)
    assert [r["round"] for r in got] == [1, 2, 3, 4] and [r.keys() for r in got] == [r.keys() for r in want]
    if first == then:
        assert no_wall(got) == no_wall(want)
        assert all(torch.equal(a, b) for a, b in zip(final_state(part), final_state(ref), strict=True))
    else:
        counts = [[(k, v) for k, v in r.items() if isinstance(v, int)] for r in (*got, *want)]
        assert counts[:4] == counts[4:]  # rounds, cohorts, bytes: exact
        lam = max(exp.plan.steps_for(int(n)) for n in exp.fed.sizes)
        x = exp.fed.preprocess(exp.fed.x_train[: exp.cfg.clients.batch_size])
        bounds = {"reduction": longest_reduction(exp.model.module, x), "steps": 4 * (lam + 1)}
        fp32_close(final_state(part), final_state(ref), **bounds, what=f"{first} -> {then}")


# ---------------------------------------------------------------------------------------------- [algorithm]


def test_a_shared_key_applies_or_is_refused_naming_the_right_key() -> None:
    # the shipped configs set [algorithm.hafedho] mu: algorithm.mu=0.5 used to be ignored silently
    with pytest.raises(ConfigError, match=r"^algorithm.mu=0.5 conflicts with algorithm.hafedho.mu=0.01 .*"):
        build(load_config(SMOKE, ["algorithm.mu=0.5"]))
    with pytest.raises(ConfigError, match=r"e\.g\. algorithm\.hafedho\.mu=0\.5$"):
        _ = load_config(SMOKE, ["algorithm.mu=0.5"]).run_name
    assert algorithm_from_table({"name": "hafedho", "mu": 0.5}).mu == 0.5  # no own table: the shared key applies
    assert algorithm_from_table({"name": "hafedho", "mu": 0.5, "hafedho": {"mu": 0.5}}).mu == 0.5  # agreeing
    assert algorithm_from_table({"name": "fedavg", "hafedho": {"mu": 0.5}}).name == "fedavg"  # not selected
    with pytest.raises(ConfigError, match=r"^algorithm.mu: unknown setting for fedavg"):
        algorithm_from_table({"name": "fedavg", "mu": 0.5})
    with pytest.raises(ConfigError, match=r"^algorithm.hafedho.mu=-1.0: must be >= 0$"):
        algorithm_from_table({"name": "hafedho", "hafedho": {"mu": -1}})
    with pytest.raises(
        ConfigError, match=r"^algorithm.accumulate=true conflicts with algorithm.hafedho.accumulate='f'"
    ):
        resolve_algorithm({"name": "hafedho", "accumulate": True, "hafedho": {"accumulate": "f"}})


def test_report_reads_hyperparameters_through_the_same_resolver() -> None:
    table = {"name": "hafedho", "lr": 0.1, "hafedho": {"mu": 0.05}, "fedprox": {"mu": 1.0}}
    hyper, resolved = hyperparameters({"algorithm": table}), resolve_algorithm(table)[1]
    assert resolved == {"lr": 0.1, "mu": 0.05} and {k: hyper[k] for k in resolved} == resolved
    assert hyper["accumulate"] == HaFedHo().accumulate  # the rest: the algorithm's defaults, never missing
    assert hyperparameters({"algorithm": {"name": "hafedho", "mu": 0.5, "hafedho": {"mu": 0.01}}}) == {}


def test_lambda_mu_warning_names_keys_that_work() -> None:
    with pytest.warns(UserWarning, match=r"lower mu where it is set \(algorithm\.hafedho\.mu or algorithm\.mu\)"):
        HaFedHo(mu=0.2).run_notes(10)


# ---------------------------------------------------------------------------------------------- user modules


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1))


def test_a_user_module_factory_is_seeded_and_recorded(tmp_path: Path) -> None:
    cfg = load_config(SMOKE)
    a = build(cfg, module=Net)
    torch.manual_seed(1234)  # the caller's RNG state does not matter
    b = build(cfg, module=lambda: Net())
    assert all(torch.equal(x, y) for x, y in zip(a.model.params().values(), b.model.params().values(), strict=True))
    assert a.cfg.model.name == f"custom:{__name__}.Net" and cfg.model.name == "logreg"  # the caller's cfg is kept
    assert a.cfg.run_name != cfg.run_name and a.cfg.run_name == b.cfg.run_name
    wider = build(cfg, module=lambda: Net(hidden=32))
    assert wider.cfg.model.name == a.cfg.model.name and wider.cfg.run_name != a.cfg.run_name
    run(a, tmp_path / "run", progress=False)
    assert 'name = "custom:' in (tmp_path / "run" / "config.toml").read_text()
    with pytest.raises(RunDirError, match=r"differs in: model.options.architecture"):
        run(build(load_config(SMOKE, ["rounds=3"]), module=lambda: Net(hidden=32)), tmp_path / "run", resume=True)
    more = build(load_config(SMOKE, ["rounds=3"]), module=Net)
    assert run(more, tmp_path / "run", resume=True, progress=False)["round"] == 3
    with pytest.raises(ConfigError, match=r"model.name='custom:.*pass it to hafedho.experiment.build"):
        build(a.cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="pass a factory"):
            build(cfg, module=Net())
