"""Model zoo: plain ``nn.Module``s sharing one forward contract, plus a registry.

Every model's ``forward(x, return_features=False)`` returns logits ``[B, num_classes]``,
or ``(z, logits)`` where ``z`` is the representation fed to the final Linear layer
(MOON's contrastive loss uses it). Every model takes ``projection`` (default 0): the width of
MOON's projection head (Linear-ReLU-Linear) inserted between the encoder and the final Linear,
whose output is then ``z``. Inputs are normalised float tensors, ``[B, D]`` or
``[B, C, H, W]``. No model contains BatchNorm, so all are safe for vectorised
(``torch.func.vmap``) client training.

A user's model is named by a reference ``model.name = "package.module:Name"`` (an ``nn.Module`` class or a
function returning one; imported on demand by ``hafedho.core.refs``) or registered by ``hafedho.register``; it is
built exactly like ours: called with the ``input_shape`` and ``num_classes`` it declares (by those names) and
``model.options``, checked against its annotations, after the run's model seed is set.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hafedho.core.algorithm import check_value
from hafedho.core.refs import import_reference, is_reference
from hafedho.models.cnn import CifarCNN, FemnistCNN, LeNet5
from hafedho.models.resnet import ResNet18GN
from hafedho.models.simple import MLP, LogReg

__all__ = [
    "MLP",
    "MODELS",
    "CifarCNN",
    "FemnistCNN",
    "LeNet5",
    "LogReg",
    "ResNet18GN",
    "build_model",
    "check_model_factory",
    "count_flops",
    "num_params",
]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "logreg": LogReg,
    "mlp": MLP,
    "femnist_cnn": FemnistCNN,
    "cifar_cnn": CifarCNN,
    "lenet5": LeNet5,
    "resnet18_gn": ResNet18GN,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> nn.Module:
    """Build a registered model.

    Args:
        name: A key of ``MODELS``, or a reference ``"package.module:Name"`` to a class or factory.
        input_shape: Shape of one example, without the batch dimension.
        num_classes: Number of output classes.
        **options: Model-specific options (e.g. ``hidden`` for ``mlp``).

    Returns:
        The freshly initialised model (uses torch's global RNG; seed it first).

    Raises:
        ValueError: Unknown name or option, an option of the wrong type (checked against the factory's
            annotations, as hyperparameters are: ``hidden="64"`` or ``hidden=[64.7]`` is refused, never
            coerced), or an input shape the model cannot take.
    """
    if is_reference(name):
        obj = import_reference("model.name", name, ValueError)
        factory = check_model_factory(obj, f"model.name={name!r}", reference=True)
    elif name in MODELS:
        factory = MODELS[name]
    else:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)}, or name your own by reference, "
            "model.name='package.module:Net'"
        )
    params = inspect.signature(factory).parameters
    shape = {"input_shape": tuple(input_shape), "num_classes": num_classes}
    allowed = [p for p, v in params.items() if p not in shape and v.kind != v.VAR_KEYWORD]
    takes_any = any(v.kind == v.VAR_KEYWORD for v in params.values())
    unknown = [] if takes_any else sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"model {name!r} has no option(s) {', '.join(unknown)}; its options are: {', '.join(allowed) or 'none'}"
        )
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # a user's annotation that does not resolve: its options go unchecked, as unannotated ones
        hints = {}
    checked = {k: _check_option(f"model.options.{k}", v, hints.get(k, Any)) for k, v in options.items()}
    module = factory(**{k: v for k, v in shape.items() if k in params}, **checked)
    if not isinstance(module, nn.Module):
        raise ValueError(f"model.name={name!r} returned {type(module).__name__}, not an nn.Module; return one")
    return module


def check_model_factory(obj: object, where: str, reference: bool = False) -> Callable[..., nn.Module]:
    """``obj`` if it can build a model (an ``nn.Module`` class, or a function returning one), else one line.
    Named by ``reference`` (text, not code), it must be a class or a ``def`` function, never another callable:
    what a config calls is the user's code (``hafedho.core.refs``)."""
    if isinstance(obj, nn.Module):
        raise ValueError(
            f"{where}: an nn.Module instance, whose weights would not follow the run's seed; name its class or a "
            "function that builds it"
        )
    plain = isinstance(obj, type) or inspect.isfunction(obj)
    if (isinstance(obj, type) and not issubclass(obj, nn.Module)) or not callable(obj) or (reference and not plain):
        what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        raise ValueError(
            f"{where}: {what} is not an nn.Module factory; name an nn.Module subclass or a function returning one"
        )
    return obj


def _check_option(key: str, value: Any, annotation: Any) -> Any:
    """``check_value`` for one model option; a ``Sequence[T]`` option takes a list of T (a tuple is returned)."""
    if annotation is Any:
        return value
    if typing.get_origin(annotation) in (collections.abc.Sequence, list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (Any,)
        if not isinstance(value, list | tuple):
            simple = isinstance(value, int | float) or (isinstance(value, str) and value.strip().isdigit())
            example = f"[{str(value).strip()}]" if simple else "[64, 64]"
            raise ValueError(
                f"{key}={value!r}: expected a list of {getattr(item, '__name__', item)}, e.g. {key}={example}"
            )
        return tuple(_check_option(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    return check_value(key, value, annotation, {})


def num_params(model: nn.Module) -> int:
    """Total number of parameter elements (trainable or not)."""
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward FLOPs of one example, counted as 2 x multiply-adds of Linear and Conv2d layers.

    Biases, activations, pooling and normalisation are ignored (they are a small
    fraction for these models); a training step costs roughly 3x this. Counted from
    the layers' actual output shapes via forward hooks on one zero example, run in
    eval mode under ``no_grad`` (the model's mode is restored afterwards).

    Args:
        model: Any module; only its ``nn.Linear``/``nn.Conv2d`` submodules count.
        input_shape: Shape of one example, without the batch dimension.

    Returns:
        ``sum over Linear of 2 * in_features * out_features * positions`` plus
        ``sum over Conv2d of 2 * (C_in / groups) * k_h * k_w * C_out * H_out * W_out``.
    """
    total = 0

    def linear_hook(module: nn.Linear, _inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        total += 2 * module.in_features * output.numel()

    def conv_hook(module: nn.Conv2d, _inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        k_h, k_w = module.kernel_size
        total += 2 * (module.in_channels // module.groups) * k_h * k_w * output.numel()

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
        elif isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=device, dtype=dtype))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return int(total)
