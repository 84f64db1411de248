"""The Kafka publisher behind fxstream's stream producer: keyed, batched, idempotent.

:class:`KafkaPublisher` implements ProxyStore's ``EventPublisher`` protocol
(:mod:`proxystore.stream.protocols`). Each event batch the
:class:`~proxystore.stream.StreamProducer` hands it becomes one Kafka record on
the stream's topic ``streams.<stream>``: the value is the batch as encoded by
:func:`proxystore.stream.events.event_to_bytes` (opaque to fxstream), the key is
the stream's key (by default its name, so a stream lives in one partition and
its events, end-of-stream included, keep their order).

Unlike ProxyStore's own Kafka shim, which flushes the producer after every
message (a broker round trip per item), records are only queued: librdkafka
groups them into batches (``linger_ms``) and sends them in the background.
:meth:`KafkaPublisher.flush` (and :meth:`KafkaPublisher.close`) waits until every
queued record is acknowledged. A record Kafka refused is never dropped
silently: the next ``send_events``, ``flush`` or ``close`` raises
:class:`~fxstream.sdk.errors.StreamDeliveryFailed` naming it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient
from proxystore.stream.events import EventBatch, event_to_bytes

from fxstream.sdk.errors import PayloadTooLarge, StreamDeliveryFailed, StreamError
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    ProvisionError,
    ProvisionReport,
    budget,
    ensure_topics,
)

__all__ = [
    "DEFAULT_LINGER_MS",
    "RECORD_OVERHEAD_BYTES",
    "KafkaPublisher",
    "StreamKey",
    "ensure_stream_topic",
]

log = logging.getLogger(__name__)

DEFAULT_LINGER_MS: Final = 5.0
"""How long a queued record may wait for others to share its batch (librdkafka ``linger.ms``)."""

RECORD_OVERHEAD_BYTES: Final = budget.RECORD_OVERHEAD_BYTES
"""Headroom for Kafka's record and batch framing when checking a record against the topic limit."""

_FLUSH_TIMEOUT_S: Final = 60.0
_QUEUE_FULL_WAIT_S: Final = 0.05

StreamKey = Callable[[str], str | bytes]
"""Maps a stream name to the Kafka key of its records (default: the name itself)."""


def ensure_stream_topic(
    admin: AdminClient, catalogue: Catalogue, stream: str, *, timeout_s: float = 30.0
) -> str:
    """Create the topic of ``stream`` (``streams.<stream>``) from the catalogue if it is missing.

    Returns the topic's full name. A topic that exists with other settings is
    used as it is (and logged): provisioning never alters a topic.
    """
    topic = catalogue.stream(stream)
    spec = catalogue.spec_for_topic(topic)
    assert spec is not None
    report: ProvisionReport = ensure_topics(admin, catalogue, {topic: spec}, timeout_s=timeout_s)
    for drift in report.drifted:
        log.warning("stream topic differs from the catalogue: %s", drift)
    return topic


def _default_key(stream: str) -> bytes:
    return stream.encode()


class KafkaPublisher:
    """ProxyStore ``EventPublisher`` writing stream events to fxstream's Kafka stream topics.

    ``kafka`` names the brokers and the principal to connect as, ``catalogue`` the deployment's
    topics (prefix). ``key`` maps a stream name to its records' key; keep it
    constant per stream, since Kafka orders records only within a partition and
    the end-of-stream event must follow the stream's items. ``linger_ms`` is how
    long librdkafka holds a record to batch it with later ones. The producer is
    idempotent with ``acks=all``, so a retried send neither duplicates nor
    reorders records. With ``create_topics`` a stream's topic is created from the
    catalogue (``streams.<stream>``, 7 days, delete) on its first event.
    ``kafka_config`` adds or overrides librdkafka settings.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        *,
        catalogue: Catalogue | None = None,
        key: StreamKey | None = None,
        linger_ms: float = DEFAULT_LINGER_MS,
        create_topics: bool = True,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        if linger_ms < 0:
            raise ValueError(f"linger_ms must be >= 0, not {linger_ms}")
        self.kafka = kafka
        self.catalogue = catalogue if catalogue is not None else Catalogue()
        self._key: StreamKey = key if key is not None else _default_key
        self._create_topics = create_topics
        self._kafka_config = dict(kafka_config or {})
        self._topics: dict[str, tuple[str, int]] = {}
        self._failures: list[str] = []
        self._failures_lock = threading.Lock()
        self._closed = False
        streams_spec = self.catalogue.spec_for_topic(self.catalogue.stream("x"))
        assert streams_spec is not None
        config: dict[str, Any] = {
            **kafka.confluent_producer(),
            # librdkafka's own cap (1,000,000) is below the topic's; records are checked
            # against the topic's limit in send_events, and batches stay within batch.size.
            "message.max.bytes": budget.producer_message_max_bytes(self.catalogue),
            "batch.size": min(1_000_000, streams_spec.max_message_bytes),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            # Only failures call back: a Python call per acknowledged record costs about as
            # much as producing it.
            "delivery.report.only.error": True,
            "on_delivery": self._on_delivery,
            "log_level": 3,
        }
        config.update(self._kafka_config)
        self.producer = Producer(config)

    # --- ProxyStore's EventPublisher ---------------------------------------------------

    def send_events(self, events: EventBatch) -> None:
        """Queue ``events`` (one stream's batch) as one record; raise earlier delivery failures.

        Returns as soon as the record is queued. Raises
        :class:`~fxstream.sdk.errors.PayloadTooLarge` when the encoded batch
        cannot fit the topic's ``max.message.bytes`` (an object sent inline
        because the stream has no store), and
        :class:`~fxstream.sdk.errors.StreamDeliveryFailed` when Kafka refused an
        earlier record.
        """
        self._check_open()
        self.raise_failures()
        topic, limit = self._topic(events.topic)
        key = self._key(events.topic)
        key_bytes = key.encode() if isinstance(key, str) else key
        value = event_to_bytes(events)
        size = budget.record_bytes(key_bytes, value)
        if size > limit:
            raise PayloadTooLarge(
                f"a stream event of {len(value):,} bytes does not fit topic {topic!r} "
                f"(max.message.bytes {limit:,}, less {RECORD_OVERHEAD_BYTES} bytes of framing): "
                "give the stream producer a store (stream_producer(..., store=Store(...))) so "
                "objects travel by reference and only their keys ride in Kafka",
                size=size,
                limit=limit,
                setting="store",
            )
        self._produce(topic, key_bytes, value)

    def close(self) -> None:
        """Wait until every queued record is acknowledged, then stop; raise if any failed."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True

    # --- batching and delivery ---------------------------------------------------------

    def flush(self, timeout_s: float = _FLUSH_TIMEOUT_S) -> None:
        """Wait until every queued record is acknowledged; raise if any was refused or timed out."""
        self._check_open()
        left = self.producer.flush(timeout_s)
        if left:
            raise StreamDeliveryFailed(
                f"{left} stream record(s) still unacknowledged after {timeout_s:g} s: is the "
                f"broker at {self.kafka.bootstrap} reachable?",
                failures=[f"{left} unacknowledged"],
            )
        self.raise_failures()

    def raise_failures(self) -> None:
        """Raise :class:`~fxstream.sdk.errors.StreamDeliveryFailed` for records Kafka refused.

        Each failure is reported once. Delivery reports arrive in the background
        and are collected whenever the publisher polls (every send, flush, close).
        """
        self.producer.poll(0)
        with self._failures_lock:
            failures, self._failures = self._failures, []
        if failures:
            raise StreamDeliveryFailed(
                f"Kafka refused {len(failures)} stream record(s); first: {failures[0]}",
                failures=failures,
            )

    def _on_delivery(self, error: KafkaError | None, message: Message) -> None:
        if error is None:
            return
        with self._failures_lock:
            self._failures.append(
                f"topic {message.topic()} key {message.key()!r}: {error.str()} ({error.name()})"
            )

    def _produce(self, topic: str, key: bytes, value: bytes) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key=key)
                break
            except BufferError:
                # librdkafka's local queue is full: let it send, then try again.
                self.producer.poll(_QUEUE_FULL_WAIT_S)
            except KafkaException as exc:
                raise StreamError(f"cannot queue a record for topic {topic!r}: {exc}") from exc
        self.producer.poll(0)

    # --- topics ------------------------------------------------------------------------

    def ensure_stream(self, stream: str) -> str:
        """The topic of ``stream``, created from the catalogue first when ``create_topics``."""
        return self._topic(stream)[0]

    def _topic(self, stream: str) -> tuple[str, int]:
        known = self._topics.get(stream)
        if known is not None:
            return known
        topic = self.catalogue.stream(stream)
        spec = self.catalogue.spec_for_topic(topic)
        assert spec is not None
        if self._create_topics:
            admin_config: dict[str, Any] = {
                **self.kafka.confluent(),
                "log_level": 3,
            }
            admin_config.update(_admin_settings(self._kafka_config))
            started = time.monotonic()
            try:
                ensure_stream_topic(AdminClient(admin_config), self.catalogue, stream)
            except ProvisionError as exc:
                raise StreamError(
                    f"cannot create the topic of stream {stream!r}: {exc}; create {topic!r} "
                    "(see docs/topics.md) or check the broker address"
                ) from exc
            log.debug("stream topic %s ready in %.3f s", topic, time.monotonic() - started)
        self._topics[stream] = (topic, spec.max_message_bytes)
        return self._topics[stream]

    def _check_open(self) -> None:
        if self._closed:
            raise StreamError("this stream publisher is closed; create a new one")


# Settings an AdminClient shares with a producer: where and how to connect, not what to produce.
_CONNECTION_PREFIXES: Final = ("security.", "sasl.", "ssl.", "client.", "socket.")


def _admin_settings(kafka_config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kafka_config.items() if k.startswith(_CONNECTION_PREFIXES)}
