"""The run hop: the :class:`Engine` protocol every way of running tasks implements.

The agent hands each task to an engine as a :class:`WorkItem` and gets a
:class:`WorkOutcome` back through a future; it never learns how the engine runs
it. An engine may run tasks in warm local processes
(:class:`~fxstream.agent.process_engine.ProcessEngine`, the first engine), in
containers (bubblewrap, podman, Apptainer), or through a batch scheduler; an
endpoint (and later a function) names the engine it uses. The shape follows
Globus Compute's engines (``GlobusComputeEngineBase``: ``submit``, a status
report, ``shutdown``), written as a typed protocol in ProxyStore's style, so an
engine is any class with these methods (no base class to inherit).

What an engine promises the agent:

* :meth:`Engine.submit` never raises for a task's own failure: the future
  resolves with an error :class:`WorkOutcome` (a user exception, a lost worker,
  a walltime). Futures resolve, and their done-callbacks run, on the engine's
  own thread, never on the caller's: callbacks must be short.
* A failure the platform caused (``retryable``; :data:`RETRYABLE_ERRORS`) is
  told apart from the task's own, so the agent retries only what a retry may
  cure.
* :meth:`Engine.cancel` resolves the task's future with a :data:`TASK_CANCELLED`
  outcome (or leaves a started task alone when ``kill`` is false).
* :meth:`Engine.counts` and :meth:`Engine.warm` are cheap snapshots, taken for
  every heartbeat and warm advert; :meth:`Engine.room` is one too, taken for every
  task the agent hands over (which images' tasks it can start without a cold pool).

The error type names below are the engine's own; user exceptions keep their
type name. :data:`TASK_CANCELLED` is the same name as
``fxstream.topics.TaskErrorType.CANCELLED`` (engines stay free of the topics).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

__all__ = [
    "BLOCK_LOST",
    "CODE_HASH_MISMATCH",
    "CODE_REQUIRED",
    "POOL_CLOSED",
    "RESOURCES_UNAVAILABLE",
    "RETRYABLE_ERRORS",
    "RUNNER_UNAVAILABLE",
    "STAGING_FAILED",
    "STAGING_UNAVAILABLE",
    "TASK_CANCELLED",
    "WALLTIME_EXCEEDED",
    "WORKER_LOST",
    "WORKER_START_FAILED",
    "Engine",
    "EngineCounts",
    "PoolRoom",
    "WarmState",
    "WorkItem",
    "WorkOutcome",
]

# Error types an engine itself produces (user exceptions keep their own type name).
WORKER_LOST: Final = "WorkerLost"
# A batch engine's block (scheduler job) ended under the task; the same name as
# fxstream.topics.TaskErrorType.BLOCK_LOST.
BLOCK_LOST: Final = "BlockLost"
WALLTIME_EXCEEDED: Final = "WalltimeExceeded"
POOL_CLOSED: Final = "PoolClosed"
CODE_REQUIRED: Final = "CodeRequired"
CODE_HASH_MISMATCH: Final = "CodeHashMismatch"
RUNNER_UNAVAILABLE: Final = "RunnerUnavailable"
WORKER_START_FAILED: Final = "WorkerStartFailed"
# The same name as fxstream.topics.TaskErrorType.CANCELLED (engines stay free of topics).
TASK_CANCELLED: Final = "TaskCancelled"
# A staged file failed (fxstream.agent.staging): for good, or for now (a site unreachable);
# the same names as fxstream.topics.TaskErrorType.STAGING_FAILED and STAGING_UNAVAILABLE.
STAGING_FAILED: Final = "StagingFailed"
STAGING_UNAVAILABLE: Final = "StagingUnavailable"
# The same name as fxstream.topics.TaskErrorType.RESOURCES_UNAVAILABLE: the item's
# resources (an MPI task's nodes) cannot be had from this engine.
RESOURCES_UNAVAILABLE: Final = "ResourcesUnavailable"

RETRYABLE_ERRORS: Final = frozenset(
    {WORKER_LOST, BLOCK_LOST, POOL_CLOSED, WORKER_START_FAILED, STAGING_UNAVAILABLE}
)
"""Error types caused by the platform rather than the task: a retry may succeed."""


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One task for a worker: which function (and its code, if at hand) and its payload.

    ``code`` may be ``None`` when the engine has seen this function's code before
    (the process engine keeps a bounded cache of it); ``walltime_s`` bounds load
    plus run time; ``image`` names the container image the item must run in (its
    function's container; ``None``: the engine's default), or the pool of the
    interpreter of its Python version (:mod:`fxstream.agent.python_envs`: its path).
    ``resources`` is an MPI task's ``num_nodes``, ``ranks_per_node`` and ``num_ranks``
    (its submission's ``resource_specification``), for an engine with an MPI mode.
    """

    task_id: str
    function_id: str
    code_sha256: str
    code: bytes | None
    payload: bytes
    walltime_s: float | None = None
    image: str | None = None
    resources: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class WorkOutcome:
    """How one work item ended: a value, or an error with its type, message and traceback.

    On success ``error_type`` is ``None`` and the message and traceback are
    empty; on failure ``value`` is ``None`` or the raised exception as the runner
    serialized it (the agent forwards it for the client to raise). ``worker`` is ``"host:pid"`` of
    the worker that ran it (empty when none did); ``started_at`` and
    ``finished_at`` are epoch seconds, ``started_at`` is ``None`` when the item
    never started. Message and traceback fit a ``TaskError`` record as they are.
    ``stdout`` and ``stderr`` are the tail of what the function printed
    (:mod:`fxstream.agent.output_capture`), empty when it printed nothing or never ran.
    """

    task_id: str
    ok: bool
    value: bytes | None
    error_type: str | None
    error_message: str
    traceback: str
    worker: str
    started_at: float | None
    finished_at: float
    stdout: str = ""
    stderr: str = ""

    @property
    def retryable(self) -> bool:
        """Whether the failure came from the platform (a lost worker, say), not the task."""
        return self.error_type in RETRYABLE_ERRORS

    @classmethod
    def failure(cls, item: WorkItem, error_type: str, message: str) -> WorkOutcome:
        """``item`` failed now with ``error_type`` before a worker ran it (no traceback)."""
        return cls(
            task_id=item.task_id,
            ok=False,
            value=None,
            error_type=error_type,
            error_message=message,
            traceback="",
            worker="",
            started_at=None,
            finished_at=time.time(),
        )


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """An engine's load at one moment, as the heartbeat reports it.

    ``workers_total`` is the number of workers the engine keeps (started or
    not), ``workers_idle`` and ``workers_busy`` the live ones without and with
    work, ``queued`` the items submitted and not yet handed to a worker. An engine
    whose workers come in scheduler jobs (blocks) counts them too: submitted and waiting
    (``blocks_pending``), running, and running with every worker idle; 0 for the others.
    """

    workers_total: int
    workers_idle: int
    workers_busy: int
    queued: int
    blocks_pending: int = 0
    blocks_running: int = 0
    blocks_idle: int = 0


@dataclass(frozen=True, slots=True)
class WarmState:
    """What one live worker holds warm: the functions it has loaded, in its container.

    ``worker_id`` is ``"host:pid"`` (or the engine's own name for a worker);
    ``container`` is ``None`` for a worker outside any container (else its image's
    name); ``idle`` is True while it holds no task. The agent advertises these
    (``WarmAdvert``) whenever they change.
    """

    worker_id: str
    function_ids: tuple[str, ...]
    container: str | None = None
    idle: bool = False


@dataclass(frozen=True, slots=True)
class PoolRoom:
    """Which images' tasks an engine with pools per image can take now without a cold pool.

    ``free`` maps each image whose pool runs, is starting or is about to start (tasks
    wait for it) to how many more of its tasks it wants now (0: full, or being drained to
    make way for another image); an image absent from it has no pool, so its next task
    means a cold start. ``None`` names the default image (a task's ``WorkItem.image``
    ``None``), as does the default image's own name. ``spare`` is how many more pools may
    start without releasing one; ``blocked`` how many images' tasks wait for a pool to be
    released (the budget is spent and none is idle); ``unwanted`` how many running pools
    are of images the agent has no task queued for (each may make way for another
    image). The agent's warm-first pick (:mod:`fxstream.agent.pick`) reads it.
    """

    free: dict[str | None, int]
    spare: int
    blocked: int
    unwanted: int


@runtime_checkable
class Engine(Protocol):
    """Runs work items and reports on its workers; see the module notes for its promises."""

    @property
    def name(self) -> str:
        """The engine's kind as an endpoint config names it (``"process"``)."""
        ...

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the engine's workers have started; False if ``timeout`` passed first."""
        ...

    def submit(self, item: WorkItem) -> Future[WorkOutcome]:
        """Queue ``item``; the future resolves with its :class:`WorkOutcome`, never raises.

        Raises ``RuntimeError`` if the engine is closed and ``ValueError`` for an
        item it can never run (a non-positive walltime).
        """
        ...

    def cancel(self, task_id: str, reason: str = "", *, kill: bool = True) -> bool:
        """Cancel the item of ``task_id``; False when the engine does not hold it (or, with
        ``kill`` False, has started it already). A cancelled item's future resolves with a
        :data:`TASK_CANCELLED` outcome naming ``reason``."""
        ...

    def counts(self) -> EngineCounts:
        """The engine's workers and queue now."""
        ...

    def warm(self) -> list[WarmState]:
        """What each live worker holds warm now."""
        ...

    def room(self, wanted: Collection[str | None] = ()) -> PoolRoom | None:
        """Which images' tasks it can take without a cold pool, ``wanted`` being the images
        the agent has tasks queued for (a pool of another image makes way first);
        ``None`` when any task can (one pool, or room for every image's): the agent then
        hands tasks over in arrival order."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker, killing what still runs after ``timeout`` s; idempotent.

        Items that have not finished resolve with a :data:`POOL_CLOSED` outcome.
        Must not be called from a future's done-callback.
        """
        ...
