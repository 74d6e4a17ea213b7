"""The HaFedHo study's report settings, named by every paper preset (``configs/_common.toml``'s
``[report] study = "hafedho_paper.study:REPORT"``): its method, its plain reference, how its derived row (the
momentum twin) reads, and the tables and figures it adds to the library's (``hafedho.report.study``).
"""

from __future__ import annotations

from hafedho_paper.twin import TWIN

REPORT = {
    "own": "hafedho",  # the study's method: the verdict, the lead rows and the robustness table judge this row
    "own_name": "HaFedHo",
    "reference": "fedavg",  # the plain baseline: the robustness table's share, rounds' auto targets
    "reference_name": "FedAvg",
    "derived": TWIN,  # how a row made by a [[variants]] derive reads (the momentum twin)
    # kinds this study adds to the report's registries, after the library's own: drawn where runs logged them
    "tables": {"diagnostics": "hafedho_paper.diagnostics:diagnostics_table"},
    "figures": {"diagnostics": "hafedho_paper.diagnostics:diagnostic_figure"},
}
