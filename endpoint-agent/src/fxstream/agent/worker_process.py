"""What runs inside a worker process: load a function once per worker, then run its tasks.

A worker (started by an engine, :mod:`fxstream.agent.process_engine`) resolves
its *runner* (a loader ``load(code) -> call`` with ``call(payload) -> bytes``),
keeps an LRU cache of loaded functions keyed by ``(function_id, code_sha256)``,
and serves batches of items from its task pipe, sending one reply per item on
its result pipe. Tasks, code and results cross the process boundary as opaque
``bytes``; the runner turns them into a Python call (the agent's runner,
:mod:`fxstream.agent.runner`, plugs in the real serialization strategy).

A user exception (even ``SystemExit``) is an error reply and the worker lives
on. The worker leads its own process group (so the engine can kill whatever a
task started with it), ignores SIGINT (the agent decides when it stops), asks
Linux to SIGKILL it when the thread that started it ends, and sends
faulthandler's dump (segfaults, aborts) to a file the engine reads after its
death. Which item runs now, and since when, is in a small shared-memory array
(:data:`STATE_SEQ`, :data:`STATE_MONOTONIC`, :data:`STATE_EPOCH`), so the
engine can time walltimes and word a death without asking the worker.

A worker is started in one of two ways. Through :mod:`multiprocessing` (spawn
or forkserver: :func:`worker_main` is its target, with its pipes and a
``RawArray`` state), or by a command line a container runtime can wrap
(:mod:`fxstream.agent.containers`): ``python -m fxstream.agent.worker_process
--tasks-fd N --results-fd M --state FILE --crash FILE [--parent-pid PID]``
(:func:`main`). Then the pipes are inherited descriptors (stdin and stdout where
a runtime cannot pass others: the worker moves them aside and points its own
stdout at stderr, so a task's prints cannot corrupt the pipe), the state array
is the 24-byte file ``--state`` mapped in both processes (:data:`STATE_BYTES`),
and the runner and cache size come as the first message on the task pipe, a
pickled ``(runner, cache_size)`` (never on the command line: a runner may hold
a store's password). Inside a container the worker's parent is the runtime,
not the engine: no ``--parent-pid`` is passed, and the runtime ends the worker
with the engine (bubblewrap's ``--die-with-parent``; for podman the worker
exits when its task pipe closes).

The pipe protocol: the engine sends a pickled list of :data:`Entry` (or
``None``: stop); the worker replies ``(REPLY_READY, pid)`` once, then per item
``(seq, status, value, error_type, message, traceback, started, finished,
cached, stdout, stderr)`` with ``status`` one of :data:`REPLY_OK`, :data:`REPLY_ERROR`,
:data:`REPLY_NEEDS_CODE`, and ``stdout`` / ``stderr`` the tail of what the function
printed (:mod:`fxstream.agent.output_capture`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import importlib
import mmap
import os
import pickle
import signal
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import IO, Any, Final

from fxstream.agent.engine import RUNNER_UNAVAILABLE
from fxstream.agent.output_capture import CapturedOutput, captured
from fxstream.topics.budget import (
    ERROR_MESSAGE_MAX_BYTES,
    TRACEBACK_MAX_BYTES,
    truncate_utf8,
    truncate_utf8_tail,
)

__all__ = [
    "DEFAULT_RUNNER",
    "REPLY_ERROR",
    "REPLY_NEEDS_CODE",
    "REPLY_OK",
    "REPLY_READY",
    "STATE_BYTES",
    "STATE_EPOCH",
    "STATE_MONOTONIC",
    "STATE_SEQ",
    "Call",
    "Entry",
    "FunctionKey",
    "ItemRunner",
    "Loader",
    "RunnerSpec",
    "load_pickled",
    "main",
    "map_state",
    "resolve_runner",
    "worker_main",
]

Call = Callable[[bytes], bytes]
"""A loaded function: serialized arguments in, serialized result out."""

Loader = Callable[[bytes], Call]
"""A runner: turns a function's code bytes into a :data:`Call` (once per worker)."""

RunnerSpec = str | Loader
"""A runner as ``"package.module:function"`` or as a picklable :data:`Loader`."""

DEFAULT_RUNNER: Final = "fxstream.agent.worker_process:load_pickled"
"""The runner for trusted callers sharing this code base (:func:`load_pickled`)."""

# Tags on the worker -> engine pipe: REPLY_READY leads its first reply, the others are an
# item reply's status (its second element).
REPLY_READY: Final = -1
"""The first reply of a worker, ``(REPLY_READY, pid)``: it is up."""
REPLY_OK: Final = 0
"""The item returned a value."""
REPLY_ERROR: Final = 1
"""The item raised (or its function could not be loaded)."""
REPLY_NEEDS_CODE: Final = 2
"""The worker lacks the function and was sent no code: send the item again with it."""

# Shared-memory slots per worker: which item runs now (-1: none) and since when.
STATE_SEQ: Final = 0
"""Index of the running item's sequence number (-1: none) in the worker's shared state."""
STATE_MONOTONIC: Final = 1
"""Index of when the running item started (monotonic clock)."""
STATE_EPOCH: Final = 2
"""Index of when the running item started (epoch seconds)."""
STATE_BYTES: Final = 3 * 8
"""The size of a worker's state file: three native doubles."""

_PR_SET_PDEATHSIG: Final = 1

FunctionKey = tuple[str, str]
"""A loaded function's key: ``(function_id, code_sha256)``."""

Entry = tuple[int, str, str, bytes | None, bytes]
"""What a worker receives per item: ``(seq, function_id, code_sha256, code or None, payload)``."""


# --- runners -------------------------------------------------------------------------------


def load_pickled(code: bytes) -> Call:
    """The default runner, for trusted callers that share this code base (tests, local use).

    ``code`` is a stdlib-pickled reference to an importable callable, a payload
    is a pickled ``(args, kwargs)`` pair and the result is pickled. Never use it
    on bytes from an untrusted source: unpickling runs code.
    """
    function = pickle.loads(code)
    if not callable(function):
        raise TypeError(f"the code unpickles to {type(function).__name__}, not a callable")

    def call(payload: bytes) -> bytes:
        args, kwargs = pickle.loads(payload)
        return pickle.dumps(function(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    return call


def resolve_runner(runner: RunnerSpec) -> Loader:
    """The loader a runner spec names; raises ``ValueError`` saying why it cannot be had."""
    if callable(runner):
        return runner
    module_name, sep, attribute_path = runner.partition(":")
    if not sep or not module_name or not attribute_path:
        raise ValueError(f"runner {runner!r} is not of the form 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            target = getattr(target, attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load runner {runner!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"runner {runner!r} is a {type(target).__name__}, not a callable")
    loader: Loader = target
    return loader


# --- the worker process --------------------------------------------------------------------


class _RunnerUnavailableError(Exception):
    """The worker could not load its runner, so it cannot load any function."""


def _describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """Type name, message and traceback text; user exceptions may fail even at ``str()``."""
    name = type(exc).__name__
    if isinstance(exc, _RunnerUnavailableError):
        name = RUNNER_UNAVAILABLE
    try:
        message = str(exc)
    except BaseException:
        message = f"<{name} whose str() failed>"
    try:
        text = "".join(traceback.format_exception(exc))
    except BaseException:
        text = ""
    return (
        name,
        truncate_utf8(message, ERROR_MESSAGE_MAX_BYTES),
        # The end of a traceback names the failing line: keep it.
        truncate_utf8_tail(text, TRACEBACK_MAX_BYTES),
    )


def _serialized_exception(exc: BaseException) -> bytes | None:
    try:
        serialized = getattr(exc, "__fxstream_exception__", None)
    except Exception:  # a user exception whose __getattr__ fails
        return None
    return serialized if isinstance(serialized, bytes) else None


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"the runner returned {type(value).__name__}, expected bytes")


class ItemRunner:
    """A worker's side: a runner, an LRU cache of loaded functions and the shared state (a
    batch engine's task runs items through one too: :mod:`fxstream.agent.batch_worker`)."""

    def __init__(self, runner: RunnerSpec, state: Any, cache_size: int) -> None:
        self._state = state
        self._cache_size = cache_size
        self._cache: OrderedDict[FunctionKey, Call] = OrderedDict()
        self._loader: Loader | None = None
        self._runner_problem = ""
        try:
            self._loader = resolve_runner(runner)
        except ValueError as exc:
            # Failing every item beats dying: the pool would only start another
            # worker that fails the same way.
            self._runner_problem = str(exc)

    def run(self, entry: Entry) -> tuple[Any, ...]:
        """Run one item and return its reply; user failures become error replies."""
        seq, function_id, code_sha256, code, payload = entry
        key = (function_id, code_sha256)
        state = self._state
        state[STATE_MONOTONIC] = time.monotonic()
        started = state[STATE_EPOCH] = time.time()
        state[STATE_SEQ] = seq
        reply: tuple[Any, ...]
        output = CapturedOutput(0)
        try:
            call = self._function(key, code)
            if call is None:
                reply = (seq, REPLY_NEEDS_CODE, None, None, "", "", started, time.time(), False)
            else:
                with captured() as output:
                    value = _as_bytes(call(payload))
                reply = (seq, REPLY_OK, value, None, "", "", started, time.time(), True)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the worker lives
            name, message, text = _describe_exception(exc)
            cached = key in self._cache
            # The runner may have left the exception serialized (for the client to raise).
            serialized = _serialized_exception(exc)
            reply = (
                seq,
                REPLY_ERROR,
                serialized,
                name,
                message,
                text,
                started,
                time.time(),
                cached,
            )
        state[STATE_SEQ] = -1
        return (*reply, output.stdout, output.stderr)

    def _function(self, key: FunctionKey, code: bytes | None) -> Call | None:
        call = self._cache.get(key)
        if call is not None:
            self._cache.move_to_end(key)
            return call
        if code is None:
            return None
        if self._loader is None:
            raise _RunnerUnavailableError(self._runner_problem)
        call = self._loader(code)
        self._cache[key] = call
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return call


def _die_with_parent(parent_pid: int | None) -> None:
    """Have Linux SIGKILL this worker when the thread that started it ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before prctl took effect.
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _enable_crash_dump(path: str) -> IO[str] | None:
    """Send faulthandler's dump (segfaults, aborts) to ``path`` for the pool to report."""
    try:
        dump = open(path, "w")  # noqa: SIM115 - open for the process's lifetime
    except OSError:
        return None
    faulthandler.enable(file=dump, all_threads=True)
    return dump


def worker_main(
    tasks: Connection,
    results: Connection,
    state: Any,
    runner: RunnerSpec,
    parent_pid: int | None,
    crash_path: str,
    cache_size: int,
) -> None:
    """A worker process's loop: receive a batch, run each item, send each reply."""
    _die_with_parent(parent_pid)
    # Its own process group, so the pool can kill whatever a task started along with it.
    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    crash_dump = _enable_crash_dump(crash_path)  # kept open: faulthandler writes to its fd
    worker = ItemRunner(runner, state, cache_size)
    dumps = pickle.dumps
    protocol = pickle.HIGHEST_PROTOCOL
    try:
        results.send_bytes(dumps((REPLY_READY, os.getpid()), protocol))
        while True:
            batch: list[Entry] | None = pickle.loads(tasks.recv_bytes())
            if batch is None:  # asked to stop
                break
            for entry in batch:
                results.send_bytes(dumps(worker.run(entry), protocol))
    except (EOFError, BrokenPipeError):
        pass  # the pool is gone: nobody is left to serve
    if crash_dump is not None:
        faulthandler.disable()
        crash_dump.close()


# --- started by a command line (a container runtime's) --------------------------------------


def map_state(path: str) -> memoryview[float]:
    """The state array in the file ``path`` (:data:`STATE_BYTES` long), shared by mapping.

    Indexed like the ``RawArray`` of a multiprocessing worker; the mapping lives as
    long as the view.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, STATE_BYTES)
    finally:
        os.close(fd)
    return memoryview(mapped).cast("d")


def _inherited(fd: int, standard: int) -> int:
    """Descriptor ``fd``; if it is stdin or stdout, moved aside and the standard one reset
    (stdin to /dev/null, stdout to stderr) so nothing a task prints or reads touches it."""
    if fd != standard:
        return fd
    moved = os.dup(fd)
    if standard == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    else:
        sys.stdout.flush()
        os.dup2(2, 1)
    return moved


def main(argv: list[str] | None = None) -> None:
    """A worker started by a command line (see the module notes): serve until told to stop."""
    parser = argparse.ArgumentParser(prog="python -m fxstream.agent.worker_process")
    parser.add_argument("--tasks-fd", type=int, required=True)
    parser.add_argument("--results-fd", type=int, required=True)
    parser.add_argument("--state", required=True, help="the 24-byte shared state file")
    parser.add_argument("--crash", required=True, help="where faulthandler writes")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    tasks = Connection(_inherited(args.tasks_fd, 0), writable=False)
    results = Connection(_inherited(args.results_fd, 1), readable=False)
    state = map_state(args.state)
    try:
        runner, cache_size = pickle.loads(tasks.recv_bytes())
    except (EOFError, OSError):
        return  # the engine is gone before it said what to run
    worker_main(tasks, results, state, runner, args.parent_pid, args.crash, cache_size)


if __name__ == "__main__":
    main()
