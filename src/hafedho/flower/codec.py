"""Lossless pytree <-> Flower record encoding.

A pytree of tensors (an algorithm's Broadcast, Upload or ClientState) travels as its flat leaves in an
``ArrayRecord`` keyed ``"00000"``, ``"00001"``, ...; each leaf is stored with NumPy's ``.npy`` format, so dtype
and shape (0-d int64 included) survive bit for bit. The structure never travels: both ends rebuild it from a
template the algorithm gives them (``init_server``/``broadcast``/``init_client``, or one upload), and every
leaf is checked against the template's dtype and shape, so a malformed record is refused, never guessed.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Array, ArrayRecord
from torch.utils import _pytree as pytree


class CodecError(ValueError):
    """A record that does not fit the expected pytree (wrong count, dtype or shape of leaves)."""


def _key(i: int) -> str:
    return f"{i:05d}"


def encode(tree: Any) -> ArrayRecord:
    """The flat leaves of ``tree`` (tensors) as an ``ArrayRecord``."""
    out: dict[str, Array] = {}
    for i, leaf in enumerate(pytree.tree_leaves(tree)):
        if not isinstance(leaf, torch.Tensor):
            raise CodecError(f"leaf {i} is a {type(leaf).__name__}, not a tensor")
        if leaf.dtype == torch.bfloat16:
            raise CodecError(f"leaf {i}: bfloat16 has no NumPy dtype; cast it to float32 before sending")
        out[_key(i)] = Array(leaf.detach().cpu().contiguous().numpy())
    return ArrayRecord(out)


def decode(record: ArrayRecord, like: Any) -> Any:
    """Rebuild a pytree with the structure of ``like`` from ``record``; leaves must match in dtype and shape."""
    leaves, spec = pytree.tree_flatten(like)
    if len(record) != len(leaves):
        raise CodecError(f"record has {len(record)} arrays, expected {len(leaves)}")
    out = []
    for i, ref in enumerate(leaves):
        arr = record.get(_key(i))
        if arr is None:
            raise CodecError(f"record lacks array {_key(i)}")
        value = torch.tensor(arr.numpy())  # a copy in torch's 64-byte aligned memory (see engines/process.py _tensor)
        if value.dtype != ref.dtype or tuple(value.shape) != tuple(ref.shape):
            raise CodecError(
                f"array {_key(i)} is {value.dtype}{tuple(value.shape)}, expected {ref.dtype}{tuple(ref.shape)}"
            )
        out.append(value)
    return pytree.tree_unflatten(out, spec)
