"""Feeding the engine: local queue -> engine, and each outcome to a retry or an answer.

The engine is given only as many tasks as it can start soon (``workers +
prefetch``, funcX's batching); the rest wait, decoded, in the local queue
(:class:`~fxstream.agent.held.HeldTasks`). When the engine answers (on its own
thread), the outcome is answered at once and the freed slot gets the next task
of the local queue: the poll thread is not in that path. Which task is next is the
warm-first pick's (:mod:`fxstream.agent.pick`): in arrival order, unless the engine
runs fewer image pools than images, when tasks of images whose pools run go first.

An outcome is final unless a retry may cure it: a platform failure (a lost
worker, ``retryable``) is retried up to the task's ``max_retries`` (a batch
engine's lost block, ``BlockLost``, at least :data:`BLOCK_LOSS_RETRIES` times), its own
exception or walltime only with ``retry_user_errors``, and a cancel, a result
too large or a refusal never. A retry waits out an exponential backoff
(``retry_backoff_s`` doubling up to ``retry_backoff_max_s``) while held, its
offset uncommitted and its lease renewed, so a crash meanwhile hands it to the
next agent; stopping hands it back at once. A cancel asked while a task ran
wins over whatever its worker's death looked like.

A task that declares staged files goes through the agent's
:class:`~fxstream.agent.staging.Stager` instead of straight to the engine: staged in, run,
staged out, in the stager's transfer slots; it holds its engine slot meanwhile. A
``StagingUnavailable`` failure is retried like a lost worker, ``StagingFailed`` never.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import Future

from fxstream.agent.answer import Answerer, cancelled_outcome, task_error
from fxstream.agent.config import EndpointConfig
from fxstream.agent.engine import BLOCK_LOST, Engine, WorkItem, WorkOutcome
from fxstream.agent.held import Held, HeldTasks
from fxstream.agent.staging import Stager
from fxstream.topics import Attempt, TaskErrorType, TaskStateName

__all__ = ["BLOCK_LOSS_RETRIES", "EngineFeed"]

BLOCK_LOSS_RETRIES = 3
"""Attempts after a lost block (a scheduler job ended under the task), whatever the task's
``max_retries``: a block's end is never the task's doing."""

log = logging.getLogger(__name__)

# Failures a retry cannot cure, even with retry_user_errors.
_NEVER_RETRIED = frozenset(
    {
        str(TaskErrorType.CANCELLED),
        str(TaskErrorType.RESULT_TOO_LARGE),
        str(TaskErrorType.NOT_ALLOWED),
        str(TaskErrorType.STAGING_FAILED),
        str(TaskErrorType.RESOURCES_UNAVAILABLE),
    }
)


class EngineFeed:
    """Feeds one agent's engine from its local queue and settles each outcome."""

    def __init__(
        self,
        config: EndpointConfig,
        engine: Engine,
        *,
        held: HeldTasks,
        answers: Answerer,
        stopping: threading.Event,
        hostname: str,
        stager: Stager | None = None,
    ) -> None:
        self._config = config
        self._engine = engine
        self._held = held
        self._answers = answers
        self._stop = stopping
        self._hostname = hostname
        self._stager = stager
        self.retries_scheduled = 0
        """Retries scheduled so far."""

    def _cancel_wins(self, held: Held, outcome: WorkOutcome) -> WorkOutcome:
        """The outcome to answer: a cancelled task's failure (say its worker died under the
        kill) is reported as the cancel, so it is never retried; a success stays one."""
        reason = self._held.pop_cancel(held.submission.task_id)
        if reason is None or outcome.ok or outcome.error_type == TaskErrorType.CANCELLED:
            return outcome
        return cancelled_outcome(held.submission, reason, started_at=outcome.started_at)

    def feed(self) -> None:
        """Give the engine tasks from the local queue, up to workers + prefetch in it."""
        engine = self._engine
        capacity = self._config.workers + self._config.prefetch
        self._held.requeue_due_retries()
        while True:
            # Warm-first when the engine's pools are fewer than its images (fxstream.agent.pick).
            room = engine.room(self._held.queued_images())
            held = self._held.next_for_engine(capacity, room)
            if held is None:
                return
            submission = held.submission
            item = WorkItem(
                task_id=submission.task_id,
                function_id=submission.function_id,
                code_sha256=held.code_sha256,
                code=held.code,
                payload=held.dispatch.submission,
                walltime_s=submission.walltime_s,
                image=held.image,
                resources=(
                    None
                    if submission.resource_specification is None
                    else submission.resource_specification.as_dict()
                ),
            )
            if self._stager is not None and Stager.wanted(submission):
                future = self._stager.run(
                    submission,
                    held.dispatch.user_id,
                    item,
                    engine,
                    functools.partial(self._held.cancel_reason, submission.task_id),
                )
            else:
                future = engine.submit(item)
            future.add_done_callback(functools.partial(self._finished, held))
            reason = self._held.cancel_reason(submission.task_id)
            if reason is not None:  # cancelled between the local queue and the engine
                engine.cancel(submission.task_id, reason)

    def _finished(self, held: Held, future: Future[WorkOutcome]) -> None:
        # On the engine's thread: answer at once, then give the slot new work.
        outcome = self._cancel_wins(held, future.result())
        self._held.left_engine(held)
        if not self._retry(held, outcome):
            self._answers.publish(held, outcome)
        self.feed()

    @staticmethod
    def _retry_limit(held: Held, outcome: WorkOutcome) -> int:
        limit = held.submission.max_retries
        if outcome.error_type == BLOCK_LOST:  # a scheduler job ended: never the task's doing
            limit = max(limit, BLOCK_LOSS_RETRIES)
        return limit

    def _should_retry(self, held: Held, outcome: WorkOutcome) -> bool:
        submission = held.submission
        if outcome.ok or len(held.earlier) >= self._retry_limit(held, outcome):
            return False
        if outcome.retryable:
            return True
        # A function's own exception (or its walltime) is retried only when asked for.
        return submission.retry_user_errors and outcome.error_type not in _NEVER_RETRIED

    def _retry(self, held: Held, outcome: WorkOutcome) -> bool:
        """Schedule another attempt after a backoff; False when the outcome is final.

        The task stays held (its offset uncommitted, its lease renewed), so a crash
        during the backoff hands it to the next agent rather than losing it.
        """
        if not self._should_retry(held, outcome):
            return False
        if self._stop.is_set():
            # Stopping: hand the task back uncommitted; the next agent runs it again.
            self._held.forget(held.submission.task_id)
            return True
        failed = Attempt(
            attempt=held.attempt,
            worker=outcome.worker or self._hostname,
            started_at=outcome.started_at,
            finished_at=outcome.finished_at,
            error=task_error(outcome),
        )
        retry = dataclasses.replace(held, attempt=held.attempt + 1, earlier=(*held.earlier, failed))
        delay = min(
            self._config.retry_backoff_s * 2 ** len(held.earlier), self._config.retry_backoff_max_s
        )
        if not self._held.schedule_retry(retry, time.monotonic() + delay):
            return True  # handed back (a rebalance or a stop) while it ran
        self.retries_scheduled += 1
        log.info(
            "task %s: attempt %d failed with %s; retry %d of %d in %.1f s",
            held.submission.task_id,
            held.attempt,
            outcome.error_type,
            len(retry.earlier),
            self._retry_limit(held, outcome),
            delay,
        )
        self._answers.announce(retry, TaskStateName.RETRYING, failed, f"retry in {delay:.1f} s")
        return True
