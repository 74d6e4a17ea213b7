"""Sources that read no files: scikit-learn's bundled digits and FedProx's Synthetic(alpha, beta)."""

from __future__ import annotations

import numpy as np

from hafedho.data.dataset import Dataset, Source, no_path
from hafedho.data.safe_pickle import DataError

__all__ = ["DIGITS", "SYNTHETIC"]


def _load_digits(path: str | None = None) -> Dataset:
    """scikit-learn's bundled 8x8 digits: float32 ``[N, 64]`` in [0, 1], fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    no_path("digits", path)
    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    # Seed 0 regardless of the run's seed: the test set must be the same in every experiment.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    info = f"digits from scikit-learn: {len(y_tr)} train / {len(y_te)} test, 64 features"
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10, info=info)


def _load_synthetic(
    path: str | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    num_devices: int = 30,
    seed: int = 0,
    dim: int = 60,
    num_classes: int = 10,
    train_fraction: float = 0.8,
    max_samples: int | None = None,
) -> Dataset:
    """FedProx's Synthetic(alpha, beta) (Li et al., arXiv 1812.06127), one device per natural group.

    Follows the authors' ``generate_synthetic.py`` rather than the paper's notation where they differ:
    ``alpha`` and ``beta`` are the standard deviations (``np.random.normal(0, alpha)``) of the scalar
    means u_k (shared by every entry of W_k and b_k) and B_k (of v_k); the paper writes N(0, alpha),
    which reads as a variance. Published results come from the code, and alpha = beta = 1 agree anyway.
    Device sizes are ``int(lognormal(4, 2)) + 50``; ``max_samples`` optionally caps them (default: none).
    Each device's first ``train_fraction`` of samples is train, the rest joins the global test set; the
    samples are i.i.d. within a device, so this equals the reference's shuffle-then-split in distribution
    (the reference keeps 90%; 80% is the split the later LEAF/pFedMe generators and this project use).
    """
    no_path("synthetic", path)
    if num_devices < 1 or dim < 1 or num_classes < 2 or not 0.0 < train_fraction < 1.0:
        raise DataError("synthetic needs num_devices >= 1, dim >= 1, num_classes >= 2, 0 < train_fraction < 1")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    if max_samples is not None:
        sizes = np.minimum(sizes, int(max_samples))
    mean_w = rng.normal(0, alpha, num_devices)  # u_k; the reference reuses it as the mean of b_k
    mean_x = rng.normal(rng.normal(0, beta, num_devices)[:, None], 1, (num_devices, dim))  # v_k ~ N(B_k, 1)
    std_x = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the covariance diagonal j^-1.2
    parts: dict[str, list[np.ndarray]] = {"xtr": [], "ytr": [], "xte": [], "yte": [], "g": []}
    for k in range(num_devices):
        w = rng.normal(mean_w[k], 1, (dim, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        # Diagonal covariance: mean + std * N(0, 1) equals the reference's multivariate_normal draw.
        x = mean_x[k] + std_x * rng.standard_normal((sizes[k], dim))
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax = argmax of the logits
        cut = int(train_fraction * sizes[k])
        parts["xtr"].append(x[:cut])
        parts["ytr"].append(y[:cut])
        parts["xte"].append(x[cut:])
        parts["yte"].append(y[cut:])
        parts["g"].append(np.full(cut, k))
    x_tr, y_tr, x_te, y_te, groups = (np.concatenate(parts[k]) for k in ("xtr", "ytr", "xte", "yte", "g"))
    info = (
        f"synthetic({alpha}, {beta}) seed {seed}: {num_devices} devices, {len(y_tr)} train / {len(y_te)} test, "
        f"{dim} features"
    )
    return Dataset(
        "synthetic",
        x_tr.astype(np.float32),
        y_tr.astype(np.int64),
        x_te.astype(np.float32),
        y_te.astype(np.int64),
        num_classes,
        groups=groups.astype(np.int64),
        info=info,
    )


DIGITS = Source(
    "digits",
    "scikit-learn 8x8 digits, 1,797 images, 10 classes (bundled, no files)",
    None,
    _load_digits,
    needs_files=False,
)
SYNTHETIC = Source(
    "synthetic",
    "FedProx Synthetic(alpha, beta), 30 devices, 60 features, 10 classes",
    None,
    _load_synthetic,
    needs_files=False,
)
