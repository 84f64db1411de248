"""The stream processors' aiokafka batches stay within every topic's limit (real broker).

The broker checks a whole record batch against the topic's ``max.message.bytes``. With
1 MiB batches the ingress put two 177 kB heartbeats of busy endpoints into one batch for
``heartbeats`` (256 KiB): the broker refused both, the ingress's transaction failed and
it set aside (dead-lettered) heartbeats and results that each fitted. Found by
``./fx bench routing`` (four endpoints holding ~750 leases each).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from confluent_kafka.admin import NewTopic

from fxstream.service.processors import build_app
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    aiokafka_max_batch_size,
    aiokafka_max_request_size,
)
from tests.conftest import RunningPlatform

HEARTBEATS_LIMIT = Catalogue().spec("heartbeats").max_message_bytes
RECORD = b"h" * 177_042  # a busy endpoint's heartbeat, as the bench saw it


def test_the_batch_size_is_the_smallest_topic_limit(tmp_path: Path) -> None:
    catalogue = Catalogue()
    assert aiokafka_max_batch_size(catalogue) == min(s.max_message_bytes for s in catalogue.specs)
    assert aiokafka_max_batch_size(catalogue) == HEARTBEATS_LIMIT == 262_144
    app = build_app(
        KafkaConnection("127.0.0.1:1"), catalogue, data_dir=tmp_path / "faust", roles=("liveness",)
    )
    assert app.conf.producer_max_batch_size == aiokafka_max_batch_size(catalogue)


async def _send_two(kafka: KafkaConnection, topic: str, max_batch_size: int) -> list[bytes]:
    """Two heartbeat-sized records to one partition in one transaction; what was committed."""
    settings: dict[str, Any] = {
        **kafka.aiokafka(),
        "transactional_id": f"{topic}-writer",
        "enable_idempotence": True,
        "acks": "all",
        "max_request_size": aiokafka_max_request_size(Catalogue()),
        "max_batch_size": max_batch_size,
    }
    producer = AIOKafkaProducer(**settings)
    await producer.start()
    try:
        async with producer.transaction():
            sent = [await producer.send(topic, RECORD, key=b"ep", partition=0) for _ in range(2)]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        **kafka.aiokafka(),
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_bytes=4 * 1_048_576,
        max_partition_fetch_bytes=4 * 1_048_576,
    )
    await consumer.start()
    try:
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 30
        while len(got) < 2 and asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(timeout_ms=1_000)
            got += [record.value or b"" for records in batches.values() for record in records]
        return got
    finally:
        await consumer.stop()


def _topic(kafka_platform: RunningPlatform, name: str, topic_cleanup: list[str]) -> str:
    admin = kafka_platform.admin()
    config = {"max.message.bytes": str(HEARTBEATS_LIMIT)}
    for future in admin.create_topics([NewTopic(name, 1, 1, config=config)]).values():
        future.result(timeout=30)
    topic_cleanup.append(name)
    return name


def test_two_large_records_in_one_transaction_both_land(
    kafka_platform: RunningPlatform,
    kafka: KafkaConnection,
    unique_prefix: str,
    topic_cleanup: list[str],
) -> None:
    topic = _topic(kafka_platform, f"{unique_prefix}heartbeats", topic_cleanup)
    got = asyncio.run(_send_two(kafka, topic, aiokafka_max_batch_size(Catalogue())))
    assert got == [RECORD, RECORD]


def test_the_old_one_mebibyte_batch_is_refused_by_the_same_topic(
    kafka_platform: RunningPlatform,
    kafka: KafkaConnection,
    unique_prefix: str,
    topic_cleanup: list[str],
) -> None:
    """The negative control: what the processors did before."""
    topic = _topic(kafka_platform, f"{unique_prefix}heartbeats-old", topic_cleanup)
    with pytest.raises(MessageSizeTooLargeError):
        asyncio.run(_send_two(kafka, topic, 1_048_576))
