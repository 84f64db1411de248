"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

The agent (:class:`Agent`, run by ``fxstream-endpoint start``) pulls its
endpoint's queue into a bounded local queue, runs tasks on an
:class:`~fxstream.agent.engine.Engine` (the first: warm worker processes,
:mod:`fxstream.agent.process_engine`), and commits each result with its queue
offset in one Kafka transaction (:mod:`fxstream.agent.publisher`), never past
an unanswered task (:mod:`fxstream.agent.offsets`). See docs/architecture.md.

The names below are imported from their modules on first use: a worker process (which
imports this package to load :mod:`fxstream.agent.worker_process`) and
``fxstream-endpoint configure`` must not pay for the agent's Kafka clients and
connectors at every start.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxstream.agent.agent import (
        Agent,
    )
    from fxstream.agent.batch_engine import BatchEngine, BlockCounts
    from fxstream.agent.batch_settings import BatchSettings, BatchSettingsError
    from fxstream.agent.engine import (
        BLOCK_LOST,
        CODE_HASH_MISMATCH,
        CODE_REQUIRED,
        POOL_CLOSED,
        RESOURCES_UNAVAILABLE,
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
    from fxstream.agent.offsets import (
        OffsetTracker,
    )
    from fxstream.agent.process_engine import (
        ProcessEngine,
        WorkerPool,
    )
    from fxstream.agent.publisher import (
        Answer,
        PublisherFenced,
        TransactionalPublisher,
    )
    from fxstream.agent.worker_process import (
        DEFAULT_RUNNER,
        Call,
        Loader,
        RunnerSpec,
        load_pickled,
        resolve_runner,
    )

_MODULES = {
    "Agent": "fxstream.agent.agent",
    "BatchEngine": "fxstream.agent.batch_engine",
    "BlockCounts": "fxstream.agent.batch_engine",
    "BatchSettings": "fxstream.agent.batch_settings",
    "BatchSettingsError": "fxstream.agent.batch_settings",
    "BLOCK_LOST": "fxstream.agent.engine",
    "CODE_HASH_MISMATCH": "fxstream.agent.engine",
    "CODE_REQUIRED": "fxstream.agent.engine",
    "POOL_CLOSED": "fxstream.agent.engine",
    "RESOURCES_UNAVAILABLE": "fxstream.agent.engine",
    "RETRYABLE_ERRORS": "fxstream.agent.engine",
    "RUNNER_UNAVAILABLE": "fxstream.agent.engine",
    "TASK_CANCELLED": "fxstream.agent.engine",
    "WALLTIME_EXCEEDED": "fxstream.agent.engine",
    "WORKER_LOST": "fxstream.agent.engine",
    "WORKER_START_FAILED": "fxstream.agent.engine",
    "Engine": "fxstream.agent.engine",
    "EngineCounts": "fxstream.agent.engine",
    "WarmState": "fxstream.agent.engine",
    "WorkItem": "fxstream.agent.engine",
    "WorkOutcome": "fxstream.agent.engine",
    "OffsetTracker": "fxstream.agent.offsets",
    "ProcessEngine": "fxstream.agent.process_engine",
    "WorkerPool": "fxstream.agent.process_engine",
    "Answer": "fxstream.agent.publisher",
    "PublisherFenced": "fxstream.agent.publisher",
    "TransactionalPublisher": "fxstream.agent.publisher",
    "DEFAULT_RUNNER": "fxstream.agent.worker_process",
    "Call": "fxstream.agent.worker_process",
    "Loader": "fxstream.agent.worker_process",
    "RunnerSpec": "fxstream.agent.worker_process",
    "load_pickled": "fxstream.agent.worker_process",
    "resolve_runner": "fxstream.agent.worker_process",
}

__all__ = [
    "BLOCK_LOST",
    "CODE_HASH_MISMATCH",
    "CODE_REQUIRED",
    "DEFAULT_RUNNER",
    "POOL_CLOSED",
    "RESOURCES_UNAVAILABLE",
    "RETRYABLE_ERRORS",
    "RUNNER_UNAVAILABLE",
    "TASK_CANCELLED",
    "WALLTIME_EXCEEDED",
    "WORKER_LOST",
    "WORKER_START_FAILED",
    "Agent",
    "Answer",
    "BatchEngine",
    "BatchSettings",
    "BatchSettingsError",
    "BlockCounts",
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


def __getattr__(name: str) -> Any:
    """Import one of the package's names from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
