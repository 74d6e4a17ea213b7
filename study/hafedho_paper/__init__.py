"""The HaFedHo paper's study, a plugin of the hafedho library (``hafedho.core.plugins``), which never imports it.

``configs/``: the paper presets (``hafedho sweep table1`` finds them through ``PLUGIN``); ``twin``: the momentum
twin, a derived row (``[[variants]]`` with ``derive = "hafedho_paper.twin:momentum_twin"``); ``study``: the study's
report settings (``[report] study = "hafedho_paper.study:REPORT"``: its own method, its plain reference, how the
twin's row reads, and its tables and figures); ``diagnostics``: HaFedHo's ``[diagnostics]`` tables and figure
(Theorem 1 measured) and the names of HaFedHo's diagnostic metrics.
"""

from __future__ import annotations

from pathlib import Path

from hafedho.core.plugins import Plugin

PRESETS = Path(__file__).resolve().parent / "configs"

# The study lived inside the library as hafedho.paper until 2026-12: results folders written then name it so.
PLUGIN = Plugin(presets=PRESETS, renamed={"hafedho.paper": "hafedho_paper"})
