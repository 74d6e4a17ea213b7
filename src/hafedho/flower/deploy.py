"""Start and stop a Flower deployment (SuperLink, SuperNodes), make TLS certificates, submit and follow runs.

Thin wrappers over Flower's own commands (``flower-superlink``, ``flower-supernode``, ``flwr``), used by
``hafedho flower ...`` and by the tests. Every process is started in its own session and stopped by pid,
together with the processes it spawned (SuperExec, ServerApp, ClientApps), found through ``/proc``.
Nothing here imports flwr, so it also works where only the Flower commands are installed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CONNECTION = "hafedho"  # the SuperLink connection name written into FLWR_HOME/config.toml

# The Flower App: its components are hafedho's; the run config mirrors hafedho.flower.common.RUN_CONFIG_DEFAULTS.
APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hafedho-flower"
version = "0.1.0"
description = "HaFedHo and baselines on Flower's deployment and simulation engines"
license = "Apache-2.0"
dependencies = ["hafedho[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hafedho"

[tool.flwr.app.components]
serverapp = "hafedho.flower.server_app:app"
clientapp = "hafedho.flower.client_app:app"

[tool.flwr.app.config]
hafedho-config = "smoke"
overrides = ""
run-dir = ""
round-timeout = 600.0
node-wait = 120.0
force = false
torch-threads = 0
"""


class DeployError(RuntimeError):
    """A Flower process that failed to start, a run that failed, or a wait that timed out."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def flower_env(flwr_home: str | Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for Flower's commands: this interpreter's bin folder first on PATH (Flower starts
    ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` by name), telemetry off."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    env.update(extra or {})
    return env


def _stat(pid: int) -> tuple[int, int, str] | None:
    """``(ppid, start time, state)`` of a process from /proc, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(pid: int) -> set[tuple[int, int]]:
    """``(pid, start time)`` of every process below ``pid``, read from /proc (empty where there is none)."""
    kids: dict[int, list[tuple[int, int]]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            kids.setdefault(st[0], []).append((int(entry.name), st[1]))
    out: set[tuple[int, int]] = set()
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.add(child)
            todo.append(child[0])
    return out


def is_running(proc: tuple[int, int]) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    st = _stat(proc[0])
    return st is not None and st[1] == proc[1] and st[2] != "Z"


def _signal(procs: Iterable[tuple[int, int]], sig: int) -> None:
    for proc in procs:
        if is_running(proc):  # never signal a recycled pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc[0], sig)


class Service:
    """One long-running Flower process, its output in ``log``; ``stop`` ends it and everything it started.

    A watcher thread records every descendant (SuperExec, ServerApp, ClientApp processes) while the service
    runs, so that even those orphaned by a crash are ended by pid.
    """

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str], cwd: str | Path) -> None:
        self.name, self.argv, self.log = name, argv, Path(log)
        self._out: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env), cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        self.family: set[tuple[int, int]] = set()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.family |= descendants(self.pid)
            self._done.wait(0.2)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> list[str]:
        """Command lines of the live processes this service started (e.g. ``flwr-clientapp ...``)."""
        out = []
        for pid, _ in sorted(p for p in descendants(self.pid) if is_running(p)):
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        return out

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill=True``: a crash) to the process and all it started; SIGKILL after
        ``timeout`` to whatever is left."""
        sig = signal.SIGKILL if kill else signal.SIGTERM
        self.family |= descendants(self.pid)
        if self.alive():
            self.popen.send_signal(sig)
        _signal(self.family, sig)
        end = time.monotonic() + timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(end - time.monotonic(), 0.1))
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=5)
        self._done.set()
        self._watcher.join(timeout=2)
        while any(is_running(p) for p in self.family) and time.monotonic() < end:
            time.sleep(0.1)
        _signal(self.family, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while any(is_running(p) for p in self.family) and time.monotonic() < end:
            time.sleep(0.05)
        if not self._out.closed:
            self._out.close()


@dataclass(frozen=True)
class Certificates:
    """PEM files of a private CA and of a server certificate it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_certificates(
    folder: str | Path, hosts: Iterable[str] = ("127.0.0.1", "localhost"), days: int = 365
) -> Certificates:
    """A CA and a server certificate for ``hosts`` (IP addresses or DNS names), written to ``folder``.

    For a real deployment use your organisation's CA; this is for tests and trials.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("hafedho test CA")).issuer_name(name("hafedho test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(name(next(iter(hosts), "localhost"))).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    out = Certificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    out.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.server_key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    out.server_key.chmod(0o600)
    return out


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


def toml_value(v: Any) -> str:
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


def write_app(folder: str | Path) -> Path:
    """A Flower App folder (only ``pyproject.toml``) whose components are hafedho's ServerApp and ClientApp."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


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
