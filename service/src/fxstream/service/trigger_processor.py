"""The trigger processor: matches events to trigger rules and submits a task per match.

It reads every source's ``events.<source>`` topic (``read_committed``; an explicit
subscription, :class:`~fxstream.service.subscription.TopicFeed`: the source of a rule
within a second or two of the rule, any other within 30 s, when the cluster's topics are
listed) and follows the compacted ``triggers`` topic (the rules) and ``task-state`` (for
the tasks in flight) in a :class:`~fxstream.service.registry.RegistryView`
(:func:`trigger_view`) that keeps only the states of rules' tasks: those whose task
group is a rule it holds and whose user is that rule's owner, told from each record's
bytes by a glance (:func:`~fxstream.topics.task_state_group`) before anything else is
decoded, so any other task costs this process a glance, not a decode and a table write.
At start the view reads ``triggers`` to its end before it reads ``task-state``, so no
state of a rule's task is judged before its rule is known; after that a rule is in the
view before the processor fires its first task (it fires only rules the view holds), so
before any of its tasks' states is written. States of a deleted rule's tasks are dropped
from then on: the processor forgets a deleted rule's tasks in flight. For each event, in
order per partition, the rules that fire are those of its source that are not paused,
were registered at or before the event's Kafka timestamp and whose filter matches
(:meth:`~fxstream.topics.TriggerRule.matches`). For each, the processor writes a
:class:`~fxstream.topics.TaskSubmission` to the rule owner's ``from.user.<owner>``: the
same topic that user's SDK writes, read by the router, which authorises it as that
user's submission (the user, the function and its pinned code digest, every endpoint of
the group, the size of the dispatch) exactly as any other: the processor decides nothing
about who may run what. The submission's ``task_group_id`` is the rule id and its
``trigger`` field names the rule and the event (source, key, topic, partition, offset);
its task id is derived from the rule id and the event's coordinates (``uuid5``), so a
repeat would be recognisable.

Exactly one task per (rule, event): the submissions of a batch and the batch's event
offsets are committed in one Kafka transaction (the router's loop,
:class:`~fxstream.service.router_loop.RouterLoop`, with its fencing, stall and
quarantine handling), so a processor killed at any point and restarted re-reads
exactly the events whose firings were never committed.

Before deciding on an event written after the rules were last read to their end, the
processor reads the ``triggers`` topic to its end (one end-offset request), so a rule
(or a pause) answered by the API before an event was written applies to that event.

Limits (:class:`~fxstream.topics.TriggerLimits`): a rule's tasks in flight are those
it fired that are not yet in a terminal state in ``task-state``; its firings per
second are a token bucket (a burst of up to one second's worth). When an event would
fire a rule at its limit, the processor stops that partition at the event: the batch
is committed up to it, the partition is rewound to it and paused, and it is tried
again every ``recheck_s``. The event therefore waits durably on its topic (the
consumer group's lag, which ``GET /v1/triggers/{id}`` shows), nothing is dropped, and
nothing is buffered in memory. The event fires all its rules together once none is at
its limit, so one rule at its limit also holds the other rules' events behind it on
that partition of that source. While idle, the processor commits its position (past
the sources' transaction markers), so a caught-up source shows no lag.

An event that does not decode is dead-lettered (``RecordDecodeError``); a firing that
cannot become a submission (arguments that do not serialize, a submission too large)
is dead-lettered (``TriggerUnfireable``) and the event's other firings go on.

Run one trigger processor per platform: the tasks in flight and the rate are counted
per process. After a restart, the tasks in flight are read back from ``task-state``;
a task fired just before the restart and not yet routed when they are read is not
counted at all (in-flight tasks are added only at start and when this process fires
one), so it can take its rule one over its limit: a known gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]

from fxstream.service.lifecycle import TERMINAL_STATES
from fxstream.service.outgoing import Outgoing
from fxstream.service.rebalance import group_generation
from fxstream.service.registry import RegistryView
from fxstream.service.router import RoutePlan
from fxstream.service.router_loop import RouterLoop
from fxstream.service.subscription import TopicFeed
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    Event,
    KafkaConnection,
    RawRecord,
    RecordDecodeError,
    SerializationError,
    Serializer,
    TaskSubmission,
    TriggerFiring,
    TriggerRule,
    client_info,
    dead_letter_for,
    decode,
    encode,
    max_submission_bytes,
    task_state_group,
)

__all__ = [
    "COMPONENT",
    "RECHECK_S",
    "TriggerLoop",
    "TriggerPlanner",
    "TriggerStats",
    "firing_task_id",
    "trigger_view",
]

log = logging.getLogger(__name__)

COMPONENT = "trigger"
# How often a partition held at a rule's limit is tried again.
RECHECK_S = 0.1
# How often an idle processor commits its position past transaction markers.
IDLE_COMMIT_S = 1.0
# A fixed namespace: the same rule and event give the same task id in every process.
_FIRING_NAMESPACE = uuid.UUID("6f1c9c52-3c1e-4f0a-9d51-7b9a0f3e2a15")


def trigger_view(
    kafka: KafkaConnection, catalogue: Catalogue, *, task_table_dir: Path | None = None
) -> RegistryView:
    """The trigger processor's view: the rules, and the states of the rules' tasks only
    (read after the rules at start; see the module)."""
    rule_tasks = _RuleTasks()
    view = RegistryView(
        kafka,
        catalogue,
        follow=("triggers", "task-state"),
        component="trigger processor's view",
        task_table_dir=task_table_dir,
        keep_task_state=rule_tasks.keep,
        read_first=("triggers",),
    )
    rule_tasks.view = view
    return view


class _RuleTasks:
    """Which task states the trigger processor's view keeps: a live rule's tasks'."""

    def __init__(self) -> None:
        self.view: RegistryView | None = None

    def keep(self, value: bytes) -> bool:
        """Whether the ``task-state`` record ``value`` is of a task of a rule the view
        holds (its task group the rule id, its user the rule's owner)."""
        glance = task_state_group(value)
        if glance is None:
            return True  # no task state: the view's decode skips it and says why
        user_id, task_group_id = glance
        if task_group_id is None or self.view is None:
            return False
        rule = self.view.trigger(task_group_id)
        return rule is not None and rule.owner_id == user_id


def firing_task_id(rule_id: str, topic: str, partition: int, offset: int) -> str:
    """The task id of the firing of rule ``rule_id`` for the event at these coordinates."""
    return str(uuid.uuid5(_FIRING_NAMESPACE, f"{rule_id}|{topic}|{partition}|{offset}"))


@dataclass
class TriggerStats:
    """Counts since start, logged at shutdown."""

    events: int = 0
    fired: int = 0
    held: int = 0
    unfireable: int = 0
    dead_lettered: int = 0
    catch_ups: int = 0


@dataclass
class _Bucket:
    """A token bucket: ``rate`` tokens a second, at most one second's worth (at least 1)."""

    rate: float
    tokens: float
    at: float

    def refill(self, now: float) -> None:
        self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now


@dataclass
class _Limits:
    """What the processor knows of each limited rule: its tasks in flight, its bucket."""

    in_flight: dict[str, set[str]] = field(default_factory=dict)
    buckets: dict[str, _Bucket] = field(default_factory=dict)


@dataclass(frozen=True)
class _Firing:
    """An event record under the key of one of its firings.

    The router's quarantine matches the records Kafka refused to their input by key;
    a firing's key is its task id, not its event's, so the loop hands the quarantine
    each event once more under each of its firings' keys.
    """

    event: RawRecord
    key: bytes | None

    @property
    def topic(self) -> str:
        """The event's topic."""
        return self.event.topic

    @property
    def partition(self) -> int:
        """The event's partition."""
        return self.event.partition

    @property
    def offset(self) -> int:
        """The event's offset."""
        return self.event.offset

    @property
    def value(self) -> bytes | None:
        """The event's bytes."""
        return self.event.value

    @property
    def headers(self) -> object:
        """The event's headers."""
        return self.event.headers


class TriggerPlanner:
    """Decides a batch of events' firings; owns the view of rules and task states."""

    def __init__(
        self,
        catalogue: Catalogue,
        view: RegistryView,
        directory: TopicDirectory,
        *,
        catch_up_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``view`` must follow ``triggers`` and ``task-state``."""
        self._catalogue = catalogue
        self._view = view
        self._follower = ViewFollower(
            view,
            directory,
            (catalogue.triggers,),
            name="trigger processor",
            catch_up_s=catch_up_s,
            start_timeout_s=60.0,
        )
        self._clock = clock
        self._monotonic = monotonic
        self._serializer = Serializer()
        self._limits = _Limits()
        # Wall time before the rules were last read to their end: events written before
        # it are decided with every rule registered before them.
        self._rules_read_at = 0.0
        self.held: dict[tuple[str, int], int] = {}
        """After :meth:`plan`: the partitions held at a rule's limit, and the offset of
        the event each waits at (the loop commits up to it and rewinds to it)."""
        self.firings: dict[bytes, RawRecord] = {}
        """After :meth:`plan`: each firing's key (its task id) and its event."""
        self.stats = TriggerStats()

    async def start(self) -> None:
        """Read the rules and task states, and count each limited rule's tasks in flight."""
        began = self._clock()
        await self._follower.start()
        self._rules_read_at = began
        for rule in self._view.triggers():
            if rule.limits.max_in_flight is not None:
                self._limits.in_flight[rule.rule_id] = {
                    task_id
                    for task_id in self._view.task_group(rule.rule_id, rule.owner_id)
                    if not self._finished(task_id)
                }

    def close(self) -> None:
        """Stop following the rules and task states."""
        self._follower.close()

    def in_flight(self, rule_id: str) -> int:
        """How many tasks of a limited rule this processor counts in flight."""
        return len(self._limits.in_flight.get(rule_id, ()))

    # --- planning --------------------------------------------------------------------

    async def plan(self, records: Sequence[RawRecord]) -> RoutePlan:
        """What to write for a batch of events, in order per partition; sets :attr:`held`."""
        self.held = {}
        self.firings = {}
        plan = RoutePlan()
        newest = max((_timestamp_s(r) for r in records), default=0.0)
        if newest >= self._rules_read_at:
            began = self._clock()
            self.stats.catch_ups += 1
            await self._follower.catch_up()
            self._rules_read_at = began
        self._forget_finished()
        by_source: dict[str, list[TriggerRule]] = {}
        for rule in self._view.triggers():
            by_source.setdefault(rule.source, []).append(rule)
        now = self._monotonic()
        for record in records:
            where = (record.topic, record.partition)
            if where in self.held:
                continue
            self.stats.events += 1
            try:
                event = decode(record.value, Event)
            except RecordDecodeError as exc:
                self._dead_letter(plan, record, str(exc), DeadLetterReason.DECODE_ERROR)
                continue
            source = self._catalogue.source_of(record.topic)
            written_at = _timestamp_s(record)
            rules = [
                rule
                for rule in by_source.get(source or "", ())
                if not rule.paused and rule.created_at <= written_at and rule.matches(event)
            ]
            if any(self._at_limit(rule, now) for rule in rules):
                self.held[where] = record.offset
                self.stats.held += 1
                continue
            for rule in rules:
                self._fire(plan, record, event, rule, now)
        return plan

    async def refuse(
        self, records: Sequence[RawRecord], reasons: Mapping[bytes | None, str]
    ) -> RoutePlan:
        """Dead-letter the events whose firings Kafka refused (their owner's topic gone?)."""
        plan = RoutePlan()
        for record in records:
            reason = reasons.get(record.key, "Kafka refused this event's firings")
            event = record.event if isinstance(record, _Firing) else record
            self._dead_letter(plan, event, reason, DeadLetterReason.TRIGGER_UNFIREABLE)
        return plan

    def _at_limit(self, rule: TriggerRule, now: float) -> bool:
        limits = rule.limits
        if limits.max_in_flight is not None:
            flying = self._limits.in_flight.setdefault(rule.rule_id, set())
            if len(flying) >= limits.max_in_flight:
                return True
        if limits.max_per_second is not None:
            bucket = self._limits.buckets.get(rule.rule_id)
            if bucket is None or bucket.rate != limits.max_per_second:
                bucket = _Bucket(limits.max_per_second, max(1.0, limits.max_per_second), now)
                self._limits.buckets[rule.rule_id] = bucket
            bucket.refill(now)
            if bucket.tokens < 1.0:
                return True
        return False

    def _fire(
        self, plan: RoutePlan, record: RawRecord, event: Event, rule: TriggerRule, now: float
    ) -> None:
        task_id = firing_task_id(rule.rule_id, record.topic, record.partition, record.offset)
        key = task_id.encode()
        try:
            payload = self._serializer.pack_arguments((), rule.kwargs_for(event))
        except SerializationError as exc:
            self._unfireable(plan, record, rule, f"its arguments do not serialize: {exc}")
            return
        submission = TaskSubmission(
            task_id=task_id,
            function_id=rule.function_id,
            endpoint_id=rule.endpoint_id,
            endpoint_group=rule.endpoint_group,
            user_id=rule.owner_id,
            function_sha256=rule.function_sha256,
            payload=payload,
            client=rule.client or client_info(),
            submitted_at=self._clock(),
            task_group_id=rule.rule_id,
            trigger=TriggerFiring(
                rule_id=rule.rule_id,
                source=event.source,
                event_key=event.event_key,
                event_topic=record.topic,
                event_partition=record.partition,
                event_offset=record.offset,
            ),
        )
        value = encode(submission)
        limit = max_submission_bytes(self._catalogue, key)
        if len(value) > limit:
            self._unfireable(
                plan,
                record,
                rule,
                f"its submission would be {len(value):,} bytes, more than the {limit:,} a "
                "task may take: use arguments 'template' to pass only the attributes the "
                "function needs",
            )
            return
        plan.first.append(Outgoing(self._catalogue.from_user(rule.owner_id), key, value))
        self.firings[key] = record
        self.stats.fired += 1
        if rule.limits.max_in_flight is not None:
            self._limits.in_flight.setdefault(rule.rule_id, set()).add(task_id)
        bucket = self._limits.buckets.get(rule.rule_id)
        if bucket is not None:
            bucket.tokens -= 1.0

    def _unfireable(self, plan: RoutePlan, record: RawRecord, rule: TriggerRule, why: str) -> None:
        self.stats.unfireable += 1
        self._dead_letter(
            plan,
            record,
            f"rule {rule.rule_id} matched this event, but {why}",
            DeadLetterReason.TRIGGER_UNFIREABLE,
        )

    def _finished(self, task_id: str) -> bool:
        state = self._view.task(task_id)
        return state is not None and state.state in TERMINAL_STATES

    def _forget_finished(self) -> None:
        live = {rule.rule_id for rule in self._view.triggers()}
        for rule_id in list(self._limits.in_flight):
            if rule_id not in live:
                del self._limits.in_flight[rule_id]
                self._limits.buckets.pop(rule_id, None)
                continue
            flying = self._limits.in_flight[rule_id]
            flying.difference_update([t for t in flying if self._finished(t)])

    def _dead_letter(
        self, plan: RoutePlan, record: RawRecord, reason: str, error_type: DeadLetterReason
    ) -> None:
        letter = dead_letter_for(record, reason=reason, error_type=error_type, component=COMPONENT)
        plan.first.append(
            Outgoing(self._catalogue.dead_letter, letter.original_key, encode(letter))
        )
        self.stats.dead_lettered += 1
        log.warning(
            "trigger: dead-lettered %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            reason,
        )


def _timestamp_s(record: RawRecord) -> float:
    """The record's Kafka timestamp in seconds (aiokafka's ``timestamp`` is in ms)."""
    stamp = getattr(record, "timestamp", None)
    return stamp / 1000.0 if isinstance(stamp, int | float) and stamp >= 0 else 0.0


class TriggerLoop(RouterLoop):
    """Fires trigger rules for every ``events.<source>`` topic until :meth:`stop`.

    The router's transactional loop with two additions: a partition held at a rule's
    limit is committed up to the held event, rewound to it and paused (and resumed every
    :data:`RECHECK_S` to try again); and an idle loop commits its position.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        planner: TriggerPlanner,
        *,
        topics: TopicFeed,
        group_id: str,
        instance: str = "0",
        batch_size: int = 500,
    ) -> None:
        """``topics``: the sources' events topics to read
        (:func:`~fxstream.service.subscription.rule_source_topics`)."""
        super().__init__(
            kafka,
            catalogue,
            planner,
            topics=topics,
            group_id=group_id,
            instance=instance,
            batch_size=batch_size,
            component=COMPONENT,
        )
        self._planner = planner
        self._held_at: dict[Any, float] = {}
        self._committed: dict[Any, int] = {}
        self._idle_since = 0.0

    async def run(self) -> None:
        """Fire rules until :meth:`stop`; exits the process if Kafka refuses a transaction."""
        self._producer = AIOKafkaProducer(**self._producer_settings)
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        watch = asyncio.create_task(self.stall_watch.run())
        try:
            await self._router.start()
            await self._producer.start()
            await self._consumer.start()
            await self._feed.start()
            while not self._stopping.is_set():
                await self.follow_feed()
                if not self._consumer.subscription():
                    # No source yet: aiokafka's getmany would wait for an assignment past
                    # any timeout, and a stop with it. Once a source exists the loop must
                    # poll even with no partition assigned (yet, or to this instance):
                    # aiokafka leaves the group after max_poll_interval_ms (5 min) without
                    # a fetch, and rejoins only when the consumer fetches again, so a
                    # loop that waited for an assignment before polling never got one
                    # (the trigger tests failed on a shared platform 10 minutes old).
                    await asyncio.sleep(0.2)
                    continue
                self._resume_held()
                self._batch_taken_at = time.monotonic()
                fetched = await self._consumer.getmany(timeout_ms=100, max_records=self._batch_size)
                if not fetched:
                    await self._commit_position()
                    continue
                self._batch_starts = {tp: rs[0].offset for tp, rs in fetched.items() if rs}
                self._batch_generation = group_generation(self._consumer)
                async with self.guard.batch(fetched) as batch:
                    records = [r for partition in batch.values() for r in partition]
                    if records:
                        await self._fire(batch, records)
        finally:
            watch.cancel()
            if self._consumer is not None:
                await self._consumer.stop()
            if self._producer is not None:
                await self._producer.stop()
            await asyncio.to_thread(self._feed.close)
            self._done.set()

    async def _fire(self, batch: dict[Any, list[Any]], records: list[Any]) -> None:
        plan = await self._router.plan(records)
        held = self._planner.held
        offsets: dict[Any, int] = {}
        rewind: dict[Any, int] = {}
        for tp, partition in batch.items():
            if not partition:
                continue
            stop = held.get((tp.topic, tp.partition))
            if stop is None:
                offsets[tp] = partition[-1].offset + 1
                continue
            rewind[tp] = stop
            if stop > partition[0].offset:
                offsets[tp] = stop
        outgoing = [*plan.first, *plan.dispatches]
        if outgoing or offsets:
            before = self.abandoned
            await self._commit(outgoing, offsets, records)
            if self.abandoned != before:
                # Aborted: the committed partitions were rewound to the batch's start;
                # a held one that committed nothing is rewound here (its start).
                for tp, offset in rewind.items():
                    if tp not in offsets:
                        with contextlib.suppress(Exception):
                            self._consumer.seek(tp, offset)
                return
            self._committed.update(offsets)
        for tp, offset in rewind.items():
            with contextlib.suppress(Exception):  # given up meanwhile: its owner reads it
                self._consumer.seek(tp, offset)
                self._consumer.pause(tp)
                self._held_at.setdefault(tp, time.monotonic())

    async def _quarantine(
        self,
        records: Sequence[Outgoing],
        inputs: Sequence[RawRecord],
        error: BaseException,
        rounds: int,
    ) -> list[Outgoing]:
        """The router's quarantine, with each event also under its firings' keys."""
        firings = [_Firing(event, key) for key, event in self._planner.firings.items()]
        return await super()._quarantine(records, [*inputs, *firings], error, rounds)

    def _resume_held(self) -> None:
        if not self._held_at:
            return
        now = time.monotonic()
        due = [tp for tp, at in self._held_at.items() if now - at >= RECHECK_S]
        if not due:
            return
        assigned = self._consumer.assignment()
        for tp in due:
            del self._held_at[tp]
            if tp in assigned:
                self._consumer.resume(tp)

    async def _commit_position(self) -> None:
        """While idle, commit the position of partitions read past their last commit (the
        sources' transaction markers), so a caught-up source shows no lag."""
        now = time.monotonic()
        if self._held_at or now - self._idle_since < IDLE_COMMIT_S:
            return
        self._idle_since = now
        offsets: dict[Any, int] = {}
        for tp in self._consumer.assignment():
            try:
                # A partition just assigned has no position until its offset is fetched.
                position = await asyncio.wait_for(self._consumer.position(tp), 1.0)
            except Exception:  # not yet, or given up meanwhile: the next idle pass
                continue
            if tp not in self._committed:
                self._committed[tp] = await self._consumer.committed(tp) or 0
            if position > self._committed[tp]:
                offsets[tp] = position
        if not offsets:
            return
        self._batch_taken_at = time.monotonic()
        self._batch_starts = dict(offsets)
        self._batch_generation = group_generation(self._consumer)
        async with self.guard.batch({tp: [None] for tp in offsets}) as owned:
            offsets = {tp: offset for tp, offset in offsets.items() if tp in owned}
            if offsets:
                before = self.abandoned
                await self._commit([], offsets)
                if self.abandoned == before:
                    self._committed.update(offsets)
