"""max |s_i u_i| over a whole simulated run, per algorithm (s_i = w_i / K): what SecAgg+'s clipping range must cover.

    PYTHONPATH=src python benchmarks/secagg_range.py default fedavg,hafedho,scaffold [KEY=VALUE ...]

Runs the simulator's round loop in this process with real client states (one thread, no run directory) and
prints, per algorithm, K (``hafedho.flower.secagg.weight_scale``), lambda and the largest entry any upload reached.
"""

from __future__ import annotations

import sys
import tempfile

from torch.utils import _pytree as pytree

from hafedho.config import load_config
from hafedho.core import RoundInfo, tree
from hafedho.experiment import build
from hafedho.flower.common import config_path
from hafedho.flower.secagg import weight_scale
from hafedho.runtime.work import RoundWork


def largest_entry(name: str, alg: str, overrides: list[str]) -> tuple[float, int, float]:
    """(K, lambda, max_i,t |s_i u_i|) of a run of config ``name`` with ``algorithm.name=alg``."""
    cfg = load_config(config_path(name), [f"algorithm.name={alg}", *overrides])
    cfg.out = tempfile.mkdtemp()
    exp = build(cfg)
    a, fed = exp.alg, exp.fed
    server, states, biggest = a.init_server(exp.model.params()), {}, 0.0
    scale = weight_scale(exp)
    for t in range(1, cfg.rounds + 1):
        cohort = exp.cohort(t).tolist()
        rnd = RoundInfo(t, fed.num_clients, len(cohort))
        work = RoundWork(a, a.broadcast(server, rnd), fed, exp.plan, exp.model, rnd, cfg.seed)
        agg, like = a.new_aggregator(), None
        for cid in cohort:
            res = work.client_update(cid, states.get(cid, a.init_client(exp.model.params())))
            states[cid], s = res.state, float(res.weight) / scale
            leaves = [x for x in pytree.tree_leaves(res.upload) if x.numel()]
            biggest = max([biggest] + [s * float(x.abs().max()) for x in leaves])
            agg.add(tree.detach(res.upload), res.weight)
            like = res.upload
        if cohort:
            server, _ = a.server_update(server, agg.result(like), RoundInfo(t, fed.num_clients, len(cohort)))
    lam = int(max(exp.plan.steps_for(int(n)) for n in fed.sizes))
    return scale, lam, biggest


if __name__ == "__main__":
    config, algs = sys.argv[1], sys.argv[2].split(",")
    for alg in algs:
        k, lam, big = largest_entry(config, alg, sys.argv[3:])
        print(f"{config} {alg}: K={k:g} lambda={lam} max|s_i u_i| = {big:.4g}", flush=True)
