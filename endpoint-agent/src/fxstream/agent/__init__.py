"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

The agent (:class:`Agent`, run by ``fxstream-endpoint start``) pulls its
endpoint's queue into a bounded local queue, runs tasks in the warm worker pool
(:mod:`fxstream.agent.workers`), and commits each result with its queue offset
in one Kafka transaction (:mod:`fxstream.agent.publisher`), never past an
unanswered task (:mod:`fxstream.agent.offsets`). See docs/architecture.md.

The names below are imported from their modules on first use: a worker process (which
imports this package to load :mod:`fxstream.agent.workers`) and ``fxstream-endpoint
configure`` must not pay for the agent's Kafka clients and connectors at every start.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxstream.agent.agent import Agent
    from fxstream.agent.offsets import OffsetTracker
    from fxstream.agent.publisher import (
        Answer,
        PublisherFenced,
        TransactionalPublisher,
    )
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

_MODULES = {
    "Agent": "fxstream.agent.agent",
    "OffsetTracker": "fxstream.agent.offsets",
    "Answer": "fxstream.agent.publisher",
    "PublisherFenced": "fxstream.agent.publisher",
    "TransactionalPublisher": "fxstream.agent.publisher",
    "CODE_HASH_MISMATCH": "fxstream.agent.workers",
    "CODE_REQUIRED": "fxstream.agent.workers",
    "DEFAULT_RUNNER": "fxstream.agent.workers",
    "POOL_CLOSED": "fxstream.agent.workers",
    "RETRYABLE_ERRORS": "fxstream.agent.workers",
    "RUNNER_UNAVAILABLE": "fxstream.agent.workers",
    "TASK_CANCELLED": "fxstream.agent.workers",
    "WALLTIME_EXCEEDED": "fxstream.agent.workers",
    "WORKER_LOST": "fxstream.agent.workers",
    "WORKER_START_FAILED": "fxstream.agent.workers",
    "Call": "fxstream.agent.workers",
    "Loader": "fxstream.agent.workers",
    "RunnerSpec": "fxstream.agent.workers",
    "WorkerPool": "fxstream.agent.workers",
    "WorkItem": "fxstream.agent.workers",
    "WorkOutcome": "fxstream.agent.workers",
    "load_pickled": "fxstream.agent.workers",
    "resolve_runner": "fxstream.agent.workers",
}

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


def __getattr__(name: str) -> Any:
    """Import one of the package's names from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
