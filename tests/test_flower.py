"""The Flower integration: any registered algorithm on Flower, equal to the simulator.

Fast tests drive the ServerApp's strategy and the ClientApp in this process (``LocalGrid``). The others start
real Flower processes on 127.0.0.1 (free ports chosen now), wait for the SuperNodes to register, and end every
process by pid in the fixture's finalizer, also on failure. A Flower message round takes seconds (SuperNodes
poll every 3 s and start one ClientApp process per message), hence the small problem: digits, 3 clients.
"""

from __future__ import annotations

import json
import os
import signal
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flower_helpers import (
    LocalGrid,
    assert_fp32_close,
    cohorts,
    die,
    flower_final,
    max_abs_diff,
    run_strategy,
    simulate,
    simulate_with_drops,
)
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from helpers import no_wall

from hafedho.algorithms import REGISTRY
from hafedho.cli import main
from hafedho.config import ConfigError, load_config
from hafedho.experiment import build
from hafedho.flower import codec, deploy
from hafedho.flower.client_app import app as client_app
from hafedho.flower.common import RUN_CONFIG_DEFAULTS, config_path, experiment
from hafedho.flower.procs import descendants
from hafedho.flower.server_app import main as server_main
from hafedho.flower.server_app import server_error
from hafedho.flower.strategy import HafedhoStrategy
from hafedho.runfiles import RunBusy, RunDirError, RunLock, read_metrics
from hafedho.sim.runner import Interrupted

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower"
# 3 clients, 2 per round: round 1 = {1, 2}, round 2 = {0, 2}; client 2 carries its state from round 1 into 2.
SMALL = ("data.num_clients=3", "sampling.cohort_size=2", "rounds=2")


def rows_close(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 1e-6) -> bool:
    """Same metrics rows up to float tolerance (wall time aside)."""
    a, b = no_wall(a), no_wall(b)
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(abs(x[k] - y[k]) <= tol * max(1.0, abs(y[k])) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def run_local(alg: str, tmp: Path, *overrides: str, fail: dict[int, set[int]] | None = None) -> HafedhoStrategy:
    """The Flower ServerApp's loop (``Strategy.start``) with the ClientApp called in-process."""
    rc = {"hafedho-config": "smoke", "overrides": " ".join([f"algorithm.name={alg}", *overrides])}
    return run_strategy(rc, tmp / "flower", LocalGrid(rc, experiment(rc).fed.num_clients, fail))


# ---------------------------------------------------------------------------------------------- codec


def test_codec_is_lossless_for_dtypes_shapes_and_structure() -> None:
    from typing import NamedTuple

    class State(NamedTuple):
        params: dict[str, torch.Tensor]
        step: torch.Tensor

    tree = (
        State({"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64)}, torch.tensor(7, dtype=torch.int64)),
        torch.tensor(0.5),
        (),
        [torch.arange(5, dtype=torch.int32), torch.tensor([True, False])],
    )
    out = codec.decode(codec.encode(tree), tree)
    assert type(out[0]) is State and out[2] == ()
    for a, b in zip(torch.utils._pytree.tree_leaves(tree), torch.utils._pytree.tree_leaves(out), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0  # torch's alignment: kernels see the simulator's layout (sim/process.py)
    assert len(codec.encode(())) == 0


def test_codec_refuses_records_that_do_not_fit() -> None:
    like = {"w": torch.zeros(2, 2)}
    with pytest.raises(codec.CodecError, match=r"expected torch\.float32"):
        codec.decode(codec.encode({"w": torch.zeros(2, 2, dtype=torch.float64)}), like)
    with pytest.raises(codec.CodecError, match=r"\(2, 2\)"):
        codec.decode(codec.encode({"w": torch.zeros(4)}), like)
    with pytest.raises(codec.CodecError, match="2 arrays, expected 1"):
        codec.decode(codec.encode((torch.zeros(2, 2), torch.zeros(1))), like)


# ---------------------------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("alg", sorted(REGISTRY))
def test_strategy_and_client_app_equal_the_simulator(tmp_path: Path, alg: str) -> None:
    """Every registered algorithm: same final model (bit for bit here) and the same metrics rows."""
    _, ref, sim_dir = simulate(alg, tmp_path, "rounds=3")
    strategy = run_local(alg, tmp_path, "rounds=3")
    assert max_abs_diff(ref, strategy.final_params()) == 0.0
    assert no_wall(read_metrics(tmp_path / "flower")) == no_wall(read_metrics(sim_dir))
    assert (tmp_path / "flower" / "done").exists()


def test_bernoulli_participation_with_empty_rounds(tmp_path: Path) -> None:
    """Cohorts of varying size, some empty (no message is sent, the server state stays)."""
    overrides = ("sampling.mode=bernoulli", "sampling.prob=0.15", "rounds=6")
    exp, ref, sim_dir = simulate("fedavg", tmp_path, *overrides)
    assert [] in cohorts(exp)
    strategy = run_local("fedavg", tmp_path, *overrides)
    assert max_abs_diff(ref, strategy.final_params()) == 0.0
    assert no_wall(read_metrics(tmp_path / "flower")) == no_wall(read_metrics(sim_dir))


def test_personal_accuracy_comes_from_the_nodes(tmp_path: Path) -> None:
    """Held-out local data: each node evaluates its own deployed model; pooled, the simulator's metric."""
    _, _, sim_dir = simulate("fedavg", tmp_path, "data.local_test_fraction=0.2")
    run_local("fedavg", tmp_path, "data.local_test_fraction=0.2")
    rows = read_metrics(tmp_path / "flower")
    assert all("test/personal_acc" in r for r in rows)
    assert no_wall(rows) == no_wall(read_metrics(sim_dir))


def test_failed_replies_are_dropped_and_m_is_what_arrived(tmp_path: Path) -> None:
    """A client lost in round 2 (an error reply): the round aggregates the others with m = replies received."""
    exp, _, _ = simulate("hafedho", tmp_path, "rounds=3")
    lost = cohorts(exp)[1][0]
    strategy = run_local("hafedho", tmp_path, "rounds=3", fail={2: {lost}})
    rows = read_metrics(tmp_path / "flower")
    assert rows[1]["dropped"] == [lost] and rows[1]["cohort_size"] == len(cohorts(exp)[1]) - 1
    assert "dropped" not in rows[0] and "dropped" not in rows[2]
    ref = simulate_with_drops(build(exp.cfg), {2: {lost}})
    assert max_abs_diff(ref, strategy.final_params()) == 0.0


def test_flower_runs_are_read_by_hafedho_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_local("fedavg", tmp_path)
    assert main(["report", str(tmp_path / "flower"), "--out", str(tmp_path / "report")]) == 0
    assert "fedavg" in capsys.readouterr().out
    assert (tmp_path / "report" / "results.md").exists()


def test_a_federation_of_another_size_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """5 SuperNodes (a simulation's num-supernodes) for N = 10: an error before any training message, no `done`
    (it used to train no client in any round, write `done` and exit 0); `flower run --simulation 5` refuses at once."""
    rc = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg"}
    strategy = HafedhoStrategy(experiment(rc), tmp_path / "flower", node_wait=0.0)
    strategy.prepare()
    grid = LocalGrid(rc, 5)
    with pytest.raises(ConfigError, match=r"num-partitions=5 but this run has N=10 clients .*--simulation 10"):
        strategy.start(grid, strategy.initial_arrays(), num_rounds=2, evaluate_fn=strategy.evaluate_global)
    assert not [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert not (tmp_path / "flower" / "done").exists() and not read_metrics(tmp_path / "flower")
    assert main(["flower", "run", "smoke", "--superlink", "127.0.0.1:9", "--simulation", "5"]) == 2
    assert "--simulation 5: the config has N=10 clients" in capsys.readouterr().err


def test_a_server_app_error_is_one_line_in_its_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The ServerApp logs hafedho's one line (``hafedho: error: ...``) before Flower logs its traceback, and
    ``hafedho flower run --wait`` ends with that line (``server_error``), not with the traceback around it."""
    rc = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg", "run-dir": str(tmp_path / "f")}
    with pytest.raises(ConfigError):
        server_main(LocalGrid(rc, 5), Context(1, 0, {}, RecordDict(), {**rc, "node-wait": 0.0}))
    (line,) = [r.getMessage() for r in caplog.records if "hafedho: error: " in r.getMessage()]
    assert "num-partitions=5 but this run has N=10 clients" in line
    flower_log = (
        "INFO :      [ROUND 1/2]\n"
        f"ERROR :     {line}\n"
        "ERROR :     ServerApp raised an exception\nTraceback (most recent call last):\n  File ...\n"
        "hafedho.config.ConfigError: the SuperNodes have ...\n"
    )
    assert server_error(flower_log) == line.split("hafedho: error: ")[1]
    assert server_error("INFO :      all fine\n") is None


def test_a_flower_run_takes_the_run_lock(tmp_path: Path) -> None:
    """One writer per run for Flower too: while a simulator run (or another ServerApp) holds the run's lock, a
    Flower server refuses before it writes anything; once the holder finishes, it may start."""
    rc = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg"}
    first = HafedhoStrategy(experiment(rc), tmp_path / "flower", node_wait=0.0)
    with RunLock(tmp_path / "flower") as held:
        assert held
        with pytest.raises(RunBusy, match=r"is being written by another process \(pid \d+\)"):
            first.prepare()
        assert not (tmp_path / "flower").exists()
    first.prepare()
    second = HafedhoStrategy(experiment(rc), tmp_path / "flower", node_wait=0.0)
    with pytest.raises(RunBusy):
        second.prepare(force=True)
    assert (tmp_path / "flower" / "config.toml").exists()
    first.finish()
    with RunLock(tmp_path / "flower") as held:
        assert held


def partial_run(alg: str, run_dir: Path, *overrides: str) -> tuple[HafedhoStrategy, LocalGrid, str | None]:
    """A ServerApp that ran its rounds and then died before ``finish`` (no ``done``): the strategy, the grid (its
    nodes keep their client states, as SuperNodes that kept running do) and its "interrupted" line."""
    rc = {"hafedho-config": "smoke", "overrides": " ".join([f"algorithm.name={alg}", *overrides])}
    grid = LocalGrid(rc, experiment(rc).fed.num_clients)
    strategy = run_strategy(rc, run_dir, grid, finish=False)
    return strategy, grid, strategy.interrupted()


def test_a_resumed_server_app_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """SCAFFOLD (client state on the nodes): a ServerApp dies after round 2, having also logged a row of round 3
    that no checkpoint covers; a new one with resume (rounds=4) drops that row, restores the server state of
    round 2 and runs rounds 3-4 with the same nodes: rows and final model = the uninterrupted 4-round run's."""
    common = ("checkpoint_every=1",)
    full = run_local("scaffold", tmp_path / "full", "rounds=4", *common)
    run_dir = tmp_path / "flower"
    _, grid, line = partial_run("scaffold", run_dir, "rounds=2", *common)
    assert line == f"{run_dir}: interrupted at round 2; continue with --resume (it continues after round 2)"
    assert not (run_dir / "done").exists()
    stray = {**read_metrics(run_dir)[-1], "round": 3}  # a row written after the last checkpoint
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(stray) + "\n")
    rc = {"hafedho-config": "smoke", "overrides": " ".join(["algorithm.name=scaffold", "rounds=4", *common])}
    resumed = HafedhoStrategy(experiment(rc), run_dir, node_wait=0.0)
    resumed.prepare(resume=True)
    assert resumed.first_round == 3 and [r["round"] for r in read_metrics(run_dir)] == [1, 2]
    resumed.start(grid, resumed.initial_arrays(), num_rounds=4, evaluate_fn=resumed.evaluate_global)
    resumed.finish()
    assert [r["round"] for r in resumed.rows] == [3, 4]
    assert no_wall(read_metrics(run_dir)) == no_wall(read_metrics(tmp_path / "full" / "flower"))
    assert max_abs_diff(full.final_params(), resumed.final_params()) == 0.0
    assert (run_dir / "done").exists()
    again = HafedhoStrategy(experiment(rc), run_dir, node_wait=0.0)  # finished: nothing to do, nothing written
    before = (run_dir / "metrics.jsonl").read_bytes()
    again.prepare(resume=True)
    assert again.first_round == 5
    again.start(grid, again.initial_arrays(), num_rounds=4, evaluate_fn=again.evaluate_global)
    again.finish()
    assert (run_dir / "metrics.jsonl").read_bytes() == before and not again.rows


def four_rounds(run_dir: Path, **settings: Any) -> dict[str, Any]:
    """The run config of the ServerApp stop-and-resume tests: FedAvg, 4 rounds, a checkpoint each round."""
    overrides = "algorithm.name=fedavg rounds=4 checkpoint_every=1"
    return {"hafedho-config": "smoke", "overrides": overrides, "run-dir": str(run_dir), "node-wait": 0.0, **settings}


def test_server_app_interrupted_then_resumed(tmp_path: Path) -> None:
    """The ServerApp's ``main``: Ctrl-C in round 3 of 4 ends with the simulator's line (nothing else lost, the
    lock released); ``resume = true`` continues from round 3, and the run equals the uninterrupted one."""
    run_dir = tmp_path / "flower"
    rc = four_rounds(run_dir)
    n = experiment(rc).fed.num_clients
    line = r"interrupted at round 2; continue with --resume \(it continues after round 2\)"
    with pytest.raises(Interrupted, match=line):
        server_main(LocalGrid(rc, n, events={3: die}), Context(1, 0, {}, RecordDict(), rc))
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2] and not (run_dir / "done").exists()
    with RunLock(run_dir) as held:
        assert held
    server_main(LocalGrid(rc, n), Context(2, 0, {}, RecordDict(), {**rc, "resume": True}))
    assert (run_dir / "done").exists()
    full = run_local("fedavg", tmp_path / "full", "rounds=4", "checkpoint_every=1")
    assert no_wall(read_metrics(run_dir)) == no_wall(full.rows)
    exp = experiment(rc)
    assert max_abs_diff(flower_final(run_dir, exp), full.final_params()) == 0.0


SIGTERM_SERVER_APP = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from flower_helpers import LocalGrid
from flwr.app import Context, RecordDict
from flwr.supercore.telemetry import EventType
from flwr.supercore.exit import register_signal_handlers
from hafedho.flower.common import experiment
from hafedho.flower.server_app import main

rc = {rc!r}
# what flwr-serverapp does before it calls the ServerApp (flwr/superlink/runtime/run_serverapp.py)
register_signal_handlers(event_type=EventType.FLWR_SERVERAPP_RUN_LEAVE, exit_message="Task stopped by user.")
sigterm = {{3: lambda grid: os.kill(os.getpid(), signal.SIGTERM)}}  # as round 3's train messages go out
main(LocalGrid(rc, experiment(rc).fed.num_clients, events=sigterm), Context(1, 0, {{}}, RecordDict(), rc))
"""


def test_server_app_sigterm(tmp_path: Path) -> None:
    """A real SIGTERM to a ServerApp process with Flower's signal handlers (as flwr-serverapp installs them): the
    checkpoint is waited for, the simulator's line is logged, the process exits as Flower's graceful exit does
    (status 0); the run then resumes to the uninterrupted run's rows."""
    import subprocess
    import sys

    run_dir = tmp_path / "flower"
    rc = four_rounds(run_dir, **{"torch-threads": 1})
    script = SIGTERM_SERVER_APP.format(tests=str(Path(__file__).parent), rc=rc)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "Task stopped by user." in proc.stderr, proc.stderr[-3000:]  # a graceful exit
    assert f"{run_dir}: interrupted at round 2; continue with --resume" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2] and not (run_dir / "done").exists()
    server_main(LocalGrid(rc, 10), Context(2, 0, {}, RecordDict(), {**rc, "resume": True}))
    full = run_local("fedavg", tmp_path / "full", "rounds=4", "checkpoint_every=1")
    assert no_wall(read_metrics(run_dir)) == no_wall(full.rows)


def test_a_server_app_stops_once_its_superlink_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``watch_superlink``: while the SuperLink's address accepts connections nothing happens; once it has refused
    them for ``patience`` seconds the ServerApp gets SIGINT (the interrupted line, the lock released), where
    Flower 1.42's would retry forever holding the run's lock. Without a SuperLink address (in process): no watch."""
    import socket

    from hafedho.flower import server_app

    raised: list[int] = []
    monkeypatch.setattr(server_app.signal, "raise_signal", raised.append)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    argv = ["flwr-serverapp", "--runtime-api-address", f"127.0.0.1:{port}", "--token", "x"]
    watch = server_app.watch_superlink(argv, patience=0.5, every=0.05)
    time.sleep(0.8)
    assert watch is not None and watch.is_alive() and not raised  # the SuperLink is there
    listener.close()
    watch.join(timeout=10)
    assert raised == [signal.SIGINT] and not watch.is_alive()
    assert server_app.watch_superlink(["pytest"], patience=0.5) is None


def test_resume_refuses_another_experiment_and_plain_runs_refuse_an_existing_directory(tmp_path: Path) -> None:
    """--resume into a directory of another seed: one line naming the key, nothing changed, the lock released;
    without --resume an existing run directory is refused as `hafedho run` refuses it."""
    run_dir = tmp_path / "flower"
    partial_run("fedavg", run_dir, "rounds=2", "checkpoint_every=1")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    other = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg rounds=4 seed=1"}
    with pytest.raises(RunDirError, match=r"holds another experiment \(differs in: seed\); use another directory") as e:
        HafedhoStrategy(experiment(other), run_dir, node_wait=0.0).prepare(resume=True)
    assert "\n" not in str(e.value)
    same = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg rounds=4"}
    with pytest.raises(RunDirError, match=r"holds an interrupted run; pass --resume to continue it or --force"):
        HafedhoStrategy(experiment(same), run_dir, node_wait=0.0).prepare()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    with RunLock(run_dir) as held:  # each refusal released the run's lock
        assert held
    from hafedho.cli import parser

    args = parser().parse_args(["flower", "run", "--superlink", "127.0.0.1:1", "--resume"])
    assert args.resume is True and RUN_CONFIG_DEFAULTS["resume"] is False


def test_flower_run_directory_is_named_by_the_experiment(tmp_path: Path) -> None:
    """The ServerApp's default run directory is OUT/flower/<the name `hafedho run` gives the same experiment>."""
    rc = {"hafedho-config": "smoke", "overrides": f"algorithm.name=fedavg engine=process out={str(tmp_path)!r}"}
    assert experiment(rc).cfg.run_name == load_config(config_path("smoke"), ["algorithm.name=fedavg"]).run_name


def test_client_refuses_a_server_with_another_config(tmp_path: Path) -> None:
    rc = {"hafedho-config": "smoke", "overrides": "algorithm.name=fedavg"}
    exp = experiment(rc)
    ctx = Context(1, 5, {"partition-id": 0, "num-partitions": exp.fed.num_clients}, RecordDict(), rc)
    LocalGrid(rc, 1)  # sets the task identity messages need
    conf = ConfigRecord({"server-round": 1, "num-clients": exp.fed.num_clients, "cohort-size": 1, "digest": "x"})
    msg = Message(RecordDict({"broadcast": codec.encode(()), "config": conf}), dst_node_id=5, message_type="train")
    with pytest.raises(ValueError, match="digest mismatch"):
        client_app(msg, ctx)
    query = Message(RecordDict(), dst_node_id=5, message_type=MessageType.QUERY)
    no_partition = Context(1, 5, {}, RecordDict(), rc)
    with pytest.raises(ValueError, match="partition-id=K num-partitions=N"):
        client_app(query, no_partition)


def test_example_app_names_hafedho_components() -> None:
    example = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    packaged = tomllib.loads(deploy.APP_PYPROJECT)
    for app in (example, packaged):
        assert app["tool"]["flwr"]["app"]["components"] == {
            "serverapp": "hafedho.flower.server_app:app",
            "clientapp": "hafedho.flower.client_app:app",
        }
        assert app["tool"]["flwr"]["app"]["config"] == RUN_CONFIG_DEFAULTS
    assert (EXAMPLE / "README.md").exists()


def test_flower_cli_writes_certificates_and_app(tmp_path: Path) -> None:
    assert main(["flower", "certs", str(tmp_path / "certs"), "--host", "10.0.0.5"]) == 0
    assert {p.name for p in (tmp_path / "certs").iterdir()} == {"ca.crt", "server.pem", "server.key"}
    assert main(["flower", "app", str(tmp_path / "app")]) == 0
    assert (tmp_path / "app" / "pyproject.toml").read_text() == deploy.APP_PYPROJECT
    from hafedho.cli import parser

    args = parser().parse_args(["flower", "run", "--superlink", "127.0.0.1:1"])
    assert (
        args.round_timeout == RUN_CONFIG_DEFAULTS["round-timeout"]
        and args.node_wait == RUN_CONFIG_DEFAULTS["node-wait"]
    )


def test_flower_supernode_gets_an_absolute_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hafedho flower supernode --state-dir rel`` hands the node an absolute folder (its ClientApp processes need
    not share its working directory)."""
    from hafedho.flower import commands

    seen: list[list[str]] = []
    monkeypatch.setattr(commands, "_foreground", lambda argv: seen.append(argv) or 0)
    monkeypatch.chdir(tmp_path)
    args = ["flower", "supernode", "--superlink", "127.0.0.1:9", "--partition-id", "1", "--num-partitions", "3"]
    assert main([*args, "--state-dir", "states"]) == 0
    conf = seen[0][seen[0].index("--node-config") + 1]
    assert f'state-dir="{tmp_path / "states"}"' in conf and "partition-id=1" in conf


def test_certificates_verify_only_against_their_ca(tmp_path: Path) -> None:
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    ours, theirs = deploy.make_certificates(tmp_path / "a"), deploy.make_certificates(tmp_path / "b")
    ssl.create_default_context().load_cert_chain(str(ours.server_cert), str(ours.server_key))  # key fits the cert
    cert = x509.load_pem_x509_certificate(ours.server_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert x509.IPAddress(ipaddress.ip_address("127.0.0.1")) in sans and x509.DNSName("localhost") in sans
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ours.ca_cert.read_bytes()))
    with pytest.raises(InvalidSignature):
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(theirs.ca_cert.read_bytes()))


# ---------------------------------------------------------------------------------------------- processes

FAST_POLL = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}  # SuperExec picks a ClientApp task up sooner
# A local Ray advertises the machine's interface address by default; this keeps its traffic on 127.0.0.1.
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def deployments(tmp_path: Path):
    """Start Flower deployments; the finalizer stops every process they started (by pid), pass or fail."""
    started: list[deploy.Deployment] = []

    def make(ray_loopback: bool = False, **kw: Any) -> deploy.Deployment:
        env = {**FAST_POLL, **(RAY_LOOPBACK if ray_loopback else {})}
        d = deploy.Deployment(tmp_path / f"deployment{len(started)}", env=env, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
    services = [s for d in started for s in (d.superlink, *d.supernodes) if s is not None]
    leftovers = [p for s in services for p in s.family if deploy.is_running(p)]
    assert not leftovers, f"processes left running: {leftovers}"


def run_config(alg: str, run_dir: Path, *overrides: str, **settings: Any) -> dict[str, Any]:
    return {
        "hafedho-config": "smoke",
        "overrides": " ".join([f"algorithm.name={alg}", *overrides]),
        "run-dir": str(run_dir),
        "torch-threads": 1,  # as the simulator in this test process (conftest), for bit-equal sums
        **settings,
    }


def finish(d: deploy.Deployment, run_id: int, timeout: float = 400.0) -> None:
    status = d.wait_for_run(run_id, timeout)
    assert status == "finished:completed", f"run {run_id} {status}:\n{d.log(run_id)[-4000:]}"


def start_federation(d: deploy.Deployment, n: int) -> list[deploy.Service]:
    d.start_superlink()
    nodes = [d.start_supernode(i, n) for i in range(n)]
    d.wait_for_nodes(n)
    return nodes


@pytest.mark.parametrize("alg", ["hafedho", pytest.param("scaffold", marks=pytest.mark.slow)])
def test_tls_deployment_matches_the_simulator(tmp_path: Path, deployments, alg: str) -> None:
    """One SuperLink with TLS and three SuperNodes; a fourth SuperNode trusting another CA is refused.
    2 rounds of a stateful algorithm (client 2 carries its state from round 1 into round 2) end where the
    simulator ends, with the same metrics rows."""
    if alg not in REGISTRY:
        pytest.skip(f"{alg} is not registered")
    d = deployments(tls=True)
    start_federation(d, 3)
    rogue = d.start_supernode(0, 3, root_cert=deploy.make_certificates(tmp_path / "rogue").ca_cert, name="rogue")
    t0, run_dir = time.monotonic(), tmp_path / "flower"
    finish(d, d.run(EXAMPLE, run_config(alg, run_dir, *SMALL)))
    exp, ref, sim_dir = simulate(alg, tmp_path / "sim", *SMALL)
    final = flower_final(run_dir, exp)
    print(f"{alg}: deployed vs simulated max |diff| = {max_abs_diff(ref, final):.3g} ({time.monotonic() - t0:.0f}s)")
    assert_fp32_close(final, ref, exp)
    assert rows_close(read_metrics(run_dir), read_metrics(sim_dir))
    assert len(deploy.online_nodes(d.env)) == 3  # the rogue never joined
    assert not rogue.alive() and "CERTIFICATE_VERIFY_FAILED" in rogue.output()


@pytest.mark.slow
def test_supernode_killed_during_a_round(tmp_path: Path, deployments) -> None:
    """Kill -9 a SuperNode while it trains in round 2 of 3: round 2 completes with the other two after the
    round timeout, round 3 runs without it, and its round-1 contribution stays in the model (the final model
    equals the simulator's loop with that client's uploads of rounds 2 and 3 lost)."""
    d = deployments()
    nodes = start_federation(d, 3)
    run_dir = tmp_path / "flower"
    overrides = ("data.num_clients=3", "sampling.fraction=1.0", "rounds=3")
    settings = {"round-timeout": 60.0, "node-wait": 5.0}
    run_id = d.run(EXAMPLE, run_config("hafedho", run_dir, *overrides, **settings))
    victim, end = nodes[1], time.monotonic() + 300
    while len(read_metrics(run_dir)) < 1:  # round 1 is aggregated
        assert time.monotonic() < end and d.superlink.alive(), d.log(run_id)[-4000:]
        time.sleep(0.2)
    before = set(victim.children())
    while not [c for c in victim.children() if "flwr-clientapp" in c and c not in before]:  # round 2 runs there
        assert time.monotonic() < end, d.log(run_id)[-4000:]
        time.sleep(0.1)
    victim.stop(kill=True)
    finish(d, run_id)
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0]["cohort_size"] == 3 and "dropped" not in rows[0]  # the victim's round-1 upload is in
    assert 1 in rows[1]["dropped"] and 1 in rows[2]["dropped"]
    # on an overloaded machine a healthy node may miss the timeout too: compare with what was really dropped
    drops = {r["round"]: set(r.get("dropped", [])) for r in rows}
    exp, _, _ = simulate("hafedho", tmp_path / "sim", *overrides)
    ref, final = simulate_with_drops(exp, drops), flower_final(run_dir, exp)
    print(f"killed node: deployed vs reference max |diff| = {max_abs_diff(ref, final):.3g}; dropped {drops}")
    assert_fp32_close(final, ref, exp)


def server_apps(d: deploy.Deployment) -> list[tuple[int, int]]:
    """The ServerApp processes the SuperLink started."""
    family = descendants(d.superlink.pid)
    return [p for p in family if b"flwr-serverapp" in Path(f"/proc/{p[0]}/cmdline").read_bytes()]


def kill_server_app(d: deploy.Deployment) -> None:
    """kill -9 every ServerApp process the SuperLink started."""
    servers = server_apps(d)
    assert servers, d.superlink.children()
    for pid, _ in servers:
        os.kill(pid, signal.SIGKILL)


def wait_rows(d: deploy.Deployment, run_id: int, run_dir: Path, count: int, end: float) -> None:
    while len(read_metrics(run_dir)) < count:
        assert time.monotonic() < end and d.superlink.alive(), d.log(run_id)[-4000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a deployment of 6 rounds, two faults and a resume: 5-10 min here
@pytest.mark.parametrize("alg", ["hafedho", "scaffold"])
def test_a_deployment_survives_kill_9_of_a_supernode_and_of_the_server_app(
    tmp_path: Path, deployments, alg: str
) -> None:
    """A TLS SuperLink and 3 SuperNodes with a state-dir, 6 rounds of 2 clients, a checkpoint every 2 rounds. A
    SuperNode that trained in rounds 1-2 is killed -9 after round 2 and restarted; the ServerApp is killed -9 in
    round 4 (round 3 logged and trained on the nodes, the last checkpoint at round 2) and resumed by a new `flwr
    run` (a new run series: every node's memory is empty). Rounds 1-6 are logged once each, no row lists a state
    reset, and the rows and final model are the simulator's (which an uninterrupted deployment equals)."""
    overrides = ("data.num_clients=3", "sampling.cohort_size=2", "rounds=6", "checkpoint_every=2")
    exp, ref, sim_dir = simulate(alg, tmp_path / "sim", *overrides)
    plan = cohorts(exp)
    victim = next(c for c in plan[1] if c not in plan[2] and c in plan[3])  # state of round <= 2 used in round 4
    d, conf = deployments(tls=True), {"state-dir": str(tmp_path / "node-states")}
    d.start_superlink()
    nodes = [d.start_supernode(i, 3, node_config=conf) for i in range(3)]
    known = set(d.wait_for_nodes(3))
    run_dir = tmp_path / "flower"
    settings = {"round-timeout": 180.0, "node-wait": 60.0}
    first, end = d.run(EXAMPLE, run_config(alg, run_dir, *overrides, **settings)), time.monotonic() + 900
    wait_rows(d, first, run_dir, 2, end)
    nodes[victim].stop(kill=True)  # between rounds for it: it is not in round 3's cohort
    d.start_supernode(victim, 3, node_config=conf, name=f"supernode-{victim}-restarted")
    while not set(deploy.online_nodes(d.env)) - known:  # the restarted node is registered before round 4
        assert time.monotonic() < end
        time.sleep(0.5)
    wait_rows(d, first, run_dir, 3, end)
    time.sleep(1.0)
    kill_server_app(d)
    assert not (run_dir / "done").exists()
    second = d.run(EXAMPLE, run_config(alg, run_dir, *overrides, **settings, resume=True))
    finish(d, second, timeout=900)
    assert "resuming" in d.log(second)
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6] and (run_dir / "done").exists()
    assert not [r for r in rows if "state_reset" in r or "dropped" in r], rows
    final = flower_final(run_dir, exp)
    print(f"{alg}: node and ServerApp killed, resumed: max |diff| from the simulator = {max_abs_diff(ref, final):.3g}")
    assert_fp32_close(final, ref, exp)
    assert rows_close(rows, read_metrics(sim_dir))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_superlink_killed_and_restarted(tmp_path: Path, deployments) -> None:
    """kill -9 the SuperLink after round 2 of 4: its ServerApp sees it gone and stops (``watch_superlink``;
    Flower's own would retry forever, holding the run's lock). Its SuperNodes are refused by the new SuperLink
    (an in-memory SuperLink forgets their identities: 401) and exit. A new SuperLink on the same address, the
    SuperNodes started again with the same state-dir, and `resume` continue the run: rows 1-4 once each, equal to
    the simulator's, SCAFFOLD's client states kept on the nodes' disks."""
    overrides = ("data.num_clients=3", "sampling.cohort_size=2", "rounds=4", "checkpoint_every=1")
    exp, ref, sim_dir = simulate("scaffold", tmp_path / "sim", *overrides)
    d, conf = deployments(), {"state-dir": str(tmp_path / "node-states")}
    d.start_superlink()
    nodes = [d.start_supernode(i, 3, node_config=conf) for i in range(3)]
    d.wait_for_nodes(3)
    run_dir, settings = tmp_path / "flower", {"round-timeout": 180.0, "node-wait": 60.0}
    first, end = d.run(EXAMPLE, run_config("scaffold", run_dir, *overrides, **settings)), time.monotonic() + 900
    wait_rows(d, first, run_dir, 2, end)
    old, servers = d.superlink, server_apps(d)
    os.kill(old.pid, signal.SIGKILL)
    while any(deploy.is_running(p) for p in servers):  # the ServerApp stops once its SuperLink is gone (30 s)
        assert time.monotonic() < end, f"the ServerApp outlived its SuperLink: {servers}"
        time.sleep(0.5)
    old.stop()  # what else the SuperLink started (Flower's SuperExec outlives it)
    assert not (run_dir / "done").exists()
    d.start_superlink()
    for i, node in enumerate(nodes):
        node.stop()
        d.start_supernode(i, 3, node_config=conf, name=f"supernode-{i}-again")
    d.wait_for_nodes(3)
    second = d.run(EXAMPLE, run_config("scaffold", run_dir, *overrides, **settings, resume=True))
    finish(d, second, timeout=900)
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and not [r for r in rows if "state_reset" in r or "dropped" in r]
    final = flower_final(run_dir, exp)
    print(f"SuperLink killed and restarted: max |diff| from the simulator = {max_abs_diff(ref, final):.3g}")
    assert_fp32_close(final, ref, exp)
    assert rows_close(rows, read_metrics(sim_dir))


def test_simulation_engine_runs_the_same_app(tmp_path: Path, deployments, capsys: pytest.CaptureFixture[str]) -> None:
    """The same Flower App on Flower's simulation engine (Ray, 3 virtual SuperNodes), submitted with
    ``hafedho flower run --simulation``."""
    pytest.importorskip("ray")
    d = deployments(simulation=True, ray_loopback=True)
    d.start_superlink()
    d.wait_ready()
    run_dir = tmp_path / "flower"
    args = ["flower", "run", "smoke", *SMALL, "--superlink", d.address, "--simulation", "3", "--torch-threads", "1"]
    assert main([*args, "--run-dir", str(run_dir), "--wait"]) == 0
    assert "finished:completed" in capsys.readouterr().out
    exp, ref, sim_dir = simulate("hafedho", tmp_path / "sim", *SMALL)
    final = flower_final(run_dir, exp)
    print(f"simulation engine vs simulator max |diff| = {max_abs_diff(ref, final):.3g}")
    assert_fp32_close(final, ref, exp)
    assert rows_close(read_metrics(run_dir), read_metrics(sim_dir))
