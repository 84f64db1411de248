"""Every fxstream producer puts a key on the partition aiokafka (and Kafka's Java client) puts it.

Different clients write the same keys to one topic: the processors (aiokafka) and the task
expiry (confluent-kafka) to ``task-state``, the processors and the agent to
``results.<user>``. A compacted topic keeps a key's latest record, and a tombstone deletes
it, only within its partition, so the two must agree. Both are checked on the real broker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.partitioner import DefaultPartitioner, murmur2  # type: ignore[import-untyped]
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import NewTopic
from hypothesis import given, settings
from hypothesis import strategies as st

from fxstream.topics import KafkaConnection
from fxstream.topics import partitioner as placement
from fxstream.topics.partitioner import Murmur2Partitioner, murmur2_partition
from tests.conftest import RunningPlatform

PARTITIONS = 4
KEYS = [f"task-{index:04d}".encode() for index in range(200)]


def _confluent_partitions(settings: dict[str, str | int], topic: str) -> dict[bytes, int]:
    placed: dict[bytes, int] = {}
    failures: list[KafkaError] = []

    def report(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(error)
            return
        key, partition = message.key(), message.partition()
        assert key is not None and partition is not None
        placed[key] = partition

    producer = Producer({**settings, "acks": "all", "log_level": 2})
    for key in KEYS:
        producer.produce(topic, key=key, value=b"v", on_delivery=report)
    assert producer.flush(30) == 0
    assert not failures, failures
    return placed


def _aiokafka_partitions(kafka: KafkaConnection, topic: str, **settings: Any) -> dict[bytes, int]:
    async def send() -> dict[bytes, int]:
        producer = AIOKafkaProducer(**kafka.aiokafka(), acks="all", **settings)
        await producer.start()
        try:
            placed: dict[bytes, int] = {}
            for key in KEYS:
                metadata = await producer.send_and_wait(topic, key=key, value=b"v")
                placed[key] = metadata.partition
            return placed
        finally:
            await producer.stop()

    return asyncio.run(send())


def test_a_confluent_producer_puts_each_key_where_aiokafka_does(
    kafka_platform: RunningPlatform,
    kafka: KafkaConnection,
    unique_prefix: str,
    topic_cleanup: list[str],
) -> None:
    topic = f"{unique_prefix}partitioner"
    topic_cleanup.append(topic)
    admin = kafka_platform.admin()
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        future.result(timeout=30)

    by_aiokafka = _aiokafka_partitions(kafka, topic)
    by_fxstream = _confluent_partitions(kafka.confluent_producer(), topic)
    by_processors = _aiokafka_partitions(kafka, topic, partitioner=Murmur2Partitioner())
    assert len(set(by_aiokafka.values())) == PARTITIONS  # the keys spread over all of them
    for name, placed in (("confluent", by_fxstream), ("processors", by_processors)):
        moved = [key for key in KEYS if placed[key] != by_aiokafka[key]]
        assert not moved, f"{name}: {len(moved)} of {len(KEYS)} keys elsewhere, e.g. {moved[:3]}"

    # librdkafka's own default would not do: the setting is what makes them agree.
    by_default = _confluent_partitions(kafka.confluent(), topic)
    assert sum(by_default[key] != by_aiokafka[key] for key in KEYS) > len(KEYS) // 2


@settings(max_examples=2_000, deadline=None)
@given(key=st.binary(max_size=300), partitions=st.integers(min_value=1, max_value=10_000))
def test_the_partition_is_kafkas_for_any_key_and_partition_count(
    key: bytes, partitions: int
) -> None:
    expected = (murmur2(key) & 0x7FFFFFFF) % partitions
    assert murmur2_partition(key, partitions) == expected
    assert placement.murmur2(key) == murmur2(key)  # the fallback in Python
    every = list(range(partitions))
    assert Murmur2Partitioner()(key, every, every) == DefaultPartitioner()(key, every, every)


def test_the_c_function_of_librdkafka_is_the_one_in_use() -> None:
    # The fallback is correct but 20 times slower: a silent fallback here would be a
    # performance regression, so this machine must find librdkafka's.
    assert placement.partition_function() is not placement._python_partition
    with pytest.raises(ValueError, match="at least one partition"):
        murmur2_partition(b"k", 0)
    assert Murmur2Partitioner()(None, [0, 1, 2], [2]) == 2  # no key: an available one
