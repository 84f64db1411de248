"""The dependencies processor: holds tasks until their parents succeed (issue 15's task DAGs).

A task may name parents (``TaskSubmission.depends_on``, :mod:`fxstream.topics.parents`).
The router authorises such a task as any other, but instead of dispatching it writes a
:class:`~fxstream.topics.HeldTask` to the compacted ``held-tasks`` topic and a
``waiting-for-parents`` state, in the transaction that would have routed it. This
processor decides each held task:

- every parent ``succeeded``: the task is *released*: its submission, with
  ``parent_results`` set to each parent's serialized result as the parent's state holds
  it (the value its result record carried: inline, or the by-reference envelope of an
  object in the proxy store, so bulk data stays in the store and only its reference
  moves), is written to the submitter's own ``from.user.<user>``, where the router
  authorises and routes it like any other submission (the service may write there, as
  the trigger processor does);
- a parent ``failed``, ``rejected`` or ``cancelled``: the task fails with
  ``ParentFailed``, whose message names the parent and its error (a grandchild's names
  its own parent, whose message names the first failure);
- a parent that is another user's task, or of which no state has appeared within
  ``grace_s`` of the hold (``UNKNOWN_PARENT_GRACE_S``: a parent submitted just before its
  child may reach task-state after it): ``ParentUnknown``, the same words either way, so
  nobody learns another user's task ids;
- a parent that succeeded but whose state keeps no value (too large for task-state), or
  parents whose results would make the task too large to route:
  ``ParentResultUnavailable``.
- a cancel by its submitter (the router copies every authorised cancel to
  ``held-tasks`` under the task's key, after its held record): ``cancelled`` (an error
  result ``TaskCancelled``); the cancel of a task not held (any other) is cleared with a
  tombstone; another user's cancel of a held task leaves it held (its held record is
  written again, so compaction keeps it rather than the cancel's copy).

A failure is an error :class:`~fxstream.topics.TaskResult` on ``results.<user>`` (the
submitter's future fails with it; the task-state processor folds it into ``failed``).
Either way a tombstone under the task's key on ``held-tasks`` is written in the same
Kafka transaction, so a task is decided exactly once: a processor killed at any point
re-reads ``held-tasks`` from its beginning at start, and a task whose decision was never
committed is still held there and is decided again (the decision depends only on the
parents' states, so it is the same one). A task whose parents are already decided when it
is held is decided at once; the rest wait.

What the processor reads: ``held-tasks`` (from the beginning, no consumer group: the
topic is the table, :class:`~fxstream.service.held_table.HeldTable`) and ``task-state``
through a :class:`~fxstream.service.registry.RegistryView` (its on-disk task table
answers each parent lookup). The view tells the loop of every terminal state of a task
some held task waits for, so a parent's end is acted on as soon as the view reads it;
every ``SWEEP_S`` all held tasks are looked at again (the unknown-parent grace expires
there). Run one dependencies processor per platform (``--only dependencies``): two would
decide the same tasks twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NoReturn

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import ProducerFenced  # type: ignore[import-untyped]

from fxstream.service.batch_loop import StoppableLoop
from fxstream.service.held_table import HeldEntry, HeldTable
from fxstream.service.metrics import PROCESSOR_METRICS
from fxstream.service.outgoing import Outgoing, refuses_record
from fxstream.service.registry import RegistryView
from fxstream.service.router_loop import EXIT_WRITE_FAILED
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    HeldTask,
    KafkaConnection,
    RecordDecodeError,
    TaskCancel,
    TaskError,
    TaskErrorType,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    aiokafka_max_batch_size,
    aiokafka_max_request_size,
    dead_letter,
    decode,
    encode,
    max_submission_bytes,
    normalise_headers,
    record_kind,
    truncate_utf8,
)
from fxstream.topics.partitioner import Murmur2Partitioner

__all__ = [
    "COMPONENT",
    "SWEEP_S",
    "UNKNOWN_PARENT_GRACE_S",
    "Decision",
    "DependencyLoop",
    "DependencyPlanner",
    "DependencyStats",
]

log = logging.getLogger(__name__)

COMPONENT = "dependencies"
UNKNOWN_PARENT_GRACE_S: Final = 60.0
"""How long a held task waits for a parent of which task-state has no state yet."""
SWEEP_S: Final = 2.0
"""How often every held task is looked at again (the grace above expires here)."""
# A parent's error message is quoted up to this many bytes in its children's.
PARENT_MESSAGE_MAX_BYTES: Final = 4_096
# Tries of one transaction before the processor exits (its supervisor restarts it).
COMMIT_ATTEMPTS: Final = 5
# How long the start waits for the view of task-state to read what it holds.
CATCH_UP_S: Final = 120.0
# Parents' states that fail their children.
_FAILED: Final = frozenset({TaskStateName.FAILED, TaskStateName.REJECTED, TaskStateName.CANCELLED})
_ENDED: Final = _FAILED | {TaskStateName.SUCCEEDED}

Lookup = Callable[[str], TaskState | None]


@dataclass
class DependencyStats:
    """Counts since start, logged at shutdown."""

    held_read: int = 0
    released: int = 0
    failed: int = 0
    cancelled: int = 0
    cancels_cleared: int = 0
    dead_lettered: int = 0
    transactions: int = 0


@dataclass(frozen=True)
class Decision:
    """What to write for one held task: ``records``, then its tombstone on ``held-tasks``."""

    task_id: str
    outcome: Literal["released", "failed", "cancelled", "cleared", "dead-lettered"]
    records: tuple[Outgoing, ...]
    error: TaskError | None = None
    tombstone: bool = True
    """False when the task stays held (``records`` then write its held record again)."""


class DependencyPlanner:
    """Decides held tasks from their parents' states (no I/O)."""

    def __init__(
        self,
        catalogue: Catalogue,
        lookup: Lookup,
        *,
        grace_s: float = UNKNOWN_PARENT_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``lookup`` answers a task's latest state (``RegistryView.task``)."""
        self._catalogue = catalogue
        self._lookup = lookup
        self._grace_s = grace_s
        self._clock = clock

    def decide(self, entry: HeldEntry, *, results_present: bool = True) -> Decision | None:
        """The decision for ``entry``, or None while a parent has not ended.

        ``results_present``: whether the submitter's results topic exists (a failure is
        written there; else as a ``failed`` state only).
        """
        held = entry.held
        waiting = False
        values: dict[str, bytes] = {}
        failure: tuple[TaskErrorType, str] | None = None
        # Only the held record's parents are read here (every sweep looks at every held
        # task); the submission is decoded once a decision is reached.
        for parent in held.depends_on:
            state = self._lookup(parent)
            if state is None or state.user_id != held.user_id:
                if state is None and self._clock() - held.held_at < self._grace_s:
                    waiting = True
                    continue
                failure = (
                    TaskErrorType.PARENT_UNKNOWN,
                    f"parent task {parent} is not a task of user {held.user_id}: no such "
                    "task was submitted by that user (a parent is named by the id of one of "
                    "your own tasks, submitted before or with this one)",
                )
                break
            if state.state in _FAILED:
                failure = (TaskErrorType.PARENT_FAILED, _parent_failed(parent, state))
                break
            if state.state is not TaskStateName.SUCCEEDED:
                waiting = True
                continue
            if state.value is None:
                failure = (
                    TaskErrorType.PARENT_RESULT_UNAVAILABLE,
                    f"parent task {parent} succeeded, but task-state does not keep its result "
                    "(too large to keep there): configure the parent's endpoint with a proxy "
                    "store (store_url) so large results travel by reference",
                )
                break
            values[parent] = state.value
        if failure is None and waiting:
            return None
        try:
            submission = decode(held.submission, TaskSubmission)
        except RecordDecodeError as exc:
            return self.dead_letter(entry, f"the held submission does not decode: {exc.reason}")
        if failure is not None:
            return self.fail(entry, submission, *failure, results_present=results_present)
        return self._release(entry, submission, values, results_present=results_present)

    def _release(
        self,
        entry: HeldEntry,
        submission: TaskSubmission,
        values: dict[str, bytes],
        *,
        results_present: bool,
    ) -> Decision:
        released = msgspec.structs.replace(
            submission, parent_results={**submission.parent_results, **values}
        )
        value = encode(released)
        key = submission.task_id.encode()
        headers = list(entry.headers) or None
        limit = max_submission_bytes(self._catalogue, key, headers)
        if len(value) > limit:
            sizes = ", ".join(f"{p}: {len(v):,} bytes" for p, v in values.items())
            return self.fail(
                entry,
                submission,
                TaskErrorType.PARENT_RESULT_UNAVAILABLE,
                f"the parents' results ({sizes}) would make this task {len(value):,} bytes, "
                f"more than the {limit:,} a task may take: configure the parents' endpoint "
                "with a proxy store (store_url) so large results travel by reference",
                results_present=results_present,
            )
        topic = self._catalogue.from_user(submission.user_id)
        return Decision(submission.task_id, "released", (Outgoing(topic, key, value, headers),))

    def fail(
        self,
        entry: HeldEntry,
        submission: TaskSubmission,
        error_type: TaskErrorType,
        message: str,
        *,
        results_present: bool = True,
    ) -> Decision:
        """Fail a held task: its error result (or, without a results topic, its state;
        ``cancelled`` for a ``TaskCancelled`` error)."""
        key = submission.task_id.encode()
        error = TaskError(type=str(error_type), message=message)
        timings = TaskTimings(submitted_at=submission.submitted_at)
        if results_present:
            result = TaskResult(
                task_id=submission.task_id,
                user_id=submission.user_id,
                function_id=submission.function_id,
                endpoint_id=submission.endpoint_id,
                task_group_id=submission.task_group_id,
                outcome="error",
                error=error,
                timings=timings,
                tags=submission.tags,
            )
            record = Outgoing(self._catalogue.results(submission.user_id), key, encode(result))
        else:
            cancelled = error_type is TaskErrorType.CANCELLED
            state = TaskState(
                task_id=submission.task_id,
                user_id=submission.user_id,
                function_id=submission.function_id,
                endpoint_id=submission.endpoint_id,
                task_group_id=submission.task_group_id,
                state=TaskStateName.CANCELLED if cancelled else TaskStateName.FAILED,
                updated_at=self._clock(),
                timings=timings,
                error=error,
                tags=submission.tags,
            )
            record = Outgoing(self._catalogue.task_state, key, encode(state))
        outcome: Literal["failed", "cancelled"] = (
            "cancelled" if error_type is TaskErrorType.CANCELLED else "failed"
        )
        return Decision(submission.task_id, outcome, (record,), error)

    def cancel(
        self, entry: HeldEntry, cancel: TaskCancel, *, results_present: bool = True
    ) -> Decision:
        """A cancel of a held task: by its submitter, the task ends ``cancelled`` (it never
        ran); by anyone else, nothing happens (the cancel is cleared, as the agent
        ignores another user's cancel)."""
        if cancel.user_id != entry.held.user_id:
            # The task stays held; its held record is written again, so that record, not
            # the cancel's copy, is what compaction keeps under its key.
            again = Outgoing(
                self._catalogue.held_tasks,
                entry.task_id.encode(),
                encode(entry.held),
                list(entry.headers) or None,
            )
            return Decision(entry.task_id, "cleared", (again,), tombstone=False)
        try:
            submission = decode(entry.held.submission, TaskSubmission)
        except RecordDecodeError as exc:
            return self.dead_letter(entry, f"the held submission does not decode: {exc.reason}")
        why = f": {cancel.reason}" if cancel.reason else ""
        return self.fail(
            entry,
            submission,
            TaskErrorType.CANCELLED,
            f"cancelled while waiting for its parents{why}",
            results_present=results_present,
        )

    def dead_letter(self, entry: HeldEntry, reason: str) -> Decision:
        """Give up on a held record that cannot be decided (it does not decode)."""
        letter = dead_letter(
            topic=self._catalogue.held_tasks,
            partition=-1,
            offset=-1,
            key=entry.task_id.encode(),
            value=entry.held.submission,
            headers=list(entry.headers),
            reason=reason,
            error_type=DeadLetterReason.DECODE_ERROR,
            component=COMPONENT,
            task_id=entry.task_id,
        )
        record = Outgoing(self._catalogue.dead_letter, entry.task_id.encode(), encode(letter))
        return Decision(entry.task_id, "dead-lettered", (record,))


def _parent_failed(parent: str, state: TaskState) -> str:
    what = {
        TaskStateName.FAILED: "failed",
        TaskStateName.REJECTED: "was rejected",
        TaskStateName.CANCELLED: "was cancelled",
    }[state.state]
    if state.error is None:
        return f"parent task {parent} {what}"
    quoted = truncate_utf8(state.error.message, PARENT_MESSAGE_MAX_BYTES)
    return f"parent task {parent} {what}: {state.error.type}: {quoted}"


class DependencyLoop(StoppableLoop):
    """Holds and decides tasks until :meth:`stop` (see the module)."""

    name = COMPONENT

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        *,
        transactional_id: str,
        grace_s: float = UNKNOWN_PARENT_GRACE_S,
        batch_size: int = 500,
        view: RegistryView | None = None,
        directory: TopicDirectory | None = None,
    ) -> None:
        """``view`` (default: a new one, of task states by id) must follow
        ``task-state`` and tell :meth:`parent_state` of each state's name
        (``on_task_state_name``); it is started here."""
        super().__init__()
        self._kafka = kafka
        self._catalogue = catalogue
        self._batch_size = batch_size
        self.table = HeldTable()
        self._view = view or RegistryView(
            kafka,
            catalogue,
            follow=("task-state",),
            component="dependencies processor's view",
            # Only parents are looked up, by id: a state is decoded when one is.
            task_states_by_id=True,
            on_task_state_name=self.parent_state,
        )
        self._directory = directory or TopicDirectory(kafka)
        self.planner = DependencyPlanner(catalogue, self._view.task, grace_s=grace_s)
        self.stats = DependencyStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: set[str] = set()
        self._due: set[str] = set()
        self._bad: list[Decision] = []
        # Cancels read from held-tasks and not yet acted on, by task id.
        self._cancels: dict[str, TaskCancel] = {}
        self._producer: Any = None
        largest = max(spec.max_message_bytes for spec in catalogue.specs)
        self._consumer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "group_id": None,
            "client_id": transactional_id,
            "enable_auto_commit": False,
            # Only what the router committed: an aborted hold never happened.
            "isolation_level": "read_committed",
            "max_partition_fetch_bytes": largest + 65_536,
            "fetch_max_wait_ms": 100,
        }
        self._producer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "client_id": transactional_id,
            "transactional_id": transactional_id,
            "enable_idempotence": True,
            "partitioner": Murmur2Partitioner(),
            "acks": "all",
            "max_request_size": aiokafka_max_request_size(catalogue),
            "max_batch_size": aiokafka_max_batch_size(catalogue),
            "request_timeout_ms": 30_000,
        }

    def view_memory_figures(self) -> dict[str, int]:
        """The memory of its view's on-disk task table (for the memory report)."""
        return self._view.memory_figures()

    # --- the view's thread --------------------------------------------------------------

    def parent_state(self, task_id: str, state: TaskStateName) -> None:
        """Called from the view's thread with each task state it reads (after its table
        holds it): an ended task some held task waits for wakes the loop."""
        loop = self._loop
        if loop is None or state not in _ENDED or not self.table.waits_for(task_id):
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._ended.add, task_id)

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Read ``held-tasks`` and decide what it holds until :meth:`stop`."""
        self._loop = asyncio.get_running_loop()
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        self._producer = AIOKafkaProducer(**self._producer_settings)
        try:
            await asyncio.to_thread(self._view.start)
            if not await asyncio.to_thread(self._view.wait_until_current, CATCH_UP_S):
                log.warning(
                    "dependencies: the view of task-state did not catch up in %.0f s; "
                    "deciding anyway (a parent not read yet only waits longer)",
                    CATCH_UP_S,
                )
            await self._producer.start()
            await self._consumer.start()
            # Where held-tasks ends now: what the table must be read to before deciding.
            ends = await self._directory.end_offsets([self._catalogue.held_tasks])
            if not ends:
                raise RuntimeError(
                    f"topic {self._catalogue.held_tasks} is missing: run ./fx up first"
                )
            partitions = {TopicPartition(topic, p): end for (topic, p), end in ends.items()}
            self._consumer.assign(list(partitions))
            await self._consumer.seek_to_beginning(*partitions)
            await self._load(partitions)
            log.info("dependencies: %d task(s) held at start", len(self.table))
            self._due.update(entry.task_id for entry in self.table)
            self._due.update(self._cancels)
            swept = time.monotonic()
            while not self._stopping.is_set():
                fetched = await self._consumer.getmany(timeout_ms=20, max_records=self._batch_size)
                self._fold(fetched)
                if time.monotonic() - swept >= SWEEP_S:
                    swept = time.monotonic()
                    if not self._view.following:
                        raise RuntimeError("dependencies: the view of task-state stopped reading")
                    self._due.update(entry.task_id for entry in self.table)
                for parent in self._ended:
                    self._due.update(self.table.children_of(parent))
                self._ended.clear()
                if self._due or self._bad:
                    await self._decide()
        finally:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            with contextlib.suppress(Exception):
                await self._producer.stop()
            await asyncio.to_thread(self._view.close)
            self._done.set()

    async def _load(self, ends: dict[Any, int]) -> None:
        """Read ``held-tasks`` to ``ends``, where it ended at start (the table as it stands)."""
        partitions = list(ends)
        started = time.monotonic()
        warned = started
        while not self._stopping.is_set():
            positions = {tp: await self._consumer.position(tp) for tp in partitions}
            if all(positions[tp] >= ends[tp] for tp in partitions):
                return
            fetched = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
            self._fold(fetched, load=True)
            if time.monotonic() - warned > 10.0:
                warned = time.monotonic()
                log.warning(
                    "dependencies: still reading held-tasks after %.0f s (%d held so far)",
                    warned - started,
                    len(self.table),
                )

    def _fold(self, fetched: dict[Any, list[Any]], *, load: bool = False) -> None:
        for records in fetched.values():
            for record in records:
                key = (record.key or b"").decode(errors="replace")
                if record.value is None:
                    # Decided (or its cancel cleared): nothing of the key is left to act on.
                    # A cancel read before this tombstone was acted on, or came too late.
                    self.table.remove(key)
                    self._cancels.pop(key, None)
                    self._due.discard(key)
                    continue
                if record_kind(record.value) == "cancel":
                    # The router's copy of a cancel (every task's): after the task's held
                    # record, if it was held (same key, same partition).
                    try:
                        self._cancels[key] = decode(record.value, TaskCancel)
                    except RecordDecodeError as exc:
                        self._bad_record(record, key, exc.reason)
                        continue
                    if not load:
                        self._due.add(key)
                    continue
                headers = tuple(
                    (name, value)
                    for name, value in normalise_headers(record.headers)
                    if value is not None
                )
                try:
                    held = decode(record.value, HeldTask)
                except RecordDecodeError as exc:
                    self._bad_record(record, key, exc.reason)
                    continue
                if held.task_id != key:
                    self._bad_record(record, key, f"the key {key!r} is not its task id")
                    continue
                self.table.put(HeldEntry(held, headers))
                self.stats.held_read += 1
                if not load:
                    self._due.add(key)

    def _bad_record(self, record: Any, key: str, reason: str) -> None:
        log.warning(
            "dependencies: dead-lettering %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            reason,
        )
        letter = dead_letter(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            value=record.value,
            headers=normalise_headers(record.headers),
            reason=reason,
            error_type=DeadLetterReason.DECODE_ERROR,
            component=COMPONENT,
        )
        out = Outgoing(self._catalogue.dead_letter, record.key, encode(letter))
        self._bad.append(Decision(key, "dead-lettered", (out,)))

    async def _decide(self) -> None:
        due, self._due = self._due, set()
        decisions = list(self._bad)
        cancels = {t: self._cancels.pop(t) for t in sorted(due) if t in self._cancels}
        for task_id in cancels:
            if task_id not in self.table:  # released, decided, or never held: nothing to do
                decisions.append(Decision(task_id, "cleared", ()))
        entries = [e for e in (self.table.get(t) for t in sorted(due)) if e is not None]
        users = {e.held.user_id for e in entries}
        present = await self._directory.present(self._catalogue.results(u) for u in users)
        for entry in entries:
            results_present = self._catalogue.results(entry.held.user_id) in present
            cancel = cancels.get(entry.task_id)
            try:
                if cancel is not None:
                    decision: Decision | None = self.planner.cancel(
                        entry, cancel, results_present=results_present
                    )
                else:
                    decision = self.planner.decide(entry, results_present=results_present)
            except Exception as exc:  # a bug here must cost one task, not the processor
                log.exception("dependencies: cannot decide task %s", entry.task_id)
                decision = self.planner.dead_letter(entry, f"dependencies failed: {exc!r}")
            if decision is not None:
                decisions.append(decision)
        if not decisions:
            self._bad = []
            return
        await self._commit(decisions)
        self._bad = []
        for decision in decisions:
            if decision.tombstone:
                self.table.remove(decision.task_id)
            if decision.outcome == "released":
                self.stats.released += 1
            elif decision.outcome == "failed":
                self.stats.failed += 1
            elif decision.outcome == "cancelled":
                self.stats.cancelled += 1
            elif decision.outcome == "cleared":
                self.stats.cancels_cleared += 1
                continue  # every cancel of a task never held comes here: not worth a line
            else:
                self.stats.dead_lettered += 1
            log.info(
                "dependencies: task %s %s%s",
                decision.task_id,
                decision.outcome,
                f" ({decision.error.type}: {decision.error.message})" if decision.error else "",
            )

    async def _commit(self, decisions: list[Decision]) -> None:
        """Write the decisions and their tombstones in one transaction (retried); a
        decision Kafka refuses is replaced by a failure, else by a dead letter."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._transact(decisions)
                self.stats.transactions += 1
                return
            except ProducerFenced:
                # Another dependencies processor with this transactional id started (or the
                # coordinator timed the transaction out): it, or the restarted one, decides.
                self._exit("dependencies: fenced by another producer with this id")
            except Exception as exc:
                if refuses_record(exc):
                    await self._restart_producer()
                    await self._one_by_one(decisions)
                    return
                if attempt >= COMMIT_ATTEMPTS or not getattr(exc, "retriable", True):
                    self._exit("dependencies: cannot commit a transaction to Kafka")
                log.warning(
                    "dependencies: transaction failed (%r), aborted; retry %d of %d",
                    exc,
                    attempt,
                    COMMIT_ATTEMPTS - 1,
                )
                await self._restart_producer()
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))

    async def _one_by_one(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            for fallback in self._fallbacks(decision):
                try:
                    await self._transact([fallback])
                    self.stats.transactions += 1
                    break
                except Exception as exc:
                    if not refuses_record(exc):
                        self._exit("dependencies: cannot commit a transaction to Kafka")
                    log.error(
                        "dependencies: Kafka refused %s's records (%r)", decision.task_id, exc
                    )
                    await self._restart_producer()
            else:
                self._exit(f"dependencies: Kafka refuses even a tombstone of {decision.task_id}")

    def _fallbacks(self, decision: Decision) -> Iterable[Decision]:
        """``decision``, then a failure saying Kafka refused it, then the tombstone alone
        (for a task that stays held: ``decision`` only)."""
        yield decision
        if not decision.tombstone:
            return
        entry = self.table.get(decision.task_id)
        if decision.outcome == "released" and entry is not None:
            submission: TaskSubmission | None
            try:
                submission = decode(entry.held.submission, TaskSubmission)
            except RecordDecodeError:  # an undecodable held record: only the dead letter
                submission = None
            if submission is not None:
                yield self.planner.fail(
                    entry,
                    submission,
                    TaskErrorType.PARENT_RESULT_UNAVAILABLE,
                    "Kafka refused the task with its parents' results (too large?): configure "
                    "the parents' endpoint with a proxy store (store_url) so large results "
                    "travel by reference",
                )
        yield Decision(decision.task_id, "dead-lettered", ())

    async def _transact(self, decisions: Sequence[Decision]) -> None:
        records = [r for d in decisions for r in d.records]
        for topic in {r.topic for r in records} | {self._catalogue.held_tasks}:
            await self._producer.partitions_for(topic)
        async with self._producer.transaction():
            sent = [
                await self._producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                for r in records
            ]
            sent += [
                await self._producer.send(self._catalogue.held_tasks, None, key=d.task_id.encode())
                for d in decisions
                if d.tombstone
            ]
            await asyncio.gather(*sent)
        PROCESSOR_METRICS.batch("dependencies", self._catalogue, len(decisions), records)

    async def _restart_producer(self) -> None:
        with contextlib.suppress(Exception):
            await self._producer.stop()
        self._producer = AIOKafkaProducer(**self._producer_settings)
        await self._producer.start()

    def _exit(self, message: str) -> NoReturn:
        # Nothing of the failed transaction is visible: the held tasks are still held on
        # held-tasks, and the restarted processor decides them again.
        log.critical("%s; exiting", message, exc_info=True)
        logging.shutdown()
        os._exit(EXIT_WRITE_FAILED)
