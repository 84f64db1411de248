"""ProxyStore stream producers and consumers wired to fxstream's Kafka and a store.

:func:`stream_producer` and :func:`stream_consumer` return ProxyStore's
:class:`~proxystore.stream.StreamProducer` / :class:`~proxystore.stream.StreamConsumer`
(as the thin subclasses :class:`KafkaStreamProducer` / :class:`KafkaStreamConsumer`)
on a :class:`~fxstream.sdk.streams.publisher.KafkaPublisher` /
:class:`~fxstream.sdk.streams.subscriber.KafkaSubscriber`. With a store, the
producer puts each object in it and Kafka carries only the event with the key;
the consumer yields proxies that resolve from the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

from proxystore.store import Store
from proxystore.stream import StreamConsumer, StreamProducer
from proxystore.stream.protocols import Filter

from fxstream.sdk.client import Client
from fxstream.sdk.settings import DEFAULT_TOPIC_PREFIX, ClientSettings
from fxstream.sdk.streams.publisher import DEFAULT_LINGER_MS, KafkaPublisher, StreamKey
from fxstream.sdk.streams.subscriber import DEFAULT_COMMIT_EVERY, KafkaSubscriber
from fxstream.topics import Catalogue, KafkaConnection

__all__ = [
    "KafkaStreamConsumer",
    "KafkaStreamProducer",
    "StreamSource",
    "stream_consumer",
    "stream_producer",
]

T = TypeVar("T")

StreamSource = Client | ClientSettings | KafkaConnection
"""Where a stream's Kafka is: a Client, its settings, or a KafkaConnection (+ ``topic_prefix``)."""


def _connection(
    source: StreamSource, topic_prefix: str | None
) -> tuple[KafkaConnection, Catalogue]:
    if isinstance(source, Client):
        catalogue = source.catalogue
        kafka = source.kafka
    elif isinstance(source, ClientSettings):
        catalogue = Catalogue(prefix=source.topic_prefix)
        kafka = source.kafka
    elif isinstance(source, KafkaConnection):
        catalogue = Catalogue(prefix=DEFAULT_TOPIC_PREFIX)
        kafka = source
    else:
        raise TypeError(
            f"streams connect through a Client, ClientSettings or a KafkaConnection, "
            f"not {type(source).__name__}"
        )
    if topic_prefix is not None:
        catalogue = Catalogue(prefix=topic_prefix)
    return kafka, catalogue


class KafkaStreamProducer(StreamProducer[T]):
    """ProxyStore's ``StreamProducer`` on a :class:`KafkaPublisher`.

    Everything is ProxyStore's; the difference is :meth:`flush`, which also
    waits for Kafka to acknowledge what was sent (the publisher never flushes
    per record).
    """

    def __init__(
        self,
        publisher: KafkaPublisher,
        *,
        default_store: Store[Any] | None = None,
        stores: Mapping[str, Store[Any] | None] | None = None,
        batch_size: int = 1,
        filter_: Filter | None = None,
    ) -> None:
        super().__init__(
            publisher,
            default_store=default_store,
            stores=stores,
            batch_size=batch_size,
            filter_=filter_,
        )
        self.kafka = publisher

    def flush(self) -> None:
        """Send every topic's buffered objects, then wait until Kafka acknowledged all records."""
        super().flush()
        self.kafka.flush()


class KafkaStreamConsumer(StreamConsumer[T]):
    """ProxyStore's ``StreamConsumer`` on a :class:`KafkaSubscriber`, with commits.

    Iterating yields the stream's items (proxies when the producer used a
    store) until the producer closes the stream. :meth:`commit` marks every item
    returned so far as done. Leaving a ``with`` block normally commits
    everything returned (end of stream included); leaving it with an exception
    commits only the items before the one in hand, which a restarted consumer
    of the same group receives again.
    """

    def __init__(self, subscriber: KafkaSubscriber, *, filter_: Filter | None = None) -> None:
        super().__init__(subscriber, filter_=filter_)
        self.kafka = subscriber

    def commit(self) -> None:
        """Commit (synchronously) every item returned so far, the current one included."""
        self.kafka.commit(include_current=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        exc_traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        self.close()


def stream_producer(
    source: StreamSource,
    stream: str,
    *,
    store: Store[Any] | None,
    batch_size: int = 1,
    key: StreamKey | None = None,
    linger_ms: float = DEFAULT_LINGER_MS,
    topic_prefix: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
) -> KafkaStreamProducer[Any]:
    """A ProxyStore ``StreamProducer`` writing ``stream`` to Kafka, bulk objects to ``store``.

    ``producer.send(stream, obj)`` puts ``obj`` in ``store`` and publishes an
    event holding its key to the topic ``streams.<stream>`` (created from the
    catalogue if missing); ``producer.close(topics=[stream])`` ends the stream
    for its consumers. With ``store=None`` objects travel inline in the event,
    which must then fit the topic's ``max.message.bytes`` (else
    :class:`~fxstream.sdk.errors.PayloadTooLarge`). ``batch_size`` objects
    share one event (ProxyStore's batching); records are batched by Kafka in
    any case (``linger_ms``). ``key`` chooses the records' Kafka key (default:
    the stream name). The store is the default for any other stream name sent
    through this producer too.
    """
    kafka, catalogue = _connection(source, topic_prefix)
    publisher = KafkaPublisher(
        kafka,
        catalogue=catalogue,
        key=key,
        linger_ms=linger_ms,
        kafka_config=kafka_config,
    )
    publisher.ensure_stream(stream)
    return KafkaStreamProducer(publisher, default_store=store, batch_size=batch_size)


def stream_consumer(
    source: StreamSource,
    stream: str,
    *,
    group: str,
    timeout_s: float | None = None,
    commit_every: int = DEFAULT_COMMIT_EVERY,
    from_start: bool = True,
    filter_: Filter | None = None,
    instance_id: str | None = None,
    topic_prefix: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
) -> KafkaStreamConsumer[Any]:
    """A ProxyStore ``StreamConsumer`` of ``stream`` in the consumer group ``group``.

    Yields the stream's items in order (proxies resolved lazily from the
    producer's store) until end-of-stream. A consumer restarted in the same
    ``group`` resumes after the last committed item (see
    :mod:`fxstream.sdk.streams.subscriber` for the commit point). ``timeout_s``
    bounds each wait for an item (None: forever). ``instance_id`` makes the
    consumer a static group member: a restart with the same id takes over its
    partitions at once instead of after the session timeout.
    """
    kafka, catalogue = _connection(source, topic_prefix)
    subscriber = KafkaSubscriber(
        kafka,
        stream,
        group,
        catalogue=catalogue,
        timeout_s=timeout_s,
        commit_every=commit_every,
        from_start=from_start,
        instance_id=instance_id,
        kafka_config=kafka_config,
    )
    return KafkaStreamConsumer(subscriber, filter_=filter_)
