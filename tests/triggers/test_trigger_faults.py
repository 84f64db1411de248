"""The trigger processor SIGKILLed mid-stream and restarted by its supervisor: every event
fires its rule exactly once (no firing lost, none repeated).

The module starts a platform of its own: it kills one of its processes.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.services import ServiceSet
from fxstream.service.trigger_processor import firing_task_id
from fxstream.topics import Event, RecordDecodeError, TaskSubmission, decode, encode
from tests.e2e.stack import Stack, committed_records, running_stack

pytestmark = pytest.mark.platform

EVENTS = 150


def key_of(event: dict[str, Any]) -> str:
    """Returns the event's key."""
    return str(event["event_key"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from running_stack(tmp_path_factory.mktemp("trigger-faults"))


def test_a_trigger_processor_killed_and_restarted_neither_loses_nor_repeats_a_firing(
    stack: Stack,
) -> None:
    client = stack.client()
    producer = Producer({**stack.kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    try:
        source = f"trig-{uuid.uuid4().hex[:10]}"
        topic = ensure_event_topic(stack.kafka, stack.catalogue, source)
        rule_id = client.register_trigger(
            source=source,
            function_id=client.register_function(key_of),
            endpoint_id=stack.endpoint_id,
        )
        trigger = ServiceSet(stack.config).trigger
        coordinates: list[tuple[str, int, int]] = []

        def delivered(error: Any, message: Any) -> None:
            assert error is None, error
            coordinates.append((message.topic(), message.partition(), message.offset()))

        for i in range(EVENTS):
            event = Event(
                source=source,
                event_key=f"e-{i}",
                event_type="file-complete",
                occurred_at=time.time(),
            )
            producer.produce(
                topic, key=event.event_key.encode(), value=encode(event), on_delivery=delivered
            )
            producer.poll(0)
            time.sleep(0.02)
            if i == 50:
                assert trigger.kill(), "the trigger processor was not running"
            if i == 100:
                trigger.start()  # the supervisor restarts it after its backoff; now
        assert producer.flush(30) == 0
        assert len(coordinates) == EVENTS
        expected = {firing_task_id(rule_id, *c) for c in coordinates}

        deadline = time.monotonic() + 120
        while True:
            status = client.get_trigger(rule_id)["status"]
            if status["states"].get("succeeded") == EVENTS and status["waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"not every event fired; last: {status}"
            time.sleep(0.5)
        assert status["fired"] == EVENTS
        tasks = client.get_taskgroup_tasks(rule_id)
        assert {t["task_id"] for t in tasks} == expected
        assert sorted(client.get_result(t["task_id"]) for t in tasks) == sorted(
            f"e-{i}" for i in range(EVENTS)
        )
        # Exactly one committed submission per (rule, event): none lost, none repeated.
        fired: Counter[str] = Counter()
        for record in committed_records(stack.kafka, stack.catalogue.from_user(client.user_id)):
            try:
                submission = decode(record.value(), TaskSubmission)
            except RecordDecodeError:
                continue
            if submission.trigger is not None and submission.trigger.rule_id == rule_id:
                fired[submission.task_id] += 1
        assert set(fired) == expected
        assert max(fired.values()) == 1, fired.most_common(3)
        client.delete_trigger(rule_id)
    finally:
        producer.flush(10)
        client.close()
