"""The task-state processor: fold results and task events into the compacted ``task-state``.

It follows every user's ``results.<user>`` topic (the users its view holds, by an
explicit subscription kept current, :class:`~fxstream.service.subscription.TopicFeed`:
a user registered after start is picked up within a second, without a restart) and
``task-events`` (steps announced by agents and the liveness processor). faust cannot
follow a changing set of topics (``app.topic(pattern=...)`` subscribes to no topic at
all and crashes the worker, faust-streaming 0.15.3), so this loop uses an aiokafka
consumer of its own inside the faust app, and writes through the app's producer.

Each record is a proposed step of a task's lifecycle
(:mod:`fxstream.service.lifecycle`): a result ends the task (succeeded,
failed, or cancelled for a ``TaskCancelled`` error), an event moves it
(running, retrying, waiting-for-endpoint, cancelled). The step is applied only
if the lifecycle allows it; the first terminal result per task wins, and later
ones are counted and dropped; impossible steps are dead-lettered. Every
attempt is kept in the state with its error and host.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]
from aiokafka.errors import CommitFailedError, IllegalStateError  # type: ignore[import-untyped]

from fxstream.service.batch_loop import StoppableLoop, offsets_after
from fxstream.service.lifecycle import (
    EVENT_STATES,
    TERMINAL_STATES,
    KnownTask,
    Recall,
    TaskMemory,
    known_from_state,
    may_follow,
)
from fxstream.service.liveness import COMPONENT as LIVENESS
from fxstream.service.outgoing import Outgoing
from fxstream.service.rebalance import CoPartitionedAssignor, PartitionGuard
from fxstream.service.registry import RegistryView
from fxstream.service.subscription import FEED_METADATA_MAX_AGE_MS, TopicFeed, follow
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetterReason,
    KafkaConnection,
    RawRecord,
    RecordDecodeError,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    dead_letter_for,
    decode,
    encode,
    fit_state,
)
from fxstream.topics.budget import ATTEMPT_MESSAGE_MAX_BYTES, bounded_error

__all__ = [
    "COMPONENT",
    "ResultsFollower",
    "TaskStatePlanner",
    "TaskStateStats",
    "fold_result",
    "recall_from",
    "results_pattern",
]

log = logging.getLogger(__name__)

COMPONENT = "task-state"
# Writes a batch's outputs; its inputs come along, to be dead-lettered if Kafka refuses
# the output one of them produced (see fxstream.service.quarantine).
Send = Callable[[Sequence[Outgoing], Sequence[RawRecord]], Awaitable[None]]
# A lone task's attempt history is kept to this many entries (the latest ones).
MAX_ATTEMPTS_KEPT = 50
# How long the processor waits, at start, for its task-state table to catch up.
CATCH_UP_S = 120.0


def recall_from(view: RegistryView) -> Recall:
    """A :class:`TaskMemory` recall that reads a task's state from ``view``'s on-disk
    task-state table (a view following ``task-state``)."""

    def recall(task_id: str) -> KnownTask | None:
        state = view.task(task_id)
        return None if state is None else known_from_state(state)

    return recall


def results_pattern(catalogue: Catalogue) -> str:
    """The regular expression matching every user's results topic of this deployment."""
    return "^" + re.escape(catalogue.prefix + "results.") + r"[A-Za-z0-9][A-Za-z0-9-]*$"


def _attempt_of(result: TaskResult) -> Attempt:
    return Attempt(
        attempt=result.attempt,
        worker=result.worker,
        started_at=result.timings.started_at,
        finished_at=result.timings.finished_at,
        error=result.error,
    )


def _merge_attempts(known: Sequence[Attempt], more: Sequence[Attempt]) -> list[Attempt]:
    """``known`` then those of ``more`` not already in it (an agent reports a retried
    attempt twice: in its retrying event and in the final result's history)."""
    merged = list(known)
    seen = {(a.attempt, a.worker, a.started_at) for a in merged}
    for attempt in more:
        if (attempt.attempt, attempt.worker, attempt.started_at) not in seen:
            merged.append(attempt)
    return merged[-MAX_ATTEMPTS_KEPT:]


def _error_once(attempts: list[Attempt], error: TaskError | None) -> list[Attempt]:
    """``attempts`` with the state's own ``error`` kept in full only once: the attempt
    that carries it keeps its type and the head of its message, no traceback."""
    if error is None:
        return attempts
    summary = bounded_error(error, message_bytes=ATTEMPT_MESSAGE_MAX_BYTES, traceback_bytes=0)
    return [msgspec.structs.replace(a, error=summary) if a.error == error else a for a in attempts]


def _event_timings(known: TaskTimings | None, event: TaskEvent) -> TaskTimings:
    """The timings a state written for ``event`` keeps: the submitted and routed times
    known before it (the router's), and the start of the attempt the event names."""
    started = event.attempt.started_at if event.attempt else None
    return TaskTimings(
        submitted_at=known.submitted_at if known else None,
        routed_at=known.routed_at if known else None,
        started_at=started,
    )


def _terminal_state(result: TaskResult) -> TaskStateName:
    if result.outcome == "success":
        return TaskStateName.SUCCEEDED
    if result.error is not None and result.error.type == TaskErrorType.CANCELLED:
        return TaskStateName.CANCELLED
    return TaskStateName.FAILED


def fold_result(
    result: TaskResult,
    now: float,
    earlier: Sequence[Attempt] = (),
    tags: Mapping[str, str] | None = None,
) -> TaskState:
    """The terminal task state one result stands for, with every attempt: ``earlier``
    (known before the result), the result's own history, then the result's attempt.
    Its tags are the result's (the agent copies the submission's), else ``tags``."""
    state = _terminal_state(result)
    succeeded = state is TaskStateName.SUCCEEDED
    attempts = _merge_attempts(earlier, [*result.earlier_attempts, _attempt_of(result)])
    error = None if succeeded else result.error
    return TaskState(
        task_id=result.task_id,
        user_id=result.user_id,
        function_id=result.function_id,
        endpoint_id=result.endpoint_id,
        task_group_id=result.task_group_id,
        state=state,
        updated_at=now,
        timings=result.timings,
        attempts=_error_once(attempts, error),
        error=error,
        value=result.value if succeeded else None,
        tags=result.tags or dict(tags or {}),
    )


@dataclass
class TaskStateStats:
    """Counts since start, logged at shutdown."""

    folded: int = 0
    events_applied: int = 0
    duplicates: int = 0
    stale: int = 0
    impossible: int = 0
    rejections_skipped: int = 0
    values_dropped: int = 0
    dead_lettered: int = 0


@dataclass
class TaskStatePlanner:
    """Decides what to write to task-state (and dead-letter) for a batch of input records."""

    catalogue: Catalogue
    memory: TaskMemory = field(default_factory=TaskMemory)
    clock: Callable[[], float] = time.time
    stats: TaskStateStats = field(default_factory=TaskStateStats)
    lookup: Callable[[str], TaskState | None] | None = None
    """Reads a task's state from task-state (``RegistryView.task``): what a state written
    for a task event keeps of the one before it (tags, submitted and routed times), and a
    result from an agent that sends no tags takes them from."""

    def __post_init__(self) -> None:
        self._state_limit = self.catalogue.spec("task-state").max_message_bytes

    def plan(self, records: Sequence[RawRecord]) -> list[Outgoing]:
        """The task-state and dead-letter records for ``records`` (results and events)."""
        out: list[Outgoing] = []
        now = self.clock()
        for record in records:
            try:
                if record.topic == self.catalogue.task_events:
                    self._plan_event(out, record, decode(record.value, TaskEvent), now)
                else:
                    self._plan_result(out, record, decode(record.value, TaskResult), now)
            except RecordDecodeError as exc:
                self._dead_letter(out, record, str(exc), DeadLetterReason.DECODE_ERROR)
            except Exception as exc:  # a bug here must cost one record, not the processor
                log.exception("task-state: cannot fold %s@%d", record.topic, record.offset)
                self._dead_letter(
                    out, record, f"task-state failed: {exc!r}", DeadLetterReason.TASK_STATE_ERROR
                )
        return out

    # --- results -------------------------------------------------------------------------

    def _plan_result(
        self, out: list[Outgoing], record: RawRecord, result: TaskResult, now: float
    ) -> None:
        if result.error is not None and result.error.type == TaskErrorType.REJECTED:
            # The router refused it and wrote the rejected state itself; folding this
            # into "failed" would overwrite it.
            self.stats.rejections_skipped += 1
            return
        if record.topic != self.catalogue.results(result.user_id):
            self._dead_letter(
                out,
                record,
                f"a result of user {result.user_id!r} on {record.topic!r}: results belong on "
                f"their user's own topic {self.catalogue.results(result.user_id)!r}",
                DeadLetterReason.MISPLACED_RESULT,
            )
            return
        known = self.memory.get(result.task_id)
        if known is not None and known.state in TERMINAL_STATES:
            self.stats.duplicates += 1
            log.info(
                "task-state: duplicate result for task %s (attempt %d) ignored; the first "
                "(%s) stands",
                result.task_id,
                result.attempt,
                known.state,
            )
            return
        # An agent older than tags sends none: the router's copy then.
        before = None if result.tags else self._state_before(result.task_id)
        state = fold_result(
            result, now, known.attempts if known else (), before.tags if before else None
        )
        self._write(out, state)
        self.memory.put(result.task_id, KnownTask(state.state, result.attempt))
        self.stats.folded += 1

    # --- events --------------------------------------------------------------------------

    def _plan_event(
        self, out: list[Outgoing], record: RawRecord, event: TaskEvent, now: float
    ) -> None:
        if event.state not in EVENT_STATES:
            allowed = ", ".join(sorted(EVENT_STATES))
            self._impossible(out, record, f"a task event may announce only {allowed}")
            return
        known = self.memory.get(event.task_id)
        current = known.state if known else TaskStateName.ROUTED
        if current is TaskStateName.WAITING_FOR_PARENTS:
            # Only a dispatched task has events: it was released and routed since, by a
            # state this processor's view has not read yet (issue 15's task DAGs).
            current = TaskStateName.ROUTED
        number = event.attempt.attempt if event.attempt else (known.attempt if known else 1)
        if current in TERMINAL_STATES:
            if event.source == LIVENESS or (known is not None and number < known.attempt):
                self.stats.stale += 1
                return
            self._impossible(
                out,
                record,
                f"impossible transition {current} -> {event.state} for task {event.task_id} "
                f"(attempt {number}, from {event.source}): the task had already ended",
            )
            return
        if known is not None and current == event.state and number == known.attempt:
            return  # the same step announced again (a lease renewal, a redelivery)
        if not may_follow(current, event.state):
            self._impossible(out, record, f"impossible transition {current} -> {event.state}")
            return
        attempts = list(known.attempts) if known else []
        if event.attempt is not None and event.attempt.error is not None:
            attempts = _merge_attempts(attempts, [event.attempt])
        # An event carries neither tags nor the router's timings: the state it follows does.
        before = self._state_before(event.task_id)
        timings = _event_timings(before.timings if before else None, event)
        state = TaskState(
            task_id=event.task_id,
            user_id=event.user_id,
            function_id=event.function_id,
            endpoint_id=event.endpoint_id,
            task_group_id=event.task_group_id,
            state=event.state,
            updated_at=now,
            timings=timings,
            attempts=_error_once(attempts, event.attempt.error if event.attempt else None),
            error=event.attempt.error if event.attempt else None,
            tags=before.tags if before else {},
        )
        self._write(out, state)
        self.memory.put(event.task_id, KnownTask(event.state, number, tuple(attempts)))
        self.stats.events_applied += 1

    def _state_before(self, task_id: str) -> TaskState | None:
        """The task's state as ``lookup`` (this processor's view of task-state) holds it:
        whichever state it is, its tags and its submitted and routed times are the router's
        (they never change). None without a lookup or before the view has the task."""
        return None if self.lookup is None else self.lookup(task_id)

    # --- writing -------------------------------------------------------------------------

    def _write(self, out: list[Outgoing], state: TaskState) -> None:
        key = state.task_id.encode()
        # Fitted to the topic by construction: a value that does not fit stays on the
        # user's results topic (status shows the outcome only), and errors and attempts
        # shrink (tracebacks, then messages, then the oldest attempts).
        fitted = fit_state(state, self._state_limit, key=key)
        if fitted.value is None and state.value is not None:
            self.stats.values_dropped += 1
        out.append(Outgoing(self.catalogue.task_state, key, encode(fitted)))

    def _impossible(self, out: list[Outgoing], record: RawRecord, reason: str) -> None:
        self.stats.impossible += 1
        self._dead_letter(out, record, reason, DeadLetterReason.IMPOSSIBLE_TRANSITION)

    def _dead_letter(
        self, out: list[Outgoing], record: RawRecord, reason: str, error_type: DeadLetterReason
    ) -> None:
        letter = dead_letter_for(record, reason=reason, error_type=error_type, component=COMPONENT)
        out.append(Outgoing(self.catalogue.dead_letter, letter.original_key, encode(letter)))
        self.stats.dead_lettered += 1
        log.warning(
            "task-state: dead-lettered %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            reason,
        )


class ResultsFollower(StoppableLoop):
    """Consumes every results topic (by name) and task-events in batches, plans, writes,
    then commits.

    Offsets are committed only after the batch's writes are acknowledged, so a
    crash re-reads (at least once) and never skips a result. An input whose output
    Kafka refuses (a folded state over the topic's limit, say) is dead-lettered by
    ``send`` and the batch committed: the processor moves on instead of stopping.
    ``states`` is the view of task-state the planner's memory recalls from
    (``recall_from``): it is started, and read to its end, before the first batch, and
    closed at the end.

    Several followers run as one consumer group (one per task-state process). Partitions
    are assigned co-partitioned (:class:`~fxstream.service.rebalance.CoPartitionedAssignor`),
    so all of one task's results and events reach one follower, and handed over only
    between batches (:class:`~fxstream.service.rebalance.PartitionGuard`). After each
    assignment the planner's memory is cleared and, before the next batch, ``states``
    is read to task-state's end (``directory`` says where that is): the previous owner's
    writes, acknowledged before it gave the partitions up, are then what the planner
    recalls, never a stale memory of its own.
    """

    name = "task-state"

    def __init__(
        self,
        kafka: KafkaConnection,
        planner: TaskStatePlanner,
        send: Send,
        *,
        topics: TopicFeed,
        group_id: str,
        batch_size: int = 500,
        metadata_max_age_ms: int = FEED_METADATA_MAX_AGE_MS,
        states: RegistryView | None = None,
        directory: TopicDirectory | None = None,
    ) -> None:
        super().__init__()
        self._feed = topics
        self._subscribed: frozenset[str] = frozenset()
        self._states = states
        self.states_started = threading.Event()
        """Set once ``states`` has been started and waited for (see :meth:`run`)."""
        self._directory = directory
        self._reassigned = False
        self.guard = PartitionGuard(self.name, on_assigned=self._assigned)
        self._planner = planner
        self._send = send
        self._batch_size = batch_size
        self._consumer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "group_id": group_id,
            "client_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            # Agents publish results in transactions: never fold an aborted one.
            "isolation_level": "read_committed",
            # Only to follow leaders: the feed brings a new user's results topic in.
            "metadata_max_age_ms": metadata_max_age_ms,
            # task-state is a status view, off the task's critical path: under load, fewer
            # and fuller fetches (the broker's cost is per request) for <= 100 ms of lag.
            "fetch_min_bytes": 64 * 1024,
            "fetch_max_wait_ms": 100,
            # One task's results (4 partitions) and events (8) reach the same instance.
            "partition_assignment_strategy": (CoPartitionedAssignor,),
        }

    async def run(self) -> None:
        """Follow the results topics until :meth:`stop`."""
        # aiokafka binds a consumer to the running loop, so it is made here, not in __init__.
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        try:
            await self._start_states()
            self.states_started.set()
            await self._consumer.start()
            await self._feed.start()
            while not self._stopping.is_set():
                await self._follow_feed()
                if not self._subscribed:
                    await asyncio.sleep(0.2)
                    continue
                fetched = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
                if not fetched:
                    continue
                # Partitions are given up only once the batch is written and committed.
                async with self.guard.batch(fetched) as batch:
                    records = [r for partition in batch.values() for r in partition]
                    if records:
                        await self._catch_up_after_rebalance()
                        await self._send(self._planner.plan(records), records)
                        await self._commit(batch)
        finally:
            await self._consumer.stop()
            await asyncio.to_thread(self._feed.close)
            if self._states is not None:
                await asyncio.to_thread(self._states.close)
            self._done.set()

    async def _follow_feed(self) -> None:
        self._subscribed = await follow(
            self._consumer, self._feed, self._subscribed, self.guard, self.name
        )

    async def _start_states(self) -> None:
        if self._states is None:
            return
        await asyncio.to_thread(self._states.start)
        if not await asyncio.to_thread(self._states.wait_until_current, CATCH_UP_S):
            # Not fatal: a restart would only read the same topic again. Until the table
            # is current, a task seen only before the restart counts as routed.
            log.warning(
                "task-state: the task-state table did not catch up in %.0f s; folding "
                "anyway (it keeps reading)",
                CATCH_UP_S,
            )

    async def _assigned(self, partitions: frozenset[Any]) -> None:
        # Runs before the consumer heartbeats again: the catch-up waits for the next batch.
        self._planner.memory.clear()
        self._reassigned = True

    async def _catch_up_after_rebalance(self) -> None:
        """Read task-state to its current end once after each assignment (see the class)."""
        if not self._reassigned or self._states is None or self._directory is None:
            return
        states = self._states
        topic = self._planner.catalogue.task_state
        ends = await self._directory.end_offsets([topic])
        while not await asyncio.to_thread(states.wait_until_read, ends, CATCH_UP_S):
            if not states.following:
                raise RuntimeError("task-state: the view of task-state stopped reading")
            log.warning("task-state: still reading task-state after a rebalance")
        self._reassigned = False

    async def _commit(self, batch: dict[Any, list[Any]]) -> None:
        try:
            await self._consumer.commit(offsets_after(batch))
        except (CommitFailedError, IllegalStateError) as exc:
            # A rebalance took the partitions away; their new owner re-reads from the
            # last commit, and the recent-task memory there absorbs most repeats.
            log.warning("task-state: commit after a rebalance failed (%s); continuing", exc)
