"""The HaFedHo study's report settings: what ``hafedho.report.study`` takes for every key a section's ``[report]``
leaves unset (a plain folder of runs, an index written before these keys existed, a preset of your own).

The paper presets state the names themselves (``configs/paper/_common.toml``'s ``[report]``); a study of another
method sets ``own`` (and ``reference``) in its preset, or ``own = ""`` for no verdict at all.
"""

from __future__ import annotations

from hafedho.paper.twin import TWIN

REPORT = {
    "own": "hafedho",  # the study's method: the verdict, the lead rows and the robustness table judge this row
    "own_name": "HaFedHo",
    "reference": "fedavg",  # the plain baseline: the robustness table's share, rounds' auto targets
    "reference_name": "FedAvg",
    "derived": TWIN,  # how a row made by a [[variants]] derive reads (the momentum twin)
}
