"""Flower's ``flwr`` command: the connection in ``FLWR_HOME/config.toml``, submitting runs, following them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONNECTION = "hafedho"  # the SuperLink connection name written into FLWR_HOME/config.toml


class DeployError(RuntimeError):
    """A Flower process that failed to start, a run that failed, or a wait that timed out."""


def toml_value(v: Any) -> str:
    """``v`` as a TOML value (bool, number or basic string), as the run config and ``--node-config`` take it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string


def write_flwr_config(
    flwr_home: str | Path, address: str, root_cert: str | Path | None = None, name: str = CONNECTION
) -> Path:
    """``FLWR_HOME/config.toml`` with one SuperLink connection ``name`` (the default one): TLS verified
    against ``root_cert``, or insecure without one."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    tls = "insecure = true" if root_cert is None else f"root-certificates = {toml_value(Path(root_cert).resolve())}"
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f"address = {toml_value(address)}", tls]
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def simulation_config(num_supernodes: int, client_cpus: int = 1, client_gpus: float = 0.0) -> dict[str, Any]:
    """``flwr run --federation-config`` for a SuperLink started with ``--simulation``: N virtual SuperNodes
    (partition-id 0..N-1), each ClientApp reserving ``client_cpus`` CPUs and ``client_gpus`` of a GPU."""
    return {
        "num-supernodes": int(num_supernodes),
        "client-resources-num-cpus": int(client_cpus),
        "client-resources-num-gpus": float(client_gpus),
    }


def flwr(args: list[str], env: Mapping[str, str], timeout: float = 120.0) -> Any:
    """Run ``flwr ARGS --format json`` and return its JSON answer."""
    cmd = [str(Path(sys.executable).parent / "flwr"), *args, "--format", "json"]
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    text = proc.stdout.strip()
    start = text.find("{")
    try:
        out = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        out = None
    if proc.returncode != 0 or not isinstance(out, dict) or not out.get("success", False):
        raise DeployError(f"`flwr {' '.join(args)}` failed: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return out


def online_nodes(env: Mapping[str, str], connection: str = CONNECTION) -> list[int]:
    """Ids of the SuperNodes the SuperLink sees online."""
    out = flwr(["supernode", "list", connection], env)
    return [int(n["node-id"]) for n in out.get("nodes", []) if n.get("status") == "online"]


def wait_for_nodes(
    env: Mapping[str, str], count: int, timeout: float = 120.0, connection: str = CONNECTION
) -> list[int]:
    """Block until ``count`` SuperNodes are online; returns their ids."""
    end, nodes, last = time.monotonic() + timeout, [], ""
    while time.monotonic() < end:
        try:
            nodes = online_nodes(env, connection)
        except DeployError as e:  # the SuperLink may still be starting
            last = str(e)
        if len(nodes) >= count:
            return nodes
        time.sleep(2.0)
    raise DeployError(f"{len(nodes)} of {count} SuperNodes online after {timeout:.0f}s {last}")


def submit(
    app: str | Path,
    env: Mapping[str, str],
    run_config: Mapping[str, Any],
    federation_config: Mapping[str, Any] | None = None,
    connection: str = CONNECTION,
) -> int:
    """``flwr run APP CONNECTION`` with ``run_config`` overrides (written to a TOML file) and, for a simulation,
    ``federation_config`` (see :func:`simulation_config`); returns the run id."""
    cfg = Path(env.get("FLWR_HOME", Path.home() / ".flwr")) / f"run-config-{time.time_ns()}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
    args = ["run", str(app), connection, "--run-config", str(cfg)]
    if federation_config:
        args += ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
    return int(flwr(args, env)["run-id"])


def run_status(env: Mapping[str, str], run_id: int, connection: str = CONNECTION) -> str:
    """``pending``, ``starting``, ``running`` or ``finished:completed|failed|stopped``."""
    out = flwr(["list", connection, "--run-id", str(run_id)], env)
    runs = [r for r in out.get("runs", []) if int(r["run-id"]) == run_id]
    if not runs:
        raise DeployError(f"run {run_id} is unknown to the SuperLink")
    return str(runs[0]["status"])


def wait_for_run(
    env: Mapping[str, str], run_id: int, timeout: float = 600.0, connection: str = CONNECTION, every: float = 5.0
) -> str:
    """Block until the run finishes; returns its final status (asked every ``every`` seconds: each ask is a
    ``flwr`` process, which costs a CPU-second)."""
    end, status = time.monotonic() + timeout, "unknown"
    while time.monotonic() < end:
        status = run_status(env, run_id, connection)
        if status.startswith("finished"):
            return status
        time.sleep(every)
    raise DeployError(f"run {run_id} still {status} after {timeout:.0f}s")


def run_log(env: Mapping[str, str], run_id: int, connection: str = CONNECTION) -> str:
    """The ServerApp's log of a run (``flwr log --show``)."""
    cmd = [str(Path(sys.executable).parent / "flwr"), "log", str(run_id), connection, "--show"]
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return proc.stdout + proc.stderr
