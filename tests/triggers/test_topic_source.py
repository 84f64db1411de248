"""The Kafka-topic source on the session broker: one event per input record, by reference,
exactly once across a SIGKILL and a restart (consume-transform-produce in transactions)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Producer

from fxstream.connectors.topic_source import RECORD_EVENT_TYPE
from fxstream.topics import KafkaConnection
from tests.triggers.support import read_events, start_source, wait_for_events


def _produce(kafka: KafkaConnection, topic: str, start: int, count: int) -> None:
    producer = Producer({**kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    for i in range(start, start + count):
        producer.produce(topic, key=f"item-{i}".encode(), value=b"v" * (100 + i))
    assert producer.flush(30) == 0


def test_records_of_a_named_topic_become_events_once_across_a_kill(
    kafka: KafkaConnection,
    credentials: Path,
    unique_prefix: str,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    # Any topic the user names; here another events topic, made by the admin.
    input_topic = event_topic(f"{source_name}-input")
    command = ("topic", input_topic, "--source", source_name)
    _produce(kafka, input_topic, 0, 40)
    with start_source(tmp_path, credentials, unique_prefix, *command) as first:
        first.wait_ready()
        wait_for_events(kafka, topic, lambda found: len(found) >= 40)
        _produce(kafka, input_topic, 40, 30)
        time.sleep(0.05)
        first.kill()  # maybe mid-transaction
    _produce(kafka, input_topic, 70, 30)
    with start_source(tmp_path, credentials, unique_prefix, *command) as second:
        second.wait_ready()
        wait_for_events(kafka, topic, lambda found: len(found) >= 100)
        time.sleep(1.0)
        assert second.terminate() == 0, second.log.read_text()[-2000:]
    events = read_events(kafka, topic)
    counts = Counter(e.event_key for e in events)
    assert {key: n for key, n in counts.items() if n != 1} == {}, "an input record twice"
    assert len(counts) == 100, "an input record lost"
    keys = sorted(str(e.attributes["key"]) for e in events)
    assert keys == sorted(f"item-{i}" for i in range(100))
    for event in events:
        assert event.event_type == RECORD_EVENT_TYPE
        assert event.attributes["topic"] == input_topic
        assert event.event_key == (
            f"{input_topic}:{event.attributes['partition']}:{event.attributes['offset']}"
        )
        index = int(str(event.attributes["key"]).removeprefix("item-"))
        assert event.attributes["size"] == 100 + index
        assert event.data is None, "the event refers to the record; its value is not copied"
