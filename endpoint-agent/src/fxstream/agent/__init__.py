"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

The agent (:class:`Agent`, run by ``fxstream-endpoint start``) pulls its
endpoint's queue into a bounded local queue, runs tasks in the warm worker pool
(:mod:`fxstream.agent.workers`), and commits each result with its queue offset
in one Kafka transaction (:mod:`fxstream.agent.publisher`), never past an
unanswered task (:mod:`fxstream.agent.offsets`). See docs/architecture.md.
"""

from fxstream.agent.agent import Agent
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.publisher import Answer, PublisherFenced, TransactionalPublisher
from fxstream.agent.workers import (
    CODE_HASH_MISMATCH,
    CODE_REQUIRED,
    DEFAULT_RUNNER,
    POOL_CLOSED,
    RETRYABLE_ERRORS,
    RUNNER_UNAVAILABLE,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    WORKER_START_FAILED,
    Call,
    Loader,
    RunnerSpec,
    WorkerPool,
    WorkItem,
    WorkOutcome,
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
    "Loader",
    "OffsetTracker",
    "PublisherFenced",
    "RunnerSpec",
    "TransactionalPublisher",
    "WorkItem",
    "WorkOutcome",
    "WorkerPool",
    "load_pickled",
    "resolve_runner",
]
