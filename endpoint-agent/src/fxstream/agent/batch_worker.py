"""What a batch engine's task runs inside a Parsl worker: one work item, as a warm worker would.

The batch engine (:mod:`fxstream.agent.batch_engine`) submits :func:`run_item` to
Parsl's HighThroughputExecutor with only bytes and strings as arguments: the item's
function id, code hash, code and submission bytes, its walltime, and the *path* of the
runner file. The runner (the agent's loader, :mod:`fxstream.agent.runner`, which may hold
the proxy store's URL and so its password) never travels through Parsl: the engine
writes it pickled to a 0600 file in its run directory, and each worker process loads it
from there once. So nothing secret is in Parsl's messages, logs or submit scripts.

Each worker process keeps one :class:`~fxstream.agent.worker_process.ItemRunner` per
runner file (an LRU of loaded functions), so a function's code is deserialized once
per worker, as in the process engine. A walltime is kept with ``SIGALRM`` where the
task runs on its process's main thread (Parsl's workers do): the function is
interrupted with :class:`WalltimeExceeded` at its next Python instruction (code stuck
inside a C call is interrupted only when it returns).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Final

from fxstream.agent.engine import WALLTIME_EXCEEDED
from fxstream.agent.worker_process import REPLY_OK, ItemRunner, RunnerSpec

__all__ = ["CACHE_SIZE", "ItemReply", "WalltimeExceeded", "run_item", "write_runner_file"]

CACHE_SIZE: Final = 64
"""Loaded functions each worker process keeps."""

ItemReply = tuple[bool, bytes | None, str | None, str, str, float, float, str, str, str]
"""``(ok, value, error_type, message, traceback, started, finished, worker, stdout,
stderr)``."""

_runners: dict[str, ItemRunner] = {}
_lock = threading.Lock()


class WalltimeExceeded(Exception):
    """The item ran past its walltime."""


assert WalltimeExceeded.__name__ == WALLTIME_EXCEEDED


def write_runner_file(path: Path, runner: RunnerSpec) -> None:
    """Write ``runner`` pickled to ``path``, owner-only (it may hold a store's password)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pickle.dumps(runner, protocol=pickle.HIGHEST_PROTOCOL))
    path.chmod(0o600)


def _runner(runner_file: str) -> ItemRunner:
    with _lock:
        runner = _runners.get(runner_file)
        if runner is None:
            # Written by this endpoint's own agent, owner-only (write_runner_file).
            spec: RunnerSpec = pickle.loads(Path(runner_file).read_bytes())
            runner = _runners[runner_file] = ItemRunner(spec, [-1.0, 0.0, 0.0], CACHE_SIZE)
        return runner


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise WalltimeExceeded("the task ran past its walltime")


def run_item(
    runner_file: str,
    function_id: str,
    code_sha256: str,
    code: bytes,
    payload: bytes,
    walltime_s: float | None,
) -> ItemReply:
    """Run one work item in this worker process and return its reply (never raises for
    the task's own failure)."""
    runner = _runner(runner_file)
    timed = walltime_s is not None and threading.current_thread() is threading.main_thread()
    previous: Any = None
    if timed:
        assert walltime_s is not None
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, walltime_s)
    try:
        reply = runner.run((0, function_id, code_sha256, code, payload))
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    _, status, value, error_type, message, text, started, finished, _, out, err = reply
    worker = f"{socket.gethostname()}:{os.getpid()}"
    ok = status == REPLY_OK
    return (ok, value, error_type, message, text, started, finished, worker, out, err)
