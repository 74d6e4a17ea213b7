"""Typed experiment configuration: TOML files plus dotted ``key=value`` overrides, strictly validated.

Every unknown key, wrong type or impossible setting fails before any training with one line naming key and fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hafedho.algorithms import algorithm_from_table, applicable
from hafedho.core.algorithm import ConfigError, FedAlgorithm, check_value, hp
from hafedho.core.device import PRECISIONS, device_problem
from hafedho.core.diagnostics import Diagnostics
from hafedho.core.refs import file_name
from hafedho.data.partition import check_partition
from hafedho.engine_registry import check_engine, engine_help, option_field
from hafedho.toml_io import control_chars, deep_merge, parse_override, read_toml

CONFIG_DIR = Path(__file__).parent / "configs"


def runtime_hp(default: Any, help: str, **checks: Any) -> Any:
    """``hp`` for a runtime setting: one that says how, where or how long a run runs, never what it computes.

    Runtime settings (``RUNTIME_KEYS``) are not part of a run's identity (extending ``rounds`` continues a run;
    engines agree up to float rounding) and never a report axis; every other setting is the experiment.
    """
    return runtime(hp(default, help, **checks))


def runtime(f: Any) -> Any:
    """A config field (``hp``'s) marked as a runtime setting (see ``runtime_hp``)."""
    return dataclasses.field(default=f.default, metadata={**f.metadata, "runtime": True})


@dataclass
class LogConfig:
    """``[log]``: experiment trackers that mirror metrics.jsonl (``hafedho.tracking``); a runtime section."""

    tensorboard: bool | str = hp(
        False, "TensorBoard event files: true = RUN_DIR/tensorboard, a folder = FOLDER/RUN_NAME, false = off"
    )
    mlflow: str = hp("", "MLflow tracking URI of a local SQLite store, e.g. 'sqlite:///mlruns.db'; '' = off")
    mlflow_experiment: str | None = hp(None, "MLflow experiment; None = the run name's prefix (name or ALG-SOURCE)")


@dataclass
class DataConfig:
    source: str = hp("digits", "data source (see `hafedho datasets`)")
    path: str | None = hp(None, "file or folder to read; None = the source's default")
    partition: str = hp("dirichlet", "how train data is split: dirichlet, iid, natural or flwr:<Partitioner>")
    q: float = hp(0.3, "Dirichlet concentration (smaller = more heterogeneous)", gt=0)
    num_clients: int = hp(0, "N; 0 = all groups for natural, 100 otherwise", ge=0)
    min_size: int = hp(10, "Dirichlet: redraw until every client holds at least this many samples", ge=1)
    partition_seed: int | None = hp(None, "seed of the partition; None = the run seed", ge=0)
    local_test_fraction: float | None = hp(
        None, "held-out share of each client's data for personalised accuracy; None = 0.2 if personalised", ge=0, lt=1
    )
    options: dict | None = hp(None, "source-specific options, e.g. {alpha = 1.0, beta = 1.0} for synthetic")
    partition_options: dict | None = hp(None, "flwr:<Partitioner>'s constructor options, e.g. {alpha = 0.5}")


@dataclass
class ClientsConfig:
    local_steps: int = hp(10, "lambda: local SGD steps per round", ge=1)
    batch_size: int = hp(20, "local batch size B", ge=1)
    local_epochs: int = hp(0, "> 0: whole local epochs instead of local_steps", ge=0)
    weight_decay: float = hp(0.0, "L2 coefficient in every client's loss", ge=0)


@dataclass
class SamplingConfig:
    mode: str = hp("fixed", "fixed-size cohorts or Bernoulli participation", choices=("fixed", "bernoulli"))
    fraction: float = hp(0.1, "fixed: m = round(fraction * N) when cohort_size = 0", gt=0, le=1)
    cohort_size: int = hp(0, "fixed: m; 0 = from fraction", ge=0)
    prob: float = hp(0.1, "bernoulli: each client's participation probability", gt=0, le=1)


@dataclass
class ModelConfig:
    name: str = hp("mlp", "model (see hafedho.models.MODELS)")
    options: dict | None = hp(None, "model options, e.g. {hidden = [64]}")


@dataclass
class DiagnosticsConfig:
    """Simulator-only measurements that log more but never change a run's trajectory; part of the experiment
    (a diagnostic run has other rows), so a run with them on has its own directory."""

    every: int = hp(
        0,
        "Theorem 1 measured: every k-th round, before the cohort trains, log how well each sampled client's estimate "
        "(HaFedHo's h) matches the exact full-data gradient it stands for (diag/*; one pass over all clients' "
        "training data; simulation only); 0 = off",
        ge=0,
    )


@dataclass
class Config:
    seed: int = hp(0, "seed of everything (model init, partition, cohorts, batches)", ge=0)
    rounds: int = runtime_hp(100, "T: communication rounds", ge=1)
    eval_every: int = runtime_hp(1, "evaluate the global model every k rounds (and at the last)", ge=1)
    checkpoint_every: int = runtime_hp(10, "checkpoint every k rounds (and at the last)", ge=1)
    engine: str | None = runtime_hp(None, engine_help())  # help, options, names: the registry's (check_engine)
    device: str = runtime_hp(
        "auto",
        "where the run's tensors live: auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N",
    )
    workers: int = runtime(option_field("workers"))
    vmap_chunk: int = runtime(option_field("vmap_chunk"))
    threads: int = runtime_hp(
        1,
        "torch intra-op threads of the run (process workers always use 1); 0 = torch's default of one per core, "
        "shared among a sweep's jobs. 1 by default: see README, Performance",
        ge=0,
    )
    compile: str = runtime_hp(
        "off",
        "torch.compile the model's forward for evaluation, local steps (and full-data passes) or all; vmap and "
        "the process engine's channels-last workers stay eager; where it cannot compile, one warning line and eager",
        choices=("off", "eval", "steps", "all"),
    )
    client_store: str = runtime_hp(
        "auto",
        "per-client state on the run's GPU, in RAM or memory-mapped on disk; auto = on the GPU while it takes at "
        "most half of the GPU's free memory, else in RAM up to 2 GiB, else on disk (docs/client_store.md)",
        choices=("auto", "device", "memory", "disk"),
    )
    precision: str = hp(
        "fp32",
        "float32 arithmetic on a GPU: fp32 (TF32 off: equal to the CPU within the float32 bound) or tf32 (TF32 "
        "matmuls and convolutions, faster on Ampere and newer GPUs); part of the experiment (docs/benchmarks.md)",
        choices=PRECISIONS,
    )
    name: str | None = runtime_hp(
        None, "run name prefix; None = ALGORITHM-SOURCE (the run directory is PREFIX-HASH-sSEED)"
    )
    out: str = runtime_hp("runs", "folder that holds run directories")
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": "trackers ([log])", "runtime": True})
    data: DataConfig = field(default_factory=DataConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    algorithm: dict = field(default_factory=lambda: {"name": "hafedho"})

    @property
    def run_name(self) -> str:
        """The run's directory name, ``PREFIX-HASH-sSEED``: PREFIX is ``name`` (default ``ALGORITHM-SOURCE``),
        HASH is ``experiment_hash`` (what the run computes, not how, where or for how many rounds it runs).

        A given ``name`` is a prefix, never the whole directory name, so two different experiments never share a
        directory, even under one name; the same experiment always gets the same one (``hafedho run``, sweeps
        and Flower alike), whatever the engine, and a run with more ``rounds`` continues it.
        """
        return f"{self.run_prefix}-{experiment_hash(self)}-s{self.seed}"

    @property
    def run_prefix(self) -> str:
        """PREFIX of the run name: ``name``, default ``ALGORITHM-SOURCE`` (a reference's ':' written as '.')."""
        return self.name or file_name(f"{self.algorithm.get('name')}-{self.data.source}")

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(dataclasses.asdict(self))

    @property
    def run_dir(self) -> Path:
        """``out/RUN_NAME``: where ``hafedho run`` and ``hafedho.run`` write (a Flower run: under ``out/flower``)."""
        return Path(self.out) / self.run_name

    def selected_algorithm(self) -> FedAlgorithm:
        """The algorithm ``[algorithm]`` selects, its settings resolved (``hafedho.algorithms.resolve_algorithm``).

        Built once, when the config is loaded (``validate``: a bad hyperparameter fails there), and held with the
        text of the table it was built from; a table changed since (an override, ``dataclasses.replace``, an
        edit in place) is resolved again, so the algorithm never disagrees with ``algorithm``.
        """
        key = canonical_json(self.algorithm)
        held = vars(self).get("_resolved")
        if held is None or held[0] != key:
            held = self._resolved = (key, algorithm_from_table(self.algorithm))
        return held[1]

    def __getstate__(self) -> dict[str, Any]:  # pickles (sweep workers, Ray) carry the table, never its algorithm
        return {k: v for k, v in vars(self).items() if k != "_resolved"}


# The runtime half of the config, declared on its fields (``runtime_hp``); the rest is the experiment.
RUNTIME_KEYS = frozenset(f.name for f in dataclasses.fields(Config) if f.metadata.get("runtime"))


def experiment_identity(cfg: Config) -> dict[str, Any]:
    """What a run computes, as plain data: the resolved config without ``RUNTIME_KEYS``, its ``[algorithm]``
    reduced to the selected algorithm's complete hyperparameters (``Config.selected_algorithm``, defaults filled
    in), so a setting given at the shared level, in the algorithm's own table, or left at its default is one
    experiment, and another algorithm's table never matters. Raises ConfigError for a bad ``[algorithm]``."""
    alg = cfg.selected_algorithm()
    ident = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_KEYS}
    name = cfg.algorithm["name"]  # as given: a registered name or a reference "package.module:Class"
    ident["algorithm"] = {"name": name, **{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)}}
    return ident


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested table as dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (the inverse of the dotted overrides)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def canonical_json(d: Any) -> str:
    """One text per value: sorted keys, no whitespace, ASCII (so hashes never depend on the process)."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def experiment_hash(cfg: Config) -> str:
    """8 hex digits of ``experiment_identity`` without the seed (seeds of one experiment share it; the run name
    carries the seed), reduced to its settings that differ from the code defaults (``_non_default``); the
    algorithm's name always counts. A hash collision cannot mix two experiments: resuming compares whole
    identities."""
    ident = _non_default(experiment_identity(cfg), _default_identity(cfg.selected_algorithm()))
    ident.pop("seed", None)
    return hashlib.sha256(canonical_json(ident).encode()).hexdigest()[:8]


def _default_identity(alg: FedAlgorithm) -> dict[str, Any]:
    """The identity of a config left at every code default, with ``alg``'s class at its defaults."""
    ident = {k: v for k, v in Config().to_dict().items() if k not in RUNTIME_KEYS}
    ident["algorithm"] = {f.name: f.default for f in dataclasses.fields(alg)}
    return ident


def _non_default(ident: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``ident`` without the settings equal to ``ref``'s (recursively). The hash covers only these, so a setting
    added later with a default never renames an existing run, and an explicit default is the same run."""
    out: dict[str, Any] = {}
    for k, v in ident.items():
        if isinstance(v, dict) and isinstance(ref.get(k), dict):
            sub = _non_default(v, ref[k])
            if sub:
                out[k] = sub
        elif k not in ref or v != ref[k]:
            out[k] = v
    return out


def identity_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two identities (or configs)."""
    out: list[str] = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += identity_diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{full}: unknown key; valid keys here: {', '.join(fields)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a table like [{full}], got {type(value).__name__}")
            values[key] = _build(hints[key], value, f"{full}.")
        elif dict in (hints[key], *typing.get_args(hints[key])):
            if key == "algorithm" and (not isinstance(value, dict) or not isinstance(value.get("name"), str)):
                raise ConfigError(f"{full}: needs a table with name = '<algorithm>' (see `hafedho algorithms`)")
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a table, got {type(value).__name__}")
            values[key] = dict(value) if value is not None else None
        else:
            values[key] = check_value(full, value, hints[key], fields[key].metadata)
    return cls(**values)


def config_path(name: str | Path) -> Path:
    """A TOML path, or the file of an embedded config (``default``, ``demo``, ``smoke``) when no such path exists."""
    p = Path(name)
    if not p.exists() and (CONFIG_DIR / f"{name}.toml").exists():
        return CONFIG_DIR / f"{name}.toml"
    return p


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved config: defaults < file (or the embedded default) < overrides, then checked."""
    table = read_toml(path if path is not None else CONFIG_DIR / "default.toml")
    for text in overrides:
        table = deep_merge(table, parse_override(text))
    return config_from_table(table)


def config_from_table(table: dict[str, Any]) -> Config:
    """A checked ``Config`` from a parsed TOML table (what ``load_config`` does after merging overrides)."""
    return validate(_build(Config, table, ""))


def validate(cfg: Config) -> Config:
    """Cross-field checks that need no data loaded, and the one check of ``[algorithm]``: the selected
    algorithm is built (bad hyperparameters fail here, before any run starts) and only its own
    ``[algorithm.NAME]`` table is kept (``hafedho.algorithms.applicable``: the others never apply to the run)."""
    alg = cfg.selected_algorithm()
    if cfg.diagnostics.every and Diagnostics.of(alg).estimate is None:
        raise ConfigError(
            f"diagnostics.every={cfg.diagnostics.every}: {alg.name} keeps no estimate to measure (no "
            "Diagnostics.estimate: docs/extending.md); use algorithm.name=hafedho or set diagnostics.every=0"
        )
    cfg.algorithm = applicable(cfg.algorithm)
    cfg._resolved = (canonical_json(cfg.algorithm), alg)  # held as built: the tables dropped never applied to it
    check_path_settings(cfg)
    if cfg.name is not None:
        check_run_name(cfg.name)
    if problem := device_problem(cfg.device):
        raise ConfigError(problem)
    if cfg.engine is not None:
        check_engine(cfg.engine)  # a name or the form of a reference; a reference is imported by the run
    check_log(cfg.log)
    s = cfg.sampling
    check_partition(cfg.data.partition, cfg.data.partition_options)
    if cfg.data.partition != "natural" and cfg.data.num_clients == 0:
        cfg.data.num_clients = 100
    n = cfg.data.num_clients
    if s.mode == "fixed" and n and s.cohort_size > n:
        raise ConfigError(f"sampling.cohort_size={s.cohort_size} exceeds data.num_clients={n}; lower it")
    return cfg


def check_path_settings(cfg: Config) -> None:
    """A name or path holding a control character (a newline, an escape) is a typo or a paste, never a folder
    anyone meant: refused, before it names a run directory or lands in files other tools read line by line."""
    for key, value in (
        ("name", cfg.name),
        ("out", cfg.out),
        ("data.path", cfg.data.path),
        ("log.tensorboard", cfg.log.tensorboard),
        ("log.mlflow", cfg.log.mlflow),
        ("log.mlflow_experiment", cfg.log.mlflow_experiment),
    ):
        if isinstance(value, str) and (bad := control_chars(value)):
            raise ConfigError(f"{key}={value!r}: holds control character(s) {bad}; remove them")


def check_log(log: LogConfig) -> None:
    """``[log]``: a TensorBoard folder is a non-empty path; MLflow runs offline, so only a SQLite store."""
    if log.tensorboard == "":
        raise ConfigError("log.tensorboard='': give true (RUN_DIR/tensorboard), a folder, or false")
    if log.mlflow and (not log.mlflow.startswith("sqlite:///") or log.mlflow == "sqlite:///"):
        raise ConfigError(
            f"log.mlflow={log.mlflow!r}: hafedho logs offline to a local SQLite store only; "
            "give log.mlflow='sqlite:///PATH.db' (e.g. sqlite:///mlruns.db), or '' for none"
        )


def check_run_name(name: str) -> None:
    """A run name is one safe folder name: ``out/NAME`` never leaves ``out`` or names ``out`` itself."""
    bad = name in ("", ".", "..") or name.startswith("-") or any(c in name for c in "/\\\0")
    if bad or name != name.strip():
        raise ConfigError(
            f"name={name!r}: a run name must be one folder name (not '.' or '..', no '/', '\\', NUL, "
            "leading '-' or surrounding spaces); e.g. name=my-run"
        )
