"""Start and stop a Flower deployment (SuperLink, SuperNodes) on this machine: :class:`Deployment`.

Thin wrappers over Flower's own commands (``flower-superlink``, ``flower-supernode``, ``flwr``), used by
``hafedho flower ...`` and by the tests. The toolkit has one module per job: processes (:mod:`.procs`: started in
their own session, stopped by pid with all they spawned), certificates (:mod:`.certs`), the ``flwr`` command
(:mod:`.flwr_cli`) and the App folder (:mod:`.app`); this module builds the SuperLink's and SuperNodes' command
lines and re-exports the rest, so ``from hafedho.flower import deploy`` is the whole toolkit.
Nothing here imports flwr, so it also works where only the Flower commands are installed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hafedho.flower.app import APP_PYPROJECT, write_app
from hafedho.flower.certs import Certificates, make_certificates
from hafedho.flower.flwr_cli import (
    CONNECTION,
    DeployError,
    flwr,
    online_nodes,
    run_log,
    simulation_config,
    submit,
    toml_value,
    wait_for_nodes,
    wait_for_run,
    write_flwr_config,
)
from hafedho.flower.procs import Service, descendants, flower_env, free_port, is_running

# The deployment toolkit in one import (``from hafedho.flower import deploy``); each name's owner is its module.
__all__ = [
    "APP_PYPROJECT",
    "CONNECTION",
    "Certificates",
    "DeployError",
    "Deployment",
    "Service",
    "descendants",
    "flower_env",
    "flwr",
    "free_port",
    "is_running",
    "make_certificates",
    "online_nodes",
    "run_log",
    "simulation_config",
    "submit",
    "superlink_argv",
    "supernode_argv",
    "toml_value",
    "wait_for_nodes",
    "wait_for_run",
    "write_app",
    "write_flwr_config",
]


def superlink_argv(
    port: int, host: str = "127.0.0.1", certs: Certificates | None = None, simulation: bool = False
) -> list[str]:
    """``flower-superlink`` serving its Fleet, Control and Runtime APIs on ``host:port``."""
    argv = ["flower-superlink", "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    if certs is None:
        argv.append("--insecure")
    else:
        argv += ["--ssl-ca-certfile", str(certs.ca_cert), "--ssl-certfile", str(certs.server_cert)]
        argv += ["--ssl-keyfile", str(certs.server_key)]
    return argv + (["--simulation"] if simulation else [])


def supernode_argv(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    port: int,
    root_cert: str | Path | None = None,
    node_config: Mapping[str, Any] | None = None,
    max_retries: int | None = None,
) -> list[str]:
    """``flower-supernode`` for partition ``partition_id`` of ``num_partitions`` (its Runtime API on ``port``)."""
    conf = {"partition-id": partition_id, "num-partitions": num_partitions, **(node_config or {})}
    argv = ["flower-supernode", "--superlink", superlink, "--port", str(port)]
    argv += ["--node-config", " ".join(f"{k}={toml_value(v)}" for k, v in conf.items())]
    argv += ["--insecure"] if root_cert is None else ["--root-certificates", str(root_cert)]
    return argv + (["--max-retries", str(max_retries)] if max_retries is not None else [])


class Deployment:
    """A SuperLink and its SuperNodes on this machine, under ``workdir`` (logs, FLWR_HOME, certificates);
    ``env`` adds environment variables for all of them (e.g. ``RAY_ADDRESS`` for a simulation on a Ray cluster).

    Use as a context manager, or call ``stop()``: every process started here is ended by pid.
    """

    def __init__(
        self,
        workdir: str | Path,
        tls: bool = False,
        simulation: bool = False,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host, self.simulation = host, simulation
        self.home = self.workdir / "flwr-home"
        self.certs = make_certificates(self.workdir / "certs", hosts=(host, "localhost")) if tls else None
        self.port = free_port(host)
        self.address = f"{host}:{self.port}"
        self.env = flower_env(self.home, env)
        self.superlink: Service | None = None
        self.supernodes: list[Service] = []

    def start_superlink(self) -> Service:
        argv = superlink_argv(self.port, self.host, self.certs, self.simulation)
        self.superlink = Service("superlink", argv, self.workdir / "superlink.log", self.env, self.workdir)
        self.connect()
        return self.superlink

    def connect(self) -> None:
        """(Re)write the ``flwr`` connection to this SuperLink."""
        write_flwr_config(self.home, self.address, self.certs.ca_cert if self.certs else None)

    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        root_cert: str | Path | None = None,
        node_config: Mapping[str, Any] | None = None,
        max_retries: int | None = None,
        name: str | None = None,
    ) -> Service:
        """A SuperNode for one partition; by default it trusts this deployment's CA (with TLS)."""
        root = root_cert if root_cert is not None else (self.certs.ca_cert if self.certs else None)
        argv = supernode_argv(
            self.address, partition_id, num_partitions, free_port(self.host), root, node_config, max_retries
        )
        name = name or f"supernode-{partition_id}"
        node = Service(name, argv, self.workdir / f"{name}.log", self.env, self.workdir)
        self.supernodes.append(node)
        return node

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the SuperLink answers ``flwr list``."""
        end = time.monotonic() + timeout
        while True:
            self._check_superlink()
            try:
                flwr(["list", CONNECTION], self.env)
                return
            except DeployError:
                if time.monotonic() > end:
                    raise
                time.sleep(1.0)

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> list[int]:
        self._check_superlink()
        return wait_for_nodes(self.env, count, timeout)

    def run(
        self, app: str | Path, run_config: Mapping[str, Any], federation_config: Mapping[str, Any] | None = None
    ) -> int:
        """Submit a run (``federation_config``: :func:`simulation_config` for a ``simulation`` SuperLink)."""
        self._check_superlink()
        return submit(app, self.env, run_config, federation_config)

    def wait_for_run(self, run_id: int, timeout: float = 600.0) -> str:
        return wait_for_run(self.env, run_id, timeout)

    def log(self, run_id: int) -> str:
        return run_log(self.env, run_id)

    def _check_superlink(self) -> None:
        if self.superlink is None or not self.superlink.alive():
            tail = self.superlink.output()[-2000:] if self.superlink else ""
            raise DeployError(f"the SuperLink is not running:\n{tail}")

    def stop(self) -> None:
        """End every SuperNode, then the SuperLink (each with what it started)."""
        for node in self.supernodes:
            node.stop()
        if self.superlink is not None:
            self.superlink.stop()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
