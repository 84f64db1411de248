"""Streams: ProxyStore's StreamProducer/StreamConsumer over fxstream's Kafka stream topics.

- :func:`stream_producer` / :func:`stream_consumer`: ProxyStore stream objects
  wired to Kafka and a store (bulk in the store, keys in Kafka).
- :class:`KafkaPublisher`: keyed, batched, idempotent ``EventPublisher``.
- :class:`KafkaSubscriber`: ``EventSubscriber`` in a consumer group with
  manual, at-least-once commits and commit-then-evict object lifetimes.

See docs/data-plane-streams.md.
"""

from fxstream.sdk.streams import _experimental  # noqa: F401  (first: quiets ProxyStore's import)
from fxstream.sdk.streams.connect import (
    KafkaStreamConsumer,
    KafkaStreamProducer,
    StreamSource,
    stream_consumer,
    stream_producer,
)
from fxstream.sdk.streams.publisher import (
    DEFAULT_LINGER_MS,
    KafkaPublisher,
    StreamKey,
    ensure_stream_topic,
)
from fxstream.sdk.streams.subscriber import (
    DEFAULT_COMMIT_EVERY,
    KafkaSubscriber,
    stream_group_id,
)

__all__ = [
    "DEFAULT_COMMIT_EVERY",
    "DEFAULT_LINGER_MS",
    "KafkaPublisher",
    "KafkaStreamConsumer",
    "KafkaStreamProducer",
    "KafkaSubscriber",
    "StreamKey",
    "StreamSource",
    "ensure_stream_topic",
    "stream_consumer",
    "stream_group_id",
    "stream_producer",
]
