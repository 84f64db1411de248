"""The trigger processor's view keeps only its rules' tasks' states, and its limits hold.

The planner (:class:`TriggerPlanner`) runs in the test's process on the session broker,
with the view the trigger processor builds (:func:`trigger_view`): rules are written to
``triggers``, events to ``events.<source>``, and the task states the router and the
task-state processor would write for the fired tasks (and for other tasks) to
``task-state``. A "restart" closes the planner and starts a new one, whose view is
rebuilt from the topics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
import pytest
from confluent_kafka import Message, Producer

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.service.registry import RegistryView
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.trigger_processor import TriggerPlanner, trigger_view
from fxstream.topics import (
    Catalogue,
    Event,
    KafkaConnection,
    Record,
    TaskState,
    TaskStateName,
    TriggerLimits,
    TriggerRule,
    encode,
    ensure_topics,
)
from tests.conftest import RunningPlatform
from tests.service.conftest import delete_topics_under

S = TaskStateName
OWNER = "trig-view-owner"
OTHER = "trig-view-other"
DIGEST = "0" * 64


@dataclass(frozen=True)
class Consumed:
    """An event as the trigger loop hands it to the planner (aiokafka's record fields)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int  # ms, as aiokafka's
    headers: list[tuple[str, bytes]] = field(default_factory=list)


class Topics:
    """Writes to the test's topics, each acknowledged, keyed as the platform keys them."""

    def __init__(self, kafka: KafkaConnection, catalogue: Catalogue, source: str) -> None:
        self.catalogue = catalogue
        self.source = source
        self._producer = Producer({**kafka.confluent_producer(), "acks": "all", "log_level": 2})

    def write(self, topic: str, key: str, value: Record | None) -> Message:
        """Write one record (None: a tombstone) and return it as delivered."""
        delivered: list[Message] = []

        def report(error: object, message: Message) -> None:
            assert error is None, error
            delivered.append(message)

        raw = None if value is None else encode(value)
        self._producer.produce(topic, key=key.encode(), value=raw, on_delivery=report)
        assert self._producer.flush(30) == 0
        return delivered[0]

    def write_many(self, topic: str, records: list[tuple[str, Record]]) -> None:
        """Write many records at once (acknowledged together)."""
        for key, value in records:
            self._producer.produce(topic, key=key.encode(), value=encode(value))
            self._producer.poll(0)
        assert self._producer.flush(60) == 0

    def rule(self, rule: TriggerRule | None, rule_id: str = "") -> None:
        """Write a rule (None: delete ``rule_id``)."""
        self.write(self.catalogue.triggers, rule.rule_id if rule else rule_id, rule)

    def state(
        self, task_id: str, name: TaskStateName, *, group: str | None, user: str = OWNER
    ) -> Message:
        """Write a task's state, as the router or the task-state processor does."""
        record = TaskState(
            task_id=task_id,
            user_id=user,
            function_id="fn-1",
            endpoint_id="ep-1",
            task_group_id=group,
            state=name,
            updated_at=time.time(),
        )
        return self.write(self.catalogue.task_state, task_id, record)

    def event(self, key: str) -> Consumed:
        """Write an event of the source (all under one key: one partition, in order)."""
        event = Event(
            source=self.source, event_key=key, event_type="file-complete", occurred_at=time.time()
        )
        message = self.write(self.catalogue.events(self.source), "k", event)
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        assert topic is not None and partition is not None and offset is not None
        return Consumed(topic, partition, offset, b"k", message.value(), message.timestamp()[1])

    def other_tasks(self, rule_id: str, count: int) -> list[str]:
        """States of tasks no rule fired: without a group, in another group, and in the
        rule's group but of another user (a client may name any group)."""
        ids = []
        for i in range(count):
            task_id = f"other-{uuid.uuid4()}"
            group, user = [(None, OWNER), (f"g-{uuid.uuid4().hex[:8]}", OWNER), (rule_id, OTHER)][
                i % 3
            ]
            self.state(task_id, S.ROUTED, group=group, user=user)
            ids.append(task_id)
        return ids

    def close(self) -> None:
        """Flush what is left."""
        self._producer.flush(10)


def make_rule(source: str, *, max_in_flight: int | None, paused: bool = False) -> TriggerRule:
    """A rule of ``OWNER`` on ``source`` that fires for every event."""
    now = time.time()
    return TriggerRule(
        rule_id=str(uuid.uuid4()),
        owner_id=OWNER,
        name="trig-view",
        source=source,
        function_id="fn-1",
        function_sha256=DIGEST,
        endpoint_id="ep-1",
        paused=paused,
        limits=TriggerLimits(max_in_flight=max_in_flight),
        created_at=now - 1,
        updated_at=now,
    )


@pytest.fixture
def topics(
    kafka_platform: RunningPlatform, kafka: KafkaConnection, catalogue: Catalogue
) -> Iterator[Topics]:
    """The catalogue's static topics and a source's events topic; deleted after the test."""
    admin = kafka_platform.admin()
    assert ensure_topics(admin, catalogue).ok
    source = f"trig-{uuid.uuid4().hex[:8]}"
    ensure_event_topic(kafka, catalogue, source)
    made = Topics(kafka, catalogue, source)
    try:
        yield made
    finally:
        made.close()
        delete_topics_under(admin, catalogue.prefix)


@asynccontextmanager
async def planner(
    kafka: KafkaConnection, catalogue: Catalogue
) -> AsyncIterator[tuple[TriggerPlanner, RegistryView]]:
    """A started trigger planner on the processor's view; closed (view and all) on exit."""
    view = trigger_view(kafka, catalogue)
    made = TriggerPlanner(catalogue, view, TopicDirectory(kafka), catch_up_s=10.0)
    try:
        await made.start()
        yield made, view
    finally:
        made.close()


def read_to(view: RegistryView, written: list[Message]) -> None:
    """Wait until ``view`` has read every record in ``written``."""
    ends: dict[tuple[str, int], int] = {}
    for message in written:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        assert topic is not None and partition is not None and offset is not None
        ends[(topic, partition)] = max(ends.get((topic, partition), 0), offset + 1)
    assert view.wait_until_read(ends, timeout_s=30), "the view did not read the writes"


async def fire(made: TriggerPlanner, events: list[Consumed]) -> list[str]:
    """Plan ``events``; the ids of the tasks fired."""
    await made.plan(events)
    return [key.decode() for key in made.firings]


def test_the_view_keeps_only_rule_tasks_and_the_in_flight_limit_holds_across_a_restart(
    kafka: KafkaConnection, catalogue: Catalogue, topics: Topics
) -> None:
    rule = make_rule(topics.source, max_in_flight=2)
    others = topics.other_tasks(rule.rule_id, 30)  # before the rule: other tasks only

    async def scenario() -> None:
        async with planner(kafka, catalogue) as (made, view):
            assert view.count_tasks() == 0, "the view kept states of tasks no rule fired"
            # A rule registered while the processor runs (it reads it before the event).
            topics.rule(rule)
            events = [topics.event(f"e-{i}") for i in range(4)]
            fired = await fire(made, events)
            assert len(fired) == 2 and made.in_flight(rule.rule_id) == 2
            assert made.held == {(events[2].topic, events[2].partition): events[2].offset}
            # The router's states of the fired tasks, amid other tasks' states.
            written = [topics.state(t, S.ROUTED, group=rule.rule_id) for t in fired]
            others.extend(topics.other_tasks(rule.rule_id, 30))
            written.append(topics.state(others[-1], S.SUCCEEDED, group=None))
            read_to(view, written)
            assert view.count_tasks() == 2
            assert sorted(view.task_group(rule.rule_id, OWNER)) == sorted(fired)
            assert all(view.task(t) is None for t in others)
            assert view.task_group(rule.rule_id, OTHER) == []
            # Tombstones of other tasks (their expiry) cost nothing and delete nothing kept.
            read_to(view, [topics.write(catalogue.task_state, t, None) for t in others[:10]])
            assert view.count_tasks() == 2
            assert await fire(made, events[2:]) == [] and made.held

        # Restart: the view is rebuilt from task-state, and still holds only the rule's
        # tasks, which are still in flight: the held event stays held.
        async with planner(kafka, catalogue) as (made, view):
            assert made.in_flight(rule.rule_id) == 2
            assert view.count_tasks() == 2
            assert all(view.task(t) is None for t in others)
            assert await fire(made, events[2:]) == [] and made.held
            read_to(view, [topics.state(fired[0], S.SUCCEEDED, group=rule.rule_id)])
            (third,) = await fire(made, events[2:])
            assert made.held == {(events[3].topic, events[3].partition): events[3].offset}
            assert made.in_flight(rule.rule_id) == 2
            read_to(view, [topics.state(third, S.ROUTED, group=rule.rule_id)])
            assert view.count_tasks() == 3

    asyncio.run(scenario())


def test_states_read_before_their_rule_would_be_are_kept_at_start(
    kafka: KafkaConnection, catalogue: Catalogue, topics: Topics
) -> None:
    # The view reads triggers to its end before task-state, so the states of a rule's
    # tasks count at start although a view reading both at once would read them first:
    # they were written first, and the rule comes after 2.5 MB of other rules (several
    # fetches of triggers' one partition; task-state's states all come in the first).
    rule = make_rule(topics.source, max_in_flight=1_000)
    ours = [f"ours-{uuid.uuid4()}" for _ in range(300)]
    for i, task_id in enumerate(ours):
        topics.state(task_id, S.RUNNING if i % 3 else S.SUCCEEDED, group=rule.rule_id)
    others = topics.other_tasks(rule.rule_id, 30)
    filler = [
        msgspec.structs.replace(
            make_rule(f"trig-filler-{i}", max_in_flight=None),
            owner_id=OTHER,
            name=f"trig-filler-{i}-" + "x" * 200,
        )
        for i in range(4_000)
    ]
    topics.write_many(catalogue.triggers, [(r.rule_id, r) for r in filler])
    topics.rule(rule)

    async def scenario() -> None:
        async with planner(kafka, catalogue) as (made, view):
            assert view.count_tasks() == len(ours)
            assert made.in_flight(rule.rule_id) == len([i for i in range(300) if i % 3])
            assert all(view.task(t) is None for t in others)

    asyncio.run(scenario())


def test_a_paused_then_deleted_rule_keeps_the_count_right(
    kafka: KafkaConnection, catalogue: Catalogue, topics: Topics
) -> None:
    rule = make_rule(topics.source, max_in_flight=1)
    topics.rule(rule)

    async def scenario() -> None:
        async with planner(kafka, catalogue) as (made, view):
            (first,) = await fire(made, [topics.event("a")])
            read_to(view, [topics.state(first, S.RUNNING, group=rule.rule_id)])
            assert view.count_tasks() == 1
        paused = msgspec.structs.replace(rule, paused=True, updated_at=time.time())
        topics.rule(paused)
        # A paused rule's tasks are still its tasks: counted after a restart, and an event
        # while paused fires nothing and is not held.
        async with planner(kafka, catalogue) as (made, view):
            assert made.in_flight(rule.rule_id) == 1 and view.count_tasks() == 1
            assert await fire(made, [topics.event("b")]) == [] and not made.held
            topics.rule(None, rule.rule_id)
            # Deleted: forgotten at the next batch; its tasks' later states are not kept.
            assert await fire(made, [topics.event("c")]) == [] and not made.held
            assert made.in_flight(rule.rule_id) == 0
            read_to(view, [topics.state(first, S.SUCCEEDED, group=rule.rule_id)])
            got = view.task(first)
            assert got is not None and got.state == S.RUNNING
        async with planner(kafka, catalogue) as (made, view):
            assert made.in_flight(rule.rule_id) == 0
            assert view.count_tasks() == 0, "a deleted rule's tasks were kept"
            assert await fire(made, [topics.event("d")]) == [] and not made.held

    asyncio.run(scenario())
