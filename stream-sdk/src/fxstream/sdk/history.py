"""Reading results back from a user's results topic: what replay needs from before it started.

The results listener only sees what arrives after it starts. A task that ended
while no client was running has its result in ``task-state`` (what the service
answers), except when that state is not there yet (the task-state processor
lags a little behind the results topic) or its value was too large for a
task-state record. For those, :func:`read_back_results` reads the results topic
itself: from each task's submission time (located with ``offsets_for_times``)
up to given offsets, the point from which the listener takes over.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Final

from confluent_kafka import Consumer, KafkaException, TopicPartition

from fxstream.sdk.errors import FxstreamError
from fxstream.topics import KafkaConnection, RecordDecodeError, TaskResult, decode

__all__ = ["CLOCK_SKEW_S", "read_back_results"]

log = logging.getLogger(__name__)

CLOCK_SKEW_S: Final = 300.0
"""How far an agent's clock (which stamps results) may lag the submitting client's clock."""

_POLL_S: Final = 0.2
_BATCH: Final = 1_000


def read_back_results(
    kafka: KafkaConnection,
    topic: str,
    wanted: Mapping[str, float],
    until: Mapping[int, int],
    *,
    timeout: float = 120.0,
    kafka_config: Mapping[str, Any] | None = None,
    group_id: str | None = None,
) -> dict[str, TaskResult]:
    """The first committed result of each wanted task found in ``topic`` before ``until``.

    ``wanted`` maps task ids to their submission times (seconds since the
    epoch); every partition is read from the first record stamped at or after
    the earliest of them (less :data:`CLOCK_SKEW_S`) up to, not including, its
    offset in ``until``. Stops early once every wanted task is found. Results
    deleted by the topic's retention are not found. Raises
    :class:`FxstreamError` when the broker does not answer, or the reading
    takes longer than ``timeout`` seconds. ``group_id`` is the (never joined) group
    librdkafka requires: one under the user's prefix ``fxstream-user.<user id>.``.
    """
    if not wanted or not until:
        return {}
    since_ms = max(0, int((min(wanted.values()) - CLOCK_SKEW_S) * 1000))
    consumer = Consumer(
        {
            **kafka.confluent(),
            # Required by librdkafka although no group is joined (assign, no commits).
            "group.id": group_id or f"fxstream-sdk-history-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 100,
            "log_level": 3,
            **(kafka_config or {}),
        }
    )
    try:
        return _read(consumer, topic, wanted, until, since_ms, timeout)
    except KafkaException as exc:
        raise FxstreamError(
            f"cannot read results back from {topic!r} ({exc}); is the broker up?"
        ) from exc
    finally:
        consumer.close()


def _read(
    consumer: Consumer,
    topic: str,
    wanted: Mapping[str, float],
    until: Mapping[int, int],
    since_ms: int,
    timeout: float,
) -> dict[str, TaskResult]:
    deadline = time.monotonic() + timeout
    located = consumer.offsets_for_times(
        [TopicPartition(topic, partition, since_ms) for partition in sorted(until)],
        timeout=timeout,
    )
    start: list[TopicPartition] = []
    for tp in located:
        end = until[tp.partition]
        # -1: no record stamped at or after since_ms, so nothing before `end` to read.
        if tp.error is None and 0 <= tp.offset < end:
            start.append(TopicPartition(topic, tp.partition, tp.offset))
    found: dict[str, TaskResult] = {}
    if not start:
        return found
    consumer.assign(start)
    open_partitions = {tp.partition for tp in start}
    while open_partitions and len(found) < len(wanted):
        if time.monotonic() > deadline:
            raise FxstreamError(
                f"reading results back from {topic!r} took longer than {timeout:g} s "
                f"({len(found)} of {len(wanted)} tasks found); retry, or raise the timeout"
            )
        first = consumer.poll(_POLL_S)
        messages = [] if first is None else [first, *consumer.consume(_BATCH - 1, timeout=0)]
        for message in messages:
            partition, offset = message.partition(), message.offset()
            if message.error() is not None or partition is None or offset is None:
                continue
            if partition not in open_partitions:
                continue
            if offset >= until[partition]:
                _close(consumer, topic, partition, open_partitions)
                continue
            try:
                result = decode(message.value(), TaskResult)
            except RecordDecodeError as exc:
                log.debug("read-back skips %s [%s] @ %s: %s", topic, partition, offset, exc)
                continue
            if result.task_id in wanted and result.task_id not in found:
                found[result.task_id] = result
        # Transaction markers and aborted records move the position past `until`
        # without handing over a record at or after it.
        for tp in consumer.position([TopicPartition(topic, p) for p in sorted(open_partitions)]):
            if tp.offset >= until[tp.partition]:
                _close(consumer, topic, tp.partition, open_partitions)
    return found


def _close(consumer: Consumer, topic: str, partition: int, open_partitions: set[int]) -> None:
    open_partitions.discard(partition)
    consumer.pause([TopicPartition(topic, partition)])
