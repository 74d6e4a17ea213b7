"""Config: strict keys and types, impossible settings, overrides; each error is one line naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hafedho.config import RUNTIME_KEYS, Config, ConfigError, experiment_identity, load_config
from hafedho.data.partition import PartitionError
from hafedho.data.sources import DataError
from hafedho.experiment import build
from hafedho.toml_io import parse_override


def test_embedded_default_and_overrides() -> None:
    cfg = load_config(None, ["algorithm.hafedho.mu=0.05", "data.q=0.1", "sampling.mode=bernoulli"])
    assert cfg.algorithm["hafedho"]["mu"] == 0.05 and cfg.data.q == 0.1 and cfg.sampling.mode == "bernoulli"
    assert parse_override("a.b.c=[1, 2]") == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.qq=0.1"], r"^data.qq: unknown key; valid keys here: source, path, partition, q, "),
        (["data.q=0"], r"^data.q=0.0: must be > 0$"),
        (["data.q=-1"], r"^data.q=-1.0: must be > 0$"),
        (["rounds='ten'"], r"^rounds='ten': expected int, got str$"),
        (["rounds=1.5"], r"^rounds=1.5: expected int, got float$"),
        (["sampling.fraction=1.5"], r"^sampling.fraction=1.5: must be <= 1$"),
        (["data.num_clients=10", "sampling.cohort_size=20"], r"sampling.cohort_size=20 exceeds data.num_clients=10"),
        (["engine='gpu'"], r"^engine='gpu': choose one of 'loop', 'process', 'vmap', 'auto', or name your own"),
        (["data=3"], r"^data: expected a table"),
        (["noequals"], r"expected key=value"),
    ],
)
def test_bad_settings_fail_with_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.hafedho.mu=-1"], r"^algorithm.hafedho.mu=-1.0: must be >= 0$"),
        (["algorithm.name=scaffoldd"], r"^algorithm.name='scaffoldd': unknown algorithm; choose one of"),
        (["algorithm.fedprocs.mu=1"], r"^algorithm.fedprocs: not an algorithm"),
        (["algorithm.name=fedavg", "algorithm.mu=0.5"], r"^algorithm.mu: unknown setting for fedavg"),
    ],
)
def test_bad_algorithm_settings_fail_at_load(overrides: list[str], message: str) -> None:
    """``[algorithm]`` is checked once, when the config is loaded (``config_from_table``): before any data, for
    ``hafedho run``, sweeps (``test_sweep``) and Flower (``load_run_config``) alike."""
    from hafedho.flower.common import load_run_config

    missing = ["data.source=femnist", "data.path=/nonexistent"]  # never reached
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*overrides, *missing])
    with pytest.raises(ConfigError, match=message):
        load_run_config({"hafedho-config": "default", "overrides": " ".join(overrides)})


def test_only_the_selected_algorithms_table_is_kept() -> None:
    """The other algorithms' tables never apply to the run, so the loaded config (and its config.toml) drops them."""
    assert load_config(None).algorithm["hafedho"] == {"mu": 0.01}
    table = load_config(None, ["algorithm.name=fedprox", "algorithm.fedprox.mu=0.1", "algorithm.moon.mu=1"]).algorithm
    assert table == {"name": "fedprox", "lr": 0.05, "fedprox": {"mu": 0.1}}


def test_the_algorithm_is_built_once_and_never_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded config holds its algorithm (built at load, not at every use); any change to ``[algorithm]``
    (an edit in place, a new table, ``dataclasses.replace``) is seen, and a pickle or copy carries the table only."""
    import copy
    import pickle

    from hafedho import config as config_mod

    cfg = load_config(None, ["algorithm.name=fedprox", "algorithm.fedprox.mu=0.1"])
    builds: list[dict] = []
    real = config_mod.algorithm_from_table
    monkeypatch.setattr(config_mod, "algorithm_from_table", lambda t: builds.append(t) or real(t))
    alg = cfg.selected_algorithm()
    assert cfg.selected_algorithm() is alg and cfg.run_name and not builds  # held since load
    cfg.algorithm["fedprox"]["mu"] = 0.2
    assert cfg.selected_algorithm().mu == 0.2 and len(builds) == 1
    cfg.algorithm = {"name": "fedavg", "lr": 0.05}
    assert cfg.selected_algorithm().name == "fedavg"
    other = dataclasses.replace(cfg, algorithm={"name": "fedprox", "fedprox": {"mu": 0.3}})
    assert other.selected_algorithm().mu == 0.3 and cfg.selected_algorithm().name == "fedavg"
    assert "_resolved" not in vars(pickle.loads(pickle.dumps(cfg))) and copy.deepcopy(cfg) == cfg
    assert pickle.loads(pickle.dumps(cfg)).selected_algorithm() == cfg.selected_algorithm()
    cfg.algorithm["mu"] = 0.5  # fedavg has no mu: refused, never an old algorithm
    with pytest.raises(ConfigError, match=r"^algorithm.mu: unknown setting for fedavg"):
        cfg.selected_algorithm()


def test_the_run_dir_is_out_and_the_run_name() -> None:
    cfg = load_config(None, ["out=elsewhere"])
    assert cfg.run_dir == Path("elsewhere") / cfg.run_name
    assert dataclasses.replace(cfg, seed=1).run_dir.name.endswith("-s1")


def test_the_runtime_half_is_declared_on_the_fields() -> None:
    """``runtime_hp`` marks how, where and how long a run runs; everything else is the experiment."""
    runtime = {"rounds", "eval_every", "checkpoint_every", "engine", "device", "workers", "vmap_chunk", "threads"}
    runtime.add("compile")
    assert {*runtime, "client_store", "name", "out", "log"} == RUNTIME_KEYS
    assert all(f.metadata["help"] for f in dataclasses.fields(Config) if f.name in RUNTIME_KEYS)  # still hp()s
    ident = experiment_identity(load_config(None))
    assert set(ident) == {f.name for f in dataclasses.fields(Config)} - RUNTIME_KEYS
    assert set(ident) == {"seed", "precision", "data", "clients", "sampling", "model", "diagnostics", "algorithm"}


def test_missing_data_path() -> None:
    cfg = load_config(None, ["data.source=femnist", "data.path=/nonexistent/femnist"])
    with pytest.raises(DataError, match="/nonexistent/femnist"):
        build(cfg)


def test_cohort_larger_than_natural_population(shared_data: Path) -> None:
    cfg = load_config(
        None, ["data.source=femnist", "data.partition=natural", "data.num_clients=0", "sampling.cohort_size=500"]
    )
    with pytest.raises(ConfigError, match=r"sampling.cohort_size=500 exceeds the 105 clients"):
        build(cfg).cohort(1)


def test_impossible_partition() -> None:
    cfg = load_config(None, ["data.num_clients=1000", "data.min_size=10"])
    with pytest.raises(PartitionError, match="min_size"):
        build(cfg)


def test_bad_toml_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config(tmp_path / "missing.toml")


def test_dump_toml_quotes_keys_that_are_not_bare() -> None:
    """A user algorithm's table (``[algorithm."my_pkg.mod:Alg"]``) is written as a quoted key: unquoted, its dots
    would read back as nested tables and its colon is no TOML at all."""
    import tomllib

    from hafedho.toml_io import dump_toml

    d = {"seed": 1, "algorithm": {"name": "my_pkg.mod:Alg", "my_pkg.mod:Alg": {"beta": 0.5}, "fedavg": {"x-y": 1}}}
    text = dump_toml(d)
    assert '[algorithm."my_pkg.mod:Alg"]' in text and "[algorithm.fedavg]\nx-y = 1" in text
    assert tomllib.loads(text) == d
