"""The ``process`` engine: the cohort spread over a persistent pool of single-threaded worker processes.

Why processes: a client's step is a small batch (FEMNIST: 20 images), which one core runs far more
efficiently than two threads do, so on an n-core CPU n independent clients at once beat one client on n
threads.

* Data is shared once: workers are forked after the data is loaded and inherit the training tensors
  copy-on-write (nothing is pickled per round). Where ``fork`` is unavailable (macOS, Windows), workers are
  spawned and the tensors are moved to torch shared memory first, then handed over once, by handle.
* Per round, the parent sends the broadcast once per worker, then hands out clients one by one (each with its
  state, gathered from the store); a worker runs ``alg.client_update`` exactly as ``loop`` does, with the same
  per-client torch seed, and streams ``(upload, weight, state, metrics)`` back.
* Determinism: results arrive in any order; a reorder buffer adds them into the aggregator in cohort order, so
  the float64 sums are the same sequence of additions as ``loop``'s. Every worker uses one intra-op thread and
  receives its tensors 64-byte aligned, so a client's update runs the same kernels on the same bits whichever
  worker runs it: it is bit-identical, and results do not depend on the number of workers.
  They match ``loop`` up to float rounding (``loop`` may use several threads and other conv kernels).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import threading
import traceback
import warnings
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from hafedho.core import FedAlgorithm, FunctionalModel, RoundInfo, tree
from hafedho.core.tree import Params
from hafedho.data.federated import FederatedData
from hafedho.runtime.store import ClientStore
from hafedho.runtime.work import CohortResult, CohortStream, RoundWork, WorkerLost, available_cores

IN_FLIGHT = 2  # clients queued per worker, so a worker never waits for the parent between clients
WINDOW = 4  # per worker: how far dispatch may run ahead of the oldest unfinished client (bounds the buffer)


class WorkerError(RuntimeError):
    """A client update failed in a worker process (the message carries the worker's traceback)."""


class WorkerDied(WorkerError, WorkerLost):
    """A worker process ended mid-round (killed, out of memory): the run can be resumed (``WorkerLost``)."""


# ----------------------------------------------------------------------------- wire format


class _Pickler(pickle.Pickler):
    """Tensors travel as numpy arrays (one memcpy each side), not through torch's shared-memory reductions,
    which would create and map one shared segment per tensor per client."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.device.type == "cpu" and obj.dtype not in _NO_NUMPY:
            return _tensor, (obj.detach().numpy(),)
        return NotImplemented


_NO_NUMPY = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
ALIGN = 64  # bytes: torch's CPU allocator's alignment (one AVX-512 register, one cache line)


def _tensor(a: np.ndarray) -> Tensor:
    """A received array as a tensor at a ``ALIGN``-byte boundary, copied there if pickle left it elsewhere (it
    lands wherever its bytes object did, 16-byte aligned). MKL documents results that depend on the inputs'
    alignment; aligned inputs keep a client's update independent of its worker's allocation history."""
    t = torch.from_numpy(a)
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


# ----------------------------------------------------------------------------- worker side


class ChannelsLastModel(FunctionalModel):
    """A ``FunctionalModel`` whose conv inputs and 4-d weights are in channels-last layout.

    oneDNN's channels-last convolutions are faster on CPU; the values are the same up to float rounding. The
    layout change is a differentiable copy inside the forward, so parameters and gradients keep their layout.
    """

    def __init__(self, model: FunctionalModel) -> None:
        self.__dict__.update(model.__dict__)  # shares the module, buffers and weight decay

    @staticmethod
    def _cl(params: Params, x: Tensor) -> tuple[Params, Tensor]:
        cl = torch.channels_last
        params = {k: v.contiguous(memory_format=cl) if v.dim() == 4 else v for k, v in params.items()}
        if x.dim() == 4:  # explicit strides: contiguous(memory_format=...) keeps a 1-channel input NCHW, and
            # a grayscale first conv would then run, and hand on, NCHW (one layout copy per conv per step)
            _, c, h, w = x.shape
            x = torch.empty_strided(x.shape, (h * w * c, 1, w * c, c), dtype=x.dtype, device=x.device).copy_(x)
        return params, x

    def logits(self, params: Params, x: Tensor) -> Tensor:
        params, x = self._cl(params, x)
        return functional_call(self.module, (params, self.buffers), (x,))

    def features(self, params: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        params, x = self._cl(params, x)
        return functional_call(self.module, (params, self.buffers), (x,), {"return_features": True})


def worker_model(model: FunctionalModel, channels_last: bool | None) -> FunctionalModel:
    """The model a worker trains: channels-last for conv models (None = when the model has a Conv2d)."""
    if channels_last is None:
        channels_last = any(isinstance(m, nn.Conv2d) for m in model.module.modules())
    if channels_last and type(model) is FunctionalModel:  # a subclass may override logits: leave it alone
        return ChannelsLastModel(model)
    return model


def _linux_worker_setup() -> None:
    """Die with the parent (no orphans if it is killed) and keep freed memory in the heap: training allocates and
    frees model-sized tensors every step, which glibc would return to the OS and page-fault back in each time
    (thousands of page faults per FEMNIST-CNN client without this, none with it)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: never trim the heap top
        libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD: 32 MiB (glibc's maximum), no dynamic adjustment


def _reader(conn: Connection, jobs: queue.SimpleQueue) -> None:
    """Drain the job pipe into a queue, so the parent's sends never block while this worker sends a result
    (both blocking on full pipe buffers would deadlock)."""
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            raw = None
        job = loads(raw) if raw is not None else None
        jobs.put(job)
        if job is None:
            return


def _worker(conn: Connection, alg: FedAlgorithm, fed: FederatedData, model: FunctionalModel, cl: bool | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pool
    _linux_worker_setup()
    torch.set_num_threads(1)
    model = worker_model(model, cl)
    model.train()
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(conn, jobs), daemon=True).start()
    work: RoundWork | None = None
    while (job := jobs.get()) is not None:
        if job[0] == "round":
            _, msg, rnd, seed, plan = job
            work = RoundWork(alg, msg, fed, plan, model, rnd, seed)
            continue
        _, pos, cid, state = job
        try:
            assert work is not None
            res = work.client_update(cid, state)
            metrics = {k: float(v) for k, v in res.metrics.items()}
            out = ("ok", pos, tree.detach(res.upload), res.weight.detach(), tree.detach(res.state), metrics)
        except Exception:
            out = ("error", pos, f"client {cid}: {traceback.format_exc()}")
        try:
            conn.send_bytes(dumps(out))
        except (OSError, ValueError):  # the parent is gone
            return


# ----------------------------------------------------------------------------- parent side


class _Pool:
    def __init__(
        self, n: int, alg: FedAlgorithm, fed: FederatedData, model: FunctionalModel, cl: bool | None, method: str
    ) -> None:
        ctx = mp.get_context(method)
        if method != "fork":  # spawned workers get the data by shared-memory handle, once
            for t in (fed.x_train, fed.y_train):
                t.share_memory_()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker, args=(child, alg, fed, model, cl), name=f"hafedho-worker-{i}", daemon=True)
            with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads; workers use no parent thread
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, True)

    def close(self, graceful: bool = True) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            _shutdown(self.procs, self.conns, graceful)


def _shutdown(procs: list[Any], conns: list[Connection], graceful: bool) -> None:
    """Ask workers to exit (or terminate them at once), then terminate any that do not within a few seconds."""
    for c in conns:
        with contextlib.suppress(OSError, ValueError):
            if graceful:
                c.send_bytes(dumps(None))
    for p in procs:
        if not graceful:
            p.terminate()
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for c in conns:
        c.close()


def default_start_method() -> str:
    return "fork" if sys.platform.startswith("linux") else "spawn"


class ProcessEngine:
    """``engine = "process"``: see the module docstring.

    Args:
        workers: worker processes; 0 = one per available core.
        channels_last: channels-last convolutions in the workers; None = for models with a Conv2d.
        start_method: "fork" (Linux default) or "spawn" (elsewhere).
    """

    name = "process"

    def __init__(self, workers: int = 0, channels_last: bool | None = None, start_method: str | None = None) -> None:
        if workers < 0:
            raise ValueError(f"workers={workers}: must be >= 0 (0 = one per core)")
        self.workers = workers or available_cores()
        self.cores = self.workers  # idle between rounds: the runner evaluates on them (runner.server_threads)
        self.channels_last = channels_last
        self.start_method = start_method or default_start_method()
        self._pool: _Pool | None = None
        self._key: tuple[int, ...] = ()

    def _ensure_pool(self, alg: FedAlgorithm, fed: FederatedData, model: FunctionalModel) -> _Pool:
        key = (id(alg), id(fed), id(model))
        if self._pool is not None and key != self._key:  # another experiment: its workers hold other data
            self.close()
        if self._pool is None:  # once per run: forking copies nothing until pages are written
            self._pool = _Pool(self.workers, alg, fed, model, self.channels_last, self.start_method)
            self._key = key
        return self._pool

    def __call__(self, work: RoundWork, cohort: np.ndarray, store: ClientStore) -> CohortResult:
        stream = CohortStream(work.alg, len(cohort), param_shapes=work.param_shapes)
        if len(cohort) == 0:
            return stream.result()
        pool = self._ensure_pool(work.alg, work.fed, work.model)
        threads = torch.get_num_threads()
        # While workers hold every core the parent only aggregates: with more threads its elementwise float64
        # sums spin on barriers, taking CPU from the workers (measured: 4x the parent's CPU time).
        torch.set_num_threads(1)
        try:
            self._round(pool, stream, cohort.tolist(), store, ("round", work.msg, work.rnd, work.seed, work.plan))
            return stream.result()
        except BaseException:
            self.close(graceful=False)  # workers may still hold this round's clients: never reuse them
            raise
        finally:
            torch.set_num_threads(threads)

    @staticmethod
    def _round(pool: _Pool, stream: CohortStream, cids: list[int], store: ClientStore, head: tuple) -> None:
        rnd: RoundInfo = head[2]
        raw = dumps(head)
        for c in pool.conns:
            c.send_bytes(raw)
        n = len(pool.conns)
        pending: dict[int, tuple] = {}  # reorder buffer: cohort position -> result
        busy = [0] * n
        nxt = done = 0

        def dispatch(w: int) -> None:
            nonlocal nxt
            # queue a second client only while more remain than workers: at the tail it would wait behind
            # one worker's current client while another worker idles
            while nxt < len(cids) and busy[w] < (IN_FLIGHT if len(cids) - nxt > n else 1) and nxt < done + WINDOW * n:
                pool.conns[w].send_bytes(dumps(("client", nxt, cids[nxt], store.gather(cids[nxt]))))
                busy[w] += 1
                nxt += 1

        for w in range(n):
            dispatch(w)
        index = {c: w for w, c in enumerate(pool.conns)}
        sentinels = {p.sentinel: p for p in pool.procs}
        while done < len(cids):
            for ready in wait([*pool.conns, *sentinels]):
                if ready in sentinels:
                    p = sentinels[ready]
                    p.join(timeout=1)  # reap it, for the exit code
                    raise WorkerDied(f"worker process {p.name} died (exit code {p.exitcode}) in round {rnd.round}")
                try:
                    out = loads(ready.recv_bytes())
                except (EOFError, OSError):
                    # The pipe can report EOF before the process sentinel fires: reap the worker for its code.
                    p = pool.procs[index[ready]]
                    p.join(timeout=5)
                    if p.exitcode is not None:
                        msg = f"worker process {p.name} died (exit code {p.exitcode}) in round {rnd.round}"
                        raise WorkerDied(msg) from None
                    raise WorkerDied(f"lost the connection to a worker process in round {rnd.round}") from None
                if out[0] == "error":
                    raise WorkerError(f"round {rnd.round}, {out[2]}")
                busy[index[ready]] -= 1
                pending[out[1]] = out
                while done in pending:  # add in cohort order: the float64 sums match loop's
                    _, pos, upload, weight, state, metrics = pending.pop(done)
                    stream.add(upload, weight, metrics)
                    store.scatter(cids[pos], state)
                    done += 1
                for v in range(n):
                    dispatch(v)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent). ``graceful=False`` terminates them at once."""
        if self._pool is not None:
            self._pool.close(graceful)
            self._pool = None

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
