"""Checkpoints: the round and the server state in ``checkpoint.pt``; the client store in a journal beside it.

The store's journal (``RUN/store/``) makes a checkpoint's cost scale with the clients that trained since the last
one, not with N: a checkpoint writes ``delta_rT.pt`` (the ids and current rows of the clients scattered since the
previous checkpoint), never the whole store. The state at the checkpoint is the store's initial state (every
client at ``init_client``'s template, saved in ``checkpoint.pt``), then the ``base`` (a full copy, if any), then
the deltas in order. Once the deltas since the base hold more rows than the store has, the next checkpoint
writes a new base instead (a full copy, ``base_rT/leafK.npy``, written in row blocks so the store never has to fit
in RAM) and drops them: the journal never holds more than about two stores, and rows are written at most about
twice each on average.

Training does not wait for the disk: ``capture`` takes what a checkpoint of round t holds at round t (the server
state on the CPU; the changed rows copied on the GPU where they fit beside the run, else into RAM) and ``write``
puts it on disk, in a background thread of ``RunDir``, while the next rounds train. One write at a time: the next
checkpoint, the end of the run and every exit wait for it.

kill -9 at any moment: every file is written under a temporary name, synced and renamed into place;
``checkpoint.pt`` (written last, atomically) names the files the state is made of, and files it does not name
are removed only after it is in place. Resume rebuilds the store from exactly those files, and checks each of
them (shapes, dtypes, ids) before anything is written, so a torn or foreign file ends in one line.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from hafedho.core.device import free_bytes
from hafedho.runfiles import RunDirError, atomic_write
from hafedho.runtime.store import ClientStore

JOURNAL_DIR = "store"  # RUN/store/
BLOCK_BYTES = 256 * 1024**2  # a base is copied in row blocks of about this size
_FILE = re.compile(r"(base_r\d+|delta_r\d+\.pt)")
_CORRUPT = (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, KeyError, EOFError, TypeError, ValueError)


@dataclass
class Journal:
    """The files of ``RUN/store/`` that make up the store at the last checkpoint."""

    base: str | None = None  # "base_rT", or None: every client at the template
    deltas: list[str] = field(default_factory=list)  # "delta_rT.pt" after the base, oldest first
    rows: int = 0  # rows in those deltas (a new base once they would exceed N)

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base, "deltas": list(self.deltas), "rows": self.rows}

    @classmethod
    def from_dict(cls, d: Any, where: Path) -> Journal:
        ok = isinstance(d, dict) and (d.get("base") is None or _FILE.fullmatch(str(d.get("base"))))
        ok = ok and isinstance(d.get("deltas"), list) and all(_FILE.fullmatch(str(x)) for x in d["deltas"])
        if not ok or not isinstance(d.get("rows"), int):
            raise RunDirError(f"{where}: corrupt checkpoint (its client-store journal); start over with --force")
        return cls(d["base"], [str(x) for x in d["deltas"]], int(d["rows"]))

    def files(self) -> set[str]:
        return ({self.base} if self.base else set()) | set(self.deltas)


# ----------------------------------------------------------------------------- checkpoint.pt


def save(path: Path, round: int, server: Any, store_template: list[torch.Tensor], extra: dict[str, Any]) -> None:
    """``checkpoint.pt``: the round, the server state's leaves (on the CPU), one client's initial state and
    ``extra`` (runtime facts; ``store_journal``: the journal's files)."""
    leaves = [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(server)]
    payload = {"round": round, "server": leaves, "store": [], "store_template": store_template, "extra": extra}
    atomic_write(path, lambda f: torch.save(payload, f))


def saved_round(path: Path) -> int:
    """The round of the checkpoint at ``path``; 0 when there is none."""
    if not path.exists():
        return 0
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["round"])
    except _CORRUPT as e:
        raise RunDirError(f"{path}: corrupt checkpoint ({type(e).__name__}); start over with --force") from None


def load(path: Path, server_template: Any) -> tuple[int, Any, dict[str, Any], dict[str, Any]]:
    """``(round, server state, payload, extra)`` of a checkpoint, the server state rebuilt on the template's
    structure, each leaf on its template leaf's device and dtype (no code is unpickled)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        leaves, spec = pytree.tree_flatten(server_template)
        saved = payload["server"]
        if len(saved) != len(leaves):
            raise RunDirError(f"{path}: checkpoint was written by another algorithm or model; start over with --force")
        for i, (a, b) in enumerate(zip(saved, leaves, strict=True)):
            bad = not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype
            if isinstance(b, torch.Tensor) and bad:
                what = f"{a.dtype}{tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise RunDirError(
                    f"{path}: server tensor {i} is {what}, this run's is {b.dtype}{tuple(b.shape)}: written by "
                    "another algorithm or model; start over with --force"
                )
        moved = [a.to(b.device) if isinstance(b, torch.Tensor) else a for a, b in zip(saved, leaves, strict=True)]
        rnd = payload["round"]
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 1:
            raise RunDirError(f"{path}: corrupt checkpoint (round {rnd!r}); start over with --force")
        return rnd, pytree.tree_unflatten(moved, spec), payload, payload.get("extra", {})
    except RunDirError:  # a ValueError too: its own line, not "corrupt checkpoint (RunDirError)"
        raise
    except _CORRUPT as e:
        raise RunDirError(f"{path}: corrupt checkpoint ({type(e).__name__}); start over with --force") from None


# ----------------------------------------------------------------------------- the store's journal


def _folder(run_dir: Path) -> Path:
    folder = run_dir / JOURNAL_DIR
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise RunDirError(
            f"{folder} is a link or a file, not the run's client-store folder; nothing is written through it: "
            "remove it, then --resume"
        )
    return folder


SNAPSHOT_SHARE = 0.25  # a checkpoint's rows are copied on the GPU while they take at most this share of its free memory


@dataclass
class Capture:
    """What the checkpoint of one round writes, taken at that round (``capture``), written later (``write``)."""

    round: int
    server: list[Any]  # the server state's leaves, on the CPU
    template: list[torch.Tensor]  # one client's initial state ([] without a store)
    extra: dict[str, Any]
    journal: Journal  # the journal once this checkpoint is written
    delta: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (ids, rows), rows on the GPU or the CPU
    base: list[torch.Tensor] | None = None  # a whole store to write as the base, on the GPU or the CPU
    stream: Any = None  # the CUDA stream that copies rows on the GPU to the host


def capture(
    run_dir: Path, t: int, server: Any, store: ClientStore | None, journal: Journal, extra: dict[str, Any]
) -> Capture:
    """The checkpoint of round ``t``, taken now: the server state on the CPU and, for a store with state, the rows
    scattered since the last checkpoint (or a whole new base, see the module docstring). Rows are copied on the
    GPU when they fit in ``SNAPSHOT_SHARE`` of its free memory (their copy to the host is then ``write``'s, on a
    stream of its own, so training goes on), else into RAM now; a memory-mapped store's base is written now."""
    leaves = [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(server)]
    cap = Capture(t, leaves, [], dict(extra), journal)
    if store is None or not store.leaves:
        return cap
    folder = _folder(run_dir)
    folder.mkdir(exist_ok=True)
    cap.template = store.template
    ids = store.take_dirty()
    if journal.rows + len(ids) > store.num_clients:  # also after a resume from a checkpoint without a journal
        name = f"base_r{t}"
        cap.journal = Journal(name, [], 0)
        if store.place == "disk":  # larger than RAM, maybe: written now, block by block
            _write_base(folder / name, [leaf.numpy() for leaf in store.leaves])
        else:
            cap.base, cap.stream = _copy(store, np.arange(store.num_clients), store.nbytes())
    elif len(ids):
        cap.journal = Journal(journal.base, [*journal.deltas, f"delta_r{t}.pt"], journal.rows + len(ids))
        rows, cap.stream = _copy(store, ids, len(ids) * store.nbytes() // store.num_clients)
        cap.delta = (torch.from_numpy(ids), rows)
    cap.extra.update(store_journal=cap.journal.as_dict(), store_clients=store.num_clients)
    return cap


def _copy(store: ClientStore, ids: np.ndarray, nbytes: int) -> tuple[list[torch.Tensor], Any]:
    """The rows ``ids`` of every leaf, copied where the store is (a GPU store: on the GPU while they fit there,
    with the stream ``write`` copies them to the host on), else in RAM."""
    dev = store.leaves[0].device
    if dev.type == "cuda" and nbytes <= SNAPSHOT_SHARE * free_bytes(dev):
        idx = torch.from_numpy(ids).to(dev)
        rows = [leaf.index_select(0, idx) for leaf in store.leaves]
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # the copies above are queued before it reads them
        for r in rows:
            r.record_stream(stream)
        return rows, stream
    return store.rows(ids), None


def _host(rows: list[torch.Tensor], stream: Any) -> list[torch.Tensor]:
    if stream is None:
        return rows
    with torch.cuda.stream(stream):
        return [r.to("cpu") for r in rows]


def write(run_dir: Path, path: Path, cap: Capture) -> None:
    """Put a ``capture`` on disk: its store files, then ``checkpoint.pt`` naming them, then remove the journal's
    files it no longer names."""
    folder = run_dir / JOURNAL_DIR
    if cap.base is not None:
        _write_base(folder / cap.journal.base, [r.numpy() for r in _host(cap.base, cap.stream)])
    if cap.delta is not None:
        ids, rows = cap.delta
        payload = {"round": cap.round, "ids": ids, "leaves": _host(rows, cap.stream)}
        atomic_write(folder / cap.journal.deltas[-1], lambda f: torch.save(payload, f))
    save(path, cap.round, cap.server, cap.template, cap.extra)
    if cap.template:
        prune(run_dir, cap.journal)


def prune(run_dir: Path, journal: Journal) -> None:
    """Remove the journal's files (and temporaries) that ``journal`` does not name: call it once ``checkpoint.pt``
    naming ``journal`` is in place. Links are removed, never followed."""
    folder = run_dir / JOURNAL_DIR
    if not folder.is_dir() or folder.is_symlink():
        return
    keep = journal.files()
    for p in folder.iterdir():
        ours = _FILE.fullmatch(p.name) or p.name.endswith(".tmp")
        if not ours or p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _blocks(store: ClientStore) -> Iterator[np.ndarray]:
    """The store's client ids in consecutive blocks of about ``BLOCK_BYTES`` of state each."""
    per_row = max(sum(leaf[0].numel() * leaf.element_size() for leaf in store.leaves), 1)
    block = max(1, BLOCK_BYTES // per_row)
    for s in range(0, store.num_clients, block):
        yield np.arange(s, min(s + block, store.num_clients))


def _write_base(folder: Path, leaves: list[np.ndarray]) -> None:
    """Every row of every leaf into ``folder/leafK.npy`` (a temporary folder, synced, then renamed into place),
    copied in row blocks (a memory-mapped store never has to fit in RAM)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.is_symlink():
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for i, leaf in enumerate(leaves):
        mm = np.lib.format.open_memmap(tmp / f"leaf{i}.npy", mode="w+", dtype=leaf.dtype, shape=leaf.shape)
        per_row = max(leaf[:1].nbytes, 1)
        block = max(1, BLOCK_BYTES // per_row)
        for s in range(0, len(leaf), block):
            mm[s : s + block] = leaf[s : s + block]
        mm.flush()
        del mm
        with open(tmp / f"leaf{i}.npy", "rb") as f:
            os.fsync(f.fileno())
    if folder.is_symlink():
        folder.unlink()
    shutil.rmtree(folder, ignore_errors=True)  # a stale base of this round from a killed attempt, never named
    os.replace(tmp, folder)


def restore_store(run_dir: Path, store: ClientStore, payload: dict[str, Any], extra: dict[str, Any]) -> Journal:
    """Rebuild ``store`` as the checkpoint saved it; returns its journal. Every file is checked (leaf count, shapes,
    dtypes, ids) before the store is written; a problem ends in one line."""
    ckpt = run_dir / "checkpoint.pt"
    if "store_journal" in extra:
        journal = Journal.from_dict(extra["store_journal"], ckpt)
        base = _read_base(run_dir / JOURNAL_DIR / journal.base, store) if journal.base else None
        deltas = [_read_delta(run_dir / JOURNAL_DIR / name, store) for name in journal.deltas]
        template = payload.get("store_template", [])
        if base is None:
            _check_template(template, store, ckpt)
            for ids in _blocks(store):
                store.load_rows(ids, [t.unsqueeze(0).expand(len(ids), *t.shape) for t in template])
        else:
            _copy_base(base, store)
        for ids, leaves in deltas:
            store.load_rows(ids, leaves)
        return journal
    try:  # checkpoints written before the journal: the whole store inline, or a snapshot folder
        if "store_dir" in extra:
            folder = run_dir / str(extra["store_dir"])
            _copy_base(_read_base(folder, store), store)
        else:
            store.load_state_dict(payload["store"])
    except ValueError as e:
        raise RunDirError(f"{ckpt}: {e}; start over with --force") from None
    return Journal(None, [], store.num_clients + 1)  # the next checkpoint writes a base


def _check_template(template: Any, store: ClientStore, where: Path) -> None:
    ok = isinstance(template, list) and len(template) == len(store.leaves)
    ok = ok and all(
        isinstance(t, torch.Tensor) and t.shape == leaf.shape[1:] and t.dtype == leaf.dtype
        for t, leaf in zip(template, store.leaves, strict=True)
    )
    if not ok:
        raise RunDirError(f"{where}: its client state does not match this algorithm's; start over with --force")


def _read_base(folder: Path, store: ClientStore) -> list[np.ndarray]:
    out = []
    for i, leaf in enumerate(store.leaves):
        f = folder / f"leaf{i}.npy"
        try:
            a = np.load(f, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise RunDirError(f"{f}: client-store file missing or corrupt ({e}); start over with --force") from None
        want = leaf[:0].cpu().numpy().dtype
        if a.shape != tuple(leaf.shape) or a.dtype != want:
            raise RunDirError(
                f"{f}: holds {a.dtype}{a.shape}, this run's store needs {want}{tuple(leaf.shape)}; "
                "start over with --force"
            )
        out.append(a)
    return out


def _copy_base(base: list[np.ndarray], store: ClientStore) -> None:
    for ids in _blocks(store):
        store.load_rows(ids, [torch.from_numpy(np.array(a[ids[0] : ids[-1] + 1])) for a in base])


def _read_delta(path: Path, store: ClientStore) -> tuple[np.ndarray, list[torch.Tensor]]:
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
        ids, leaves = d["ids"], d["leaves"]
    except (*_CORRUPT, OSError) as e:
        what = f"client-store file missing or corrupt ({type(e).__name__})"
        raise RunDirError(f"{path}: {what}; start over with --force") from None
    ok = isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1
    ok = ok and (len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) < store.num_clients))
    ok = ok and len(torch.unique(ids)) == len(ids) and isinstance(leaves, list) and len(leaves) == len(store.leaves)
    ok = ok and all(
        isinstance(t, torch.Tensor) and tuple(t.shape) == (len(ids), *leaf.shape[1:]) and t.dtype == leaf.dtype
        for t, leaf in zip(leaves, store.leaves, strict=True)
    )
    if not ok:
        raise RunDirError(
            f"{path}: not a client-store file of this run (ids, shapes or dtypes); start over with --force"
        )
    return ids.numpy(), leaves


def stored_clients(run_dir: Path) -> list[torch.Tensor]:
    """The client store of the checkpoint in ``run_dir`` as full ``[N, ...]`` CPU leaves (tests, the golden set)."""
    payload = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    extra = payload.get("extra", {})
    if "store_journal" not in extra:
        return list(payload["store"])
    template = payload["store_template"]
    if not template:
        return []
    store = ClientStore(list(template), int(extra["store_clients"]))
    restore_store(run_dir, store, payload, extra)
    return [leaf.clone() for leaf in store.leaves]
