"""Result subscriptions on a running platform: a trigger rule's results, and a task group's.

Rules are registered through the SDK and fired by the platform's trigger processor; the
functions run on the platform's local endpoint; the subscriptions read the user's results
topic. Events are written to ``events.<source>`` as a source would (the admin's producer).
Every source and group name is this module's own (the platform is shared).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.private import PrivatePlatform
from fxstream.sdk import Client, Executor, ResultSubscription, SubscribedResult
from fxstream.service.trigger_processor import firing_task_id
from fxstream.topics import Event, encode

pytestmark = pytest.mark.platform


def key_of(event: dict[str, Any]) -> dict[str, Any]:
    """The rules' function: names the event it ran for."""
    return {"key": event["event_key"], "n": event["attributes"].get("n")}


def square(x: int) -> int:
    """The task group's function."""
    return x * x


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    return shared_platform


@pytest.fixture(scope="module")
def client(stack: PrivatePlatform) -> Iterator[Client]:
    client = stack.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def producer(stack: PrivatePlatform) -> Iterator[Producer]:
    producer = Producer({**stack.kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    yield producer
    producer.flush(10)


def emit(
    stack: PrivatePlatform, producer: Producer, source: str, key: str, n: int
) -> tuple[str, int, int]:
    """Writes one event of ``source``; returns its topic, partition and offset."""
    event = Event(
        source=source,
        event_key=key,
        event_type="file-complete",
        occurred_at=time.time(),
        attributes={"n": n},
    )
    delivered: list[Any] = []
    producer.produce(
        stack.catalogue.events(source),
        key=key.encode(),
        value=encode(event),
        on_delivery=lambda err, msg: delivered.append((err, msg)),
    )
    producer.flush(10)
    error, message = delivered[0]
    assert error is None, error
    return message.topic(), message.partition(), message.offset()


def collect(
    subscription: ResultSubscription, count: int, *, timeout_s: float = 90.0, quiet_s: float = 2.0
) -> list[SubscribedResult]:
    """``count`` results (fails after ``timeout_s``), then whatever else comes within
    ``quiet_s`` (a repeat or a stranger would show there)."""
    got: list[SubscribedResult] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {count} results arrived: {got}"
        result = subscription.get(timeout=left)
        if result is not None:
            got.append(result)
    while (extra := subscription.get(timeout=quiet_s)) is not None:
        got.append(extra)
    return got


def test_a_rule_subscription_gets_exactly_the_results_of_its_firings_once(
    stack: PrivatePlatform, client: Client, producer: Producer
) -> None:
    source = f"sub-{uuid.uuid4().hex[:10]}"
    ensure_event_topic(stack.kafka, stack.catalogue, source)
    function_id = client.register_function(key_of)
    wanted = client.register_trigger(
        source=source, function_id=function_id, endpoint_id=stack.endpoint_id, key_pattern="*.h5"
    )
    other = client.register_trigger(
        source=source, function_id=function_id, endpoint_id=stack.endpoint_id, key_pattern="*.txt"
    )
    try:
        with (
            client.subscribe(rule_id=wanted) as subscription,
            client.subscribe(rule_id=other) as other_subscription,
        ):
            fired: dict[str, tuple[str, int]] = {}
            for n in range(8):
                key = f"run/{n}.h5" if n % 2 == 0 else f"run/{n}.txt"
                coordinates = emit(stack, producer, source, key, n)
                if key.endswith(".h5"):
                    fired[firing_task_id(wanted, *coordinates)] = (key, n)
            got = collect(subscription, len(fired))
            others = collect(other_subscription, 4)
        assert sorted(r.task_id for r in got) == sorted(fired)  # exactly these, each once
        for result in got:
            assert result.ok and result.task_group_id == wanted
            key, n = fired[result.task_id]
            assert result.result() == {"key": key, "n": n}
            assert result.endpoint_id == stack.endpoint_id and result.function_id == function_id
        assert subscription.duplicates == 0 and subscription.foreign == 0
        assert all(r.task_group_id == other for r in others) and len(others) == 4
        assert not {r.task_id for r in others} & set(fired)

        # Started after the results: "created" replays every result of the rule, once.
        with client.subscribe(rule_id=wanted, since="created") as late:
            replayed = collect(late, len(fired), timeout_s=30)
        assert sorted(r.task_id for r in replayed) == sorted(fired)
        # From now: none of them again.
        with client.subscribe(rule_id=wanted) as live:
            assert live.get(timeout=1.5) is None
    finally:
        client.delete_trigger(wanted)
        client.delete_trigger(other)


def test_a_task_group_subscription_gets_the_groups_results_only(
    stack: PrivatePlatform, client: Client
) -> None:
    group, other_group = f"sub-{uuid.uuid4()}", f"sub-{uuid.uuid4()}"
    with client.subscribe(task_group_id=group) as subscription:
        # Another client submits: the subscription sees results it did not submit.
        with stack.client() as submitter:
            mine = Executor(endpoint_id=stack.endpoint_id, client=submitter, task_group_id=group)
            theirs = Executor(
                endpoint_id=stack.endpoint_id, client=submitter, task_group_id=other_group
            )
            futures = [mine.submit(square, i) for i in range(6)]
            strangers = [theirs.submit(square, 100 + i) for i in range(3)]
            assert [f.result(timeout=90) for f in futures] == [i * i for i in range(6)]
            for f in strangers:
                f.result(timeout=90)
            mine.shutdown()
            theirs.shutdown()
        got = collect(subscription, len(futures))
    assert sorted(r.task_id for r in got) == sorted(f.task_id for f in futures)
    assert sorted(r.result() for r in got) == [i * i for i in range(6)]
    assert all(r.task_group_id == group for r in got)
    assert subscription.skipped >= len(strangers)
