"""Cohort sampling, a pure function of (seed, round): every algorithm sees the same cohorts."""

from __future__ import annotations

import numpy as np

from hafedho.core.seeds import rng_for


def fixed_cohort(seed: int, rnd: int, num_clients: int, m: int) -> np.ndarray:
    """m clients drawn uniformly without replacement (the paper's setting), sorted ids."""
    return np.sort(rng_for(seed, "cohort", rnd).choice(num_clients, size=m, replace=False))


def bernoulli_cohort(seed: int, rnd: int, num_clients: int, prob: float) -> np.ndarray:
    """Each client joins independently with probability ``prob``; an empty cohort is legal."""
    return np.flatnonzero(rng_for(seed, "cohort", rnd).random(num_clients) < prob)
