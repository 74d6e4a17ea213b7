"""Wiring: turn a validated ``Config`` into an ``Experiment`` (data, partition, model, algorithm)."""

from __future__ import annotations

import copy
import hashlib
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hafedho.config import Config, ConfigError, ModelConfig, canonical_json
from hafedho.core import FedAlgorithm, FunctionalModel
from hafedho.core.algorithm import check_hooks
from hafedho.core.refs import USER_MODULE, user_module_name
from hafedho.core.sampling import bernoulli_cohort, fixed_cohort
from hafedho.core.seeds import seed_for
from hafedho.core.sizing import module_device
from hafedho.data import partition as P
from hafedho.data.federated import BatchPlan, FederatedData, split_local_test
from hafedho.data.flwr_partition import flwr_partition
from hafedho.data.sources import Dataset, load_dataset
from hafedho.models import build_model


@dataclass
class Experiment:
    """Everything a run needs, built from a config by ``hafedho.experiment.build``."""

    cfg: Config
    alg: FedAlgorithm
    fed: FederatedData
    model: FunctionalModel
    partition: dict[str, Any]  # sizes, hash

    @property
    def plan(self) -> BatchPlan:
        c = self.cfg.clients
        return BatchPlan(c.local_steps, c.batch_size, c.local_epochs)

    def cohort(self, rnd: int) -> np.ndarray:
        s, n = self.cfg.sampling, self.fed.num_clients
        if s.mode == "bernoulli":
            return bernoulli_cohort(self.cfg.seed, rnd, n, s.prob)
        return fixed_cohort(self.cfg.seed, rnd, n, cohort_size(self.cfg, n))


def cohort_size(cfg: Config, num_clients: int) -> int:
    """m for fixed-size sampling, checked against the real N (known once the partition is built)."""
    s = cfg.sampling
    m = s.cohort_size or max(1, round(s.fraction * num_clients))
    if m > num_clients:
        raise ConfigError(f"sampling.cohort_size={m} exceeds the {num_clients} clients; lower it")
    return m


def make_partition(cfg: Config, ds: Dataset, seed: int) -> list[np.ndarray]:
    d = cfg.data
    if d.partition == "natural":
        if ds.groups is None:
            raise ConfigError(f"data.partition='natural': source {ds.name!r} has no natural clients; use 'dirichlet'")
        parts = P.natural(ds.groups)
        if d.num_clients not in (0, len(parts)):
            raise ConfigError(
                f"data.num_clients={d.num_clients}: {ds.name} has {len(parts)} natural clients; set it to 0 or "
                f"{len(parts)}"
            )
        return parts
    if d.partition == "iid":
        return P.iid(len(ds.y_train), d.num_clients, seed)
    if d.partition.startswith(P.FLWR):
        return flwr_partition(
            d.partition, ds.y_train, d.num_clients, seed, d.partition_options, ds.groups, d.q, d.min_size
        )
    return P.dirichlet(ds.y_train, d.num_clients, d.q, seed, min_size=d.min_size)


def architecture(module: nn.Module) -> str:
    """8 hex digits of a module's parameter and buffer names, shapes and dtypes: two user modules of one class
    but another size are two experiments."""
    items = [(k, list(v.shape), str(v.dtype)) for k, v in module.state_dict(keep_vars=True).items()]
    return hashlib.sha256(canonical_json(items).encode()).hexdigest()[:8]


def data_hash(ds: Dataset) -> str:
    """16 hex digits of the data's arrays (dtypes, shapes, bytes): a resume on a replaced data file is refused."""
    h = hashlib.sha256()
    for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.groups):
        if a is not None:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape};".encode())
            h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:16]


def check_model(module: nn.Module, x: torch.Tensor, num_classes: int, name: str) -> None:
    """One forward of ``x`` (two training rows) when the run is built: the model has a parameter and returns float
    logits ``[len(x), num_classes]``, else one line naming ``model.name``. Nothing the run computes moves: no
    gradient, eval mode (each submodule's mode restored), no random draw kept (``fork_rng``). An exception raised
    in the model's own ``forward`` propagates as it is."""
    where = f"model.name={name!r}"
    if next(module.parameters(), None) is None:
        raise ConfigError(f"{where} has no parameters; give it at least one trainable layer (e.g. nn.Linear)")
    dev = module_device(module)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.no_grad():
            out = module(x.to(dev))
    finally:
        for m, mode in modes:
            m.training = mode
    b, want = len(x), f"logits [{len(x)}, {num_classes}] (batch, classes)"
    if not isinstance(out, torch.Tensor):
        what = f"a tuple of {len(out)}" if type(out) is tuple else type(out).__name__
        raise ConfigError(f"{where} returns {what} for a batch of {b}; forward(x) must return one Tensor of {want}")
    got = list(out.shape)
    if out.dim() == 2 and got[0] == b and got[1] != num_classes:
        raise ConfigError(
            f"{where} returns {got} for a batch of {b}, but the data has {num_classes} classes: give it "
            f"{num_classes} outputs"
        )
    if got != [b, num_classes]:
        raise ConfigError(f"{where} returns {got} for a batch of {b}; forward(x) must return {want}")
    if not out.is_floating_point():
        raise ConfigError(f"{where} returns {out.dtype} logits; forward(x) must return floating-point {want}")


def seed_globals(seed: int) -> None:
    """Seed the global generators (``random``, NumPy's, torch's) before user code runs (a loader, a model
    factory): code that draws from them gives the same data and model on every run of the config."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(cfg: Config, module: Callable[[], nn.Module] | nn.Module | None = None) -> Experiment:
    """Load data, partition it, build the model and the algorithm.

    Args:
        cfg: a validated config (``hafedho.config.load_config``).
        module: a factory (``lambda: MyNet()``, or the class itself) returning any ``nn.Module`` that maps a
            batch of the source's inputs to logits, used instead of ``cfg.model`` (the reference engine runs it
            as is; MOON and pFedAFM also need ``forward(x, return_features=True) -> (z, logits)``). It is called
            after the run's model seed is set, so the same config gives the same initial model. An ``nn.Module``
            instance is accepted too, with a warning: its weights were drawn before ``build`` could seed them.
            The run's config records ``model.name = "custom:<module>.<Class>"`` (``core.refs.user_module_name``: a
            record, not a reference) and, as its only option, the module's ``architecture`` (a hash of its parameter
            shapes), so its directory name and its resume check see the user's model, never the default one.
    """
    alg = cfg.selected_algorithm()  # checked when the config was loaded, before any data
    check_hooks(alg)  # a user's hook of the wrong arity: one line now, not a TypeError after round 1
    if module is None and cfg.model.name.startswith(USER_MODULE):
        raise ConfigError(
            f"model.name={cfg.model.name!r} is a user module; pass it to hafedho.experiment.build(cfg, module=...), "
            "or name it by reference: model.name='package.module:Class'"
        )
    if module is not None and not (isinstance(module, nn.Module) or callable(module)):
        raise ConfigError(
            f"module={type(module).__name__}: pass a factory returning an nn.Module (e.g. module=lambda: MyNet()), "
            "or None to build model.name"
        )
    seed_globals(seed_for(cfg.seed, "user_code"))
    ds = load_dataset(cfg.data.source, cfg.data.path, **(cfg.data.options or {}))
    pseed = cfg.seed if cfg.data.partition_seed is None else cfg.data.partition_seed
    parts = make_partition(cfg, ds, pseed)
    frac = cfg.data.local_test_fraction
    frac = (0.2 if alg.personalized else 0.0) if frac is None else frac
    local_test = None
    if frac > 0:
        parts, local_test = split_local_test(
            parts, frac, cfg.seed if cfg.data.partition_seed is None else cfg.data.partition_seed
        )
    fed = FederatedData(ds.x_train, ds.y_train, ds.x_test, ds.y_test, parts, ds.mean, ds.std, local_test)
    seed_globals(seed_for(cfg.seed, "model_init"))  # same initial model for every algorithm
    if module is None:
        try:
            module = build_model(cfg.model.name, fed.input_shape, ds.num_classes, **(cfg.model.options or {}))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model: {e}") from None
    else:
        if isinstance(module, nn.Module):
            warnings.warn(
                "build(cfg, module=<nn.Module instance>): its weights were drawn before build() seeded the run, "
                "so they do not follow cfg.seed; pass a factory instead, e.g. module=lambda: MyNet()",
                stacklevel=2,
            )
        else:
            module = module()
            if not isinstance(module, nn.Module):
                raise ConfigError(f"build(module=...): the factory returned {type(module).__name__}, not nn.Module")
        cfg = copy.deepcopy(cfg)  # the caller's config keeps its own model
        cfg.model = ModelConfig(
            name=user_module_name(type(module)),
            options={"architecture": architecture(module)},
        )
    sizes = [len(p) for p in parts]
    partition = {
        "hash": P.partition_hash(parts),
        "data_hash": data_hash(ds),
        "num_clients": len(parts),
        "sizes": sizes,
        "label_skew": P.label_skew(ds.y_train, parts, ds.num_classes),
        "source": ds.info,
    }
    model = FunctionalModel(module, weight_decay=cfg.clients.weight_decay)
    check_model(module, fed.preprocess(fed.x_train[:2]), ds.num_classes, cfg.model.name)
    return Experiment(cfg, alg, fed, model, partition)
