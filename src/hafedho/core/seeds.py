"""Every random draw is a pure function of (run seed, purpose, round, client), never of call order.

That is what makes cohorts identical across algorithms, results independent of the engine and of the number
of worker processes, and a resumed run bit-identical to an uninterrupted one without saving RNG positions.
"""

from __future__ import annotations

import zlib

import numpy as np

PURPOSES = ("model_init", "cohort", "batches", "client_torch")


def seed_for(seed: int, purpose: str, *parts: int) -> int:
    """A 63-bit seed derived from ``(seed, purpose, *parts)`` through NumPy's SeedSequence hashing."""
    tag = zlib.crc32(purpose.encode())
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, tag, *(int(p) & 0xFFFFFFFF for p in parts)])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def rng_for(seed: int, purpose: str, *parts: int) -> np.random.Generator:
    return np.random.default_rng(seed_for(seed, purpose, *parts))
