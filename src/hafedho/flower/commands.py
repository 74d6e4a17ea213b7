"""``hafedho flower ...``: thin wrappers over Flower's commands for a hafedho deployment.

    hafedho flower certs DIR [--host H ...]        a CA and a server certificate (for trials; use your own CA)
    hafedho flower app DIR                         a Flower App folder naming hafedho's ServerApp and ClientApp
    hafedho flower superlink [--certs DIR]         flower-superlink (Fleet, Control, Runtime APIs on one port)
    hafedho flower supernode --superlink H:P --partition-id K --num-partitions N [--root-cert CA]
    hafedho flower run [CONFIG] [KEY=VALUE ...] --superlink H:P [--root-cert CA] [--simulation N] [--resume] [--wait]

Nothing here imports flwr; the Flower commands must be installed beside hafedho (``pip install 'hafedho[flower]'``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hafedho.config import CONFIG_DIR, ConfigError, load_config
from hafedho.flower import deploy
from hafedho.flower.app import RUN_CONFIG_DEFAULTS, flower_run_dir


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``flower`` subcommand and its own subcommands."""
    p = sub.add_parser("flower", help="run algorithms on Flower (SuperLink, SuperNodes, runs, certificates)")
    fs = p.add_subparsers(dest="flower_command", required=True)

    c = fs.add_parser("certs", help="write a test CA and a server certificate (ca.crt, server.pem, server.key)")
    c.add_argument("dir")
    c.add_argument("--host", action="append", help="IP or DNS name the SuperLink is reached at (repeatable)")

    a = fs.add_parser("app", help="write a Flower App folder (pyproject.toml) for `flwr run`")
    a.add_argument("dir")

    s = fs.add_parser("superlink", help="start flower-superlink in the foreground")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    s.add_argument("--port", type=int, default=9092)
    s.add_argument(
        "--certs", help="folder from `hafedho flower certs` (ca.crt, server.pem, server.key); else --insecure"
    )
    s.add_argument("--simulation", action="store_true", help="run submitted apps in Flower's simulation engine (Ray)")

    n = fs.add_parser("supernode", help="start flower-supernode for one partition in the foreground")
    n.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    n.add_argument("--partition-id", type=int, required=True, help="this node's client id, 0..N-1")
    n.add_argument("--num-partitions", type=int, required=True, help="N, the number of clients")
    n.add_argument("--root-cert", help="CA certificate to verify the SuperLink with; else --insecure")
    n.add_argument("--port", type=int, default=9094, help="this node's local Runtime API port (one per node)")
    n.add_argument("--data-path", help="this node's copy of the data (overrides data.path)")
    n.add_argument(
        "--state-dir",
        help="folder of this node's client-state store: SCAFFOLD's, HaFedHo's, ... client states survive a restart "
        "of the node and a resumed run (docs/flower.md); default: in the SuperNode's memory",
    )

    r = fs.add_parser("run", help="submit a hafedho experiment to a SuperLink (`flwr run`)")
    r.add_argument("overrides", nargs="*", metavar="[CONFIG] KEY=VALUE", help="as for `hafedho run`")
    r.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink (its single HTTP port)")
    r.add_argument("--root-cert", help="CA certificate to verify the SuperLink with; else --insecure")
    r.add_argument("--simulation", type=int, metavar="N", help="the SuperLink runs --simulation: N virtual SuperNodes")
    r.add_argument("--client-cpus", type=int, default=1, help="simulation: CPUs per ClientApp (Ray resources)")
    r.add_argument("--client-gpus", type=float, default=0.0, help="simulation: share of a GPU per ClientApp")
    rc = RUN_CONFIG_DEFAULTS  # the Flower App's own defaults (hafedho.flower.app.RUN_CONFIG)
    r.add_argument(
        "--run-dir", default=rc["run-dir"], help="run directory on the SuperLink's machine (absolute path best)"
    )
    r.add_argument("--round-timeout", type=float, default=rc["round-timeout"], help="seconds a round waits for replies")
    r.add_argument("--node-wait", type=float, default=rc["node-wait"], help="seconds round 1 waits for its SuperNodes")
    r.add_argument(
        "--torch-threads",
        type=int,
        default=rc["torch-threads"],
        help="> 0: torch threads of the server and each client",
    )
    r.add_argument("--force", action="store_true", help="replace an existing run directory")
    r.add_argument(
        "--resume", action="store_true", help="continue the run directory from its checkpoint (docs/flower.md)"
    )
    r.add_argument("--secagg", action="store_true", help="SecAgg+ secure aggregation (docs/flower.md)")
    for key in ("secagg-num-shares", "secagg-reconstruction-threshold", "secagg-clipping-range"):
        r.add_argument(f"--{key}", type=type(rc[key]), default=rc[key], help=f"see docs/flower.md (default {rc[key]})")
    r.add_argument(
        "--secagg-quantization-range", type=int, default=rc["secagg-quantization-range"], help="0 = automatic"
    )
    r.add_argument("--app", help="Flower App folder (default: a generated one naming hafedho's apps)")
    r.add_argument("--wait", action="store_true", help="wait for the run to finish and print its log")
    return p


def _foreground(argv: list[str]) -> int:
    """Become the Flower process (exec): signals and the exit status are its own, no wrapper is left behind."""
    env = deploy.flower_env()
    exe = shutil.which(argv[0], path=env["PATH"])
    if exe is None:
        raise deploy.DeployError(f"{argv[0]} not found; install the flower extra: pip install 'hafedho[flower]'")
    sys.stdout.flush()
    os.execve(exe, argv, env)
    return 0  # not reached


def run_command(args: argparse.Namespace) -> int:
    """Dispatch ``hafedho flower <command>``."""
    try:
        return _COMMANDS[args.flower_command](args)
    except deploy.DeployError as e:
        print(f"hafedho flower: {e}", file=sys.stderr)
        return 1


def _certs(args: argparse.Namespace) -> int:
    certs = deploy.make_certificates(args.dir, hosts=tuple(args.host or ("127.0.0.1", "localhost")))
    print(f"CA:  {certs.ca_cert}\ncert: {certs.server_cert}\nkey:  {certs.server_key}")
    return 0


def _app(args: argparse.Namespace) -> int:
    print(deploy.write_app(args.dir) / "pyproject.toml")
    return 0


def _superlink(args: argparse.Namespace) -> int:
    certs = None
    if args.certs:
        d = Path(args.certs)
        certs = deploy.Certificates(d / "ca.crt", d / "server.pem", d / "server.key")
    return _foreground(deploy.superlink_argv(args.port, args.host, certs, args.simulation))


def _supernode(args: argparse.Namespace) -> int:
    extra = {"data-path": args.data_path} if args.data_path else {}
    if args.state_dir:  # absolute: the node's ClientApp processes need not share its working directory
        extra["state-dir"] = str(Path(args.state_dir).resolve())
    argv = deploy.supernode_argv(
        args.superlink, args.partition_id, args.num_partitions, args.port, args.root_cert, extra
    )
    return _foreground(argv)


def _run(args: argparse.Namespace) -> int:
    from hafedho.flower.common import check_deployable, config_path
    from hafedho.flower.server_app import server_error

    items = list(args.overrides)
    name = items.pop(0) if items and "=" not in items[0] else "default"
    cfg = check_deployable(load_config(config_path(name), items))  # fail here, not on the server, for a bad config
    n = cfg.data.num_clients  # 0: all natural clients, known once the data is read (the server checks it then)
    if args.simulation is not None and n and args.simulation != n:
        raise ConfigError(
            f"--simulation {args.simulation}: the config has N={n} clients (data.num_clients) and each virtual "
            f"SuperNode is one of them; use --simulation {n} or data.num_clients={args.simulation}"
        )
    if config_path(name).parent != CONFIG_DIR:
        print(f"note: the SuperLink's and every SuperNode's machine read {name!r} themselves: keep a copy there")
    run_config = {
        "hafedho-config": name,
        "overrides": shlex.join(items),
        "run-dir": args.run_dir,
        "round-timeout": args.round_timeout,
        "node-wait": args.node_wait,
        "force": args.force,
        "resume": args.resume,
        "torch-threads": args.torch_threads,
        **{k: getattr(args, k.replace("-", "_")) for k in RUN_CONFIG_DEFAULTS if k.startswith("secagg")},
    }
    home = Path(tempfile.mkdtemp(prefix="hafedho-flwr-"))
    deploy.write_flwr_config(home, args.superlink, args.root_cert)
    app = Path(args.app) if args.app else deploy.write_app(home / "app")
    env = deploy.flower_env(home)
    sim = deploy.simulation_config(args.simulation, args.client_cpus, args.client_gpus) if args.simulation else None
    run_id = deploy.submit(app, env, run_config, sim)
    where = args.run_dir or f"{flower_run_dir(cfg.run_dir)} (relative to the SuperLink's working directory)"
    print(f"run {run_id} submitted: {cfg.rounds} rounds of {cfg.algorithm['name']}; metrics -> {where}")
    if not args.wait:
        print(f"follow it with: FLWR_HOME={home} flwr log {run_id} {deploy.CONNECTION}")
        return 0
    status = deploy.wait_for_run(env, run_id, timeout=float("inf"))
    text = deploy.run_log(env, run_id)
    reason = server_error(text) if status != "finished:completed" else None
    if reason is not None:  # hafedho's own one line, not Flower's traceback around it
        print(f"the ServerApp's whole log: FLWR_HOME={home} flwr log {run_id} {deploy.CONNECTION} --show")
        raise ConfigError(f"run {run_id} {status}: {reason}")
    print(text)
    print(f"run {run_id}: {status}")
    return 0 if status == "finished:completed" else 1


_COMMANDS = {"certs": _certs, "app": _app, "superlink": _superlink, "supernode": _supernode, "run": _run}
