"""An endpoint's log lines, read from ``endpoint-logs`` for its owner (``GET
/v1/endpoints/{id}/logs``).

Agents ship their log in :class:`~fxstream.topics.EndpointLogs` batches
(:mod:`fxstream.agent.log_shipper`); the ingress forwards each, keyed by its endpoint, to
the shared ``endpoint-logs`` topic, so one endpoint's batches are all in one partition
(murmur2 of the key, as every fxstream producer places keys: fxstream.topics.partitioner). A
request reads the tail of that partition only, at most ``scan`` batches back (kept for the
topic's retention, 3 days), and answers the newest ``limit`` lines of the endpoint at or
above ``level`` and after ``since``, oldest first. Nothing is kept between requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from confluent_kafka import Consumer, KafkaError, TopicPartition

from fxstream.topics import EndpointLogs, KafkaConnection, RecordDecodeError, decode
from fxstream.topics.acls import SERVICE_VIEW_GROUP
from fxstream.topics.partitioner import murmur2_partition

__all__ = ["DEFAULT_SCAN", "LEVELS", "read_endpoint_logs"]

log = logging.getLogger(__name__)

DEFAULT_SCAN: Final = 2_000
"""Batches read back from the end of the endpoint's partition, at most."""
LEVELS: Final = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
"""The levels a request may filter on, lowest first."""
_POLL_S: Final = 0.5


def read_endpoint_logs(
    kafka: KafkaConnection,
    topic: str,
    endpoint_id: str,
    *,
    limit: int = 200,
    level: str = "INFO",
    since: float | None = None,
    scan: int = DEFAULT_SCAN,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """``{"lines": [{"at", "level", "logger", "message", "agent_id", "hostname"}],
    "dropped": int, "scanned": int, "complete": bool}`` (see the module notes).

    ``complete`` is false when the scan reached its ``scan`` bound or ``timeout_s`` with
    older batches left unread; ``dropped`` sums what the agents said they dropped."""
    floor = LEVELS[level]
    consumer = Consumer(
        {
            **kafka.confluent(),
            "group.id": SERVICE_VIEW_GROUP,  # assigned, never joined
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "log_level": 2,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=timeout_s).topics[topic]
        partitions = sorted(metadata.partitions)
        if not partitions:
            return {"lines": [], "dropped": 0, "scanned": 0, "complete": True}
        key = endpoint_id.encode()
        partition = partitions[murmur2_partition(key, len(partitions))]
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout_s
        )
        start = max(low, high - scan)
        lines: list[dict[str, Any]] = []
        dropped = scanned = 0
        if high > start:
            consumer.assign([TopicPartition(topic, partition, start)])
            deadline = time.monotonic() + timeout_s
            position = start
            while position < high and time.monotonic() < deadline:
                message = consumer.poll(_POLL_S)
                if message is None:
                    continue
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        break
                    log.warning("reading %s [%s]: %s", topic, partition, error)
                    continue
                position = (message.offset() or 0) + 1
                scanned += 1
                if message.key() != key:
                    continue
                try:
                    batch = decode(message.value(), EndpointLogs)
                except RecordDecodeError:
                    continue  # the ingress checked it; a record nobody can read says nothing
                dropped += batch.dropped
                lines.extend(
                    {
                        "at": line.at,
                        "level": line.level,
                        "logger": line.logger,
                        "message": line.message,
                        "agent_id": batch.agent_id,
                        "hostname": batch.hostname,
                    }
                    for line in batch.lines
                    if LEVELS.get(line.level, 0) >= floor and (since is None or line.at > since)
                )
            complete = start == low and position >= high
        else:
            complete = True
        lines.sort(key=lambda line: line["at"])
        return {
            "lines": lines[-limit:],
            "dropped": dropped,
            "scanned": scanned,
            "complete": complete,
        }
    finally:
        consumer.close()
