"""The functional view of an ``nn.Module`` that algorithms train: parameters in, loss out."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from hafedho.core import tree
from hafedho.core.sizing import module_device, rows_per_pass
from hafedho.core.tree import Params


class FunctionalModel:
    """Wraps a module so that its parameters are explicit arguments (``torch.func.functional_call``).

    Args:
        module: any ``nn.Module`` whose ``forward(x)`` returns logits. Models that also accept
            ``return_features=True`` (all of ``hafedho.models``) support ``features`` (MOON).
        weight_decay: L2 coefficient added to the loss, ``f(w) + wd/2 ||w||^2``. It lives in the loss (not in
            the optimiser) so every algorithm's gradient sums and control variates see the same f.
    """

    def __init__(self, module: nn.Module, weight_decay: float = 0.0) -> None:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
            # Running statistics are in-place buffer writes, which torch.func transforms forbid, and averaging
            # them across clients is ill-defined anyway; BatchNorm then normalises with batch statistics in
            # training and evaluation alike. Our models use GroupNorm.
            warnings.warn("BatchNorm layers will use batch statistics (running stats are not tracked)", stacklevel=2)
            torch.func.replace_all_batch_norm_modules_(module)
        self.module = module
        self.buffers = dict(module.named_buffers())
        self.weight_decay = weight_decay
        self._rows: dict[tuple, int] = {}  # (row shape, dtype) -> rows_per_pass
        self.compile_for: tuple[bool, ...] = ()  # grad modes whose forward runs compiled (use_compile)
        self._compiled: Any = None
        self._compiled_ok: set[bool] = set()
        self._on_fallback: Callable[[str], None] | None = None

    def use_compile(self, what: str, on_fallback: Callable[[str], None] | None = None) -> None:
        """Run the forward through ``torch.compile`` for evaluation (``"eval"``), for local steps and full-data
        passes (``"steps"``, autograd through the compiled graph) or both (``"all"``); ``"off"`` is eager.

        Only outside functorch transforms: under ``vmap`` the forward stays eager. Where compilation fails (no C++
        compiler, a module dynamo cannot trace), the first call says so in one line through ``on_fallback``
        (default: stderr) and the model runs eager from then on. Results agree with eager within the float32
        bound of ``tests/tolerance.py``: the compiled kernels fuse and reorder float operations.
        """
        self.compile_for = {"off": (), "eval": (False,), "steps": (True,), "all": (False, True)}[what]
        self._compiled, self._compiled_ok, self._on_fallback = None, set(), on_fallback

    def __getstate__(self) -> dict[str, Any]:  # a compiled function does not pickle: a worker compiles its own
        return {**self.__dict__, "_compiled": None, "_compiled_ok": set(), "_on_fallback": None}

    def rows_per_pass(self, row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Rows of ``row_shape`` that one pass takes at once (``core.sizing``: the CPU's cache rule, or the GPU's
        memory rule for a module on a GPU), measured once per shape and device."""
        key = (tuple(int(d) for d in row_shape), dtype, self.device)
        if key not in self._rows:
            self._rows[key] = rows_per_pass(self.module, key[0], dtype)
        return self._rows[key]

    @property
    def device(self) -> torch.device:
        """Where the module's parameters live (the CPU for a module without any)."""
        return module_device(self.module)

    def to(self, device: torch.device) -> FunctionalModel:
        """Move the module (parameters and buffers) to ``device`` in place; a compiled forward is rebuilt there."""
        if device != self.device:
            self.module.to(device)
            self.buffers = dict(self.module.named_buffers())
            self._compiled, self._compiled_ok = None, set()
        return self

    def params(self) -> Params:
        return {k: v.detach().clone() for k, v in self.module.named_parameters()}

    def logits(self, params: Params, x: Tensor) -> Tensor:
        compiled = self.compile_for and torch.is_grad_enabled() in self.compile_for
        if compiled and not torch._C._are_functorch_transforms_active():
            return self._compiled_logits(params, x)
        return functional_call(self.module, (params, self.buffers), (x,))

    def _compiled_logits(self, params: Params, x: Tensor) -> Tensor:
        mode = torch.is_grad_enabled()
        if self._compiled is None:
            self._compiled = torch.compile(lambda p, b, x: functional_call(self.module, (p, b), (x,)), dynamic=False)
        try:
            out = self._compiled(params, self.buffers, x)
        except Exception as e:
            if mode in self._compiled_ok:  # it compiled and ran before: a real error of this call
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            self.compile_for = ()
            text = f"compile: torch.compile is unavailable here ({type(e).__name__}: {first}); running eager"
            (self._on_fallback or (lambda t: print(f"warning: {t}", file=sys.stderr)))(text)
            return functional_call(self.module, (params, self.buffers), (x,))
        self._compiled_ok.add(mode)
        return out

    def features(self, params: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        return functional_call(self.module, (params, self.buffers), (x,), {"return_features": True})

    @property
    def head_names(self) -> tuple[str, str]:
        """Names of the final Linear layer's weight and bias (the last two parameters, by our models' contract)."""
        names = list(dict(self.module.named_parameters()))
        return names[-2], names[-1]

    def head(self, params: Params, z: Tensor) -> Tensor:
        """The final Linear layer applied to a representation z (pFedAFM mixes representations before it)."""
        w, b = self.head_names
        return F.linear(z, params[w], params[b])

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        return self.loss_from_logits(params, self.logits(params, x), y, mask)

    def loss_from_logits(self, params: Params, logits: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y, reduction="none")
        loss = (ce * mask).sum() / mask.sum().clamp(min=1.0)
        if self.weight_decay:
            loss = loss + 0.5 * self.weight_decay * tree.sq_norm(params)
        return loss

    def train(self, mode: bool = True) -> FunctionalModel:
        self.module.train(mode)
        return self


@torch.no_grad()
def evaluate(model: FunctionalModel, params: Params, x: Tensor, y: Tensor, batch_size: int | None = None) -> dict:
    """Accuracy and mean cross-entropy of ``params`` on ``(x, y)`` in eval mode (no dropout).

    ``x`` goes through the model in chunks of ``batch_size`` rows (None: ``model.rows_per_pass``, the cache rule
    of ``core.sizing``; under a compiled forward the last chunk is padded with zero rows, outputs dropped). The
    per-example losses are summed in float64, so the chunking moves the loss by float32 rounding of the logits at
    most, and the accuracy only where two logits nearly tie.
    """
    was_training = model.module.training
    model.module.eval()
    chunk = batch_size or model.rows_per_pass(tuple(x.shape[1:]), x.dtype)
    pad = False in model.compile_for  # a compiled forward sees one shape: the last chunk padded to a whole one
    correct, loss_sum = 0, 0.0
    for i in range(0, len(y), chunk):
        rows = x[i : i + chunk]
        if pad and len(rows) < chunk:
            rows = torch.cat([rows, rows.new_zeros((chunk - len(rows), *rows.shape[1:]))])
        logits = model.logits(params, rows)[: len(y[i : i + chunk])]
        loss_sum += float(F.cross_entropy(logits, y[i : i + chunk], reduction="none").double().sum())
        correct += int((logits.argmax(1) == y[i : i + chunk]).sum())
    model.module.train(was_training)
    n = max(len(y), 1)
    return {"acc": correct / n, "loss": loss_sum / n}
