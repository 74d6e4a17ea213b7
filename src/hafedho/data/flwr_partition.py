"""Flower Datasets' partitioners by class name: ``data.partition = "flwr:DirichletPartitioner"``.

The partitioner runs on a Hugging Face ``datasets.Dataset`` built from the labels alone (columns ``index``,
``label`` and, for sources with natural clients, ``group``); each partition's ``index`` column is read back as
that client's indices into our in-memory train arrays. Nothing is downloaded (the Hub is switched off first).

Like ``flwr_datasets.FederatedDataset(shuffle=True, seed=S)``, the rows are first shuffled as
``Dataset.shuffle(seed=S)`` does (the seedless partitioners, e.g. ``IidPartitioner``'s contiguous shards, need it),
and the partitioner gets ``num_partitions = data.num_clients``, ``partition_by = "label"`` and ``seed = S``, where S
is the partition seed (``data.partition_seed``, else the run seed). Its other constructor arguments come from
``data.partition_options``; an ``alpha`` left out is ``data.q``, a ``min_partition_size`` left out is
``data.min_size``. flwr-datasets (the ``datasets`` extra) is imported only here, and only when used.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import warnings
from typing import Any

import numpy as np

from hafedho.data.partition import FLWR, PartitionError

# Not row partitioners: the abstract base, one that needs a Python function, and those that split columns.
_EXCLUDED = ("Partitioner", "IdToSizeFncPartitioner", "VerticalEvenPartitioner", "VerticalSizePartitioner")
# Set from our own settings, never from data.partition_options.
_OURS = {"num_partitions": "data.num_clients", "seed": "data.partition_seed"}


def _partitioner_module() -> Any:
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read by `datasets` when first imported: no Hub access, ever
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import flwr_datasets.partitioner as fp
    except ImportError:
        raise PartitionError("data.partition='flwr:...' needs flwr-datasets; pip install 'hafedho[datasets]'") from None
    datasets.config.HF_HUB_OFFLINE = True  # `datasets` may have been imported before the variables were set
    datasets.disable_progress_bars()
    return fp


def available(fp: Any) -> list[str]:
    """The row partitioners of ``flwr_datasets.partitioner`` usable by name."""
    return sorted(
        n
        for n in fp.__all__
        if n not in _EXCLUDED and isinstance(getattr(fp, n), type) and issubclass(getattr(fp, n), fp.Partitioner)
    )


def flwr_partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    options: dict[str, Any] | None = None,
    groups: np.ndarray | None = None,
    q: float | None = None,
    min_size: int | None = None,
) -> list[np.ndarray]:
    """Client index sets from the flwr-datasets partitioner ``name`` (``"flwr:ClassName"`` or ``"ClassName"``).

    Args:
        name: the partitioner's class name in ``flwr_datasets.partitioner``, optionally with the ``flwr:`` prefix.
        labels: 1-D int train labels, one per example.
        num_clients: N; the partitioner's ``num_partitions`` (when it has one) and the number it must produce.
        seed: the partition seed: the dataset shuffle's and the partitioner's ``seed``.
        options: the partitioner's other constructor arguments (``data.partition_options``); ``partition_by`` may
            be ``"label"`` or ``"group"`` (the source's natural clients; NaturalIdPartitioner's default, and it
            refuses a source without them), else ``"label"`` by default.
        groups: the source's natural client id per example, or None.
        q, min_size: defaults for ``alpha`` and ``min_partition_size`` (``data.q``, ``data.min_size``).

    Returns:
        One sorted ``int64`` index array per client, as ``hafedho.data.partition``'s partitions.

    Raises:
        PartitionError: flwr-datasets missing, an unknown name or option, a missing required option, anything
            the partitioner refuses, or a result with the wrong number of clients, an empty or overlapping one.
    """
    cls_name = name[len(FLWR) :] if name.startswith(FLWR) else name
    key = f"data.partition='{FLWR}{cls_name}'"
    fp = _partitioner_module()
    names = available(fp)
    if cls_name not in names:
        raise PartitionError(f"{key}: unknown partitioner; choose one of {', '.join(names)}")
    cls = getattr(fp, cls_name)
    kwargs = _constructor_args(cls, key, dict(options or {}), num_clients, seed, q, min_size, groups is not None)

    import datasets

    labels = np.asarray(labels, dtype=np.int64)
    # FederatedDataset's shuffle before partitioning, Dataset.shuffle(seed=seed), is this permutation of the rows
    # (datasets 4.x); built in that order, the table has no indices mapping to go through on every row read.
    order = np.random.default_rng(seed).permutation(len(labels))
    columns = {"index": order, "label": labels[order]}
    if groups is not None:
        columns["group"] = np.asarray(groups, dtype=np.int64)[order]
    table = datasets.Dataset.from_dict(columns)
    # stderr is held back (NaturalIdPartitioner draws a tqdm bar); the partitioner's warnings are re-issued below.
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()):
        # DirichletPartitioner warns before each redraw: the outcome is a partition or the error below.
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")  # Dataset.sort, pyarrow 25
        try:
            partitioner = cls(**kwargs)
            partitioner.dataset = table
            parts = [
                np.sort(np.asarray(partitioner.load_partition(i).with_format("numpy")[:]["index"], dtype=np.int64))
                for i in range(partitioner.num_partitions)
            ]
        except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as e:
            raise PartitionError(f"{key}: {' '.join(str(e).split())}") from None
    for w in caught:
        warnings.warn(f"{key}: {' '.join(str(w.message).split())}", stacklevel=2)
    _check_result(key, parts, num_clients, len(labels))
    return parts


def _constructor_args(
    cls: type,
    key: str,
    options: dict[str, Any],
    num_clients: int,
    seed: int,
    q: float | None,
    min_size: int | None,
    has_groups: bool,
) -> dict[str, Any]:
    """The partitioner's keyword arguments: ours, then ``options`` checked against its signature, then defaults."""
    params = {p.name: p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]}
    valid = [p for p in params if p not in _OURS]
    for opt in options:
        if opt in _OURS:
            raise PartitionError(f"data.partition_options.{opt}: set by hafedho; use {_OURS[opt]} instead")
        if opt not in params:
            raise PartitionError(
                f"data.partition_options.{opt}: {cls.__name__} has no such option; valid: {', '.join(valid) or 'none'}"
            )
    kwargs: dict[str, Any] = {"num_partitions": num_clients, "seed": seed}
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    natural = cls.__name__ == "NaturalIdPartitioner"  # it splits by an id column: by label it would mean classes
    if natural and not has_groups:
        raise PartitionError(
            f"{key}: this source has no natural client ids (writers, devices) to split by; use "
            "data.partition='dirichlet' or 'iid', or a source with natural clients (femnist)"
        )
    if "partition_by" in params:
        by = options.pop("partition_by", "group" if natural else "label")
        if by not in ("label", "group") or (by == "group" and not has_groups):
            hint = "'label' or 'group'" if has_groups else "'label' (this source has no natural clients)"
            raise PartitionError(f"data.partition_options.partition_by={by!r}: use {hint}")
        kwargs["partition_by"] = by
    defaults = {"alpha": q, "min_partition_size": min_size}  # documented: data.q and data.min_size
    kwargs.update({k: v for k, v in defaults.items() if k in params and k not in options and v is not None})
    kwargs.update(options)
    missing = [p.name for p in params.values() if p.default is inspect.Parameter.empty and p.name not in kwargs]
    if missing:
        raise PartitionError(
            f"{key} needs {', '.join(f'data.partition_options.{m}' for m in missing)}; "
            f"e.g. data.partition_options.{missing[0]}=..."
        )
    return kwargs


def _check_result(key: str, parts: list[np.ndarray], num_clients: int, total: int) -> None:
    if len(parts) != num_clients:
        raise PartitionError(
            f"{key} made {len(parts)} partitions but data.num_clients={num_clients}; set data.num_clients={len(parts)}"
        )
    sizes = np.array([len(p) for p in parts])
    if (sizes == 0).any():
        empty = np.flatnonzero(sizes == 0)
        raise PartitionError(
            f"{key} left {len(empty)} client(s) empty (first: client {int(empty[0])}); "
            "change data.partition_options or use fewer clients"
        )
    seen = np.concatenate(parts)
    if len(np.unique(seen)) != len(seen) or (len(seen) and (seen.min() < 0 or seen.max() >= total)):
        raise PartitionError(f"{key} gave an example to two clients (or an index outside the data); not supported")
