"""The tasks an agent holds: taken off its queue and not yet answered durably.

A task is *held* from the moment the agent takes its dispatch off Kafka until
its answer is handed to the transactional publisher (or it is handed back,
uncommitted, on a rebalance or a stop). While held, a task is in exactly one
place: the bounded *local queue* (decoded, its code at hand, waiting for the
engine), the *engine*, a *retry backoff*, or the *wait for its function's code*
(the service is down). Its lease is in every heartbeat
(:meth:`HeldTasks.leases`), and its queue offset stays uncommitted.

:class:`HeldTasks` is that state, behind one lock: the poll thread takes tasks
and cancels, the engine's thread answers them and feeds the engine, and each
method is one atomic step of either. It also keeps the assignment *epoch*
(bumped when partitions are revoked or lost): answers to tasks taken in an
earlier epoch are dropped by the publisher, their partition having a new owner.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from fxstream.agent.engine import PoolRoom
from fxstream.agent.pick import DEFAULT_MAX_IMAGE_WAIT_S, LocalQueue
from fxstream.topics import Attempt, TaskDispatch, TaskLease, TaskSubmission

__all__ = ["CancelClaim", "Held", "HeldTasks"]


@dataclass(frozen=True)
class Held:
    """A task taken off the queue and not yet answered durably."""

    partition: int
    offset: int
    dispatch: TaskDispatch
    submission: TaskSubmission
    dequeued_at: float
    size: int
    code_sha256: str = ""
    code: bytes = b""
    # The allowed image its function's container names, or the interpreter pool of its
    # Python version (None: the endpoint's default).
    image: str | None = None
    # This agent's attempt number (the dispatch's, then one more per local retry) and
    # the failed attempts before it, oldest first.
    attempt: int = 1
    earlier: tuple[Attempt, ...] = ()
    # The assignment epoch it was taken in (see TransactionalPublisher).
    epoch: int = 0

    @property
    def task_id(self) -> str:
        """The task's id."""
        return self.submission.task_id


@dataclass(frozen=True)
class CancelClaim:
    """What :meth:`HeldTasks.claim_cancel` found for a cancel.

    ``held`` is the task held under that id (``None``: not held, answered
    already); ``refused`` is true when its submitter is another user than the
    cancel's (nothing was changed); ``waiting`` is the task taken out of the
    local queue, a retry backoff or the wait for its code, to be answered as
    cancelled now (``None``: it is in the engine, or not held).
    """

    held: Held | None
    refused: bool = False
    waiting: Held | None = None


class HeldTasks:
    """Every held task by id, where it waits, and the assignment epoch; thread-safe."""

    def __init__(self, max_image_wait_s: float = DEFAULT_MAX_IMAGE_WAIT_S) -> None:
        self._lock = threading.Lock()
        # Every held task by task id; the ones not yet given to the engine are also in
        # _queue, in arrival order (taken warm-first: fxstream.agent.pick).
        self._held: dict[str, Held] = {}
        self._queue: LocalQueue[Held] = LocalQueue(max_image_wait_s)
        self._queue_bytes = 0
        self._in_engine = 0
        # When each task in the engine was given to it (a lease's started_at), by task id.
        self._given_to_engine: dict[str, float] = {}
        # Tasks whose function's code the service could not give yet (it is down).
        self._awaiting_code: list[Held] = []
        # Tasks waiting out a retry backoff: (due on the monotonic clock, tie-break, task).
        self._retries: list[tuple[float, int, Held]] = []
        self._retry_order = itertools.count()
        # Held tasks a cancel asked to stop (task id -> reason), until they are answered.
        self._cancelled: dict[str, str] = {}
        self._epoch = 0

    # --- reading -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current assignment epoch (tasks taken now carry it)."""
        return self._epoch

    @property
    def queued(self) -> int:
        """Tasks in the local queue (read without the lock: a hint for the poll size)."""
        return len(self._queue)

    def queued_images(self) -> list[str | None]:
        """The images of the tasks in the local queue (for the engine's room)."""
        with self._lock:
            return self._queue.images()

    def queue_size(self) -> tuple[int, int]:
        """The local queue's length in tasks and in bytes."""
        with self._lock:
            return len(self._queue), self._queue_bytes

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._held)

    def is_current(self, held: Held) -> bool:
        """Whether ``held`` is still the held version of its task (not handed back,
        answered or replaced meanwhile)."""
        with self._lock:
            return self._held.get(held.task_id) is held

    def leases(self, limit: int) -> tuple[list[TaskLease], bool]:
        """The tasks held now (at most ``limit``), and whether more were left out."""
        with self._lock:
            held = list(itertools.islice(self._held.values(), limit))
            truncated = len(self._held) > limit
            started = dict(self._given_to_engine)
        leases = [
            TaskLease(
                task_id=h.submission.task_id,
                user_id=h.submission.user_id,
                function_id=h.submission.function_id,
                task_group_id=h.submission.task_group_id,
                attempt=h.dispatch.attempt,
                started_at=started.get(h.submission.task_id),
            )
            for h in held
        ]
        return leases, truncated

    # --- taking tasks (the poll thread) ------------------------------------------------

    def hold(self, held: Held) -> Held | None:
        """Hold a task just taken off the queue; or, when the same task is held from this
        epoch already (a redelivery), return that one and hold nothing: one run answers
        both. A task held from an earlier epoch is answered nowhere: this one replaces it."""
        with self._lock:
            earlier = self._held.get(held.task_id)
            if earlier is not None and earlier.epoch == held.epoch:
                return earlier
            self._held[held.task_id] = held
            return None

    def enqueue(self, held: Held) -> None:
        """Put a held task, its code now at hand, at the end of the local queue (unless it
        was handed back or replaced by a later delivery meanwhile)."""
        with self._lock:
            current = self._held.get(held.task_id)
            if current is None or (current.offset, current.epoch) != (held.offset, held.epoch):
                return
            self._held[held.task_id] = held
            self._queue.append(held)
            self._queue_bytes += held.size

    def await_code(self, held: Held) -> None:
        """Park a held task until the service gives its function's code."""
        with self._lock:
            self._awaiting_code.append(held)

    @property
    def awaiting_code(self) -> bool:
        """Whether any task waits for its function's code (read without the lock)."""
        return bool(self._awaiting_code)

    def take_awaiting_code(self) -> list[Held]:
        """Every task waiting for its code (to try the fetch again), oldest first."""
        with self._lock:
            waiting, self._awaiting_code = self._awaiting_code, []
            return waiting

    def still_awaiting_code(self, still: list[Held]) -> None:
        """Park again, ahead of any parked since, tasks whose code is still unavailable."""
        with self._lock:
            self._awaiting_code = still + self._awaiting_code

    # --- cancels (the poll thread) -----------------------------------------------------

    def claim_cancel(self, task_id: str, reason: str, user_id: str) -> CancelClaim:
        """Mark a held task cancelled by ``user_id`` (see :class:`CancelClaim`).

        The dispatch's user is the router's (the broker-authenticated submitter), and
        so is the cancel's (the router forwards only its user's own cancels): another
        user's cancel changes nothing.
        """
        with self._lock:
            held = self._held.get(task_id)
            if held is None:
                return CancelClaim(None)
            if held.dispatch.user_id != user_id:
                return CancelClaim(held, refused=True)
            self._cancelled[task_id] = reason
            queued = self._queue.remove(task_id)
            if queued is not None:
                self._queue_bytes -= queued.size
                self._cancelled.pop(task_id, None)
            else:
                queued = self._take_waiting_retry(task_id)
            return CancelClaim(held, waiting=queued)

    def _take_waiting_retry(self, task_id: str) -> Held | None:
        """Take a task out of its retry backoff, or out of the wait for its function's
        code; the caller holds the lock."""
        for entry in self._retries:
            if entry[2].task_id == task_id:
                self._retries.remove(entry)
                heapq.heapify(self._retries)
                self._cancelled.pop(task_id, None)
                return entry[2]
        for held in self._awaiting_code:
            if held.task_id == task_id:
                self._awaiting_code.remove(held)
                self._cancelled.pop(task_id, None)
                return held
        return None

    def drop_cancel(self, task_id: str) -> None:
        """Forget a cancel that will not be carried out (the task runs on)."""
        with self._lock:
            self._cancelled.pop(task_id, None)

    def cancel_reason(self, task_id: str) -> str | None:
        """The reason a cancel gave for a held task, or None: a cancelled task is never
        retried."""
        if not self._cancelled:  # the common case, without the lock: nothing cancelled
            return None
        with self._lock:
            return self._cancelled.get(task_id)

    def pop_cancel(self, task_id: str) -> str | None:
        """The reason a cancel gave for a task now answered, forgetting it; or None."""
        if not self._cancelled:  # the common case, without the lock: nothing cancelled
            return None
        with self._lock:
            return self._cancelled.pop(task_id, None)

    # --- the engine (its thread, and the poll thread) ------------------------------------

    def next_for_engine(self, capacity: int, room: PoolRoom | None = None) -> Held | None:
        """The next task of the local queue for the engine, counted in it; None when the
        queue is empty, ``capacity`` tasks are in the engine already, or no queued task
        may go to the engine's pools now (``room``, the engine's: the warm-first pick of
        :mod:`fxstream.agent.pick`; None: the oldest task)."""
        with self._lock:
            if not self._queue or self._in_engine >= capacity:
                return None
            held = self._queue.take(room, time.monotonic())
            if held is None:
                return None
            self._queue_bytes -= held.size
            self._in_engine += 1
            self._given_to_engine[held.task_id] = time.time()
            return held

    def left_engine(self, held: Held) -> None:
        """The engine has answered ``held``."""
        with self._lock:
            self._in_engine -= 1
            self._given_to_engine.pop(held.task_id, None)

    def schedule_retry(self, retry: Held, due: float) -> bool:
        """Hold ``retry`` (the task's next attempt) in a backoff until ``due`` (monotonic
        clock); False when the task was handed back (a rebalance or a stop) while it ran."""
        with self._lock:
            if retry.task_id not in self._held:
                return False
            self._held[retry.task_id] = retry
            heapq.heappush(self._retries, (due, next(self._retry_order), retry))
            return True

    def requeue_due_retries(self) -> None:
        """Put retries whose backoff is over at the front of the local queue."""
        now = time.monotonic()
        with self._lock:
            while self._retries and self._retries[0][0] <= now:
                held = heapq.heappop(self._retries)[2]
                if self._held.get(held.task_id) is not held:
                    continue  # dropped by a rebalance or a stop meanwhile
                # Ahead of tasks not yet tried: it has waited its turn already.
                self._queue.appendleft(held)
                self._queue_bytes += held.size

    # --- letting go ----------------------------------------------------------------------

    def release(self, held: Held) -> None:
        """Stop holding ``held`` (answered: only its offset waits for the transaction), unless
        its task is held in another version now."""
        with self._lock:
            if self._held.get(held.task_id) is held:
                del self._held[held.task_id]

    def forget(self, task_id: str) -> None:
        """Stop holding a task whatever its version (handed back uncommitted)."""
        with self._lock:
            self._held.pop(task_id, None)

    def give_up(self, partitions: Collection[int]) -> None:
        """Partitions were revoked or lost: a new epoch begins, and their tasks not in the
        engine are handed back (uncommitted, the new owner gets them)."""
        with self._lock:
            self._epoch += 1
            self._unqueue(h for h in self._waiting() if h.partition in partitions)

    def hand_back_waiting(self) -> None:
        """Hand back every task not in the engine (stopping): uncommitted, the next agent
        gets them."""
        with self._lock:
            self._unqueue(self._waiting())

    def _waiting(self) -> list[Held]:
        return [*self._queue, *(r[2] for r in self._retries), *self._awaiting_code]

    def _unqueue(self, dropped: Iterable[Held]) -> None:
        """Forget tasks not in the engine; uncommitted, they are redelivered. The caller
        holds the lock."""
        gone = {held.task_id for held in dropped}
        if not gone:
            return
        for task_id in gone:
            self._held.pop(task_id, None)
            self._cancelled.pop(task_id, None)
        self._queue.retain(lambda h: h.task_id not in gone)
        self._queue_bytes = sum(h.size for h in self._queue)
        self._retries = [r for r in self._retries if r[2].task_id not in gone]
        heapq.heapify(self._retries)
        self._awaiting_code = [h for h in self._awaiting_code if h.task_id not in gone]
