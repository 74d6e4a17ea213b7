"""What every runtime shares, below the simulator (``hafedho.sim``) and Flower (``hafedho.flower``), its two peers:
``work`` (``RoundWork``, the seeded client step; ``CohortStream``/``CohortResult``; the ``Engine`` protocol),
``store`` (per-client state, in RAM or memory-mapped), ``checkpoint``, ``rounds`` (``ServerRounds``: a round's
server-side bookkeeping) and ``rundir`` (``RunDir``: the one owner of a run directory)."""
