"""The process engine: a number of warm worker processes that load a function once.

The first :class:`~fxstream.agent.engine.Engine`. A :class:`ProcessEngine`
starts ``size`` worker processes once and keeps them (:meth:`ProcessEngine.resize`
changes how many). Each worker
(:mod:`fxstream.agent.worker_process`, what runs inside it) caches the functions
it has loaded, keyed by ``(function_id, code_sha256)``, so the second task of a
function skips deserialising its code. Tasks, code and results cross
the process boundary as opaque ``bytes``: a *runner* turns them into a Python
call inside the worker, so the agent can plug in the real serialization
strategy without this module knowing it.

Design choices the agent relies on:

* **Code shipping.** The pool, not the agent, decides when code travels. It
  remembers which worker holds which function warm (mirroring each worker's LRU
  cache) and attaches the code to a work item only for a worker that lacks it.
  The agent may always pass ``code``; it may also pass ``None`` for a function
  the pool has already seen (the pool keeps a bounded cache of code by
  ``(function_id, code_sha256)``). If the code is in neither place the future
  resolves at once with a ``CodeRequired`` error outcome and nothing runs: the
  agent resubmits with the code. Should a worker still lack a function (its
  loader failed, say), it answers "needs code" and the pool resends the item
  with the code: this never reaches the caller.
* **Affinity.** An item goes to an idle worker that has its function warm when
  there is one, else to the idle worker with the fewest warm functions.
* **Batching.** When work is queued, several items go to one worker in one
  message, but only for functions observed to be short (mean run time under
  ``short_task_s``), so a long task never holds another behind it while a
  worker is idle. Outcomes still come back one by one.
* **Failures.** A user exception is an error outcome and the worker lives on.
  A worker that dies (``os._exit``, a signal, a segfault, the OOM killer) is
  seen at once through a pidfd (or its process sentinel off Linux) and
  replaced; the task it was running gets a ``WorkerLost`` outcome (with
  faulthandler's dump as its traceback after a segfault) and the items queued
  behind it on that worker, which never started, run elsewhere. A task over
  its walltime gets its worker killed and a ``WalltimeExceeded`` outcome.
* **Cancel.** :meth:`ProcessEngine.cancel` drops a queued item and kills the
  worker running a started one (the pool replaces it, and kills the task's own
  child processes with it); either way the outcome is ``TaskCancelled``, not
  retryable. An item batched behind another on the same worker cannot be taken
  back from it: its outcome is ``TaskCancelled`` at once, but being a short
  function (batching is only for those), it may still run.
  Walltime covers loading the function too. Each worker leads its own process
  group, and the pool kills the whole group whenever a worker ends, so
  programs a task started do not outlive it.
* **Size.** :meth:`ProcessEngine.resize` sets how many workers the pool keeps. It
  grows by starting workers (on the collector thread, like every start; a worker
  being retired that still runs its tasks is kept instead, being warm). It shrinks
  by retiring workers: not yet started ones first, then those starting up, then idle
  ones (the fewest functions warm first), and only then busy ones (the fewest items
  held first). A retired worker takes no new item; a busy one is asked to stop once
  it has answered the items it holds (a running task is never killed for a resize),
  and a retired worker's slot is never respawned. Until it has ended, a retired
  worker counts in ``workers_total`` (so at most ``size`` plus the busy retired
  workers run at once: a budget across pools counts them) and, while it runs
  items, as busy; it is not advertised warm. ``on_retired`` (if given) is called on
  the collector thread each time a retired worker has ended.
* **Threads.** Futures are resolved, and their done-callbacks run, on the
  pool's single collector thread: keep callbacks short.
* **Processes.** Every worker is started by the collector thread and asks the
  kernel (Linux) to SIGKILL it when that thread ends, so a crashed agent leaves
  no worker behind; :meth:`ProcessEngine.close` stops and reaps every worker.
  Workers ignore SIGINT: the agent decides when they stop.
* **Containers.** Without a ``runtime`` workers are started by
  :mod:`multiprocessing` (spawn or forkserver). With one
  (:class:`~fxstream.agent.containers.Runtime`: process, bubblewrap, podman,
  docker, apptainer) each worker is started by the command line the runtime
  builds around ``python -m fxstream.agent.worker_process`` (``posix_spawn``,
  its own session): its pipes are inherited descriptors (3 and 4, or stdin and
  stdout), its state array is a file in its own sandbox directory mapped by both
  sides, and the runner is the first message on its task pipe. The sandbox
  directory (bound writable into the container, with ``writable``) holds the
  state and crash files and is removed when the worker ends. The interpreter,
  the virtualenv and every directory on ``sys.path`` are bound read-only. A
  killed container whose launcher does not take it down (podman, docker) is
  killed with the runtime's stop command.
* **Interpreters.** With ``python`` (a
  :class:`~fxstream.agent.python_envs.PythonInterpreter` probed at the agent's start)
  the workers run that interpreter instead of the agent's, started by command line
  (the ``process`` runtime unless another is given), with its own import path as
  ``PYTHONPATH`` and its own paths bound read-only into a container.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Final, Literal

from fxstream.agent.containers import ContainerError, Image, ProcessRuntime, Runtime, WorkerLaunch
from fxstream.agent.engine import (
    CODE_HASH_MISMATCH,
    CODE_REQUIRED,
    POOL_CLOSED,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    WORKER_START_FAILED,
    EngineCounts,
    PoolRoom,
    WarmState,
    WorkItem,
    WorkOutcome,
)
from fxstream.agent.python_envs import PythonInterpreter
from fxstream.agent.worker_process import (
    DEFAULT_RUNNER,
    REPLY_NEEDS_CODE,
    REPLY_OK,
    REPLY_READY,
    STATE_BYTES,
    STATE_EPOCH,
    STATE_MONOTONIC,
    STATE_SEQ,
    Entry,
    FunctionKey,
    RunnerSpec,
    map_state,
    resolve_runner,
    worker_main,
)

__all__ = ["ProcessEngine", "WorkerPool"]

log = logging.getLogger(__name__)

# A crashed worker's faulthandler dump is read back up to this size (its end).
_MAX_CRASH_DUMP_BYTES: Final = 65_536

_START_POLL_S: Final = 0.01
_EXIT_GRACE_S: Final = 0.5
_MAX_RESPAWN_DELAY_S: Final = 10.0
_START_FAILURES_BEFORE_FAILING: Final = 3
_DURATION_WEIGHT: Final = 0.2
_MAX_TRACKED_FUNCTIONS: Final = 4096


_Resolution = tuple["Future[WorkOutcome]", "WorkOutcome"]

# Where a launched worker's pipes are moved before they are put at their place (3 and 4, or
# 0 and 1): above every descriptor a dup2 writes, so none overwrites another's source.
_FD_STAGING_MIN: Final = 64
_STOP_TIMEOUT_S: Final = 30.0


# --- workers started by a command line (a container runtime's) -----------------------------


class _LaunchedWorker:
    """A worker started by a runtime's command line: the subset of ``multiprocessing``'s
    process the pool uses (``pid``, ``sentinel``, ``exitcode``, ``kill``, ``join``)."""

    def __init__(
        self, argv: list[str], env: dict[str, str], fds: dict[int, int], stop: list[str] | None
    ) -> None:
        """Start ``argv`` in its own session with descriptor ``source`` at ``fds[source]``
        (stdin is /dev/null unless one is put there); ``stop`` kills its container."""
        staged = [fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, _FD_STAGING_MIN) for source in fds]
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_DUP2, fd, target)
            for fd, target in zip(staged, fds.values(), strict=True)
        ]
        if 0 not in fds.values():
            actions.insert(0, (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
        try:
            self.pid: int = os.posix_spawnp(
                argv[0],
                argv,
                env,
                file_actions=actions,
                setsid=True,
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
            )
        finally:
            for fd in staged:
                os.close(fd)
        self.sentinel: int = os.pidfd_open(self.pid)
        self.exitcode: int | None = None
        self._stop = stop

    def _exited(self) -> bool:
        return self.exitcode is not None or bool(select.select([self.sentinel], [], [], 0)[0])

    def kill(self) -> None:
        """SIGKILL the launcher; first, while it lives, have the runtime kill its container."""
        if self.exitcode is not None:
            return
        if self._stop is not None and not self._exited():
            stop, self._stop = self._stop, None
            threading.Thread(
                target=_run_stop, args=(stop,), name="fxstream-stop", daemon=True
            ).start()
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self) -> None:
        """Reap the launcher (once) and record its exit code (negative: the signal)."""
        if self.exitcode is not None:
            return
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            self.exitcode = -signal.SIGKILL
        else:
            self.exitcode = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


def _run_stop(argv: list[str]) -> None:
    """Run a runtime's stop command; its failure (the container is gone already) is fine."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=_STOP_TIMEOUT_S, check=False)


_Process = BaseProcess | _LaunchedWorker


# --- the pool ------------------------------------------------------------------------------


class _Task:
    """An item inside the pool: its sequence number, code and future."""

    __slots__ = ("cancelled", "claimed", "code", "force_code", "future", "item", "key", "seq")

    def __init__(self, seq: int, item: WorkItem, code: bytes, future: Future[WorkOutcome]) -> None:
        self.seq = seq
        self.item = item
        self.code = code
        self.future = future
        self.key: FunctionKey = (item.function_id, item.code_sha256)
        self.claimed = False  # the future was moved to "running"
        self.force_code = False  # the worker said it lacks the function
        self.cancelled = False  # cancel() was asked while a worker held it


class _Slot:
    """The pool's view of one worker process."""

    __slots__ = (
        "crash_path",
        "dead",
        "exit_fd",
        "index",
        "kill_reason",
        "outstanding",
        "pid",
        "process",
        "ready",
        "results",
        "retiring",
        "sandbox",
        "state",
        "stop_sent",
        "tasks",
        "warm",
        "worker_id",
    )

    def __init__(
        self,
        index: int,
        process: _Process,
        tasks: Connection,
        results: Connection,
        state: Any,
        crash_path: str,
        host: str,
        sandbox: str | None = None,
    ) -> None:
        self.index = index
        self.process = process
        self.pid: int = process.pid or 0
        self.worker_id = f"{host}:{self.pid}"
        self.tasks = tasks
        self.results = results
        self.state = state
        self.crash_path = crash_path
        self.sandbox = sandbox  # a launched worker's own directory, removed when it ends
        self.exit_fd = _exit_fd(process)
        self.ready = False
        self.dead = False
        self.retiring = False  # retired by a resize: no new items, never respawned
        self.stop_sent = False  # asked to stop (a retiring worker that holds no item)
        # Items sent and not yet answered, in the order the worker runs them.
        self.outstanding: OrderedDict[int, _Task] = OrderedDict()
        # The pool's mirror of the worker's function cache (LRU order).
        self.warm: OrderedDict[FunctionKey, None] = OrderedDict()
        # Why the pool killed it: ("walltime", seq), ("cancelled", seq), ("closed", -1) or
        # ("protocol", -1).
        self.kill_reason: tuple[str, int] | None = None

    def running_seq(self) -> int:
        """The item the worker is running now, or -1."""
        return int(self.state[STATE_SEQ])

    def started_monotonic(self, seq: int) -> float | None:
        """When item ``seq`` started (monotonic clock), or None if it is not running."""
        if self.running_seq() != seq:
            return None
        started = float(self.state[STATE_MONOTONIC])
        # The worker may have moved on between the two reads.
        return started if self.running_seq() == seq else None


def _exit_fd(process: _Process) -> int:
    """A descriptor readable once ``process`` has exited.

    A pidfd where Linux has them: multiprocessing's sentinel is a pipe the worker
    holds open, so it stays silent while a process the task forked lives on.
    """
    if isinstance(process, _LaunchedWorker):
        return process.sentinel  # a pidfd already
    pid = process.pid
    if pid is not None and hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):
            return os.pidfd_open(pid)
    return process.sentinel


def _kill_group(slot: _Slot) -> None:
    """SIGKILL a worker and every process in its group (what its tasks started)."""
    with contextlib.suppress(OSError):
        slot.process.kill()  # first: a launched worker's runtime is asked while it lives
    with contextlib.suppress(OSError):
        os.killpg(slot.pid, signal.SIGKILL)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "an unknown status"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _failure(task: _Task, error_type: str, message: str, **fields: Any) -> _Resolution:
    outcome = WorkOutcome(
        task_id=task.item.task_id,
        ok=False,
        value=None,
        error_type=error_type,
        error_message=message,
        traceback=fields.get("traceback", ""),
        worker=fields.get("worker", ""),
        started_at=fields.get("started_at"),
        finished_at=time.time(),
    )
    return task.future, outcome


def _check_picklable(runner: RunnerSpec) -> None:
    # Workers receive the runner pickled; a lambda would only fail on the collector thread.
    try:
        pickle.dumps(runner)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"runner {runner!r} cannot be pickled for the workers: use a module-level "
            "function or a 'package.module:function' string"
        ) from exc


def _context(start_method: str) -> SpawnContext | ForkServerContext:
    # Never fork: a forked worker would inherit the agent's threads' locks and its Kafka clients.
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    if start_method == "forkserver":
        return multiprocessing.get_context("forkserver")
    raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")


def _resolve(resolutions: Iterable[_Resolution]) -> None:
    """Set outcomes on futures; never called with the pool lock held (callbacks may submit)."""
    for future, outcome in resolutions:
        if not future.done():
            future.set_result(outcome)


class ProcessEngine:
    """A pool of ``size`` warm worker processes (see the module notes for the design).

    The ``"process"`` :class:`~fxstream.agent.engine.Engine`.

    ``runner`` is a :data:`RunnerSpec`; it is resolved here first so a bad
    spec fails at once. ``max_batch`` caps the items sent to a worker in one
    message, ``short_task_s`` is the mean run time under which a function's
    items may be batched, ``function_cache_size`` is each worker's LRU of
    loaded functions and ``code_cache_size`` the pool's LRU of code bytes.

    With a ``runtime`` every worker is started by the command line it builds,
    inside ``image`` (which must be of that runtime; none for ``process``), with
    write access to its own sandbox directory and to ``writable``, and read access
    to this Python (interpreter, virtualenv, ``sys.path``) and ``readonly``; a runtime
    that cannot run here (its binary is missing) raises
    :class:`~fxstream.agent.containers.ContainerError` saying what to install.
    ``start_method`` applies only without a runtime. ``python`` is the interpreter the
    workers run (None: the agent's own; see the module notes). ``on_retired`` is called
    (on the collector thread, without the pool's lock: keep it short) whenever a worker
    :meth:`resize` retired has ended.
    """

    def __init__(
        self,
        size: int,
        runner: RunnerSpec = DEFAULT_RUNNER,
        *,
        start_method: Literal["spawn", "forkserver"] = "spawn",
        max_batch: int = 16,
        short_task_s: float = 0.005,
        function_cache_size: int = 64,
        code_cache_size: int = 256,
        runtime: Runtime | None = None,
        image: Image | None = None,
        writable: Sequence[str] = (),
        readonly: Sequence[str] = (),
        python: PythonInterpreter | None = None,
        on_retired: Callable[[], None] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got size={size}")
        if max_batch < 1 or function_cache_size < 1 or code_cache_size < 1:
            raise ValueError("max_batch and the cache sizes must be at least 1")
        resolve_runner(runner)
        _check_picklable(runner)
        if runtime is not None:
            problem = runtime.unavailable()
            if problem is not None:
                raise ContainerError(problem)
            if runtime.name != "process" and (image is None or image.runtime != runtime.name):
                raise ContainerError(
                    f"the {runtime.name} runtime needs an image of its own, not "
                    f"{'none' if image is None else repr(image.spec)}"
                )
        if python is not None and runtime is None:
            runtime = ProcessRuntime()  # another interpreter: started by its command line
        self._runtime = runtime
        self._image = image
        self._python = python if python is not None else PythonInterpreter.current()
        self._writable = tuple(os.path.abspath(p) for p in writable)
        self._readonly = (
            (*self._python.paths, *(os.path.abspath(p) for p in readonly)) if runtime else ()
        )
        self._instance = uuid.uuid4().hex[:8]
        self._size = size
        self._runner = runner
        self._start_method = start_method
        self._context = _context(start_method)
        self._max_batch = max_batch
        self._short_task_s = short_task_s
        self._function_cache_size = function_cache_size
        self._code_cache_size = code_cache_size
        self._host = socket.gethostname()

        self._on_retired = on_retired

        self._lock = threading.Lock()
        self._pending: deque[_Task] = deque()
        # Every worker the pool keeps or is retiring, by index (None: not started yet, or
        # awaiting its respawn). The kept ones (not retiring) number ``size`` once the
        # collector has applied the last resize (``_resize_due``).
        self._slots: dict[int, _Slot | None] = dict.fromkeys(range(size))
        self._indices = itertools.count(size)  # the index of the next worker a resize adds
        self._resize_due = False
        self._respawn_at: dict[int, float] = {}
        self._code_cache: OrderedDict[FunctionKey, bytes] = OrderedDict()
        self._durations: dict[str, float] = {}
        self._seq = itertools.count()
        self._spawn_count = itertools.count()
        self._start_failures = 0
        self._walltime_items = 0
        self._closed = False
        # Outcomes decided off the collector thread (cancel), resolved on it.
        self._deferred: list[_Resolution] = []

        self._crash_dir = tempfile.mkdtemp(prefix="fxstream-workers-")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

        self._started = threading.Event()
        self._collector = threading.Thread(
            target=self._collect, name="fxstream-worker-pool", daemon=True
        )
        self._collector.start()
        self._started.wait()
        atexit.register(self._close_at_exit)

    # --- public API ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """``"process"``: the name an endpoint config gives this engine."""
        return "process"

    @property
    def size(self) -> int:
        """The number of workers the pool keeps (the last :meth:`resize`'s)."""
        with self._lock:
            return self._size

    def resize(self, size: int) -> None:
        """Keep ``size`` workers from now on (see **Size** in the module notes).

        Returns at once: the collector thread starts or retires workers. Growing starts
        workers (or keeps retired ones still answering their items); shrinking retires
        idle workers first and a busy one only once it has answered the items it holds,
        never killing a task. Thread-safe; successive calls coalesce (the last wins).
        Raises ``ValueError`` below 1 and ``RuntimeError`` once closed.
        """
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got size={size}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            if size == self._size:
                return
            self._size = size
            self._resize_due = True
        self._wake()

    @property
    def idle_count(self) -> int:
        """Live workers with nothing to do (a worker still starting up counts as idle; a
        retired one does not)."""
        with self._lock:
            return sum(1 for s in self._kept_live() if not s.outstanding)

    @property
    def busy_count(self) -> int:
        """Live workers running or holding at least one item (retired ones finishing too)."""
        with self._lock:
            return sum(1 for s in self._live_slots() if s.outstanding)

    @property
    def queued_count(self) -> int:
        """Items submitted but not yet handed to a worker."""
        with self._lock:
            return len(self._pending)

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes (retired ones still ending included)."""
        with self._lock:
            return [s.pid for s in self._live_slots()]

    def warm_functions(self) -> dict[str, list[str]]:
        """Function ids each live worker (``"host:pid"``) holds loaded, for warm adverts
        (a retired worker takes no more items: not listed)."""
        with self._lock:
            return {
                s.worker_id: list(dict.fromkeys(function_id for function_id, _ in s.warm))
                for s in self._kept_live()
            }

    def counts(self) -> EngineCounts:
        """Workers (total, idle, busy) and queued items, in one snapshot.

        ``workers_total`` is ``size`` plus the retired workers not yet ended (they hold
        their place in a budget until then); a retired worker answering its last items
        counts as busy, one stopping as neither idle nor busy.
        """
        with self._lock:
            return EngineCounts(
                workers_total=self._held(),
                workers_idle=sum(1 for s in self._kept_live() if not s.outstanding),
                workers_busy=sum(1 for s in self._live_slots() if s.outstanding),
                queued=len(self._pending),
            )

    @property
    def image(self) -> Image | None:
        """The image every worker runs in (None: no container)."""
        return self._image

    def warm(self) -> list[WarmState]:
        """The functions each live worker holds loaded, oldest first, and whether it is idle
        (for warm adverts)."""
        container = self._image.name if self._image is not None else None
        with self._lock:
            return [
                WarmState(
                    worker_id=s.worker_id,
                    function_ids=tuple(dict.fromkeys(function_id for function_id, _ in s.warm)),
                    container=container,
                    idle=not s.outstanding,
                )
                for s in self._kept_live()
            ]

    def room(self, wanted: Collection[str | None] = ()) -> PoolRoom | None:
        """None: one pool, so any task may come next (the agent hands them over in order)."""
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every worker the pool keeps (``size``, after the last :meth:`resize`)
        has started up; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                kept = [s for s in self._slots.values() if s is None or not s.retiring]
                if (
                    not self._resize_due
                    and len(kept) == self._size
                    and all(s is not None and not s.dead and s.ready for s in kept)
                ):
                    return True
                if self._closed:
                    return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def submit(self, item: WorkItem) -> Future[WorkOutcome]:
        """Queue ``item``; the future resolves with its :class:`WorkOutcome`, never raises.

        Raises ``RuntimeError`` if the pool is closed and ``ValueError`` for a
        non-positive walltime.
        """
        if item.walltime_s is not None and not item.walltime_s > 0:
            raise ValueError(f"walltime_s must be positive, got {item.walltime_s}")
        future: Future[WorkOutcome] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            code, problem = self._code_for(item)
            task = _Task(next(self._seq), item, code or b"", future)
            if problem is None:
                self._pending.append(task)
                self._dispatch()
        if problem is not None:
            future.set_running_or_notify_cancel()
            _resolve([_failure(task, *problem)])
        return future

    def cancel(self, task_id: str, reason: str = "", *, kill: bool = True) -> bool:
        """Cancel the item of ``task_id``; False when the pool does not hold it (or, with
        ``kill`` False, holds it in a worker already).

        A queued item is dropped; a worker that has started it (or was sent it
        next) is SIGKILLed with whatever the task started, and replaced, unless
        ``kill`` is False. Its future resolves with a ``TaskCancelled`` outcome
        (``reason`` in its message), on the collector thread like every outcome.
        An item the worker finished just before the kill keeps its real outcome.
        """
        message = f"task {task_id} was cancelled" + (f": {reason}" if reason else "")
        resolutions: list[_Resolution] = []
        with self._lock:
            found = self._cancel_pending(task_id, message, resolutions)
            if not found and kill:
                found = self._cancel_held(task_id, message, resolutions)
            self._deferred.extend(resolutions)
        if resolutions:
            self._wake()
        return found

    def _cancel_pending(self, task_id: str, message: str, out: list[_Resolution]) -> bool:
        for task in self._pending:
            if task.item.task_id == task_id:
                self._pending.remove(task)
                if task.claimed or task.future.set_running_or_notify_cancel():
                    out.append(_failure(task, TASK_CANCELLED, message))
                return True
        return False

    def _cancel_held(self, task_id: str, message: str, out: list[_Resolution]) -> bool:
        for slot in self._live_slots():
            for position, task in enumerate(slot.outstanding.values()):
                if task.item.task_id != task_id:
                    continue
                if task.cancelled:
                    return True
                task.cancelled = True
                if position == 0:
                    # Running, loading, or next up: only killing the worker stops it. Its
                    # death (seen by the collector) resolves the item as cancelled.
                    self._kill(slot, ("cancelled", task.seq))
                else:
                    out.append(_failure(task, TASK_CANCELLED, message))
                return True
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and reap it; idempotent.

        Items not yet handed to a worker resolve with ``PoolClosed`` at once.
        Workers finish the items they hold and exit; any still running after
        ``timeout`` seconds are SIGKILLed and their items resolve with
        ``PoolClosed``. Must not be called from a future's done-callback.
        """
        if threading.current_thread() is self._collector:
            raise RuntimeError("close() cannot run on the pool's own thread (a done-callback)")
        dropped: list[_Resolution] = []
        with self._lock:
            if not self._closed:
                self._closed = True
                dropped = self._drop_pending("the pool was closed before the task started")
                for slot in self._live_slots():
                    with contextlib.suppress(OSError):
                        slot.tasks.send_bytes(pickle.dumps(None))
        _resolve(dropped)
        self._wake()
        self._collector.join(timeout)
        if self._collector.is_alive():
            self._kill_all(("closed", -1))
            self._collector.join()
        with self._lock:
            deferred, self._deferred = self._deferred, []
        _resolve(deferred)  # cancels the collector did not get to
        self._release()

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- submission helpers (lock held) ----------------------------------------------------

    def _live_slots(self) -> list[_Slot]:
        return [s for s in self._slots.values() if s is not None and not s.dead]

    def _kept_live(self) -> list[_Slot]:
        """The live workers the pool keeps (not retired by a resize)."""
        return [s for s in self._slots.values() if s is not None and not s.dead and not s.retiring]

    def _held(self) -> int:
        """The workers the pool holds: ``size`` (or the kept workers, before the collector
        applies a shrink) plus the retired ones not yet ended."""
        retiring = sum(1 for s in self._slots.values() if s is not None and s.retiring)
        return retiring + max(self._size, len(self._slots) - retiring)

    def _code_for(self, item: WorkItem) -> tuple[bytes | None, tuple[str, str] | None]:
        """The code to ship for ``item`` and, if it cannot run, the error to answer with."""
        key = (item.function_id, item.code_sha256)
        cached = self._code_cache.get(key)
        if cached is not None:
            self._code_cache.move_to_end(key)
            return cached, None
        if item.code is None:
            return None, (
                CODE_REQUIRED,
                f"function {item.function_id} (sha256 {item.code_sha256}) is not cached "
                "in the worker pool: submit the item with its code",
            )
        digest = hashlib.sha256(item.code).hexdigest()
        if digest != item.code_sha256:
            return None, (
                CODE_HASH_MISMATCH,
                f"the code of function {item.function_id} hashes to sha256 {digest}, "
                f"not {item.code_sha256}",
            )
        self._code_cache[key] = item.code
        if len(self._code_cache) > self._code_cache_size:
            self._code_cache.popitem(last=False)
        return item.code, None

    def _dispatch(self) -> None:
        """Hand queued items to idle, started workers, a batch per worker."""
        while self._pending:
            idle = [s for s in self._kept_live() if s.ready and not s.outstanding]
            if not idle:
                return
            batch = self._take_batch(math.ceil(len(self._pending) / len(idle)))
            if batch:
                self._send(self._choose_worker(idle, batch[0].key), batch)

    def _choose_worker(self, idle: list[_Slot], key: FunctionKey) -> _Slot:
        for slot in idle:
            if key in slot.warm:
                return slot
        return min(idle, key=lambda s: len(s.warm))

    def _take_batch(self, share: int) -> list[_Task]:
        """Up to ``share`` queued items (at most max_batch); only short functions batch."""
        limit = min(share, self._max_batch)
        batch: list[_Task] = []
        while self._pending and len(batch) < limit:
            task = self._pending[0]
            if batch and not (self._is_short(batch[0]) and self._is_short(task)):
                break
            self._pending.popleft()
            if task.claimed or task.future.set_running_or_notify_cancel():
                task.claimed = True
                batch.append(task)
        return batch

    def _is_short(self, task: _Task) -> bool:
        return self._durations.get(task.item.function_id, math.inf) < self._short_task_s

    def _send(self, slot: _Slot, batch: list[_Task]) -> None:
        entries: list[Entry] = []
        wake = False
        for task in batch:
            item = task.item
            ship_code = task.force_code or task.key not in slot.warm
            self._mark_warm(slot, task.key)
            code = task.code if ship_code else None
            entries.append((task.seq, item.function_id, item.code_sha256, code, item.payload))
            task.force_code = False
            slot.outstanding[task.seq] = task
            if item.walltime_s is not None:
                self._walltime_items += 1
                wake = True
        # A dead worker cannot take them: its sentinel fires and the collector requeues them.
        with contextlib.suppress(OSError):
            slot.tasks.send_bytes(pickle.dumps(entries, pickle.HIGHEST_PROTOCOL))
        if wake:
            # The collector may be sleeping with no deadline: it must start timing these.
            self._wake()

    def _mark_warm(self, slot: _Slot, key: FunctionKey) -> None:
        # Mirrors the worker's LRU, which sees the same keys in the same order.
        slot.warm[key] = None
        slot.warm.move_to_end(key)
        if len(slot.warm) > self._function_cache_size:
            slot.warm.popitem(last=False)

    def _drop_pending(self, reason: str) -> list[_Resolution]:
        dropped: list[_Resolution] = []
        while self._pending:
            task = self._pending.popleft()
            if task.claimed or task.future.set_running_or_notify_cancel():
                dropped.append(_failure(task, POOL_CLOSED, reason))
        return dropped

    def _requeue(self, tasks: list[_Task], reason: str) -> list[_Resolution]:
        """Put items that never started back at the front (or fail them once closed)."""
        if self._closed:
            return [_failure(task, POOL_CLOSED, reason) for task in tasks]
        for task in tasks:
            # Everything queued was submitted after these were sent: submission order is
            # restored by sequence number, a short walk from the front.
            position = 0
            while position < len(self._pending) and self._pending[position].seq < task.seq:
                position += 1
            self._pending.insert(position, task)
        return []

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # --- the collector thread --------------------------------------------------------------

    def _collect(self) -> None:
        """The collector thread: start workers, read replies, watch deaths and walltimes."""
        try:
            for index in list(self._slots):
                self._start_worker(index)
            self._started.set()
            while not self._finished():
                timeout = self._next_timeout()
                for key, _ in self._selector.select(timeout):
                    self._on_event(key.data)
                self._respawn_due()
                self._apply_size()
        except BaseException:
            log.exception("the worker pool's collector failed; failing every task")
            self._fail_everything()
        finally:
            self._started.set()

    def _finished(self) -> bool:
        with self._lock:
            return self._closed and not any(self._slots.values())

    def _next_timeout(self) -> float | None:
        """How long select may sleep; also kills workers over their walltime."""
        deadlines = [at - time.monotonic() for at in self._respawn_at.values()]
        walltime_next = self._check_walltimes()
        if walltime_next is not None:
            deadlines.append(walltime_next)
        return max(0.0, min(deadlines)) if deadlines else None

    def _on_event(self, data: tuple[str, _Slot] | None) -> None:
        if data is None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            with self._lock:
                deferred, self._deferred = self._deferred, []
            _resolve(deferred)
            return
        kind, slot = data
        if slot.dead:
            return
        if kind == "exit":
            self._on_exit(slot, exited=True)
            return
        try:
            message = slot.results.recv_bytes()
        except (EOFError, OSError):
            self._on_exit(slot)
            return
        if not self._on_message_checked(slot, message):
            # Garbage on the pipe (a task wrote to an inherited descriptor?): this worker
            # cannot be trusted any more, but the pool and the other workers can.
            self._kill(slot, ("protocol", -1))
            self._on_exit(slot)

    def _on_message_checked(self, slot: _Slot, message: bytes) -> bool:
        """Handle a reply; False (and logged) if it is not one."""
        try:
            self._on_message(slot, message)
        except (pickle.UnpicklingError, ValueError, TypeError, EOFError):
            log.exception("worker %d sent an unreadable reply", slot.pid)
            return False
        return True

    def _on_message(self, slot: _Slot, message: bytes) -> None:
        reply: tuple[Any, ...] = pickle.loads(message)
        if not isinstance(reply, tuple) or len(reply) not in (2, 11):
            raise ValueError(f"not a worker reply: {type(reply).__name__}")
        resolutions: list[_Resolution] = []
        with self._lock:
            if reply[0] == REPLY_READY:
                slot.ready = True
                self._start_failures = 0
            else:
                resolutions = self._on_reply(slot, reply)
            if slot.retiring and not slot.outstanding:
                self._stop_retired(slot)  # its last item is answered
            if not slot.dead:
                self._dispatch()
        _resolve(resolutions)

    def _on_reply(self, slot: _Slot, reply: tuple[Any, ...]) -> list[_Resolution]:
        seq, status, value, error_type, message, text, started, finished, cached, out, err = reply
        task = slot.outstanding.pop(seq, None)
        if task is None:
            return []
        if task.item.walltime_s is not None:
            self._walltime_items -= 1
        if not cached:
            slot.warm.pop(task.key, None)
        if status == REPLY_NEEDS_CODE:
            task.force_code = True
            return self._requeue([task], "the pool was closed before the task started")
        self._record_duration(task.item.function_id, finished - started)
        outcome = WorkOutcome(
            task_id=task.item.task_id,
            ok=status == REPLY_OK,
            value=value,
            error_type=error_type,
            error_message=message,
            traceback=text,
            worker=slot.worker_id,
            started_at=started,
            finished_at=finished,
            stdout=out,
            stderr=err,
        )
        return [(task.future, outcome)]

    def _record_duration(self, function_id: str, seconds: float) -> None:
        previous = self._durations.pop(function_id, None)
        if previous is not None:
            seconds = previous + _DURATION_WEIGHT * (seconds - previous)
        self._durations[function_id] = seconds  # re-inserted last: the dict is in LRU order
        if len(self._durations) > _MAX_TRACKED_FUNCTIONS:
            del self._durations[next(iter(self._durations))]

    # --- walltimes ---------------------------------------------------------------------------

    def _check_walltimes(self) -> float | None:
        """Kill workers whose running item is over its walltime; seconds until the next check."""
        next_check: float | None = None
        with self._lock:
            if not self._walltime_items:
                return None
            now = time.monotonic()
            for slot in self._live_slots():
                wait = self._check_walltime(slot, now)
                if wait is not None:
                    next_check = wait if next_check is None else min(next_check, wait)
        return next_check

    def _check_walltime(self, slot: _Slot, now: float) -> float | None:
        if not slot.outstanding or slot.kill_reason is not None:
            return None
        head = next(iter(slot.outstanding.values()))
        limit = head.item.walltime_s
        if limit is None:
            return None
        started = slot.started_monotonic(head.seq)
        if started is None:
            return _START_POLL_S  # about to start: poll until it has
        if now - started < limit:
            return started + limit - now
        self._kill(slot, ("walltime", head.seq))
        return None

    @staticmethod
    def _kill(slot: _Slot, reason: tuple[str, int]) -> None:
        """SIGKILL a worker and remember why, to word the outcome of what it ran."""
        if slot.kill_reason is None:
            slot.kill_reason = reason
        _kill_group(slot)

    # --- worker death and replacement ------------------------------------------------------

    def _on_exit(self, slot: _Slot, *, exited: bool = False) -> None:
        """A worker died (``exited``) or closed its pipe: reap it, settle its items, replace it."""
        with self._lock:
            slot.dead = True
        self._selector.unregister(slot.results)
        self._selector.unregister(slot.exit_fd)
        if not exited:
            # A pipe closes a moment before its process exits. (Not Process.join(timeout):
            # it waits on the sentinel pipe, which a task's child may hold open.)
            multiprocessing.connection.wait([slot.exit_fd], _EXIT_GRACE_S)
        # Kill what the task left running in the worker's group (or the worker itself, if
        # it closed its pipe yet lives on: it is of no more use).
        _kill_group(slot)
        slot.process.join()
        if slot.exit_fd != slot.process.sentinel:
            os.close(slot.exit_fd)
        for message in self._drain(slot):
            self._on_message_checked(slot, message)
        crash_dump = self._read_crash_dump(slot)
        if slot.sandbox is not None:
            shutil.rmtree(slot.sandbox, ignore_errors=True)
        with self._lock:
            slot.tasks.close()
            slot.results.close()
            if slot.retiring:  # retired by a resize: its place is gone
                del self._slots[slot.index]
            else:
                self._slots[slot.index] = None
            resolutions = self._settle(slot, crash_dump)
            replace = not self._closed and not slot.retiring
            if replace and not slot.ready:
                resolutions += self._note_start_failure(slot)
            self._dispatch()  # requeued items may fit an idle worker now
        _resolve(resolutions)
        if replace:
            self._schedule_respawn(slot)
        elif slot.retiring and self._on_retired is not None:
            self._on_retired()

    def _drain(self, slot: _Slot) -> list[bytes]:
        """Replies the worker wrote before it died."""
        # Non-blocking: a process the task forked may hold the pipe open, so EOF may never come.
        os.set_blocking(slot.results.fileno(), False)
        messages: list[bytes] = []
        while True:
            try:
                messages.append(slot.results.recv_bytes())
            except (EOFError, OSError):
                return messages

    def _read_crash_dump(self, slot: _Slot) -> str:
        try:
            with open(slot.crash_path, "rb") as dump:
                dump.seek(0, os.SEEK_END)
                dump.seek(max(0, dump.tell() - _MAX_CRASH_DUMP_BYTES))
                text = dump.read().decode("utf-8", "replace")
            os.unlink(slot.crash_path)
        except OSError:
            return ""
        return text

    def _settle(self, slot: _Slot, crash_dump: str) -> list[_Resolution]:
        """Resolve the item a dead worker was running; requeue those it never started."""
        tasks = list(slot.outstanding.values())
        slot.outstanding.clear()
        self._walltime_items -= sum(1 for t in tasks if t.item.walltime_s is not None)
        if not tasks:
            return []
        head = tasks[0]
        resolutions: list[_Resolution] = []
        if slot.running_seq() == head.seq:
            resolutions.append(self._lost(slot, head, crash_dump))
            tasks = tasks[1:]
        # A cancelled item that never started is not run elsewhere.
        for task in tasks:
            if task.cancelled:
                message = f"task {task.item.task_id} was cancelled before it started"
                resolutions.append(_failure(task, TASK_CANCELLED, message))
        tasks = [task for task in tasks if not task.cancelled]
        return resolutions + self._requeue(tasks, "the pool was closed before the task started")

    def _lost(self, slot: _Slot, task: _Task, crash_dump: str) -> _Resolution:
        how = _describe_exit(slot.process.exitcode)
        function_id = task.item.function_id
        started = float(slot.state[STATE_EPOCH])
        fields = {"worker": slot.worker_id, "started_at": started, "traceback": crash_dump}
        if slot.kill_reason == ("walltime", task.seq):
            message = (
                f"task exceeded its walltime of {task.item.walltime_s:g} s running function "
                f"{function_id}; worker {slot.pid} was killed"
            )
            return _failure(task, WALLTIME_EXCEEDED, message, **fields)
        if slot.kill_reason == ("cancelled", task.seq):
            message = (
                f"task {task.item.task_id} was cancelled while running function {function_id}; "
                f"worker {slot.pid} was killed"
            )
            return _failure(task, TASK_CANCELLED, message, **fields)
        if slot.kill_reason == ("closed", -1):
            message = (
                f"the pool was closed and worker {slot.pid} killed while running "
                f"function {function_id}"
            )
            return _failure(task, POOL_CLOSED, message, **fields)
        message = f"worker {slot.pid} died with {how} while running function {function_id}"
        if slot.kill_reason == ("protocol", -1):
            message = (
                f"worker {slot.pid} wrote an unreadable reply while running function "
                f"{function_id} and was killed"
            )
        log.warning("%s (task %s)", message, task.item.task_id)
        return _failure(task, WORKER_LOST, message, **fields)

    def _note_start_failure(self, slot: _Slot) -> list[_Resolution]:
        """Count workers that die before they are ready; fail queued work if they keep dying."""
        self._start_failures += 1
        how = _describe_exit(slot.process.exitcode)
        log.error("worker %d died during start-up with %s", slot.pid, how)
        if self._start_failures < _START_FAILURES_BEFORE_FAILING:
            return []
        reason = (
            f"{self._start_failures} workers in a row died during start-up "
            f"(the last with {how}); see the agent's stderr"
        )
        failed: list[_Resolution] = []
        while self._pending:
            task = self._pending.popleft()
            if task.claimed or task.future.set_running_or_notify_cancel():
                failed.append(_failure(task, WORKER_START_FAILED, reason))
        return failed

    def _schedule_respawn(self, slot: _Slot) -> None:
        delay = 0.0
        if self._start_failures:
            delay = min(_MAX_RESPAWN_DELAY_S, 0.1 * 2 ** (self._start_failures - 1))
        if delay == 0.0:
            self._start_worker(slot.index)
        else:
            self._respawn_at[slot.index] = time.monotonic() + delay

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for index, at in list(self._respawn_at.items()):
            if at <= now:
                del self._respawn_at[index]
                if not self._closed and index in self._slots:
                    self._start_worker(index)

    # --- resizing (the collector thread) ----------------------------------------------------

    def _apply_size(self) -> None:
        """Start or retire workers so the pool keeps ``size`` (after :meth:`resize`)."""
        with self._lock:
            if not self._resize_due or self._closed:
                return
            self._resize_due = False
            kept = [i for i, s in self._slots.items() if s is None or not s.retiring]
            start: list[int] = []
            if len(kept) > self._size:
                self._retire(kept, len(kept) - self._size)
            elif len(kept) < self._size:
                start = self._grow(self._size - len(kept))
        for index in start:
            self._start_worker(index)

    def _retire(self, kept: list[int], count: int) -> None:
        """Retire ``count`` of the ``kept`` workers, the cheapest to lose first (lock held)."""
        for index in sorted(kept, key=self._retire_order)[:count]:
            slot = self._slots[index]
            if slot is None:  # not started, or awaiting its respawn: nothing runs
                del self._slots[index]
                self._respawn_at.pop(index, None)
                continue
            slot.retiring = True
            if not slot.outstanding:
                self._stop_retired(slot)

    def _retire_order(self, index: int) -> tuple[int, int, int]:
        """Which worker a shrink retires first (smallest first; lock held): none running,
        then starting up, then idle (fewest functions warm), then busy (fewest items held);
        the newest first among equals."""
        slot = self._slots[index]
        if slot is None:
            return (0, 0, -index)
        if not slot.ready:
            return (1, 0, -index)
        if not slot.outstanding:
            return (2, len(slot.warm), -index)
        return (3, len(slot.outstanding), -index)

    def _grow(self, count: int) -> list[int]:
        """Keep ``count`` more workers (lock held): retired ones not yet asked to stop are
        kept again (warm), the rest are new indices the caller starts."""
        for slot in self._live_slots():
            if count and slot.retiring and not slot.stop_sent:
                slot.retiring = False
                count -= 1
        start = [next(self._indices) for _ in range(count)]
        self._slots.update(dict.fromkeys(start))
        return start

    @staticmethod
    def _stop_retired(slot: _Slot) -> None:
        """Ask a retired worker that holds no item to stop (lock held); its exit is seen
        by the collector like any other."""
        if slot.stop_sent:
            return
        slot.stop_sent = True
        # A worker dead already cannot take it: its sentinel fires all the same.
        with contextlib.suppress(OSError):
            slot.tasks.send_bytes(pickle.dumps(None))

    def _start_worker(self, index: int) -> None:
        """Start a worker for slot ``index`` (on the collector thread: see _die_with_parent)."""
        try:
            slot = self._spawn(index)
        except OSError as exc:
            log.error("cannot start a worker process: %s", exc)
            with self._lock:
                self._start_failures += 1
            self._respawn_at[index] = time.monotonic() + _MAX_RESPAWN_DELAY_S
            return
        self._selector.register(slot.results, selectors.EVENT_READ, ("reply", slot))
        self._selector.register(slot.exit_fd, selectors.EVENT_READ, ("exit", slot))
        with self._lock:
            self._slots[index] = slot
            if self._closed:  # closed while it started: it missed the stop message
                with contextlib.suppress(OSError):
                    slot.tasks.send_bytes(pickle.dumps(None))

    def _spawn(self, index: int) -> _Slot:
        if self._runtime is not None:
            return self._launch(index, self._runtime)
        tasks_r, tasks_w = self._context.Pipe(duplex=False)
        results_r, results_w = self._context.Pipe(duplex=False)
        state = self._context.RawArray("d", 3)
        state[STATE_SEQ] = -1
        crash_path = os.path.join(self._crash_dir, f"worker-{next(self._spawn_count)}.txt")
        # Only a spawned worker's parent is this process (a forkserver's is the server).
        parent_pid = os.getpid() if self._start_method == "spawn" else None
        process = self._context.Process(
            target=worker_main,
            args=(
                tasks_r,
                results_w,
                state,
                self._runner,
                parent_pid,
                crash_path,
                self._function_cache_size,
            ),
            name=f"fxstream-worker-{index}",
        )
        try:
            process.start()
        except BaseException:
            for connection in (tasks_r, tasks_w, results_r, results_w):
                connection.close()
            raise
        finally:
            # The worker holds its own ends now; closing ours lets EOF mean "it is gone".
            tasks_r.close()
            results_w.close()
        return _Slot(index, process, tasks_w, results_r, state, crash_path, self._host)

    def _launch(self, index: int, runtime: Runtime) -> _Slot:
        """Start a worker by the runtime's command line (see the module notes)."""
        number = next(self._spawn_count)
        sandbox = os.path.join(self._crash_dir, f"worker-{number}")
        os.mkdir(sandbox, 0o700)
        state_path = os.path.join(sandbox, "state")
        with open(state_path, "wb") as state_file:
            state_file.write(bytes(STATE_BYTES))
        state = map_state(state_path)
        state[STATE_SEQ] = -1
        crash_path = os.path.join(sandbox, "crash.txt")
        channel = (3, 4) if runtime.passes_fds else (0, 1)
        argv = [self._python.executable, "-m", "fxstream.agent.worker_process"]
        argv += ["--tasks-fd", str(channel[0]), "--results-fd", str(channel[1])]
        argv += ["--state", state_path, "--crash", crash_path]
        if runtime.name == "process":  # in a container the parent is the runtime
            argv += ["--parent-pid", str(os.getpid())]
        env = dict(os.environ)
        if self._python.executable != sys.executable:
            env.pop("PYTHONHOME", None)  # the agent's, not this interpreter's
        env["PYTHONPATH"] = os.pathsep.join(self._python.sys_path)
        launch = WorkerLaunch(
            argv=tuple(argv),
            env=env,
            sandbox=sandbox,
            name=f"fxstream-worker-{self._instance}-{number}",
            readonly=self._readonly,
            writable=(sandbox, *self._writable),
            fds=2 if runtime.passes_fds else 0,
        )
        command = runtime.command(launch, self._image)
        tasks_r, tasks_w = os.pipe()
        results_r, results_w = os.pipe()
        try:
            process = _LaunchedWorker(
                command,
                runtime.environment(launch),
                {tasks_r: channel[0], results_w: channel[1]},
                runtime.stop_command(launch),
            )
        except BaseException:
            for fd in (tasks_w, results_r):
                os.close(fd)
            shutil.rmtree(sandbox, ignore_errors=True)
            raise
        finally:
            # The worker holds its own ends now; closing ours lets EOF mean "it is gone".
            os.close(tasks_r)
            os.close(results_w)
        tasks = Connection(tasks_w, readable=False)
        results = Connection(results_r, writable=False)
        # Never on the command line: a runner may hold a store's password. A worker that
        # died already is seen by the collector (its pidfd), not here.
        with contextlib.suppress(OSError):
            tasks.send_bytes(
                pickle.dumps((self._runner, self._function_cache_size), pickle.HIGHEST_PROTOCOL)
            )
        return _Slot(index, process, tasks, results, state, crash_path, self._host, sandbox)

    # --- shutdown ----------------------------------------------------------------------------

    def _kill_all(self, reason: tuple[str, int]) -> None:
        with self._lock:
            for slot in self._live_slots():
                self._kill(slot, reason)

    def _fail_everything(self) -> None:
        """Last resort when the collector itself fails: no future may hang."""
        with self._lock:
            self._closed = True
            resolutions = self._drop_pending("the worker pool failed")
            resolutions += self._deferred
            self._deferred = []
            for slot in self._live_slots():
                _kill_group(slot)
                for task in slot.outstanding.values():
                    resolutions.append(_failure(task, POOL_CLOSED, "the worker pool failed"))
                slot.outstanding.clear()
        _resolve(resolutions)

    def _release(self) -> None:
        """Reap every process and free the pool's descriptors and files (after the collector)."""
        for slot in list(self._slots.values()):
            if slot is not None:
                _kill_group(slot)
                slot.process.join()
                if slot.exit_fd != slot.process.sentinel:
                    with contextlib.suppress(OSError):
                        os.close(slot.exit_fd)
                slot.tasks.close()
                slot.results.close()
        self._slots = {}
        with contextlib.suppress(KeyError, ValueError):
            self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        shutil.rmtree(self._crash_dir, ignore_errors=True)
        atexit.unregister(self._close_at_exit)

    def _close_at_exit(self) -> None:
        self.close(timeout=1.0)


WorkerPool = ProcessEngine
"""The process engine's name from before there were engines (kept for existing callers)."""
