"""Flower's processes on this machine: started in their own session, stopped by pid with all they spawned.

Descendants (SuperExec, ServerApp, ClientApps) are found through ``/proc`` and identified by pid and start time,
so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO

__all__ = ["Service", "descendants", "flower_env", "free_port", "is_running"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def flower_env(flwr_home: str | Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for Flower's commands: this interpreter's bin folder first on PATH (Flower starts
    ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` by name), telemetry off."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    env.update(extra or {})
    return env


def _stat(pid: int) -> tuple[int, int, str] | None:
    """``(ppid, start time, state)`` of a process from /proc, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(pid: int) -> set[tuple[int, int]]:
    """``(pid, start time)`` of every process below ``pid``, read from /proc (empty where there is none)."""
    kids: dict[int, list[tuple[int, int]]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            kids.setdefault(st[0], []).append((int(entry.name), st[1]))
    out: set[tuple[int, int]] = set()
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.add(child)
            todo.append(child[0])
    return out


def is_running(proc: tuple[int, int]) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    st = _stat(proc[0])
    return st is not None and st[1] == proc[1] and st[2] != "Z"


def _signal(procs: Iterable[tuple[int, int]], sig: int) -> None:
    for proc in procs:
        if is_running(proc):  # never signal a recycled pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc[0], sig)


class Service:
    """One long-running Flower process, its output in ``log``; ``stop`` ends it and everything it started.

    A watcher thread records every descendant (SuperExec, ServerApp, ClientApp processes) while the service
    runs, so that even those orphaned by a crash are ended by pid.
    """

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str], cwd: str | Path) -> None:
        self.name, self.argv, self.log = name, argv, Path(log)
        self._out: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env), cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        self.family: set[tuple[int, int]] = set()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.family |= descendants(self.pid)
            self._done.wait(0.2)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> list[str]:
        """Command lines of the live processes this service started (e.g. ``flwr-clientapp ...``)."""
        out = []
        for pid, _ in sorted(p for p in descendants(self.pid) if is_running(p)):
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        return out

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill=True``: a crash) to the process and all it started; SIGKILL after
        ``timeout`` to whatever is left."""
        sig = signal.SIGKILL if kill else signal.SIGTERM
        self.family |= descendants(self.pid)
        if self.alive():
            self.popen.send_signal(sig)
        _signal(self.family, sig)
        end = time.monotonic() + timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(end - time.monotonic(), 0.1))
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=5)
        self._done.set()
        self._watcher.join(timeout=2)
        while any(is_running(p) for p in self.family) and time.monotonic() < end:
            time.sleep(0.1)
        _signal(self.family, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while any(is_running(p) for p in self.family) and time.monotonic() < end:
            time.sleep(0.05)
        if not self._out.closed:
            self._out.close()
