"""A user's data source, named by reference: ``data.source = "examples.server_adam.blobs:load"``.

A function ``load(path=None, **options) -> Dataset``: ``path`` is ``data.path`` (unused here: the data is drawn in
memory), the options are ``data.options``, e.g. ``data.options = {classes = 3}``.
"""

import numpy as np

from hafedho.data.dataset import Dataset


def load(path: str | None = None, n: int = 600, classes: int = 4, dim: int = 8, seed: int = 0) -> Dataset:
    """Gaussian blobs: one unit-variance cloud per class around a random centre."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 3.0, (classes, dim))
    y = rng.integers(0, classes, n)
    x = (centres[y] + rng.normal(0.0, 1.0, (n, dim))).astype(np.float32)
    cut = n * 4 // 5
    return Dataset("blobs", x[:cut], y[:cut], x[cut:], y[cut:], classes, info=f"blobs: {n} points, {classes} classes")
