"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

The agent (:class:`Agent`, run by ``fxstream-endpoint start``) pulls its
endpoint's queue into a bounded local queue, runs tasks on an
:class:`~fxstream.agent.engine.Engine` (the first: warm worker processes,
:mod:`fxstream.agent.process_engine`), and commits each result with its queue
offset in one Kafka transaction (:mod:`fxstream.agent.publisher`), never past
an unanswered task (:mod:`fxstream.agent.offsets`). See docs/architecture.md.
"""

from fxstream.agent.agent import Agent
from fxstream.agent.engine import (
    CODE_HASH_MISMATCH,
    CODE_REQUIRED,
    POOL_CLOSED,
    RETRYABLE_ERRORS,
    RUNNER_UNAVAILABLE,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    WORKER_START_FAILED,
    Engine,
    EngineCounts,
    WarmState,
    WorkItem,
    WorkOutcome,
)
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.process_engine import ProcessEngine, WorkerPool
from fxstream.agent.publisher import Answer, PublisherFenced, TransactionalPublisher
from fxstream.agent.worker_process import (
    DEFAULT_RUNNER,
    Call,
    Loader,
    RunnerSpec,
    load_pickled,
    resolve_runner,
)

__all__ = [
    "CODE_HASH_MISMATCH",
    "CODE_REQUIRED",
    "DEFAULT_RUNNER",
    "POOL_CLOSED",
    "RETRYABLE_ERRORS",
    "RUNNER_UNAVAILABLE",
    "TASK_CANCELLED",
    "WALLTIME_EXCEEDED",
    "WORKER_LOST",
    "WORKER_START_FAILED",
    "Agent",
    "Answer",
    "Call",
    "Engine",
    "EngineCounts",
    "Loader",
    "OffsetTracker",
    "ProcessEngine",
    "PublisherFenced",
    "RunnerSpec",
    "TransactionalPublisher",
    "WarmState",
    "WorkItem",
    "WorkOutcome",
    "WorkerPool",
    "load_pickled",
    "resolve_runner",
]
