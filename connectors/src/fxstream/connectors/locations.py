"""Publishing where proxied objects live to the compacted ``data-locations`` topic.

Whoever creates an object publishes a :class:`~fxstream.topics.DataLocation`
keyed by its object key (the SDK for arguments, the agent for results, a
stream writer when it opens and again when it closes); whoever evicts it
publishes a tombstone under the same key, so compaction forgets it. Routing on
these records comes later; they are published now so the history exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from confluent_kafka import Producer

from fxstream.topics import DataLocation, ObjectReference, encode

__all__ = ["LocationPublisher", "location_of"]


def location_of(reference: ObjectReference, *, complete: bool = True) -> DataLocation:
    """The data-locations record for an object reference."""
    return DataLocation(
        object_key=reference.object_key,
        store=reference.store,
        site=reference.site,
        size_bytes=reference.size_bytes,
        updated_at=time.time(),
        tier=reference.tier,
        node=reference.node,
        complete=complete,
        sha256=reference.sha256,
    )


class LocationPublisher:
    """Writes data-locations records with a producer the caller owns (nothing is flushed here).

    The records ride on the caller's producer, batched with its other records;
    a lost location record costs routing quality, never correctness, so
    delivery is not awaited.
    """

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer = producer
        self.topic = topic

    def created(self, references: Iterable[ObjectReference], *, complete: bool = True) -> None:
        """Say these objects exist now (``complete=False``: a stream still being written)."""
        for reference in references:
            self.producer.produce(
                self.topic,
                key=reference.object_key.encode(),
                value=encode(location_of(reference, complete=complete)),
            )

    def removed(self, object_keys: Iterable[str]) -> None:
        """Say that these objects were evicted (tombstones: compaction drops the keys)."""
        for object_key in object_keys:
            self.producer.produce(self.topic, key=object_key.encode(), value=None)
