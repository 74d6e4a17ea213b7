"""Client state on the SuperNodes (``flower/node_store.py``): kept across a SuperNode restart and a resumed
ServerApp when the node has a ``state-dir``, and never lost silently when it has none.

In process (``LocalGrid``): a restarted SuperNode is a node whose ``context.state`` is empty again; a resumed
deployment is a new grid (each ``flwr run`` is a new run series on the nodes). The deployed versions of these
cases are in ``tests/test_flower.py`` (slow).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flower_helpers import LocalGrid, die, max_abs_diff
from flower_helpers import run_strategy as run
from flwr.app import Context, RecordDict
from helpers import no_wall

from hafedho.config import ConfigError
from hafedho.flower.common import client_template, experiment
from hafedho.flower.node_store import NodeStore
from hafedho.flower.server_app import main as server_main
from hafedho.flower.strategy import HafedhoStrategy
from hafedho.runfiles import RunDirError, read_metrics
from hafedho.runtime import checkpoint
from hafedho.sim.runner import Interrupted

# 10 clients, 5 per round, 5 rounds: clients train in consecutive rounds, where HaFedHo reads its state too.
ROUNDS = ("rounds=5", "checkpoint_every=1", "sampling.cohort_size=5")


def run_config(alg: str, *overrides: str) -> dict[str, Any]:
    return {"hafedho-config": "smoke", "overrides": " ".join([f"algorithm.name={alg}", *ROUNDS, *overrides])}


def trained_twice(rc: dict[str, Any]) -> tuple[int, int]:
    """A client of some round t >= 2 that also trained before t: its state matters in round t."""
    exp = experiment(rc)
    seen: set[int] = set()
    for t in range(1, exp.cfg.rounds + 1):
        for cid in exp.cohort(t).tolist():
            if cid in seen and t >= 2:
                return cid, t
            seen.add(cid)
    raise AssertionError("no client trains twice")


@pytest.mark.parametrize("alg", ["scaffold", "hafedho"])
def test_a_restarted_supernode_with_a_state_dir_continues_exactly(tmp_path: Path, alg: str) -> None:
    """Every SuperNode restarts before round 3 (an empty ``context.state``); with a ``state-dir`` the run equals
    the uninterrupted one bit for bit, and no row lists a reset. Older state versions are deleted as the
    checkpoints move on."""
    rc = run_config(alg)
    exp = experiment(rc)
    full = run(rc, tmp_path / "full", LocalGrid(rc, exp.fed.num_clients))
    state_dir = tmp_path / "node-states"
    everyone = tuple(range(exp.fed.num_clients))
    grid = LocalGrid(
        rc, exp.fed.num_clients, node_config={"state-dir": str(state_dir)}, events={3: lambda g: g.restart(*everyone)}
    )
    got = run(rc, tmp_path / "flower", grid)
    assert max_abs_diff(full.final_params(), got.final_params()) == 0.0
    assert no_wall(got.rows) == no_wall(full.rows) and not any("state_reset" in r for r in got.rows)
    (store,) = state_dir.iterdir()
    assert store.name == f"{got.digest}-{got.run_token}"
    clients = {p.name: sorted(int(f.name[1:-3]) for f in p.glob("r*.pt")) for p in store.glob("client-*")}
    assert len(clients) == len({c for t in range(1, 6) for c in exp.cohort(t).tolist()})
    assert all(1 <= len(v) <= 3 for v in clients.values()), clients  # pruned as the checkpoints moved on


def test_a_restarted_supernode_without_a_state_dir_is_recorded(tmp_path: Path) -> None:
    """No ``state-dir``: the restarted node's client trains from init_client, and the round's row says so
    (``state_reset``); the model then differs from the uninterrupted run's."""
    rc = run_config("scaffold")
    exp = experiment(rc)
    cid, t = trained_twice(rc)
    full = run(rc, tmp_path / "full", LocalGrid(rc, exp.fed.num_clients))
    grid = LocalGrid(rc, exp.fed.num_clients, events={t: lambda g: g.restart(cid)})
    got = run(rc, tmp_path / "flower", grid)
    rows = read_metrics(tmp_path / "flower")
    assert rows[t - 1]["state_reset"] == [cid]
    assert [r["round"] for r in rows if "state_reset" in r] == [t]
    assert max_abs_diff(full.final_params(), got.final_params()) > 0.0


def test_a_deleted_node_store_is_recorded(tmp_path: Path) -> None:
    """A node whose store folder is deleted between rounds: its client restarts from init_client, listed in
    that round's ``state_reset``; a stateless algorithm (FedAvg) has nothing to lose and lists nobody."""
    rc = run_config("hafedho")
    exp = experiment(rc)
    cid, t = trained_twice(rc)
    state_dir = tmp_path / "node-states"
    conf = {"state-dir": str(state_dir)}
    grid = LocalGrid(rc, exp.fed.num_clients, node_config=conf, events={t: lambda g: shutil.rmtree(state_dir)})
    run(rc, tmp_path / "flower", grid)
    reset = {r["round"]: r["state_reset"] for r in read_metrics(tmp_path / "flower") if "state_reset" in r}
    assert t in reset and cid in reset[t]
    fedavg, conf = run_config("fedavg"), {"state-dir": str(tmp_path / "fedavg-states")}
    grid = LocalGrid(fedavg, exp.fed.num_clients, node_config=conf, events={t: lambda g: g.restart(cid)})
    run(fedavg, tmp_path / "fedavg", grid)
    assert not any("state_reset" in r for r in read_metrics(tmp_path / "fedavg"))
    assert not (tmp_path / "fedavg-states").exists()  # nothing to keep: nothing written


@pytest.mark.parametrize("alg", ["scaffold", "hafedho"])
def test_a_resumed_deployment_gets_the_client_states_back(tmp_path: Path, alg: str) -> None:
    """The ServerApp dies in round 4 with its last checkpoint at round 2, after its clients trained in round 3; a
    new ServerApp resumes on new nodes (a new run series: every ``context.state`` empty) with the same
    ``state-dir``: round 3 is recomputed from the states of round <= 2 (the clients' round-3 versions are
    ignored, then replaced), and the run equals the uninterrupted one bit for bit."""
    run_dir, state_dir = tmp_path / "flower", tmp_path / "node-states"
    rc = {**run_config(alg, "checkpoint_every=2"), "run-dir": str(run_dir), "node-wait": 0.0}
    exp = experiment(rc)
    n, conf = exp.fed.num_clients, {"state-dir": str(state_dir)}
    with pytest.raises(Interrupted, match=r"interrupted at round 3; .*from the checkpoint of round 2"):
        server_main(LocalGrid(rc, n, node_config=conf, events={4: die}), Context(1, 0, {}, RecordDict(), rc))
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3]
    ahead = {int(p.parent.name[7:]) for p in state_dir.glob("*/client-*/r3.pt")}
    assert ahead == set(exp.cohort(3).tolist())  # states of the round the resumed run recomputes
    server_main(LocalGrid(rc, n, node_config=conf), Context(2, 0, {}, RecordDict(), {**rc, "resume": True}))
    full = run(rc, tmp_path / "full", LocalGrid(rc, n))
    assert no_wall(read_metrics(run_dir)) == no_wall(full.rows)
    server = exp.alg.init_server(exp.model.params())
    _, server, _, extra = checkpoint.load(run_dir / "checkpoint.pt", server)
    assert max_abs_diff(exp.alg.eval_params(server), full.final_params()) == 0.0
    (store,) = state_dir.iterdir()  # one run: one store folder, named by the token the checkpoint keeps
    assert store.name.endswith(f"-{extra['run_token']}") and len(extra["client_rounds"]) == n


def test_a_checkpoint_with_corrupt_node_facts_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "flower"
    rc = {**run_config("scaffold", "rounds=2"), "run-dir": str(run_dir), "node-wait": 0.0}
    n = experiment(rc).fed.num_clients
    with pytest.raises(Interrupted):
        server_main(LocalGrid(rc, n, events={2: die}), Context(1, 0, {}, RecordDict(), rc))
    payload = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    payload["extra"]["client_rounds"] = [0] * (n - 1)
    torch.save(payload, run_dir / "checkpoint.pt")
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(RunDirError, match=r"corrupt checkpoint \(its run token or its 10 clients' rounds\)") as e:
        HafedhoStrategy(experiment(rc), run_dir, node_wait=0.0).prepare(resume=True)
    assert "\n" not in str(e.value) and (run_dir / "metrics.jsonl").read_bytes() == before


def node_store(tmp_path: Path, cid: int = 3, state_dir: Any = None) -> NodeStore:
    exp = experiment(run_config("scaffold"))
    conf = {"partition-id": cid, "num-partitions": 10, "state-dir": str(state_dir or tmp_path / "s")}
    return NodeStore.of(Context(1, 1, conf, RecordDict(), {}), "abc-123", cid, client_template(exp))


def test_node_store_refusals_are_one_line(tmp_path: Path) -> None:
    """A damaged state file, a state of another client, a link in the store's path, two nodes on one client's
    store and a relative state-dir: each one line naming the file or key and the fix."""
    store = node_store(tmp_path)
    state = store.like
    with store.writing():
        store.save(1, state, 0)
    assert store.load(2)[0] == 1 and store.load(1) == (0, None)
    (store.folder / "r1.pt").write_bytes(b"not a state")
    with pytest.raises(ConfigError, match=r"r1.pt: not a readable client state .*; delete .*r1.pt to restart client 3"):
        store.load(2)
    other = node_store(tmp_path, cid=4)
    with other.writing():
        other.save(1, state, 0)
    shutil.copy(other.folder / "r1.pt", store.folder / "r1.pt")
    with pytest.raises(ConfigError, match=r"not a state of client 3 of this run"):
        store.load(2)
    busy = r"in use by another process .* give each node its own partition-id"
    with store.writing(), pytest.raises(RunDirError, match=busy), node_store(tmp_path).writing():  # a second node
        pass
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "abc-123").symlink_to(target)
    linked = node_store(tmp_path, state_dir=tmp_path / "linked")
    with pytest.raises(RunDirError, match=r"is a symbolic link, not a client-state folder"), linked.writing():
        pass
    assert not any(target.iterdir())
    with pytest.raises(ConfigError, match=r"state-dir='rel/dir' is relative; give the SuperNode an absolute path"):
        node_store(tmp_path, state_dir="rel/dir")


def test_a_run_token_that_is_a_path_is_refused(tmp_path: Path) -> None:
    """The run token names a folder on the node: a server sending ``../..`` gets one line, nothing is written."""
    from hafedho.flower.client_app import _store

    rc = run_config("scaffold")
    conf = {"partition-id": 0, "num-partitions": 10, "state-dir": str(tmp_path / "s")}
    context = Context(1, 1, conf, RecordDict(), rc)
    with pytest.raises(ConfigError, match=r"run-token='\.\./\.\./x', not a hex token"):
        _store(experiment(rc), context, 0, {"run-token": "../../x"})
    assert _store(experiment(rc), context, 0, {"run-token": "ab12"}).folder.parent.name.endswith("-ab12")
    assert not (tmp_path / "s").exists()
