"""Tests for hafedho.models."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import SMOKE
from tolerance import fp32_close, longest_reduction
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from hafedho.config import load_config
from hafedho.core import ConfigError, FunctionalModel
from hafedho.experiment import build
from hafedho.models import MODELS, build_model, count_flops, num_params

# (name, input shape, classes) each model is meant for.
CASES = [
    ("logreg", (60,), 5),
    ("mlp", (60,), 5),
    ("femnist_cnn", (1, 28, 28), 62),
    ("cifar_cnn", (3, 32, 32), 10),
    ("lenet5", (3, 32, 32), 10),
    ("lenet5", (1, 28, 28), 10),
    ("resnet18_gn", (3, 32, 32), 10),
]
SMALL = [c for c in CASES if c[0] != "resnet18_gn"]
FEATURE_DIM = {"mlp": 200, "femnist_cnn": 128, "cifar_cnn": 192, "lenet5": 84, "resnet18_gn": 512}


def make(name: str, shape: tuple[int, ...], classes: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, shape, classes)


def test_registry_has_all_models() -> None:
    assert set(MODELS) == {"logreg", "mlp", "femnist_cnn", "cifar_cnn", "lenet5", "resnet18_gn"}


@pytest.mark.parametrize(("name", "shape", "classes"), CASES)
def test_shapes_and_feature_mode(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = make(name, shape, classes).eval()
    x = torch.randn(2, *shape)
    with torch.no_grad():
        logits = model(x)
        z, logits2 = model(x, return_features=True)
    assert logits.shape == (2, classes)
    dim = FEATURE_DIM.get(name, 60)  # logreg's z is the flattened input
    assert z.shape == (2, dim)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=0)


def test_parameter_counts() -> None:
    """Counts by hand.

    femnist_cnn (1x28x28, 62 classes), as FedML's CNN_DropOut:
        conv1 32*1*9+32 = 320, conv2 64*32*9+64 = 18,496, fc1 9216*128+128 = 1,179,776,
        fc2 128*62+62 = 7,998; total 1,206,590.
    cifar_cnn (3x32x32, 10 classes):
        conv1 64*3*25+64 = 4,864, conv2 64*64*25+64 = 102,464, fc1 1600*384+384 = 614,784,
        fc2 384*192+192 = 73,920, fc3 192*10+10 = 1,930; total 797,962.
    lenet5 (3x32x32, 10 classes):
        conv1 6*3*25+6 = 456, conv2 16*6*25+16 = 2,416, fc1 400*120+120 = 48,120,
        fc2 120*84+84 = 10,164, fc3 84*10+10 = 850; total 62,006.
    mlp (784 inputs, 10 classes) is FedAvg's 2NN: 157,000 + 40,200 + 2,010 = 199,210.
    resnet18_gn (10 classes): the standard CIFAR ResNet-18 count 11,173,962 (GroupNorm has
        the same affine parameters as BatchNorm).
    """
    assert num_params(build_model("femnist_cnn", (1, 28, 28), 62)) == 1_206_590
    assert num_params(build_model("cifar_cnn", (3, 32, 32), 10)) == 797_962
    assert num_params(build_model("lenet5", (3, 32, 32), 10)) == 62_006
    assert num_params(build_model("mlp", (784,), 10)) == 199_210
    assert num_params(build_model("logreg", (784,), 10)) == 7_850
    assert num_params(build_model("resnet18_gn", (3, 32, 32), 10)) == 11_173_962


@pytest.mark.parametrize(("name", "shape", "classes"), CASES)
def test_no_batchnorm(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = build_model(name, shape, classes)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize(("name", "shape", "classes"), SMALL)
def test_functional_grad_matches_autograd(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = make(name, shape, classes).eval()  # eval: dropout off, so both runs agree
    x, y = torch.randn(4, *shape), torch.randint(0, classes, (4,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    g = grad(loss_fn)(params)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}  # torch.func against autograd: other kernels may run
    fp32_close(g, grads, reduction=longest_reduction(model, x), steps=1, what=name)


def test_functional_grad_resnet_runs() -> None:
    model = make("resnet18_gn", (3, 16, 16), 10).eval()
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 2])
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = grad(lambda p: nn.functional.cross_entropy(functional_call(model, p, (x,)), y))(params)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    fp32_close(g, grads, reduction=longest_reduction(model, x), steps=1, what="resnet18_gn")


@pytest.mark.parametrize(
    ("name", "shape", "classes"),
    [("logreg", (60,), 5), ("mlp", (60,), 5), ("femnist_cnn", (1, 28, 28), 62), ("cifar_cnn", (3, 32, 32), 10)],
)
def test_vmap_over_models_matches_loop(name: str, shape: tuple[int, ...], classes: int) -> None:
    models = [make(name, shape, classes, seed=s).eval() for s in range(3)]
    params, buffers = stack_module_state(models)
    base = models[0]
    x = torch.randn(3, 2, *shape)  # a different batch per model

    def run(p: dict, b: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (xb,))

    with torch.no_grad():
        batched = vmap(run)(params, buffers, x)
        looped = torch.stack([m(xb) for m, xb in zip(models, x, strict=True)])
    fp32_close(batched, looped, reduction=longest_reduction(base, x[0]), steps=1, what=name)  # bmm vs mm kernels


def test_count_flops_linear() -> None:
    # 2 * in * out per example; biases are not counted.
    assert count_flops(nn.Sequential(nn.Flatten(), nn.Linear(10, 5)), (10,)) == 2 * 10 * 5
    assert count_flops(build_model("logreg", (10,), 5), (10,)) == 100


def test_count_flops_conv_and_mode_restored() -> None:
    # Conv 3->8, 3x3, stride 1, no padding on 10x10: output 8x8x8 = 512 positions x
    # (3*3*3 = 27) MACs each, so 2 * 27 * 512 = 27,648 FLOPs.
    model = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3))
    model.train()
    assert count_flops(model, (3, 10, 10)) == 2 * 27 * 8 * 8 * 8
    assert model.training


def test_unknown_model_and_option() -> None:
    with pytest.raises(ValueError, match="unknown model 'x'; choose one of: logreg, mlp"):
        build_model("x", (10,), 2)
    with pytest.raises(ValueError, match="no option"):
        build_model("mlp", (10,), 2, width=3)
    assert num_params(build_model("mlp", (10,), 2, hidden=(4,))) == 10 * 4 + 4 + 4 * 2 + 2


@pytest.mark.parametrize(
    ("name", "shape"),
    [("femnist_cnn", (64,)), ("cifar_cnn", (1, 28, 28)), ("lenet5", (3, 30, 30)), ("resnet18_gn", (64,))],
)
def test_wrong_input_shape(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"model '{name}' cannot take input shape {shape}")) as err:
        build_model(name, shape, 10)
    assert "\n" not in str(err.value)


# --- MOON's projection head (model option ``projection``) ------------------------------------------------------


@pytest.mark.parametrize(("name", "shape", "classes"), CASES)
def test_projection_head_is_z_and_feeds_the_output_layer(name: str, shape: tuple[int, ...], classes: int) -> None:
    """projection = 16 inserts Linear(d, d) ReLU Linear(d, 16) between the encoder (its z of width d) and the
    output layer: z becomes 16-d, the output layer takes 16 inputs, and d*d + d + 16*d + 16 + (16 - d)*classes
    parameters are added. The output layer stays the last two parameters (pFedAFM's head contract)."""
    torch.manual_seed(0)
    plain = build_model(name, shape, classes)
    torch.manual_seed(0)
    model = build_model(name, shape, classes, projection=16).eval()
    d = FEATURE_DIM.get(name, 60)
    assert num_params(model) - num_params(plain) == d * d + d + 16 * d + 16 + (16 - d) * classes
    x = torch.randn(2, *shape)
    fm = FunctionalModel(model)
    with torch.no_grad():
        z, logits = model(x, return_features=True)
        assert z.shape == (2, 16) and logits.shape == (2, classes)
        torch.testing.assert_close(fm.head(fm.params(), z), logits, rtol=0, atol=0)
        torch.testing.assert_close(model(x), logits, rtol=0, atol=0)
    names = [k for k, _ in model.named_parameters()]
    assert names[-2:] == list(fm.head_names) and model.get_parameter(names[-2]).shape == (classes, 16)
    assert [k for k in names if "proj" in k][-1].endswith("proj.2.bias")


def test_projection_zero_is_the_plain_model() -> None:
    torch.manual_seed(0)
    a = build_model("lenet5", (3, 32, 32), 10)
    torch.manual_seed(0)
    b = build_model("lenet5", (3, 32, 32), 10, projection=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# --- model options are type-checked like hyperparameters --------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hidden": "64"}, "model.options.hidden='64': expected a list of int, e.g. model.options.hidden=[64]"),
        ({"hidden": 64}, "model.options.hidden=64: expected a list of int, e.g. model.options.hidden=[64]"),
        ({"hidden": [64.7]}, "model.options.hidden[0]=64.7: expected int, got float"),
        ({"hidden": [64, True]}, "model.options.hidden[1]=True: expected int, got bool"),
        ({"projection": "8"}, "model.options.projection='8': expected int, got str"),
        ({"projection": 8.0}, "model.options.projection=8.0: expected int, got float"),
        ({"projection": -1}, "model 'mlp': projection must be an integer >= 0 (got -1); 0 = no head"),
    ],
)
def test_model_options_are_type_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_model("mlp", (6,), 4, **options)


def test_list_options_are_taken_as_given() -> None:
    """hidden = [64] (a TOML list) builds a 6-64-4 network; a tuple is accepted too."""
    for hidden in ([64], (64,)):
        model = build_model("mlp", (6,), 4, hidden=hidden)
        assert [tuple(p.shape) for p in model.parameters()] == [(64, 6), (64,), (4, 64), (4,)]
    with pytest.raises(ValueError, match=r"^model\.options\.groups=2\.0: expected int, got float$"):
        build_model("resnet18_gn", (3, 32, 32), 10, groups=2.0)


def test_bad_model_option_in_a_config_is_one_config_error_line() -> None:
    cfg = load_config(SMOKE, ["model.name='mlp'", "model.options.hidden='64'"])
    with pytest.raises(ConfigError, match=r"^model: model\.options\.hidden='64': expected a list of int") as err:
        build(cfg)
    assert "\n" not in str(err.value)
