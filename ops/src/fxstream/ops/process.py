"""A background process the platform owns: started detached, tracked by a PID file, stopped by PID.

The PID alone is not trusted (PIDs are reused): the PID file also records the
process's start time, and a process counts as ours only while a process with
that PID and that start time exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1

__all__ = [
    "ManagedProcess",
    "ProcessStartError",
    "ensure_port_free",
    "free_port_block",
    "free_ports",
    "stop_together",
    "tail",
    "terminate_with_parent",
]


class ProcessStartError(RuntimeError):
    """A process exited during start-up; the message carries the tail of its log."""


def ensure_port_free(port: int, setting: str) -> None:
    """Raise :class:`ProcessStartError` naming ``setting`` if another program holds ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ProcessStartError(
                f"port {port} is already in use by another program: choose another port "
                f"with {setting} (environment or fxstream.toml)"
            ) from exc


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free now on 127.0.0.1 (held at once, so they differ)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def free_port_block(size: int, attempts: int = 50) -> int:
    """The first of ``size`` consecutive ports free now on 127.0.0.1 (the cluster's layout)."""
    for _ in range(attempts):
        base = free_ports(1)[0]
        if base + size > 65535:
            continue
        with ExitStack() as stack:
            try:
                for port in range(base, base + size):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise ProcessStartError(f"no block of {size} free ports found on 127.0.0.1")


def terminate_with_parent() -> None:
    """In a child before exec: ask Linux to SIGTERM it when its parent exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ("" if it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ManagedProcess:
    """One long-running process of the platform."""

    name: str
    argv: Sequence[str]
    pid_file: Path
    log_file: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    die_with_parent: bool = False
    umask: int | None = None
    """The process's umask (None: inherit ours); 0o077 makes what it writes 0600."""

    def pid(self) -> int | None:
        """The PID if our process is running, else None (a stale PID file is removed)."""
        try:
            pid_text, started_text = self.pid_file.read_text().split()
            pid, started = int(pid_text), float(started_text)
        except (OSError, ValueError):
            return None
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                return pid
            if proc.status() == psutil.STATUS_ZOMBIE:
                self._reap(pid)
        except psutil.NoSuchProcess:
            self._reap(pid)
        except psutil.AccessDenied:
            return None
        self.pid_file.unlink(missing_ok=True)
        return None

    def is_running(self) -> bool:
        """True while our process is alive."""
        return self.pid() is not None

    def start(self) -> int:
        """Start the process unless it already runs; return its PID."""
        existing = self.pid()
        if existing is not None:
            return existing
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        with self.log_file.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=env,
                # Its own session: a Ctrl-C in the terminal that ran `up` must not stop it.
                start_new_session=True,
                preexec_fn=terminate_with_parent if self.die_with_parent else None,
                umask=-1 if self.umask is None else self.umask,
            )
        started = psutil.Process(popen.pid).create_time()
        self.pid_file.write_text(f"{popen.pid} {started!r}\n")
        return popen.pid

    def check_alive(self) -> None:
        """Raise :class:`ProcessStartError` with the log's tail if the process has exited."""
        if self.pid() is None:
            raise ProcessStartError(
                f"{self.name} exited during start-up; last lines of {self.log_file}:\n"
                f"{tail(self.log_file)}"
            )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop by PID: SIGTERM, wait up to ``timeout_s``, then SIGKILL. True if it was running."""
        pid = self.pid()
        if pid is None:
            return False
        # It may exit on its own between the check and the signal: that is success too.
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._reap(pid)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> bool:
        """SIGKILL without grace (fault injection); True if it was running."""
        pid = self.pid()
        if pid is None:
            return False
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.kill()
            proc.wait(timeout=10)
        self._reap(pid)
        self.pid_file.unlink(missing_ok=True)
        return True

    @staticmethod
    def _reap(pid: int) -> None:
        # Only our own children can be reaped; for anything else this is a no-op.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def stop_together(
    processes: Sequence[ManagedProcess],
    timeout_s: float = 30.0,
    *,
    straggler_s: float | None = None,
) -> list[int]:
    """Stop several processes at once: SIGTERM to all, wait up to ``timeout_s``, then SIGKILL.

    For the cluster's brokers: stopped one after another, the last one has lost the
    controller quorum and waits for it until it is killed (60 s); stopped together,
    they mostly exit in seconds, but one may still be left waiting for a quorum its
    peers took with them. ``straggler_s``: once some have exited and none has for this
    long, the rest are killed then (their peers are gone: nothing they wait for will
    come). Returns the PIDs that were running.
    """
    running: dict[int, tuple[ManagedProcess, psutil.Process]] = {}
    for process in processes:
        pid = process.pid()
        if pid is None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            running[pid] = (process, proc)
    alive = [proc for _, proc in running.values()]
    deadline = time.monotonic() + timeout_s
    last_exit: float | None = None
    while alive and time.monotonic() < deadline:
        gone, alive = psutil.wait_procs(alive, timeout=0.2)
        now = time.monotonic()
        if gone:
            last_exit = now
        elif straggler_s is not None and last_exit is not None and now - last_exit > straggler_s:
            break
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)
    for pid, (process, _) in running.items():
        ManagedProcess._reap(pid)
        process.pid_file.unlink(missing_ok=True)
    return list(running)
