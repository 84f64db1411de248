"""Service test fixtures: a private set of topics per test module on the session broker.

Each module gets its own topic prefix, so its registry starts empty and other
modules' records never show up in it; every topic under that prefix (the static
ones and the results.* / tasks.ep.* topics the API creates) is deleted after.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from fxstream.topics import Catalogue, KafkaConnection, Record, encode, ensure_topics
from tests.conftest import RunningPlatform


def delete_topics_under(admin: AdminClient, prefix: str) -> None:
    """Delete every topic whose name starts with ``prefix``."""
    names = [name for name in admin.list_topics(timeout=30).topics if name.startswith(prefix)]
    if not names:
        return
    for future in admin.delete_topics(names, operation_timeout=30).values():
        try:
            future.result(timeout=30)
        except Exception:  # already gone: nothing to clean
            continue


@pytest.fixture(scope="module")
def catalogue(kafka_platform: RunningPlatform) -> Iterator[Catalogue]:
    """A catalogue with a prefix of this module's own, its static topics provisioned."""
    catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    admin = kafka_platform.admin()
    report = ensure_topics(admin, catalogue)
    assert report.ok, report
    try:
        yield catalogue
    finally:
        delete_topics_under(admin, catalogue.prefix)


@pytest.fixture(scope="module")
def module_kafka(kafka_platform: RunningPlatform) -> KafkaConnection:
    """How to connect to the session broker (module-scoped, unlike the top-level ``kafka``)."""
    return kafka_platform.kafka


Produce = Callable[[str, str, Record | bytes | None], tuple[int, int]]


@pytest.fixture(scope="module")
def produce(module_kafka: KafkaConnection) -> Iterator[Produce]:
    """Write one record (a Record, raw bytes, or None for a tombstone); returns (partition, offset).

    It waits for the broker's acknowledgement, as the service's own writes do.
    """
    # As the processors (aiokafka) and every fxstream producer: murmur2 of the key.
    producer = Producer({**module_kafka.confluent_producer(), "acks": "all", "log_level": 2})

    def send(topic: str, key: str, value: Record | bytes | None) -> tuple[int, int]:
        delivered: list[Message] = []
        failures: list[KafkaError] = []

        def report(error: KafkaError | None, message: Message) -> None:
            if error is None:
                delivered.append(message)
            else:
                failures.append(error)

        raw = encode(value) if isinstance(value, Record) else value
        producer.produce(topic, key=key.encode(), value=raw, on_delivery=report)
        assert producer.flush(30) == 0, "the record was not delivered within 30 s"
        assert not failures, failures
        partition, offset = delivered[0].partition(), delivered[0].offset()
        assert partition is not None and offset is not None
        return partition, offset

    yield send
    producer.flush(10)


def eventually(check: Callable[[], bool], *, timeout_s: float = 10.0, what: str = "") -> None:
    """Wait until ``check()`` is true, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not true after {timeout_s}s: {what or check}")
        time.sleep(0.02)
