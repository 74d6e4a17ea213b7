"""Contract tests over the whole registry: every algorithm obeys every invariant of the runtime.

A new algorithm file is checked here the moment it is registered: finite metrics, a falling loss on a
synthetic federated problem, stable state shapes and dtypes, bit-identical checkpoint/resume, honest byte
counts, empty rounds that change nothing, a two-round CLI run, and one-line refusals of bad hyperparameters derived
from each ``hp`` declaration.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import torch
from helpers import no_wall, smoke_config
from torch.utils import _pytree as pytree

from hafedho.algorithms import REGISTRY
from hafedho.algorithms.fedavg import FedAvg
from hafedho.cli import main
from hafedho.core import ConfigError, RoundInfo, tree
from hafedho.experiment import build
from hafedho.runfiles import read_metrics
from hafedho.runtime.checkpoint import stored_clients
from hafedho.sim.runner import run

ALGS = sorted(REGISTRY)
CKPT = "checkpoint_every=1"  # every contract run checkpoints each round


@pytest.mark.parametrize("alg", ALGS)
def test_loss_falls_and_metrics_finite_on_synthetic(tmp_path: Path, alg: str) -> None:
    """FedProx Synthetic(1, 1): 30 natural devices, logistic regression, 10 rounds of 6 clients."""
    cfg = smoke_config(
        tmp_path,
        CKPT,
        "rounds=10",
        "data.source='synthetic'",
        "data.partition='natural'",
        "data.num_clients=0",
        "sampling.cohort_size=6",
        "clients.local_steps=5",
        "algorithm.lr=0.01",
        alg=alg,
    )
    run(build(cfg), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        for k, v in row.items():
            assert not isinstance(v, float) or math.isfinite(v), (k, v)
    first = sum(r["train/loss"] for r in rows[:2]) / 2
    last = sum(r["train/loss"] for r in rows[-2:]) / 2
    assert last < first, f"{alg}: train loss {first:.4f} -> {last:.4f}"


@pytest.mark.parametrize("alg", ALGS)
def test_state_shapes_stable_resume_identical_and_bytes_honest(tmp_path: Path, alg: str) -> None:
    full = build(smoke_config(tmp_path / "a", CKPT, "rounds=4", alg=alg))
    run(full, tmp_path / "a" / "run", progress=False)
    run(build(smoke_config(tmp_path / "b", CKPT, "rounds=2", alg=alg)), tmp_path / "b" / "run", progress=False)
    run(
        build(smoke_config(tmp_path / "b", CKPT, "rounds=4", alg=alg)),
        tmp_path / "b" / "run",
        resume=True,
        progress=False,
    )
    a_rows, b_rows = read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run")
    assert no_wall(a_rows) == no_wall(b_rows)

    a = torch.load(tmp_path / "a" / "run" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "run" / "checkpoint.pt", weights_only=True)
    a["store"], b["store"] = (stored_clients(tmp_path / x / "run") for x in "ab")  # the journal, read back
    for x, y in zip(a["server"] + a["store"], b["server"] + b["store"], strict=True):
        assert torch.equal(x, y)

    params0 = full.model.params()
    server0 = pytree.tree_leaves(full.alg.init_server(params0))
    client0 = pytree.tree_leaves(full.alg.init_client(params0))
    assert [(t.shape, t.dtype) for t in a["server"]] == [(t.shape, t.dtype) for t in server0]
    n = full.fed.num_clients
    assert [(t.shape, t.dtype) for t in a["store"]] == [((n, *t.shape), t.dtype) for t in client0]

    msg = full.alg.broadcast(full.alg.init_server(params0), RoundInfo(1, n, 1))
    for row in a_rows:
        assert row["bytes_down"] == row["cohort_size"] * tree.num_bytes(msg)
        assert row["bytes_up"] > 0


@pytest.mark.parametrize("alg", ALGS)
def test_an_empty_round_leaves_the_server_state_unchanged(tmp_path: Path, alg: str) -> None:
    """Nobody sampled (Bernoulli participation): the runtime skips ``server_update``, so no algorithm needs a
    None case; the rows say the round happened with nobody, and the checkpoint is the initial server state."""
    exp = build(smoke_config(tmp_path, CKPT, "sampling.mode='bernoulli'", "sampling.prob=0.0001", alg=alg))
    assert all(len(exp.cohort(t)) == 0 for t in (1, 2))
    init = pytree.tree_leaves(exp.alg.init_server(exp.model.params()))
    run(exp, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [(r["cohort_size"], r["bytes_up"], r["bytes_down"]) for r in rows] == [(0, 0, 0), (0, 0, 0)]
    assert not any(k.startswith(("server/", "train/")) for r in rows for k in r)
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert len(ckpt["server"]) == len(init) and all(
        torch.equal(a, b) for a, b in zip(ckpt["server"], init, strict=True)
    )


@pytest.mark.parametrize("alg", ALGS)
def test_cli_runs_two_rounds(tmp_path: Path, alg: str) -> None:
    assert main(["run", "smoke", f"algorithm.name={alg}", "--out", str(tmp_path), "--quiet"]) == 0
    assert [r["round"] for r in read_metrics(next(tmp_path.glob(f"{alg}-digits-*-s0")))] == [1, 2]


HYPERPARAMETERS = [
    pytest.param(alg, f.name, id=f"{alg}.{f.name}") for alg in ALGS for f in dataclasses.fields(REGISTRY[alg])
]


def refusals(cls: type, name: str) -> list[tuple[object, str]]:
    """Values the hyperparameter ``name`` must refuse, each with its one-line message, read off its declaration:
    the wrong type, None unless optional, a non-finite float, each side of its range, a value not among its
    choices. Ints stand in for floats (accepted and converted, so the message shows the float)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[name]
    hint = typing.get_type_hints(cls)[name]
    types = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    expected = " or ".join(t.__name__ for t in types)
    key = f"algorithm.{name}"
    wrong = 1 if str in types else "1"
    out: list[tuple[object, str]] = [(wrong, f"{key}={wrong!r}: expected {expected}, got {type(wrong).__name__}")]
    if type(None) not in typing.get_args(hint):
        out.append((None, f"{key}: None is not allowed; expected {expected}"))
    if float in types:
        out.append((math.inf, f"{key}=inf: must be a finite number"))
    for bound, sign, outside in (("gt", ">", 0), ("ge", ">=", -1), ("lt", "<", 0), ("le", "<=", 1)):
        if meta.get(bound) is not None:
            bad = meta[bound] + outside
            out.append(
                (int(bad) if float(bad).is_integer() else bad, f"{key}={float(bad)!r}: must be {sign} {meta[bound]}")
            )
    if meta.get("choices"):
        choices = ", ".join(map(repr, meta["choices"]))
        out.append(("no-such-choice", f"{key}='no-such-choice': choose one of {choices}"))
    return out


@pytest.mark.parametrize(("alg", "name"), HYPERPARAMETERS)
def test_bad_hyperparameter_is_refused_in_one_line(alg: str, name: str) -> None:
    cls = REGISTRY[alg]
    for value, message in refusals(cls, name):
        with pytest.raises(ConfigError) as err:
            cls.from_config({name: value})
        assert str(err.value) == message


@pytest.mark.parametrize("alg", ALGS)
def test_unknown_and_pinned_settings_are_refused_naming_the_valid_ones(alg: str) -> None:
    """Also FedAvg's settings that a subclass pins as a ClassVar (FedProx's server_lr): they are no settings."""
    cls = REGISTRY[alg]
    valid = sorted(f.name for f in dataclasses.fields(cls))
    pinned = [f.name for f in dataclasses.fields(FedAvg) if issubclass(cls, FedAvg) and f.name not in valid]
    for key in ["no_such_setting", *pinned]:
        with pytest.raises(ConfigError) as err:
            cls.from_config({key: getattr(cls, key, 1.0)})
        assert str(err.value) == f"algorithm.{key}: unknown setting for {alg}; valid: {', '.join(valid)}"
