"""A user's model or algorithm that breaks the contract ends in one line naming it, what it returned and what is
expected (issue 33), before training where it can be seen then; an exception raised in the user's own code keeps
its traceback."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import SMOKE

import hafedho
from hafedho.cli import main
from hafedho.config import ConfigError, load_config
from hafedho.experiment import build, check_model
from hafedho.models import build_model
from hafedho.sim.runner import Divergence

USER_CODE = """
import torch
from dataclasses import dataclass
from torch import nn

from hafedho.algorithms import FedAvg
from hafedho.core import ClientResult


class Net(nn.Module):  # a 3-class model
    def __init__(self, input_shape, num_classes, outputs=3, shape="ok"):
        super().__init__()
        self.fc = nn.Linear(64, outputs)
        self.shape = shape

    def forward(self, x):
        z = self.fc(x.flatten(1))
        if self.shape == "flat":
            return z[:, 0]
        if self.shape == "tuple":
            return z, z
        if self.shape == "int":
            return z.long()
        if self.shape == "raise":
            raise RuntimeError("my forward broke")
        return z


class NoParams(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()

    def forward(self, x):
        return torch.zeros(len(x), 10)


@dataclass(frozen=True, kw_only=True)
class TwoArgServer(FedAvg):
    name = "two_arg_server"

    def server_update(self, server, agg):
        return super().server_update(server, agg, None)


@dataclass(frozen=True, kw_only=True)
class TupleClient(FedAvg):
    name = "tuple_client"

    def client_update(self, msg, state, data, info, rnd, model):
        res = super().client_update(msg, state, data, info, rnd, model)
        return res.upload, res.weight


@dataclass(frozen=True, kw_only=True)
class RaisingClient(FedAvg):
    name = "raising_client"

    def client_update(self, msg, state, data, info, rnd, model):
        raise KeyError("my client broke")


@dataclass(frozen=True, kw_only=True)
class NanMetric(FedAvg):
    name = "nan_metric"

    def server_update(self, server, agg, rnd):
        server, metrics = super().server_update(server, agg, rnd)
        return server, {**metrics, "server/ratio": float("nan")}


@dataclass(frozen=True, kw_only=True)
class NarrowUpload(FedAvg):  # every client uploads linear.weight's first column only: [10, 1] for [10, 64]
    name = "narrow_upload"

    def client_update(self, msg, state, data, info, rnd, model):
        res = super().client_update(msg, state, data, info, rnd, model)
        delta = {k: v[:, :1] if k == "linear.weight" else v for k, v in res.upload.delta.items()}
        return res._replace(upload=res.upload._replace(delta=delta))


@dataclass(frozen=True, kw_only=True)
class FloatWeight(FedAvg):
    name = "float_weight"

    def client_update(self, msg, state, data, info, rnd, model):
        res = super().client_update(msg, state, data, info, rnd, model)
        return res._replace(weight=1.0, metrics={**res.metrics, "client/one": 1})  # Python numbers
"""


@pytest.fixture(autouse=True)
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``mymod`` on ``sys.path``, imported afresh by each test."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "mymod.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "mymod", raising=False)
    yield code
    sys.modules.pop("mymod", None)


def one_line(capsys: pytest.CaptureFixture[str], expected: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hafedho: error: ") and err.count("\n") == 1 and expected in err, err
    return err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.name=mymod:Net"],
            "model.name='mymod:Net' returns [2, 3] for a batch of 2, but the data has 10 classes: give it 10 outputs",
        ),
        (["model.name=mymod:Net", "model.options.shape=flat", "model.options.outputs=10"], "returns [2] for a batch"),
        (["model.name=mymod:Net", "model.options.shape=tuple", "model.options.outputs=10"], "returns a tuple of 2"),
        (["model.name=mymod:Net", "model.options.shape=int", "model.options.outputs=10"], "returns torch.int64 logi"),
        (["model.name=mymod:NoParams"], "model.name='mymod:NoParams' has no parameters; give it at least one"),
        (["algorithm.name=mymod:TwoArgServer"], "algorithm TwoArgServer: server_update(self, server, agg) cannot "),
    ],
)
def test_a_broken_model_or_hook_is_one_line_before_training(
    overrides: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "smoke", *overrides, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = one_line(capsys, expected)
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*/metrics*"))  # nothing trained


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_a_client_update_returning_a_tuple_is_one_line(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "smoke", "algorithm.name=mymod:TupleClient", f"engine={engine}", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 2
    one_line(capsys, "algorithm TupleClient: client_update returned a tuple of 2; it must return ClientResult(")


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_uploads_of_another_shape_than_their_parameter_are_one_line(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every client uploads [10, 1] for the [10, 64] weight (so the round's uploads agree with each other): refused
    against the model's parameter of that name, before it would broadcast into the model."""
    argv = ["run", "smoke", "algorithm.name=mymod:NarrowUpload", "model.name=logreg", f"engine={engine}"]
    assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 2
    expected = "upload leaf .delta['linear.weight'] is torch.float32[10, 1], but parameter linear.weight is [10, 64]"
    one_line(capsys, f"algorithm NarrowUpload: {expected}")


def test_exceptions_in_user_code_keep_their_traceback(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="my forward broke") as info:
        build(load_config(SMOKE, ["model.name=mymod:Net", "model.options.shape=raise"]))
    assert info.traceback[-1].path.name == "mymod.py"  # the user's own line
    with pytest.raises(KeyError, match="my client broke") as info:
        hafedho.run("smoke", "algorithm.name=mymod:RaisingClient", out=tmp_path, rounds=1)
    assert info.traceback[-1].path.name == "mymod.py"


def test_a_nan_metric_beside_a_finite_model_names_the_algorithm_not_the_lr(tmp_path: Path) -> None:
    with pytest.raises(Divergence) as info:
        hafedho.run("smoke", "algorithm.name=mymod:NanMetric", out=tmp_path, rounds=1)
    text = str(info.value)
    assert text.startswith("run stopped at round 1: server/ratio is nan (algorithm NanMetric's server_update ")
    assert "lower algorithm.lr" not in text


def test_a_float_weight_runs_on_vmap_as_on_loop(tmp_path: Path) -> None:
    rows = {
        e: hafedho.run("smoke", "algorithm.name=mymod:FloatWeight", f"engine={e}", out=tmp_path / e, rounds=1).final
        for e in ("loop", "vmap")
    }
    assert rows["loop"]["round"] == rows["vmap"]["round"] == 1
    assert rows["loop"]["client/one"] == rows["vmap"]["client/one"] == 1.0  # a Python-number metric, too
    assert rows["vmap"]["test/loss"] == pytest.approx(rows["loop"]["test/loss"], rel=1e-4)  # equal up to rounding


def test_a_positional_override_that_is_not_a_string_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"run\(\.\.\., 5\): an override is a string 'key=value'"):
        hafedho.run("smoke", 5)


def test_the_forward_check_moves_nothing_and_is_cheap() -> None:
    """The check's forward draws no random number the run sees, leaves every submodule's mode as it was, and
    costs a forward of two rows: well under 0.1 s for LeNet-5 (about 1 ms on two busy CPU cores)."""
    torch.manual_seed(0)

    class Noise(torch.nn.Module):  # draws in any mode
        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return z + 0 * torch.rand_like(z)

    net = torch.nn.Sequential(build_model("lenet5", (1, 28, 28), 10), torch.nn.Dropout(0.5), Noise())
    net[1].eval()
    x = torch.randn(2, 1, 28, 28)
    check_model(net, x, 10, "lenet5")  # warm-up
    state = torch.random.get_rng_state()
    t0 = time.perf_counter()
    check_model(net, x, 10, "lenet5")
    assert time.perf_counter() - t0 < 0.1
    assert torch.equal(torch.random.get_rng_state(), state)
    assert net.training and net[0].training and not net[1].training


@pytest.mark.parametrize("delay", [0.1, 0.5, 1.0, 2.0])
def test_ctrl_c_at_any_moment_of_the_start_is_one_line(tmp_path: Path, delay: float) -> None:
    """SIGINT while torch loads, while the run is built, or once it trains: one line, no traceback (the ``hafedho``
    command's entry point is ``hafedho.console:main``)."""
    import signal
    import subprocess

    code = "import sys; from hafedho.console import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "run", "smoke", "rounds=200", "--out", str(tmp_path / "out"), "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.startswith("hafedho: ") and err.count("\n") == 1 and "Traceback" not in err, err
