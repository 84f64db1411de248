"""Task futures, and the timings of a task's hops.

A :class:`TaskFuture` is a :class:`concurrent.futures.Future`, so ``wait``,
``as_completed`` and ``add_done_callback`` work as usual. It is resolved by the
Client's results listener when the task's result record arrives; it is never
polled for its result. Whether its task is running is asked of the service
(``GET /v1/tasks/{id}``, the caller's own tasks only) when :meth:`~TaskFuture.running`
is called, at most every 0.2 s per future: a
user's principal may read only its own results topic, not every user's task events.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Final

from fxstream.topics import TaskTimings

__all__ = ["TIMING_KEYS", "TaskFuture", "Timings", "timings_of"]

log = logging.getLogger(__name__)

# How often one future asks the service whether its task runs (running() in a loop).
_PROBE_INTERVAL_S: Final = 0.2
_RUNNING: Final = "running"

# concurrent.futures.Future's states (its _state values, stable since Python 3.2).
PENDING: Final = "PENDING"
RUNNING: Final = "RUNNING"
CANCELLED: Final = "CANCELLED"
CANCELLED_AND_NOTIFIED: Final = "CANCELLED_AND_NOTIFIED"
FINISHED: Final = "FINISHED"

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

    ``task_id``, ``function_id`` and ``endpoint_id`` name the task (for a task
    submitted with an endpoint group, ``candidates`` are the group and ``endpoint_id``
    becomes the endpoint the service chose once its result arrives);
    ``timings`` (see :data:`TIMING_KEYS`) is filled in when the result
    arrives; ``worker`` and ``attempt`` say where and on which attempt it ran, and
    ``stdout`` / ``stderr`` what the function printed there (through ``sys.stdout`` and
    ``sys.stderr``: the last 16 KiB of each, a line saying how much went before).
    ``duplicates`` counts further result records for this task, which are
    ignored (a result is delivered once).

    :meth:`cancel` follows ``concurrent.futures``: it returns False once the
    future is done or its task is running (:meth:`running` turns true when the
    service's task state says the task runs: its agent reported it started; the
    service is asked when :meth:`running` is called on a sent, pending future), and
    True otherwise, cancelling the future at once. If the task was
    already sent, a remote cancel follows it (without waiting for Kafka): the
    agent holding the task skips it if it is still queued, and its
    ``TaskCancelled`` answer is discarded. Stopping a running task is an explicit
    call, ``Executor.kill(future)`` or ``Client.cancel(task_id)``.
    A task cancelled from elsewhere (``Client.cancel`` in another process) ends
    this future the same way: :meth:`cancelled` is True and :meth:`result`
    raises ``concurrent.futures.CancelledError``, as for any cancelled future;
    :attr:`cancelled_remotely` tells the two apart. A task that finished before
    its cancel reached it keeps its result.

    Known gap: :meth:`cancel` knows the task runs only once :meth:`running` saw it
    (a user's principal may not read the task events, so nothing pushes it), and the
    running report reaches the service's task state after the task started, so a
    task cancelled in that first period is not yet known to run; its remote cancel
    then stops its worker, as ``kill`` would.
    """

    def __init__(
        self, task_id: str, *, function_id: str, endpoint_id: str, submitted_at: float
    ) -> None:
        super().__init__()
        self.task_id = task_id
        self.function_id = function_id
        self.endpoint_id = endpoint_id
        # A grouped task: every endpoint the router may have sent it to (its cancels go
        # to each); empty for a task that names one endpoint.
        self.candidates: tuple[str, ...] = ()
        # The tags it was submitted with (Client.get_tasks filters on them).
        self.tags: dict[str, str] = {}
        self.timings: Timings = timings_of(None, submitted=submitted_at, delivered=None)
        self.worker: str | None = None
        self.attempt: int | None = None
        # What the function printed (the tail; fxstream.topics.budget.OUTPUT_MAX_BYTES).
        self.stdout = ""
        self.stderr = ""
        self.duplicates = 0
        self.cancelled_remotely = False
        # Set by the Client: sends this task's remote cancel (never blocks).
        self._remote_cancel: Callable[[TaskFuture], None] | None = None
        # Set by the Client: the service's state name of this task (or None if unknown).
        self._state_probe: Callable[[TaskFuture], str | None] | None = None
        self._probed_at = float("-inf")
        self._sent = False
        self._sent_lock = threading.Lock()
        # Objects its arguments put in the proxy store: released once its result is consumed.
        self._stored: list[Any] = []
        # Set once another task depends on this one (a TaskFuture passed as an argument):
        # a result passed by reference then stays in the store for the child to read,
        # instead of being evicted once this client has read it.
        self._keep_result = False

    def cancel(self) -> bool:
        """Cancel the future unless it is done or running; True if it is now cancelled.

        Unlike a plain ``Future``, it is at once reported to ``wait`` and
        ``as_completed`` (no executor worker is going to pick it up to notice). It does
        not ask the service (``shutdown(cancel_futures=True)`` cancels thousands at once):
        it refuses once :meth:`running` has seen the task run.
        """
        if not self._cancel_here():
            return False
        with self._sent_lock:
            sent = self._sent
        remote_cancel = self._remote_cancel
        if sent and remote_cancel is not None and not self.cancelled_remotely:
            self._remote_cancel = None  # once is enough
            try:
                remote_cancel(self)
            except Exception:  # cancel() must not raise; the task then runs on, discarded
                log.warning("cannot send the remote cancel of task %s", self.task_id, exc_info=True)
        return True

    def running(self) -> bool:
        """True while the task runs (asked of the service for a sent, pending future)."""
        self._refresh_running()
        return super().running()

    def _refresh_running(self) -> None:
        """Move PENDING -> RUNNING if the service says the sent task runs (rate-limited)."""
        probe = self._state_probe
        if probe is None or self.done():
            return
        with self._sent_lock:
            if not self._sent:
                return
        with self._condition:
            if self._state != PENDING:
                return
            now = time.monotonic()
            if now - self._probed_at < _PROBE_INTERVAL_S:
                return
            self._probed_at = now
        try:
            state = probe(self)
        except Exception:  # running() must not raise: the future simply stays pending
            log.debug("cannot ask the service for task %s's state", self.task_id, exc_info=True)
            return
        if state == _RUNNING:
            self._mark_running()

    def _cancel_here(self) -> bool:
        """Cancel this future only (no remote cancel); True if it is cancelled now."""
        if self.cancelled():
            return True
        if not super().cancel():
            return False
        # CANCELLED -> CANCELLED_AND_NOTIFIED: what concurrent.futures.wait counts as done.
        # A concurrent cancel may have notified already; that is still cancelled.
        with contextlib.suppress(RuntimeError):
            self.set_running_or_notify_cancel()
        return True

    def _cancel_unsent(self) -> bool:
        """Cancel the future if its task was not sent yet (the sender then skips it)."""
        with self._sent_lock:
            if self._sent:
                return False
            return self._cancel_here()

    def _mark_running(self) -> bool:
        """The platform reports the task running: PENDING -> RUNNING (True if it moved)."""
        with self._condition:
            if self._state != PENDING:
                return False
            self._state = RUNNING
            return True

    def _force_cancel(self) -> bool:
        """End the future cancelled even if RUNNING (its task was killed); False if done."""
        with self._condition:
            if self._state in (FINISHED, CANCELLED, CANCELLED_AND_NOTIFIED):
                return self._state != FINISHED
            was_running = self._state == RUNNING
        if not was_running:
            return self._cancel_here()
        with self._condition:
            if self._state != RUNNING:
                return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED)
            # What Future.cancel and set_running_or_notify_cancel do, from RUNNING.
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]
        return True

    def _mark_sent(self) -> bool:
        """Note that the task is about to be produced; False (send nothing) if cancelled.

        With :meth:`cancel` checking the flag under the same lock, a cancel racing
        the send either stops the send or sees it and sends a remote cancel.
        """
        with self._sent_lock:
            if self.cancelled():
                return False
            self._sent = True
            return True

    def _resolve_cancelled_remotely(self) -> bool:
        """End the future as cancelled because its task was (a ``TaskCancelled`` result)."""
        if self.done():
            return False
        self.cancelled_remotely = True
        if self._force_cancel():
            return True
        self.cancelled_remotely = False
        return False

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
