"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

Built so far: the warm worker pool (:mod:`fxstream.agent.workers`) and the
offset bookkeeping for committing after results are durable
(:mod:`fxstream.agent.offsets`). The agent loop itself is not built yet; see
docs/architecture.md.
"""

from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.workers import (
    CODE_HASH_MISMATCH,
    CODE_REQUIRED,
    DEFAULT_RUNNER,
    POOL_CLOSED,
    RETRYABLE_ERRORS,
    RUNNER_UNAVAILABLE,
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
    "WALLTIME_EXCEEDED",
    "WORKER_LOST",
    "WORKER_START_FAILED",
    "Call",
    "Loader",
    "OffsetTracker",
    "RunnerSpec",
    "WorkItem",
    "WorkOutcome",
    "WorkerPool",
    "load_pickled",
    "resolve_runner",
]
