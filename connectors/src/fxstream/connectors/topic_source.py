"""A Kafka-topic source: events on ``events.<source>`` derived from records on a named topic.

:class:`TopicEventSource` consumes a topic the user names (any topic its principal may read)
in the consumer group ``fxstream-source.<source>.topic`` and, for each record, writes the
event ``derive`` makes of it (default :func:`record_event`: ``event_type="kafka-record"``,
naming the record by ``topic``, ``partition`` and ``offset``, with its ``key`` when it is
short UTF-8, its ``size``, its Kafka ``timestamp`` and, for a fxstream record, its ``kind``).
The record's value is not copied: the event refers to it where it is. A ``derive`` that
returns None skips the record (a filter).

Exactly once: the events of a batch and the consumer's offsets after it commit in one
Kafka transaction (transactional id ``fxstream-source.<source>.topic``), consume-transform-
produce. A source killed at any point and restarted resumes from the last committed
offsets; the events of an uncommitted batch were aborted with it, so each input record gives
its event once (to ``read_committed`` readers). The input is read with ``read_committed``.

Permissions: the source's principal ``src.<source>`` may write ``events.<source>`` and use
its groups and transactional ids; READ on the input topic is not in the ACL table (a topic
of the user's choosing), so run it as the admin or have the admin grant that READ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from fxstream.connectors.event_writer import EventWriter, source_group
from fxstream.topics import Event, record_kind

__all__ = ["RECORD_EVENT_TYPE", "TopicEventSource", "record_event"]

log = logging.getLogger(__name__)

RECORD_EVENT_TYPE: Final = "kafka-record"
_MAX_KEY_CHARS: Final = 256
_BATCH: Final = 500

Derive = Callable[[str, Message], Event | None]


def record_event(source: str, message: Message) -> Event:
    """The default event for a consumed record: a reference to it, never its value."""
    topic, partition, offset = message.topic() or "", message.partition(), message.offset()
    value = message.value()
    raw_key = message.key()
    key: str | None = None
    if raw_key is not None and len(raw_key) <= _MAX_KEY_CHARS:
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            key = None
    _kind, timestamp_ms = message.timestamp()
    return Event(
        source=source,
        event_key=f"{topic}:{partition}:{offset}",
        event_type=RECORD_EVENT_TYPE,
        occurred_at=timestamp_ms / 1000.0 if timestamp_ms > 0 else time.time(),
        attributes={
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "key": key,
            "size": len(value) if value is not None else None,
            "timestamp_ms": timestamp_ms,
            "kind": record_kind(value),
        },
    )


class TopicEventSource:
    """Turns the records of ``input_topic`` into events, exactly once (see the module doc).

    Args:
        writer: the source's event writer (not yet started: :meth:`run` starts it).
        input_topic: the topic to read (its full name).
        derive: ``(source, message) -> Event | None``; default :func:`record_event`.
        from_beginning: where a new group starts: the topic's first record (True) or its
            end (False).
        poll_s: how long one poll waits before ``stop`` is looked at.

    Run one per source: it is a static member of its group (``group.instance.id``).
    """

    def __init__(
        self,
        writer: EventWriter,
        input_topic: str,
        *,
        derive: Derive = record_event,
        from_beginning: bool = True,
        poll_s: float = 0.25,
    ) -> None:
        self.writer = writer
        self.input_topic = input_topic
        self.derive = derive
        self.from_beginning = from_beginning
        self.poll_s = poll_s
        self.group = source_group(writer.source, "topic")
        self.emitted = 0
        """Events this source wrote."""
        self.ready = threading.Event()
        """Set once the consumer has its partitions."""

    def run(self, stop: threading.Event) -> None:
        """Consume and write events until ``stop`` is set."""
        self.writer.start(scan=False)
        consumer = Consumer(
            {
                **self.writer.connection.confluent(),
                "group.id": self.group,
                # Static membership: a restarted source takes its partitions over at once
                # instead of waiting a session timeout for its dead predecessor.
                "group.instance.id": self.group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest" if self.from_beginning else "latest",
                "isolation.level": "read_committed",
                "log_level": 3,
            }
        )

        def assigned(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            self.ready.set()

        consumer.subscribe([self.input_topic], on_assign=assigned)
        try:
            while not stop.is_set():
                messages = consumer.consume(_BATCH, timeout=self.poll_s)
                if not messages:
                    continue
                events: list[Event] = []
                ends: dict[tuple[str, int], int] = {}
                for message in messages:
                    error = message.error()
                    if error is not None:
                        if error.fatal():
                            raise KafkaException(error)
                        log.warning("consumer error on %s: %s", self.input_topic, error)
                        continue
                    event = self.derive(self.writer.source, message)
                    if event is not None:
                        events.append(event)
                    where = (message.topic() or "", message.partition() or 0)
                    ends[where] = max(ends.get(where, -1), (message.offset() or 0) + 1)
                offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(ends.items())]
                # A failure raises: the position moved past the batch, so the only correct
                # continuation is a restart from the committed offsets.
                self.writer.write(
                    events, offsets=offsets, group_metadata=consumer.consumer_group_metadata()
                )
                self.emitted += len(events)
        finally:
            consumer.close()
            self.writer.close()
