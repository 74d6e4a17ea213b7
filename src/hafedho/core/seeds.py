"""Every random draw is a pure function of (run seed, purpose, round, client), never of call order.

That is what makes cohorts identical across algorithms, results independent of the engine and of the number
of worker processes, and a resumed run bit-identical to an uninterrupted one without saving RNG positions.
"""

from __future__ import annotations

import zlib

import numpy as np

# Every purpose a draw may have, and the parts that follow it: one stream each, so adding a draw never moves another.
PURPOSES: dict[str, str] = {
    "model_init": "the initial global model (torch; also random's and NumPy's global generators); no parts",
    "user_code": "the global generators (random, NumPy, torch) seeded before a data source loads; no parts",
    "local_test": "the held-out local test split of every client; no parts",
    "cohort": "round t's cohort; (t,)",
    "batches": "client i's batches in round t; (t, i)",
    "client_torch": "client i's torch generator in round t (dropout); (t, i)",
    "vmap_chunk": "chunk k's torch generator in round t under vmap (dropout); (t, k)",
    "full_gradient": "the torch generator of the simulator's full-data pass over client j in round t; (t, j)",
}


def seed_for(seed: int, purpose: str, *parts: int) -> int:
    """A 63-bit seed derived from ``(seed, purpose, *parts)`` through NumPy's SeedSequence hashing."""
    if purpose not in PURPOSES:  # a typo would silently give a new, unrelated stream
        raise ValueError(f"seed purpose {purpose!r} is not listed in hafedho.core.seeds.PURPOSES")
    if seed < 0:
        raise ValueError(f"seed {seed}: seeds are non-negative integers")
    tag = zlib.crc32(purpose.encode())
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, tag, *(int(p) & 0xFFFFFFFF for p in parts), *_high(seed)])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def _high(seed: int) -> list[int]:
    """The 32-bit words of ``seed`` above its lowest, least significant first; none below 2**32.

    Seeds below 2**32 hash exactly as they always have (committed runs keep their numbers); a larger seed appends
    its high words, the last one non-zero, so seed + k * 2**32 never shares a stream with seed. (SeedSequence pads
    with zero words, so a trailing zero word would collide: it never occurs here.)
    """
    words: list[int] = []
    seed >>= 32
    while seed:
        words.append(seed & 0xFFFFFFFF)
        seed >>= 32
    return words


def rng_for(seed: int, purpose: str, *parts: int) -> np.random.Generator:
    return np.random.default_rng(seed_for(seed, purpose, *parts))
