"""The decoded-array cache: a reader's arrays memoised as an ``.npz``, keyed by the source file's content, and
the last ``MEMO_ENTRIES`` of them kept in memory, so that a sweep worker that runs many runs reads its data
once (the key still sees an edited or replaced source). Arrays served from memory are read-only: no run can
change the data another run sees."""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["cache_dir", "cached"]

# Bump when the layout of cached arrays changes, so stale caches are rebuilt rather than misread.
_CACHE_VERSION = 1
MEMO_ENTRIES = 2  # data sets kept in memory per process (a CIFAR-10 copy is 150 MB)
_MEMO: OrderedDict[str, tuple[tuple[int, int] | None, dict[str, np.ndarray]]] = OrderedDict()  # file -> stat, arrays


def cache_dir() -> Path:
    """Where decoded arrays are cached: ``$HAFEDHO_CACHE_DIR`` or ``~/.cache/hafedho``."""
    return Path(os.environ.get("HAFEDHO_CACHE_DIR") or Path.home() / ".cache" / "hafedho")


def _fingerprint(path: Path) -> str:
    """Identity of a file or directory tree: resolved path plus the name and bytes of every file.

    The bytes, not size and mtime: an edit in place that keeps both (a rewrite, a restored mtime) would otherwise
    be served stale, and a resume check on the decoded data would accept it. SHA-256 (hardware-accelerated on
    current CPUs, faster than BLAKE2b there) reads 63 MB, the CIFAR-10 JPEG archive, in about 0.2 s on a slow
    shared core: a fraction of the decoding it saves (seconds).
    """
    h = hashlib.sha256(str(path.resolve()).encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(f"\0{f.relative_to(path) if f != path else ''}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def cached(
    kind: str, path: Path, options: str, build: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], bool]:
    """Return ``build()``'s arrays, memoised as an ``.npz`` under :func:`cache_dir`.

    The key is the source's resolved path, the bytes of its file(s), ``options`` and a format version, so an
    edited or replaced source is decoded afresh. The cache is written atomically (temporary
    file, then ``os.replace``); an unreadable cache entry is rebuilt; an unwritable cache dir only costs
    the speed-up.

    Returns:
        The arrays and whether they came from the cache.
    """
    key = hashlib.sha256(f"{_CACHE_VERSION}\0{kind}\0{options}\0{_fingerprint(path)}".encode()).hexdigest()
    target = cache_dir() / f"{kind}-{path.name}-{key[:20]}.npz"
    memo = _MEMO.get(str(target))
    if memo is not None and memo[0] == _stat(target):  # the cache file as it was read: not replaced since
        _MEMO.move_to_end(str(target))
        return dict(memo[1]), True
    arrays, hit = _load_or_build(target, build)
    for a in arrays.values():
        a.setflags(write=False)
    _MEMO[str(target)] = (_stat(target), arrays)
    while len(_MEMO) > MEMO_ENTRIES:
        _MEMO.popitem(last=False)
    return dict(arrays), hit


def _stat(target: Path) -> tuple[int, int] | None:
    try:
        st = target.stat()
    except OSError:  # not written (a read-only cache dir): the memo still holds the decoded arrays
        return None
    return st.st_size, st.st_mtime_ns


def _load_or_build(target: Path, build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    if target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}, True
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error):
            pass  # corrupt or half-written by a crashed process: rebuild and replace it below
    arrays = build()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".tmp-", suffix=".npz", delete=False) as f:
            tmp = f.name
            np.savez(f, **arrays)
        os.replace(tmp, target)
        tmp = None
    except OSError:
        pass  # read-only home, full disk: the data is still correct, just not cached
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return arrays, False
