"""The batch engine: tasks run in Parsl's HighThroughputExecutor, on blocks a provider makes.

An endpoint with ``engine: htex`` (:mod:`fxstream.agent.batch_settings`) gets this
engine instead of the process engine. Like Globus Compute's own engine, it drives a
Parsl ``HighThroughputExecutor`` without a Parsl DataFlowKernel: the executor's
interchange (a process of the agent's) hands tasks to the workers of its *blocks*,
each block one job of the provider (local processes, or a Slurm, PBS Pro, ... job),
and Parsl's ``JobStatusPoller`` runs its scaling strategy every
``strategy_period_s``: blocks are added while tasks wait beyond the idle workers (up
to ``max_blocks``) and a block idle for ``max_idletime_s`` is released (down to
``min_blocks``). A block the scheduler kills (``scancel``, its walltime) fails its
running tasks with Parsl's ``ManagerLost``: here a ``BlockLost`` outcome, which the
agent retries even for a task submitted without ``max_retries`` (never the task's
doing), on a new block the strategy starts.

What the engine sends Parsl for a task is :func:`fxstream.agent.batch_worker.run_item`
and bytes: the runner (which may hold the proxy store's password) is in a 0600 file
of the run directory, read by the workers (so that directory must be on a file
system the compute nodes share, as Parsl's own run directory must).

**MPI mode** (``batch.mpi``, :class:`~fxstream.agent.batch_settings.MpiSettings`): the
executor is Parsl's HighThroughputExecutor set up as Parsl's own ``MPIExecutor`` sets it
(``enable_mpi_mode``, its ``mpi_launcher``, one worker per concurrent MPI task and the
``SimpleLauncher``; that class itself is not used since it takes the interchange's
command as one string). Each item's ``resources`` (``num_nodes``, ``ranks_per_node``,
``num_ranks``) is its Parsl ``resource_specification``: the block's worker pool
(Parsl's ``MPITaskScheduler``) gives the task that many of the block's nodes, holds it
back until they are free, and sets ``$PARSL_MPI_PREFIX`` (``mpiexec -n .. -ppn ..
-hosts ..`` or ``srun ...``) in the worker before the function runs, which an
``MPIFunction`` puts before its command. An item that asks for more nodes than a block
has, or none, resolves at once as ``ResourcesUnavailable`` (the agent refuses those
before: :meth:`fxstream.agent.config.EndpointConfig.resource_refusal`).

Not the process engine's equal yet (written down in docs/architecture.md):

* **cancel** of a task a worker already runs resolves its future at once, but the
  worker runs it to its end (HTEX cannot stop one task); its result is dropped.
* **walltime** interrupts the function with ``SIGALRM`` at its next Python
  instruction (:mod:`fxstream.agent.batch_worker`), so a function blocked in C code
  runs on until it returns.
* **warm state** is learnt from results (which worker ran which function), not asked
  of the workers; one image for all the workers (below), not a pool per image.

**Containers** (the endpoint's ``runtime`` and ``image``, :class:`BlockContainer`): as
Globus Compute's engine does, the container wraps the command each block runs, Parsl's
worker pool: ``bwrap ... -- python -m ...process_worker_pool ...`` (or ``podman run``,
``apptainer exec``: :mod:`fxstream.agent.containers`), so the pool and every worker it
forks run in the image, with the agent's interpreter and sources bound read-only and
only the run directory (and the endpoint's writable directories) writable; the network
is the host's, which the pool needs to reach the interchange. A block's job killed by
the scheduler takes its container with it (``--die-with-parent``).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from parsl.executors import HighThroughputExecutor
from parsl.executors.high_throughput.errors import ManagerLost
from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD
from parsl.executors.high_throughput.mpi_prefix_composer import validate_resource_spec
from parsl.jobs.job_status_poller import JobStatusPoller
from parsl.jobs.states import JobState

from fxstream.agent.batch_settings import BatchSettings
from fxstream.agent.batch_worker import WalltimeExceeded, run_item, write_runner_file
from fxstream.agent.containers import ContainerError, Image, Runtime, WorkerLaunch
from fxstream.agent.engine import (
    BLOCK_LOST,
    CODE_REQUIRED,
    POOL_CLOSED,
    RESOURCES_UNAVAILABLE,
    RUNNER_UNAVAILABLE,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    EngineCounts,
    PoolRoom,
    WarmState,
    WorkItem,
    WorkOutcome,
)
from fxstream.agent.python_envs import PythonInterpreter
from fxstream.agent.worker_process import RunnerSpec

__all__ = ["BatchEngine", "BlockContainer", "BlockCounts"]

log = logging.getLogger(__name__)

_MANAGERS_TTL_S: Final = 1.0
_CODE_CACHE: Final = 256
_WARM_FUNCTIONS: Final = 32
_WARM_FORGET_S: Final = 600.0
_LIVE_STATES: Final = frozenset({JobState.PENDING, JobState.RUNNING, JobState.UNKNOWN})
_INTERCHANGE: Final = "parsl.executors.high_throughput.interchange"
_WORKER_POOL: Final = "parsl.executors.high_throughput.process_worker_pool"


@dataclass(frozen=True, slots=True)
class BlockContainer:
    """The container every block's worker pool runs in: ``runtime`` with ``image``, the
    host paths the workers read (``readonly``, besides the agent's interpreter and
    sources) and may write (``writable``, besides the run directory)."""

    runtime: Runtime
    image: Image
    readonly: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()

    def launch_cmd(self, run_dir: Path) -> str:
        """Parsl's worker-pool launch command (a ``str.format`` template) run inside the
        container; ``ContainerError`` when the runtime cannot run here."""
        why = self.runtime.unavailable()
        if why is not None:
            raise ContainerError(why)
        python = PythonInterpreter.current()
        sandbox = str(run_dir / "workers")
        Path(sandbox).mkdir(parents=True, exist_ok=True, mode=0o700)
        launch = WorkerLaunch(
            argv=(sys.executable, "-m", _WORKER_POOL),
            env={},  # the job's own environment (a runtime passes names, never values)
            sandbox=sandbox,
            name=f"fxstream-block-{run_dir.name}",
            readonly=(*python.paths, *self.readonly),
            writable=(str(run_dir), *self.writable),
            fds=0,
        )
        command = " ".join(shlex.quote(part) for part in self.runtime.command(launch, self.image))
        # Parsl formats the template with the pool's options: keep the command's own braces.
        escaped = command.replace("{", "{{").replace("}", "}}")
        return DEFAULT_LAUNCH_CMD.replace("process_worker_pool.py", escaped, 1)


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """The engine's blocks now: submitted and waiting in the scheduler's queue, running,
    and running with no task on any of their workers."""

    pending: int
    running: int
    idle: int


class _MpiHighThroughputExecutor(HighThroughputExecutor):
    """HTEX in Parsl's MPI mode: what ``parsl.executors.MPIExecutor`` configures, with
    its resource specifications checked by Parsl's own MPI validator."""

    def validate_resource_spec(self, resource_specification: dict[str, Any]) -> None:
        """Parsl's MPI check: known keys only, and a specification is required."""
        validate_resource_spec(resource_specification)


@dataclass
class _Pending:
    item: WorkItem
    future: Future[WorkOutcome]
    submitted_at: float


class BatchEngine:
    """Runs work items through Parsl's HighThroughputExecutor (see the module notes)."""

    def __init__(
        self,
        settings: BatchSettings,
        runner: RunnerSpec,
        run_dir: Path,
        *,
        label: str = "fxstream",
        container: BlockContainer | None = None,
    ) -> None:
        settings.validate()
        self._settings = settings
        self._run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._runner_file = run_dir / "runner.pickle"
        write_runner_file(self._runner_file, runner)
        provider = settings.build_provider()
        scripts = run_dir / "submit_scripts"
        scripts.mkdir(exist_ok=True, mode=0o700)
        provider.script_dir = str(scripts)
        mpi = settings.mpi
        executor_class = HighThroughputExecutor if mpi is None else _MpiHighThroughputExecutor
        self._executor = executor_class(
            label=label,
            provider=provider,
            address=settings.address,
            # MPI mode: one worker per concurrent MPI task on the block's first node, as
            # MPIExecutor sets it (cores_per_worker tiny, so the cap is what counts).
            max_workers_per_node=(
                settings.max_workers_per_node if mpi is None else settings.mpi_tasks_per_block
            ),
            cores_per_worker=settings.cores_per_worker if mpi is None else 1e-9,
            encrypted=True,
            worker_logdir_root=str(run_dir / "workers"),
            # Workers and interchange notice a lost peer in seconds, not Parsl's 2 minutes.
            heartbeat_period=5,
            heartbeat_threshold=20,
            # By this interpreter's path, not Parsl's scripts on PATH (the agent's PATH
            # need not hold its virtualenv's bin directory; a block's job shares its files).
            interchange_launch_cmd=[sys.executable, "-m", _INTERCHANGE],
            launch_cmd=(
                DEFAULT_LAUNCH_CMD.replace(
                    "process_worker_pool.py", f"{shlex.quote(sys.executable)} -m {_WORKER_POOL}", 1
                )
                if container is None
                else container.launch_cmd(run_dir)
            ),
        )
        self._executor.run_dir = str(run_dir)
        if mpi is not None:  # read when the executor starts (its workers' launch command)
            self._executor.enable_mpi_mode = True
            self._executor.mpi_launcher = mpi.launcher
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._codes: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._warm: dict[str, tuple[OrderedDict[str, None], float]] = {}
        self._managers: list[dict[str, Any]] = []
        self._managers_at = 0.0
        self._closed = False
        # Every future resolves here: never on a caller's thread, never under the lock.
        self._resolver = ThreadPoolExecutor(1, thread_name_prefix="batch-engine-resolve")
        self._executor.start()  # type: ignore[no-untyped-call]
        strategy = settings.strategy
        self._poller = JobStatusPoller(
            strategy=strategy,
            max_idletime=settings.max_idletime_s,
            strategy_period=settings.strategy_period_s,
        )
        self._poller.add_executors([self._executor])

    @property
    def name(self) -> str:
        """``"htex"``, as an endpoint config names this engine."""
        return "htex"

    @property
    def run_dir(self) -> Path:
        """Where the executor keeps its logs, submit scripts and the runner file."""
        return self._run_dir

    # --- the Engine protocol --------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until a block's workers have connected; at once when the engine keeps no
        block while idle (``min_blocks`` 0: an idle block is released, so none need be
        up); False if ``timeout`` passed first."""
        if self._settings.min_blocks == 0:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if any(m.get("worker_count", 0) > 0 for m in self._connected(fresh=True)):
                return True
            time.sleep(0.2)
        return False

    def submit(self, item: WorkItem) -> Future[WorkOutcome]:
        """Queue ``item`` on the executor; the future resolves with its outcome."""
        if item.walltime_s is not None and item.walltime_s <= 0:
            raise ValueError("walltime_s must be positive")
        future: Future[WorkOutcome] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the batch engine is closed")
            code = self._code_for(item)
            self._pending[item.task_id] = _Pending(item, future, time.time())
        if code is None:
            self._resolve(
                item.task_id,
                WorkOutcome.failure(
                    item,
                    CODE_REQUIRED,
                    "the batch engine was given no code for this function and has none cached",
                ),
            )
            return future
        num_nodes = None if item.resources is None else item.resources.get("num_nodes")
        refusal = self._settings.resource_refusal(num_nodes)
        if refusal is not None:
            self._resolve(item.task_id, WorkOutcome.failure(item, RESOURCES_UNAVAILABLE, refusal))
            return future
        try:
            inner = self._executor.submit(
                run_item,
                dict(item.resources or {}),
                str(self._runner_file),
                item.function_id,
                item.code_sha256,
                code,
                item.payload,
                item.walltime_s,
            )
        except Exception as exc:  # the executor is in a bad state: a platform failure
            self._resolve(item.task_id, WorkOutcome.failure(item, WORKER_LOST, _describe(exc)))
            return future
        inner.add_done_callback(lambda done: self._on_done(item, done))
        return future

    def cancel(self, task_id: str, reason: str = "", *, kill: bool = True) -> bool:
        """Resolve ``task_id``'s future as cancelled. A task a worker already runs runs on
        to its end (its result is dropped), so with ``kill`` False nothing is done: the
        engine cannot tell whether a worker has started it."""
        if not kill:
            return False
        with self._lock:
            pending = self._pending.get(task_id)
        if pending is None:
            return False
        message = f"cancelled: {reason}" if reason else "cancelled"
        return self._resolve(task_id, WorkOutcome.failure(pending.item, TASK_CANCELLED, message))

    def counts(self) -> EngineCounts:
        """Connected workers, how many hold a task, the tasks not yet at a worker, and the
        blocks (:meth:`blocks`)."""
        managers = self._connected()
        total = sum(int(m.get("worker_count", 0)) for m in managers)
        busy = min(total, sum(int(m.get("tasks", 0)) for m in managers))
        with self._lock:
            outstanding = len(self._pending)
        blocks = self.blocks()
        return EngineCounts(
            workers_total=total,
            workers_idle=total - busy,
            workers_busy=busy,
            queued=max(0, outstanding - busy),
            blocks_pending=blocks.pending,
            blocks_running=blocks.running,
            blocks_idle=blocks.idle,
        )

    def blocks(self) -> BlockCounts:
        """Blocks pending, running, and running with every worker idle.

        A block runs once its workers' manager has connected (the interchange says so at
        once); the provider's own view (``squeue``, polled by Parsl every minute for
        Slurm) only says which submitted blocks are not over yet: those not connected
        are pending.
        """
        managers = self._connected()
        connected = {str(m.get("block_id")) for m in managers}
        busy = {str(m.get("block_id")) for m in managers if m.get("tasks", 0)}
        live = {
            block
            for block, status in self._executor.status_facade.items()
            if status.state in _LIVE_STATES
        }
        return BlockCounts(
            pending=len(live - connected),
            running=len(connected),
            idle=len(connected - busy),
        )

    def warm(self) -> list[WarmState]:
        """Each worker that returned a result lately, with the functions it ran."""
        now = time.monotonic()
        with self._lock:
            for worker in [w for w, (_, seen) in self._warm.items() if now - seen > _WARM_FORGET_S]:
                del self._warm[worker]
            idle = not self._pending
            return [
                WarmState(worker_id=worker, function_ids=tuple(functions), idle=idle)
                for worker, (functions, _) in self._warm.items()
            ]

    def room(self, wanted: Collection[str | None] = ()) -> PoolRoom | None:
        """``None``: one pool, so tasks are handed over in arrival order."""
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Release every block, stop the interchange, and fail what has not finished with
        a ``PoolClosed`` outcome; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            left = list(self._pending.values())
        for pending in left:
            self._resolve(
                pending.item.task_id,
                WorkOutcome.failure(
                    pending.item, POOL_CLOSED, "the endpoint's batch engine was closed"
                ),
            )
        try:
            self._poller.close(timeout)  # scales every block in (scancel, kill)
        finally:
            try:
                self._executor.shutdown(timeout=timeout)
            finally:
                self._resolver.shutdown(wait=True)

    # --- internals ---------------------------------------------------------------------------

    def _code_for(self, item: WorkItem) -> bytes | None:
        key = (item.function_id, item.code_sha256)
        if item.code is not None:
            self._codes[key] = item.code
            self._codes.move_to_end(key)
            if len(self._codes) > _CODE_CACHE:
                self._codes.popitem(last=False)
            return item.code
        code = self._codes.get(key)
        if code is not None:
            self._codes.move_to_end(key)
        return code

    def _connected(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        now = time.monotonic()
        if fresh or now - self._managers_at > _MANAGERS_TTL_S:
            try:
                managers = self._executor.connected_managers()
            except Exception as exc:  # the interchange is gone or slow: say so, keep last
                log.warning("the batch engine's interchange did not answer: %s", exc)
                managers = self._managers
            self._managers, self._managers_at = list(managers), now
        return self._managers

    def _on_done(self, item: WorkItem, done: Future[Any]) -> None:
        exc = done.exception()
        if exc is None:
            ok, value, error_type, message, text, started, finished, worker, out, err = (
                done.result()
            )
            self._note_warm(worker, item.function_id)
            outcome = WorkOutcome(
                task_id=item.task_id,
                ok=ok,
                value=value,
                error_type=error_type,
                error_message=message,
                traceback=text,
                worker=worker,
                started_at=started,
                finished_at=finished,
                stdout=out,
                stderr=err,
            )
        elif isinstance(exc, WalltimeExceeded):  # fired between the function and its reply
            outcome = WorkOutcome.failure(item, WALLTIME_EXCEEDED, "the task ran past its walltime")
        elif isinstance(exc, OSError | EOFError | ValueError) and not _is_parsl(exc):
            # run_item could not read the runner file: every task would fail the same way.
            outcome = WorkOutcome.failure(
                item,
                RUNNER_UNAVAILABLE,
                f"the batch workers cannot load the agent's runner ({_describe(exc)}): the "
                f"run directory {self._run_dir} must be on a file system the workers share",
            )
        elif isinstance(exc, ManagerLost):  # its block ended: scancel, walltime, a node
            outcome = WorkOutcome.failure(
                item, BLOCK_LOST, f"the task's block ended: {_describe(exc)}"
            )
        else:  # a lost worker process, or the executor failing
            outcome = WorkOutcome.failure(item, WORKER_LOST, _describe(exc))
        self._resolve(item.task_id, outcome)

    def _note_warm(self, worker: str, function_id: str) -> None:
        with self._lock:
            functions, _ = self._warm.get(worker, (OrderedDict(), 0.0))
            functions[function_id] = None
            functions.move_to_end(function_id)
            if len(functions) > _WARM_FUNCTIONS:
                functions.popitem(last=False)
            self._warm[worker] = (functions, time.monotonic())

    def _resolve(self, task_id: str, outcome: WorkOutcome) -> bool:
        """Resolve ``task_id``'s future with ``outcome`` on the resolver thread; False if
        it was resolved already (a cancel beat the result, or the other way round)."""
        with self._lock:
            pending = self._pending.pop(task_id, None)
        if pending is None:
            return False
        future = pending.future
        with contextlib.suppress(RuntimeError):  # after close: resolve here, as a last resort
            self._resolver.submit(future.set_result, outcome)
            return True
        future.set_result(outcome)
        return True


def _is_parsl(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("parsl.")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
