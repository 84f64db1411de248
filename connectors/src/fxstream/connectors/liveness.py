"""Writer leases: how a read-while-writing stream's reader knows its writer died.

A stream reader that finds no new data cannot tell a slow writer from a dead one by
looking at the data. So every stream writer (:mod:`~fxstream.connectors.file_stream`,
:mod:`~fxstream.connectors.adios_stream`) holds a *lease*: a small JSON side file
``<stream>.writer`` that records who writes the stream (PID, host name, kernel boot id,
PID namespace, process start time) and whose modification time a daemon thread in the
writer refreshes every ``refresh_interval`` seconds. The writer removes the lease when
it closes, after its end-of-stream (or abort) marker is written.

A reader waiting for data asks a :class:`LeaseWatcher` whether the writer is gone:

- on the same machine (same host name, boot id and PID namespace) it checks the
  writer's process directly in ``/proc``: gone, a zombie, or a different process that
  reuses the PID (another start time) means the writer died. This is immediate, so a
  SIGKILLed writer is noticed within one poll of the reader;
- on any machine, a lease whose modification time has not changed for ``stale_after``
  seconds (measured on the reader's own monotonic clock, so clock skew between hosts
  does not matter) means the writer died or hung: this is the only check across hosts
  and needs a shared file system that propagates mtimes (NFS does, within its
  attribute-cache time, which ``stale_after`` must exceed);
- a lease file that disappeared without an end-of-stream marker means the writer closed
  without finishing (or crashed before writing its lease).

The reader then raises :class:`StreamAborted`, after re-reading the stream once, so an
end marker written just before the lease was removed is never mistaken for an abort.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "LEASE_SUFFIX",
    "LeaseWatcher",
    "StreamAborted",
    "StreamWriterExit",
    "WriterIdentity",
    "WriterLease",
    "lease_path_for",
]

LEASE_SUFFIX = ".writer"


class StreamAborted(RuntimeError):
    """The stream's writer died, hung or gave up before writing its end-of-stream marker.

    Attributes:
        stream: the stream's path or name.
        reason: why the reader concluded the stream was aborted.
    """

    def __init__(self, stream: str, reason: str) -> None:
        super().__init__(f"stream {stream} aborted: {reason}")
        self.stream = stream
        self.reason = reason


def lease_path_for(stream_path: str | os.PathLike[str]) -> Path:
    """The lease side file of the stream at ``stream_path``."""
    return Path(f"{os.fspath(stream_path)}{LEASE_SUFFIX}")


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class StreamWriterExit(abc.ABC):
    """Context-manager behaviour shared by stream writers.

    Leaving the ``with`` block normally ends the stream (:meth:`close`); leaving
    it by an exception aborts it, so readers raise :class:`StreamAborted`
    naming the error instead of waiting for steps that never come.
    """

    @abc.abstractmethod
    def close(self) -> None:
        """End the stream: write its end-of-stream marker."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """End the stream as aborted: write its abort marker with ``reason``."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(f"the writer raised {exc!r}")


@dataclass(frozen=True)
class WriterIdentity:
    """Who writes a stream: enough to recognise the very process again on this machine."""

    pid: int
    host: str
    boot_id: str
    pid_namespace: str
    start_ticks: int

    @classmethod
    def current(cls) -> WriterIdentity:
        """The identity of the calling process."""
        pid = os.getpid()
        state = _proc_state(pid)
        return cls(
            pid=pid,
            host=socket.gethostname(),
            boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
            pid_namespace=_pid_namespace(),
            start_ticks=state[1] if state else -1,
        )

    def on_this_machine(self) -> bool:
        """Whether the writer's PID can be checked from here (same host, boot, PID namespace)."""
        here = WriterIdentity.current()
        return (
            bool(self.boot_id)
            and self.host == here.host
            and self.boot_id == here.boot_id
            and self.pid_namespace == here.pid_namespace
        )

    def process_gone(self) -> str | None:
        """Why the writer process is dead (checked in /proc), or None if it still runs."""
        state = _proc_state(self.pid)
        if state is None:
            return f"writer process {self.pid} on {self.host} no longer exists"
        letter, start_ticks = state
        if self.start_ticks >= 0 and start_ticks != self.start_ticks:
            return f"writer process {self.pid} on {self.host} exited (its PID was reused)"
        if letter in ("Z", "X"):
            return f"writer process {self.pid} on {self.host} exited (it is a zombie)"
        return None


class WriterLease:
    """The writer's side of a lease: create it, refresh it in the background, release it.

    Args:
        path: the lease file (see :func:`lease_path_for`).
        refresh_interval: seconds between refreshes of the file's modification time.
    """

    def __init__(self, path: Path, refresh_interval: float = 1.0) -> None:
        if refresh_interval <= 0:
            raise ValueError(f"refresh_interval must be > 0 seconds, got {refresh_interval}")
        self.path = path
        self.refresh_interval = refresh_interval
        self.identity = WriterIdentity.current()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Write the lease file (atomically) and start refreshing it."""
        record: dict[str, Any] = asdict(self.identity)
        record["refresh_interval"] = self.refresh_interval
        temporary = self.path.with_name(f".{self.path.name}.{self.identity.pid}.tmp")
        temporary.write_text(json.dumps(record))
        temporary.replace(self.path)
        self._thread = threading.Thread(
            target=self._refresh, name=f"lease {self.path.name}", daemon=True
        )
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_interval):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def release(self) -> None:
        """Stop refreshing and remove the lease file (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


class LeaseWatcher:
    """The reader's side of a lease: has the stream's writer gone away?

    Args:
        path: the lease file (see :func:`lease_path_for`).
        stale_after: seconds without a refresh (on this reader's clock) after which the
            writer counts as dead or hung. Must exceed the writer's refresh interval
            (and, across hosts, the shared file system's attribute-cache time).
    """

    def __init__(self, path: Path, stale_after: float = 10.0) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be > 0 seconds, got {stale_after}")
        self.path = path
        self.stale_after = stale_after
        self._identity: WriterIdentity | None = None
        self._local: bool | None = None
        self._last_mtime_ns: int | None = None
        self._last_change = time.monotonic()

    def writer(self) -> WriterIdentity | None:
        """The writer's identity once its lease has been read, else None."""
        return self._identity

    def _load(self) -> WriterIdentity | None:
        try:
            record = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            # A JSONDecodeError cannot come from a half-written lease (it is renamed into
            # place), only from a foreign file: treat it like a missing lease.
            return None
        return WriterIdentity(
            pid=int(record["pid"]),
            host=str(record["host"]),
            boot_id=str(record["boot_id"]),
            pid_namespace=str(record["pid_namespace"]),
            start_ticks=int(record["start_ticks"]),
        )

    def writer_gone(self) -> str | None:
        """Why the writer is gone (dead, hung, or closed without finishing), or None."""
        try:
            mtime_ns = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return (
                f"the writer's lease {self.path} is gone: the writer closed without an "
                "end-of-stream marker, or never started"
            )
        if self._identity is None:
            self._identity = self._load()
            if self._identity is not None:
                self._local = self._identity.on_this_machine()
        if self._local and self._identity is not None:
            reason = self._identity.process_gone()
            if reason is not None:
                return reason
        now = time.monotonic()
        if mtime_ns != self._last_mtime_ns:
            self._last_mtime_ns = mtime_ns
            self._last_change = now
        elif now - self._last_change > self.stale_after:
            who = (
                f"process {self._identity.pid} on {self._identity.host}"
                if self._identity
                else "the writer"
            )
            return (
                f"{who} has not refreshed its lease {self.path} for "
                f"{now - self._last_change:.1f} s (stale after {self.stale_after} s): "
                "it died or hangs"
            )
        return None
