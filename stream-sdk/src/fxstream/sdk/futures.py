"""Task futures, and the timings of a task's hops.

A :class:`TaskFuture` is a :class:`concurrent.futures.Future`, so ``wait``,
``as_completed`` and ``add_done_callback`` work as usual. It is resolved by the
Client's results listener when the task's result record arrives; it is never
polled.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
from typing import Any, Final

from fxstream.topics import TaskTimings

__all__ = ["TIMING_KEYS", "TaskFuture", "Timings", "timings_of"]

Timings = dict[str, float | None]
"""Hop name -> seconds since the Unix epoch (None for a hop not reported)."""

TIMING_KEYS: Final = (
    "submitted",
    "routed",
    "dequeued",
    "started",
    "finished",
    "result_published",
    "delivered",
)
"""The hops of a task, in order; ``delivered`` is when this SDK received the result."""


def timings_of(
    reported: TaskTimings | None, *, submitted: float | None, delivered: float | None
) -> Timings:
    """The timings dict from a record's :class:`TaskTimings` plus what this SDK saw itself.

    ``submitted`` is used when the record does not report ``submitted_at``.
    """
    t = reported if reported is not None else TaskTimings()
    return {
        "submitted": t.submitted_at if t.submitted_at is not None else submitted,
        "routed": t.routed_at,
        "dequeued": t.dequeued_at,
        "started": t.started_at,
        "finished": t.finished_at,
        "result_published": t.result_published_at,
        "delivered": delivered,
    }


class TaskFuture(Future[Any]):
    """The future of one submitted task.

    ``task_id``, ``function_id`` and ``endpoint_id`` name the task;
    ``timings`` (see :data:`TIMING_KEYS`) is filled in when the result
    arrives; ``worker`` and ``attempt`` say where and on which attempt it ran.
    ``duplicates`` counts further result records for this task, which are
    ignored (a result is delivered once).

    Cancelling a future whose task was already sent to Kafka only stops this
    future from waiting: there is no remote cancel yet, so the task may still
    run, and its result is discarded.
    """

    def __init__(
        self, task_id: str, *, function_id: str, endpoint_id: str, submitted_at: float
    ) -> None:
        super().__init__()
        self.task_id = task_id
        self.function_id = function_id
        self.endpoint_id = endpoint_id
        self.timings: Timings = timings_of(None, submitted=submitted_at, delivered=None)
        self.worker: str | None = None
        self.attempt: int | None = None
        self.duplicates = 0

    def cancel(self) -> bool:
        """Cancel the future unless it is done; True if it is now cancelled.

        Unlike a plain ``Future``, it is at once reported to ``wait`` and
        ``as_completed`` (no executor worker is going to pick it up to notice).
        """
        if self.cancelled():
            return True
        if not super().cancel():
            return False
        # CANCELLED -> CANCELLED_AND_NOTIFIED: what concurrent.futures.wait counts as done.
        # A concurrent cancel may have notified already; that is still cancelled.
        with contextlib.suppress(RuntimeError):
            self.set_running_or_notify_cancel()
        return True

    def _resolve_result(self, value: Any) -> bool:
        """Set the result unless the future is already done or cancelled; True if it was set."""
        try:
            self.set_result(value)
        except InvalidStateError:
            return False
        return True

    def _resolve_exception(self, exc: BaseException) -> bool:
        """Set the exception unless the future is already done or cancelled."""
        try:
            self.set_exception(exc)
        except InvalidStateError:
            return False
        return True

    def __repr__(self) -> str:
        base = super().__repr__()
        return f"{base[:-1]} task_id={self.task_id}>"
