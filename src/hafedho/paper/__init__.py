"""What belongs to the HaFedHo study, not to the library, behind generic extension points any method can use.

``twin``: the momentum twin, a derived row (``[[variants]]`` with ``derive = "hafedho.paper.twin:momentum_twin"``,
the sweep's by-reference hook); ``study``: the study's report settings (its own method, its plain reference, how
a derived row reads), the defaults of every ``[report]`` that leaves them unset (``hafedho.report.study``).
Nothing below this package imports it: the sweep and the report load it by reference (``hafedho.core.refs``).
"""
