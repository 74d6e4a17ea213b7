"""Split a dataset's example indices among federated clients.

Every partition is a pure function of its arguments (a ``seed`` drives a private
``np.random.default_rng``), and every client's index array is sorted ascending and
``int64`` so that equal partitions compare and hash equal.
"""

from __future__ import annotations

import hashlib
import math
from numbers import Integral, Real

import numpy as np

from hafedho.core.algorithm import ConfigError

__all__ = [
    "FLWR",
    "PARTITIONS",
    "PartitionError",
    "check_partition",
    "dirichlet",
    "iid",
    "label_skew",
    "natural",
    "partition_hash",
]


class PartitionError(ValueError):
    """A partition request that cannot be met; the message is one user-facing line."""


PARTITIONS = ("dirichlet", "iid", "natural")  # data.partition: ours, or FLWR + a flwr-datasets partitioner's name
FLWR = "flwr:"  # e.g. "flwr:DirichletPartitioner" (hafedho.data.flwr_partition)


def check_partition(partition: str, options: dict | None) -> None:
    """``data.partition`` is one of ours or ``flwr:<Partitioner>``; ``data.partition_options`` go with the latter
    only (checked when the config is loaded: ConfigError)."""
    flwr = partition.startswith(FLWR) and len(partition) > len(FLWR)
    if partition not in PARTITIONS and not flwr:
        raise ConfigError(
            f"data.partition={partition!r}: choose one of {', '.join(map(repr, PARTITIONS))} or "
            f"'{FLWR}<Partitioner>' (e.g. '{FLWR}DirichletPartitioner')"
        )
    if options is not None and not flwr:
        raise ConfigError(
            f"data.partition_options: only for data.partition='{FLWR}<Partitioner>'; remove it or use data.q"
        )


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise PartitionError(f"{name} must be an integer >= {minimum} (got {value!r})")
    return int(value)


def _check_int_array(name: str, values: np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise PartitionError(f"{name} must be a 1-D integer array (got shape {arr.shape}, dtype {arr.dtype})")
    if arr.size and arr.min() < 0:
        raise PartitionError(f"{name} must be non-negative (found {int(arr.min())})")
    return arr.astype(np.int64, copy=False)


def _finish(pieces: list[np.ndarray]) -> np.ndarray:
    """Concatenate one client's pieces into its canonical form: sorted ``int64``."""
    if not pieces:
        return np.empty(0, dtype=np.int64)
    return np.sort(np.concatenate(pieces)).astype(np.int64, copy=False)


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    q: float,
    seed: int,
    min_size: int = 10,
    max_redraws: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed partition with per-class Dirichlet(q) client shares.

    Follows NIID-Bench's ``partition_data`` "noniid-labeldir" (Li et al., 2022,
    arXiv:2102.02079), also used by FedML: for each class, draw client shares from
    Dir(q * 1_n), zero the share of every client already holding >= N/n examples,
    renormalise, and cut the shuffled class indices at the cumulative shares. The
    whole draw repeats until every client holds at least ``min_size`` examples.
    Differences: a bounded number of redraws instead of an endless loop; when every
    eligible client's share underflows to exactly 0 (tiny q; NIID-Bench divides by
    zero there), the shares are redrawn from Dir(q) over the eligible clients only,
    which is the same distribution. Clients' indices are returned sorted rather
    than shuffled (order carries no information; sorting makes hashes canonical).

    Args:
        labels: 1-D non-negative integer class labels, one per example.
        num_clients: Number of clients n.
        q: Dirichlet concentration; small q means strong label skew.
        seed: Seed of the private random generator.
        min_size: Smallest acceptable client size.
        max_redraws: Number of draws tried before giving up.

    Returns:
        One sorted ``int64`` index array per client; together they cover every
        example exactly once.

    Raises:
        PartitionError: On invalid arguments, or when ``max_redraws`` draws all
            leave some client below ``min_size``.
    """
    labels = _check_int_array("labels", labels)
    n = _check_int("num_clients", num_clients, 1)
    min_size = _check_int("data.min_size", min_size, 0)
    max_redraws = _check_int("max_redraws", max_redraws, 1)
    if isinstance(q, bool) or not isinstance(q, Real) or not math.isfinite(q) or q <= 0:
        raise PartitionError(f"data.q must be > 0 and finite (got {q!r})")
    total = len(labels)
    if n * min_size > total:
        raise PartitionError(
            f"cannot give each of {n} clients at least data.min_size={min_size} examples: "
            f"the data has only {total}; use fewer clients or a smaller data.min_size"
        )

    rng = np.random.default_rng(seed)
    # np.flatnonzero gives each class's indices in increasing order, like NIID-Bench's
    # np.where; every draw shuffles a fresh copy so draws do not depend on each other.
    class_indices = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    alpha = np.full(n, float(q))
    cap = total / n
    best = 0
    for _ in range(max_redraws):
        pieces: list[list[np.ndarray]] = [[] for _ in range(n)]
        sizes = np.zeros(n, dtype=np.int64)
        for idx in class_indices:
            idx_k = idx.copy()
            rng.shuffle(idx_k)
            p = rng.dirichlet(alpha)
            # Balance: clients already at the average size take no more examples.
            eligible = sizes < cap
            p = p * eligible
            mass = p.sum()
            if mass > 0:
                p = p / mass
            else:
                # Every eligible share underflowed to 0.0 (tiny q); NIID-Bench would divide
                # by zero here. A Dirichlet's renormalised sub-vector is itself Dirichlet
                # (q on each kept coordinate), so a fresh draw over the eligible clients
                # has exactly the intended distribution. Some client is always eligible:
                # fewer than N examples are placed before this (non-empty) class.
                p = np.zeros(n)
                p[eligible] = rng.dirichlet(alpha[eligible])
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            for j, piece in enumerate(np.split(idx_k, cuts)):
                if piece.size:
                    pieces[j].append(piece)
                    sizes[j] += piece.size
        smallest = int(sizes.min())
        if smallest >= min_size:
            return [_finish(client) for client in pieces]
        best = max(best, smallest)

    raise PartitionError(
        f"dirichlet partition (q={q}, {n} clients, {total} examples) failed after {max_redraws} "
        f"draws: the best draw's smallest client had {best} < data.min_size={min_size} examples; "
        f"use fewer clients, a larger data.q, or a smaller data.min_size"
    )


def iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Uniform random partition into nearly equal parts (sizes differ by at most 1).

    Args:
        num_examples: Number of examples N; indices are ``0..N-1``.
        num_clients: Number of clients n (at most N, so no client is empty).
        seed: Seed of the private random generator.

    Returns:
        One sorted ``int64`` index array per client.
    """
    num_examples = _check_int("num_examples", num_examples, 0)
    n = _check_int("num_clients", num_clients, 1)
    if n > num_examples:
        raise PartitionError(f"cannot split {num_examples} examples among {n} clients without empty clients")
    perm = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(part).astype(np.int64, copy=False) for part in np.array_split(perm, n)]


def natural(groups: np.ndarray) -> list[np.ndarray]:
    """One client per natural group (e.g. FEMNIST writer, Shakespeare role).

    Args:
        groups: 1-D integer group id per example; ids must be exactly ``0..G-1``.

    Returns:
        G sorted ``int64`` index arrays; client g holds the examples of group g.

    Raises:
        PartitionError: If ``groups`` is not 1-D integer, is empty, or some id in
            ``0..max`` has no example.
    """
    groups = _check_int_array("groups", groups)
    if groups.size == 0:
        raise PartitionError("natural partition needs at least one example")
    counts = np.bincount(groups)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        listed = ", ".join(str(int(g)) for g in empty[:5]) + (", ..." if empty.size > 5 else "")
        raise PartitionError(
            f"natural partition: group id(s) {listed} have no examples; "
            f"group ids must be 0..{len(counts) - 1} with none empty"
        )
    # A stable sort keeps indices increasing within each group.
    order = np.argsort(groups, kind="stable").astype(np.int64, copy=False)
    return np.split(order, np.cumsum(counts)[:-1])


def partition_hash(parts: list[np.ndarray]) -> str:
    """Short, stable fingerprint of a partition (first 16 hex digits of a SHA-256).

    Sensitive to client order and to every index; length prefixes keep the
    encoding unambiguous (moving one index between clients changes the hash).
    """
    h = hashlib.sha256()
    h.update(len(parts).to_bytes(8, "little"))
    for part in parts:
        arr = np.ascontiguousarray(np.asarray(part), dtype="<i8")
        h.update(arr.size.to_bytes(8, "little"))
        h.update(arr.tobytes())
    return h.hexdigest()[:16]


def label_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between client and global label distributions.

    The global distribution is that of all examples held by the clients (the whole
    dataset for a full partition). Empty clients have no label distribution and are
    left out of the mean. 0 means IID labels; values near 1 mean disjoint labels.

    Args:
        labels: 1-D integer labels in ``0..num_classes-1``, indexed by ``parts``.
        parts: Client index arrays.
        num_classes: Number of classes C.

    Returns:
        The mean over non-empty clients of ``0.5 * sum_c |p_client(c) - p_global(c)|``.
    """
    labels = _check_int_array("labels", labels)
    num_classes = _check_int("num_classes", num_classes, 1)
    if labels.size and labels.max() >= num_classes:
        raise PartitionError(f"labels must be < num_classes={num_classes} (found {int(labels.max())})")
    counts = np.stack(
        [np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes) for p in parts]
        or [np.zeros(num_classes, dtype=np.int64)]
    ).astype(np.float64)
    sizes = counts.sum(axis=1)
    nonempty = sizes > 0
    if not nonempty.any():
        raise PartitionError("label_skew needs at least one non-empty client")
    counts, sizes = counts[nonempty], sizes[nonempty]
    global_dist = counts.sum(axis=0) / sizes.sum()
    tv = 0.5 * np.abs(counts / sizes[:, None] - global_dist).sum(axis=1)
    return float(tv.mean())
