"""Extending hafedho from one's own code (docs/extending.md): ``"package.module:Name"`` references for algorithms,
models and data sources, ``hafedho.register``, the Python API ``hafedho.run``, and the tutorial's example
(examples/server_adam: FedAdam, Reddi et al. arXiv:2003.00295, Algorithm 2) run exactly as the tutorial runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMOKE, no_wall
from tolerance import fp32_close
from torch import nn

import hafedho
from hafedho.algorithms import REGISTRY, FedAvg, algorithm_class
from hafedho.algorithms.fedavg import Upload
from hafedho.cli import main
from hafedho.config import ConfigError, experiment_identity, load_config
from hafedho.core import RoundInfo, WeightedMean
from hafedho.core.seeds import seed_for
from hafedho.data.sources import SOURCES
from hafedho.experiment import build
from hafedho.models import MODELS
from hafedho.runfiles import read_metrics
from hafedho.runtime import checkpoint

REPO = Path(__file__).resolve().parents[1]
FEDADAM = "examples.server_adam.fedadam:FedAdam"  # the tutorial's reference, resolved from the repository root
NET = "examples.server_adam.nets:SmallNet"
BLOBS = "examples.server_adam.blobs:load"


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tutorial's folder on ``sys.path``, as ``PYTHONPATH=.`` from the repository root puts it (hafedho never
    searches the working directory); registrations made by a test are undone after it."""
    monkeypatch.syspath_prepend(str(REPO))
    saved = [(r, dict(r)) for r in (REGISTRY, MODELS, SOURCES)]
    yield
    for registry, before in saved:
        registry.clear()
        registry.update(before)


def env(*, tutorial: bool = True) -> dict[str, str]:
    """A child's environment: the library, and (``tutorial``) the repository root on ``PYTHONPATH``, as the tutorial
    tells a user to put the folder holding ``examples/``."""
    path = os.pathsep.join([str(REPO / "src"), *([str(REPO)] if tutorial else [])])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}


# ------------------------------------------------------------------------------------ FedAdam's server step


def test_fedadam_server_update_is_adams_step_in_float64() -> None:
    """Two rounds of FedAdam's server on float64 trees against Algorithm 2 written out in numpy: Delta_t the plain
    mean of the cohort's deltas, m and v Adam's moments from m_{-1} = 0, v_{-1} = tau^2, then the step. The server
    keeps the ``adam`` transform's moments of the pseudo-gradient -Delta_t: (-m_t, v_t)."""
    alg = algorithm_class(FEDADAM)(server_lr=0.1, beta1=0.8, beta2=0.95, tau=0.01)
    gen = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(3, 4, generator=gen, dtype=torch.float64), "b": torch.randn(4, generator=gen).double()}
    server = alg.init_server(x)
    ref_x = {k: v.numpy().copy() for k, v in x.items()}
    ref_m = {k: np.zeros_like(v) for k, v in ref_x.items()}
    ref_v = {k: np.full_like(v, 0.01**2) for k, v in ref_x.items()}
    for t in (1, 2):
        deltas = [{k: 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}]
        deltas += [{k: 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}]
        agg = WeightedMean()
        for d, n in zip(deltas, (10.0, 30.0), strict=True):  # sizes differ: the paper's mean is unweighted
            agg.add(Upload(d), torch.ones(()) if alg.weighting == "uniform" else torch.tensor(n))
        server, _ = alg.server_update(server, agg.result(like=Upload(x)), RoundInfo(t, 10, 2))
        for k in ref_x:
            delta = (deltas[0][k].numpy() + deltas[1][k].numpy()) / 2
            ref_m[k] = 0.8 * ref_m[k] + 0.2 * delta
            ref_v[k] = 0.95 * ref_v[k] + 0.05 * delta**2
            ref_x[k] = ref_x[k] + 0.1 * ref_m[k] / (np.sqrt(ref_v[k]) + 0.01)
            pairs = ((server.params[k], ref_x[k]), (server.opt.m[k], -ref_m[k]), (server.opt.v[k], ref_v[k]))
            for got, want in pairs:
                assert got.dtype == torch.float64
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)
    assert not np.allclose(ref_x["w"], x["w"].numpy())  # the step moved the model


def test_fedadam_is_the_hand_written_server_bit_for_bit() -> None:
    """Four float32 rounds: the same bits as the server the example wrote out before it ran the library's ``adam``
    (that code is the reference below, op for op); the moments are kept as the transform's, m of -Delta_t."""
    alg = algorithm_class(FEDADAM)()
    gen = torch.Generator().manual_seed(2)
    x = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    server = alg.init_server(x)
    m, v = {k: torch.zeros_like(p) for k, p in x.items()}, {k: torch.full_like(p, alg.tau**2) for k, p in x.items()}
    b1, b2 = alg.beta1, alg.beta2
    for t in range(1, 5):
        d = {k: 0.1 * torch.randn(p.shape, generator=gen) for k, p in x.items()}
        server, _ = alg.server_update(server, Upload(d), RoundInfo(t, 10, 2))
        m = {k: b1 * m[k] + (1 - b1) * d[k] for k in d}
        v = {k: b2 * v[k] + (1 - b2) * d[k] ** 2 for k in d}
        x = {k: x[k] + alg.server_lr * m[k] / (v[k].sqrt() + alg.tau) for k in d}
        for k in d:
            assert torch.equal(server.params[k], x[k]) and torch.equal(server.opt.v[k], v[k])
            assert torch.equal(server.opt.m[k], -m[k])


def test_the_tutorial_shows_the_example_as_it_is() -> None:
    """docs/extending.md's code block is examples/server_adam/fedadam.py without its docstring, character for
    character: the tutorial cannot drift from the file CI runs."""
    code = (REPO / "examples" / "server_adam" / "fedadam.py").read_text()
    body = code[code.index("from dataclasses") :]
    assert f"```python\n{body}```" in (REPO / "docs" / "extending.md").read_text()
    assert len([line for line in body.splitlines() if line.strip()]) <= 32  # "about 30 lines"


def test_fedadam_paper_defaults() -> None:
    alg = algorithm_class(FEDADAM)()
    assert isinstance(alg, FedAvg) and (alg.beta1, alg.beta2, alg.tau, alg.weighting) == (0.9, 0.99, 1e-3, "uniform")


# -------------------------------------------------------------------- the tutorial, from the CLI and from Python


def test_the_tutorial_runs_from_the_command_line_and_from_python(tmp_path: Path) -> None:
    """`hafedho run smoke algorithm.name=examples.server_adam.fedadam:FedAdam` as a command (``python -P``: like
    the installed ``hafedho`` script, the working directory is not on sys.path; the tutorial's PYTHONPATH is),
    then one round of it through ``hafedho.run``: one run directory name, identical metrics; and round 1's server
    update in the run's checkpoint is Adam's step computed by hand from the checkpoint's first moment."""
    cmd = [sys.executable, "-P", "-m", "hafedho", "run", "smoke", f"algorithm.name={FEDADAM}", "--quiet"]
    proc = subprocess.run(
        [*cmd, "algorithm.server_lr=0.1", "--out", str(tmp_path / "cli")],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (cli_dir,) = [p for p in (tmp_path / "cli").iterdir() if not p.name.startswith(".")]
    assert cli_dir.name.startswith("examples.server_adam.fedadam.FedAdam-digits-") and cli_dir.name.endswith("-s0")
    assert f'name = "{FEDADAM}"' in (cli_dir / "config.toml").read_text()  # recorded as its reference
    cli_rows = read_metrics(cli_dir)
    assert len(cli_rows) == 2 and isinstance(cli_rows[-1]["test/acc"], float)

    res = hafedho.run(
        "smoke", f"algorithm.name={FEDADAM}", out=tmp_path / "api", rounds=1, algorithm={"server_lr": 0.1}
    )
    assert res.run_dir.name == cli_dir.name and res.final["round"] == 1
    assert no_wall(res.rows) == no_wall(cli_rows[:1])

    # Round 1's server step, read back from the checkpoint, against Algorithm 2 computed by hand.
    exp = build(res.config)
    x0 = exp.model.params()
    _, server, _, _ = checkpoint.load(res.run_dir / "checkpoint.pt", exp.alg.init_server(x0))
    a = exp.alg
    m1 = {k: -m.double() for k, m in server.opt.m.items()}  # the paper's m_1 (the state's is of -Delta_1)
    delta = {k: m / (1 - a.beta1) for k, m in m1.items()}  # Delta_1, since m_0 = 0
    v1 = {k: a.beta2 * a.tau**2 + (1 - a.beta2) * d**2 for k, d in delta.items()}
    x1 = {k: x0[k].double() + a.server_lr * m1[k] / (v1[k].sqrt() + a.tau) for k in x0}
    fp32_close({k: v.double() for k, v in server.opt.v.items()}, v1, reduction=1, steps=1, what="v_1")
    fp32_close({k: v.double() for k, v in server.params.items()}, x1, reduction=1, steps=1, what="x_1")
    assert max(float((server.params[k] - x0[k]).abs().max()) for k in x0) > 1e-3  # a real step was taken


def test_a_reference_is_the_algorithm_name_in_the_run_identity() -> None:
    """The reference string is the name: in the identity and so in the hash; another module path, another run."""
    cfg = load_config(SMOKE, [f"algorithm.name={FEDADAM}"])
    assert experiment_identity(cfg)["algorithm"]["name"] == FEDADAM
    assert type(cfg.selected_algorithm()).__name__ == "FedAdam"
    hashes = {load_config(SMOKE, [f"algorithm.name={n}"]).run_name.split("-")[-2] for n in (FEDADAM, "fedavg")}
    assert len(hashes) == 2
    hafedho.register(algorithm_class(FEDADAM), name="my_adam")
    mine = load_config(SMOKE, ["algorithm.name=my_adam"])
    assert experiment_identity(mine)["algorithm"]["name"] == "my_adam" and mine.run_name.startswith("my_adam-digits-")
    assert mine.run_name != cfg.run_name


def test_a_reference_in_a_per_algorithm_table_and_in_shared_settings(tmp_path: Path) -> None:
    cfg_file = tmp_path / "fedadam.toml"
    cfg_file.write_text(
        SMOKE.read_text().replace('name = "hafedho"', f'name = "{FEDADAM}"')
        + f'\n[algorithm."{FEDADAM}"]\nbeta1 = 0.5\n'
    )
    alg = load_config(cfg_file).selected_algorithm()
    assert alg.beta1 == 0.5 and alg.lr == 0.1


# -------------------------------------------------------------------------------- a user's model and data


def test_a_user_model_by_reference_is_built_and_seeded_like_ours(tmp_path: Path) -> None:
    from examples.server_adam.nets import SmallNet  # importable now: the fixture runs at the repository root

    cfg = load_config(SMOKE, [f"model.name={NET}", "model.options.width=16", "seed=3"])
    exp = build(cfg)
    assert type(exp.model.module) is SmallNet and exp.model.module.head.in_features == 16
    torch.manual_seed(seed_for(3, "model_init"))
    want = SmallNet((64,), 10, width=16).state_dict()
    got = exp.model.module.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the run's model seed, as for built-in models
    assert exp.cfg.model.name == NET  # recorded as its reference
    with pytest.raises(ConfigError, match=r"model\.options\.width='16': expected int"):
        build(load_config(SMOKE, [f"model.name={NET}", "model.options.width='16'"]))
    with pytest.raises(ConfigError, match="has no option"):
        build(load_config(SMOKE, [f"model.name={NET}", "model.options.depth=2"]))


def test_a_user_data_source_by_reference_runs(tmp_path: Path) -> None:
    res = hafedho.run(
        "smoke",
        f"data.source={BLOBS}",
        "data.options={classes = 3, n = 400}",
        f"model.name={NET}",
        out=tmp_path,
        rounds=1,
    )
    assert res.run_dir.name.startswith("hafedho-examples.server_adam.blobs.load-")
    assert res.final["round"] == 1 and 0.0 <= res.final["test/acc"] <= 1.0
    partition = json.loads((res.run_dir / "partition.json").read_text())
    assert partition["source"] == "blobs: 400 points, 3 classes" and sum(partition["sizes"]) == 320


# ------------------------------------------------------------------------------------------ bad references


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.name=no_such_pkg.algos:FedX", "module 'no_such_pkg' not found; make its package importable"),
        ("algorithm.name=examples.server_adam.fedadam:FedAdamm", "has no attribute 'FedAdamm'"),
        (f"algorithm.name={NET}", "class SmallNet is not a FedAlgorithm subclass; subclass hafedho.algorithms.FedAvg"),
        ("algorithm.name=examples.server_adam:", "a reference reads 'package.module:Name'"),
        (f"model.name={FEDADAM}", "class FedAdam is not an nn.Module factory"),
        ("model.name=examples.server_adam.nets:math", "module is not an nn.Module factory"),
        (f"data.source={NET}", "class SmallNet is not a data source; name a hafedho.data.sources.Source or a function"),
        ("data.source=examples.server_adam.nets:no_loader", "has no attribute 'no_loader'"),
    ],
)
def test_a_bad_reference_is_one_line_naming_the_fix(
    override: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", "smoke", override, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hafedho: error: ") and err.count("\n") == 1 and expected in err, err
    assert not any(tmp_path.iterdir())  # refused before any run directory is made


def test_user_code_has_one_spelling_and_a_passed_module_only_a_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``"package.module:Name"`` names user code everywhere; ``custom:<module>.<Class>`` is what a run built from a
    module passed in Python records (``core.refs.user_module_name``), never a reference: typed, it is refused
    with both ways that work."""
    from hafedho.core.refs import is_reference, user_module_name

    assert is_reference(NET) and is_reference(FEDADAM) and not is_reference("mlp")
    assert user_module_name(nn.Linear) == "custom:torch.nn.modules.linear.Linear"
    assert not is_reference(user_module_name(nn.Linear))
    assert main(["run", "smoke", "model.name='custom:my_pkg.nets.Net'", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        "hafedho.experiment.build(cfg, module=...), or name it by reference: model.name='package.module:Class'" in err
    )


def test_an_undecorated_subclass_and_a_wrong_return_are_refused(tmp_path: Path) -> None:
    from hafedho.core import hp

    class Loose(FedAvg):  # forgot @dataclass: its hp field would be a class attribute holding a Field
        name = "loose"
        gamma: float = hp(0.5, "a setting")

    with pytest.raises(ConfigError, match=r"decorate class Loose with @dataclass\(frozen=True, kw_only=True\)"):
        hafedho.register(Loose)
    hafedho.register(lambda path=None: [1, 2], name="not_data", kind="data")
    with pytest.raises(Exception, match=r"returned list, not a hafedho\.data\.dataset\.Dataset"):
        hafedho.run("smoke", "data.source=not_data", out=tmp_path)


# ------------------------------------------------------------------------------------------- a user's engine

BAD_ENGINES = """
from hafedho.sim.engines.loop import LoopEngine

NOT_A_CLASS = 3


class NoClose:
    name = "no_close"

    def __call__(self, work, cohort, store):
        raise AssertionError("never run")


class Broken(LoopEngine):
    def __init__(self, workers):
        raise RuntimeError(f"no pool of {workers}")


class WithWorkers(LoopEngine):
    def __init__(self, workers, chunk=-1, other=None):
        self.workers, self.chunk, self.other = workers, chunk, other


class TakesAll(LoopEngine):
    def __init__(self, **options):
        self.options = options
"""


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` holding ``my_engines`` (docs/extending.md's engine, as printed) and
    ``my_bad_engines``; both are forgotten after the test, so each test imports them afresh."""
    code = tmp_path / "code"
    code.mkdir()
    doc = (REPO / "docs" / "extending.md").read_text().split("## 10. An engine of your own", 1)[1]
    (code / "my_engines.py").write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    (code / "my_bad_engines.py").write_text(BAD_ENGINES)
    monkeypatch.syspath_prepend(str(code))
    for name in ("my_engines", "my_bad_engines"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield code
    for name in ("my_engines", "my_bad_engines"):
        sys.modules.pop(name, None)


def test_a_user_engine_by_reference_runs_like_loop(
    user_code: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/extending.md's engine (``loop`` counting its calls), named by reference: it runs every round, the run
    is the one ``engine=loop`` names (the engine is no part of the identity), its rows equal ``loop``'s bit for
    bit, and the first line and ``run.json`` name it by its reference."""
    ref = "my_engines:CountingEngine"
    assert main(["run", "smoke", "rounds=2", f"engine={ref}", "--out", str(tmp_path / "mine")]) == 0
    first = capsys.readouterr().out.strip().splitlines()[0]
    from my_engines import CountingEngine

    assert CountingEngine.calls == 2
    ref_run = hafedho.run("smoke", "engine=loop", out=tmp_path / "loop", rounds=2)
    mine = tmp_path / "mine" / ref_run.run_dir.name
    assert f"{mine.name}: device cpu, engine {ref} (counting), precision" in first
    assert json.loads((mine / "run.json").read_text())["engine"] == f"{ref} (counting)"
    assert no_wall(read_metrics(mine)) == no_wall(ref_run.rows) and len(ref_run.rows) == 2


def test_a_user_engine_gets_the_options_it_names_on_any_device(user_code: Path) -> None:
    from hafedho.sim.engines.make import engine_for, make_engine

    eng = make_engine("my_bad_engines:WithWorkers", workers=3, vmap_chunk=5)
    assert (eng.workers, eng.chunk, eng.other) == (3, 5, None)  # chunk: the vmap engine's keyword for vmap_chunk
    assert make_engine("my_bad_engines:TakesAll", workers=2).options == {"workers": 2, "vmap_chunk": 0}
    cfg = load_config(SMOKE, ["engine=my_engines:CountingEngine"])
    assert engine_for(cfg, torch.device("cuda", 0)).name == "counting"  # built, not run: no GPU needed


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ("no_such_pkg.engines:Mine", "engine='no_such_pkg.engines:Mine': module 'no_such_pkg' not found; make its"),
        ("my_bad_engines:Missing", "has no attribute 'Missing'"),
        ("my_bad_engines:NOT_A_CLASS", "names an object of type int, not a class; an engine has name (a str), "),
        ("my_bad_engines:NoClose", "NoClose has no close(); an engine has name"),
        ("my_bad_engines:Broken", "building it raised RuntimeError: no pool of 0; fix its constructor"),
        ("gpu", "engine='gpu': choose one of 'loop', 'process', 'vmap', 'auto', or name your own engine class as"),
    ],
)
def test_a_bad_engine_is_one_line_naming_the_fix(
    engine: str, expected: str, user_code: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "smoke", f"engine={engine}", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hafedho: error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()  # refused before the run's lock or directory


# ------------------------------------------------------------------------------------------------ register


def test_register_algorithm_model_and_data_then_run_by_name(tmp_path: Path) -> None:
    from examples.server_adam.blobs import load
    from examples.server_adam.nets import SmallNet

    fedadam = algorithm_class(FEDADAM)
    assert hafedho.register(fedadam) is fedadam and REGISTRY["fedadam"] is fedadam  # its own name attribute
    hafedho.register(fedadam)  # again (a rerun notebook cell): fine
    hafedho.register(SmallNet, name="small")
    hafedho.register(load, name="blobs", kind="data")
    res = hafedho.run(
        {"rounds": 1, "data": {"source": "blobs", "num_clients": 10}, "model": {"name": "small"}},
        "algorithm.name=fedadam",
        out=tmp_path,
    )
    assert res.run_dir.name.startswith("fedadam-blobs-") and res.final["round"] == 1
    assert res.config.model.name == "small" and type(build(res.config).model.module) is SmallNet


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: hafedho.register(algorithm_class("fedavg"), name="fedavg"), "'fedavg' is a built-in algorithm"),
        (lambda: hafedho.register(lambda: nn.Linear(2, 2)), "say what it is: kind='model'"),
        (lambda: hafedho.register(lambda: nn.Linear(2, 2), kind="model"), "give it a plain name"),
        (lambda: hafedho.register(lambda: nn.Linear(2, 2), name="a:b", kind="model"), "give it a plain name"),
        (lambda: hafedho.register(nn.Linear(2, 2), name="lin", kind="model"), "an nn.Module instance"),
        (lambda: hafedho.register(print, name="x", kind="table"), "kind='table': choose"),
    ],
)
def test_register_refuses_in_one_line(call, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_register_refuses_a_second_object_under_a_taken_name() -> None:
    hafedho.register(lambda: nn.Linear(64, 10), name="lin", kind="model")
    hafedho.register(lambda: nn.Linear(64, 10), name="lin", kind="model")  # a redefinition: same qualname
    with pytest.raises(ConfigError, match="'lin' is already registered to"):
        hafedho.register(nn.Bilinear, name="lin")


def test_python_api_takes_a_config_object_and_a_path(tmp_path: Path) -> None:
    cfg = load_config(SMOKE, ["rounds=1", "algorithm.name=fedavg"])
    a = hafedho.run(cfg, out=tmp_path / "a")
    b = hafedho.run(SMOKE, "rounds=1", "algorithm.name=fedavg", out=tmp_path / "b")
    assert a.run_dir.name == b.run_dir.name and no_wall(a.rows) == no_wall(b.rows)
    again = hafedho.run(cfg, out=tmp_path / "a")  # resume=True: a finished run is read back, nothing recomputed
    assert again.rows == a.rows and again.already_finished and not a.already_finished
    with pytest.raises(ConfigError, match="config file not found"):
        hafedho.run("no-such-config")


def test_import_hafedho_is_light() -> None:
    code = "import sys, hafedho; print([m for m in ('torch', 'numpy', 'hafedho.api') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------- in worker processes


@pytest.mark.slow
def test_references_resolve_in_spawned_sweep_workers_and_forked_engine_workers(tmp_path: Path) -> None:
    """The tutorial's sweep (FedAdam against HaFedHo, by reference) with two spawned workers, each run on the
    process engine's forked workers: every run finishes, FedAdam's directory is named by its reference."""
    preset = REPO / "examples" / "server_adam" / "compare.toml"
    args = [sys.executable, "-P", "-m", "hafedho", "sweep", str(preset), "--jobs", "2", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*args, "--quiet", "rounds=2", "engine=process", "workers=2", "data.num_clients=10", "eval_every=1"],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = sorted(p.name for p in tmp_path.iterdir() if (p / "done").exists())
    assert len(done) == 3 and any("FedAdam" in n for n in done), done
