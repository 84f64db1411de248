"""The Kafka subscriber behind fxstream's stream consumer: a consumer group with manual commits.

:class:`KafkaSubscriber` implements ProxyStore's ``EventSubscriber`` protocol
(:mod:`proxystore.stream.protocols`): each call of :meth:`~KafkaSubscriber.next_events`
returns the next record of the stream's topic decoded as a ProxyStore
``EventBatch``.

Commit point (at-least-once). A record is *handed over* when ``next_events``
returns it. It is *done* once the application asks for the next one (the
:class:`~proxystore.stream.StreamConsumer` asks only when it has yielded every
event of the record), or at an explicit :meth:`~KafkaSubscriber.commit`. Done
records are committed to the consumer group: asynchronously every
``commit_every`` done records, when the next record is requested; synchronously
on ``commit()``, on ``close()`` and when the group takes partitions away (a
rebalance). The record in the application's hands is never committed by
``close()`` alone, so a consumer that stops (crash, kill, exception) gets it
again on restart; a restarted member of the same group starts right after the
last committed record. Duplicates after a crash are at most the records done
but not yet committed (fewer than ``commit_every``, plus any asynchronous commit
still in flight) and the one in hand; nothing is skipped.

Object lifetimes. A ``StreamProducer`` marks store objects ``evict=True`` by
default, which in ProxyStore means "delete when first resolved": that would
break the redelivery above (the new consumer finds the key gone). The
subscriber therefore clears the flag on the events it hands over, and evicts
those objects itself once their record's offset is committed. An object is thus
deleted only after its record can no longer be delivered again to this group;
when several groups read one stream, producers send with ``evict=False`` and
manage lifetimes themselves. After a crash, the objects of records whose commit
succeeded but whose eviction had not run yet stay in the store (a store lease
or TTL reclaims them).

A record that is not a ProxyStore event batch of this stream goes to the
``dead-letter`` topic and is skipped (committed like a done record).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Final, Self

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from proxystore.store import get_or_create_store
from proxystore.store.config import StoreConfig
from proxystore.stream.events import EventBatch, NewObjectKeyEvent, bytes_to_event

from fxstream.sdk.errors import StreamError, StreamTimeout
from fxstream.sdk.streams.publisher import ensure_stream_topic
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    KafkaConnection,
    ProvisionError,
    dead_letter,
    encode,
    normalise_headers,
    producer_message_max_bytes,
)

__all__ = ["DEFAULT_COMMIT_EVERY", "KafkaSubscriber", "stream_group_id"]

log = logging.getLogger(__name__)

DEFAULT_COMMIT_EVERY: Final = 1
"""Done records between asynchronous commits (1: commit each record once the next is asked for)."""

_POLL_INTERVAL_S: Final = 0.1
_COMMIT_TIMEOUT_S: Final = 30.0
_ASSIGNMENT_TIMEOUT_S: Final = 60.0

_Partition = tuple[str, int]


def stream_group_id(catalogue: Catalogue, stream: str, group: str) -> str:
    """The Kafka consumer group id of ``group`` reading ``stream``.

    Namespaced by prefix and stream, so one group name can be reused for
    different streams without the groups' offsets mixing.
    """
    return f"{catalogue.stream(stream)}.{group}"


class KafkaSubscriber:
    """ProxyStore ``EventSubscriber`` reading one stream as a member of a consumer group.

    ``stream`` is the stream's name (its topic is ``streams.<stream>``) and
    ``group`` the consumer group: members of one group share the stream's
    partitions and, across restarts, its committed position. A new group starts
    at the beginning of what the topic retains (``from_start``) or at its end.
    ``timeout_s`` bounds how long ``next_events`` waits for a record (None:
    forever), raising :class:`~fxstream.sdk.errors.StreamTimeout`.
    ``commit_every``: see the module's commit point. With ``create_topic``
    the stream's topic is created from the catalogue when missing, so a
    consumer may start before its producer. ``kafka_config`` adds or overrides
    librdkafka settings.

    A consumer killed without leaving the group holds its partitions until
    the group's session timeout (librdkafka's ``session.timeout.ms``, 45 s)
    expires; a successor waits that long. Give each member a stable
    ``instance_id`` (Kafka's static membership, ``group.instance.id``) and a
    restarted member with the same id takes its partitions over at once.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        stream: str,
        group: str,
        *,
        catalogue: Catalogue | None = None,
        timeout_s: float | None = None,
        commit_every: int = DEFAULT_COMMIT_EVERY,
        from_start: bool = True,
        create_topic: bool = True,
        instance_id: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, not {commit_every}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, not {timeout_s}")
        self.kafka = kafka
        self.stream = stream
        self.catalogue = catalogue if catalogue is not None else Catalogue()
        self.topic = self.catalogue.stream(stream)
        self.group_id = stream_group_id(self.catalogue, stream, group)
        self.timeout_s = timeout_s
        self.commit_every = commit_every
        self._kafka_config = dict(kafka_config or {})
        self._assigned: set[_Partition] = set()
        # Next offset to commit per partition: one past the last done record.
        self._done: dict[_Partition, int] = {}
        self._done_since_commit = 0
        # Store objects to evict once the record at that offset is committed, in offset order.
        self._evictions: dict[_Partition, list[tuple[int, list[tuple[StoreConfig, Any]]]]] = {}
        self._in_hand: Message | None = None
        self._stashed: Message | None = None
        self._dead_letters: Producer | None = None
        self._closed = False
        if create_topic:
            admin = AdminClient({**kafka.confluent(), "log_level": 3})
            try:
                ensure_stream_topic(admin, self.catalogue, stream)
            except ProvisionError as exc:
                raise StreamError(
                    f"cannot create the topic of stream {stream!r}: {exc}; create "
                    f"{self.topic!r} (see docs/topics.md) or check the broker address"
                ) from exc
        config: dict[str, Any] = {
            **kafka.confluent(),
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest" if from_start else "latest",
            "on_commit": self._on_commit,
            "log_level": 3,
        }
        if instance_id is not None:
            config["group.instance.id"] = instance_id
        config.update(self._kafka_config)
        self.consumer = Consumer(config)
        self.consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )

    # --- ProxyStore's EventSubscriber --------------------------------------------------

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> EventBatch:
        return self.next_events()

    def next_events(self) -> EventBatch:
        """Mark the record handed over last as done, then return the next record's events.

        Blocks until a record arrives (at most ``timeout_s``). Store objects the
        events reference are evicted after the record's commit, not when the
        application resolves them (see the module docstring).
        """
        self._check_open()
        self._finish_in_hand()
        if self._done_since_commit >= self.commit_every:
            self._commit(asynchronous=True)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            message = self._poll(deadline)
            batch = self._decode(message)
            if batch is not None:
                self._in_hand = message
                return batch

    def close(self) -> None:
        """Commit the done records, then leave the group (the record in hand stays uncommitted)."""
        if self._closed:
            return
        try:
            self._commit(asynchronous=False)
        finally:
            self._closed = True
            self.consumer.close()
            if self._dead_letters is not None:
                self._dead_letters.flush(_COMMIT_TIMEOUT_S)

    # --- commits -----------------------------------------------------------------------

    def commit(self, *, include_current: bool = True) -> None:
        """Commit now (synchronously) every done record and, by default, the one in hand.

        Call it when the application has finished with everything it was given,
        e.g. before a planned stop; a restarted consumer then resumes after the
        last record returned, with no duplicate.
        """
        self._check_open()
        if include_current:
            self._finish_in_hand()
        self._commit(asynchronous=False)

    def committed(self) -> dict[int, int]:
        """Partition -> committed offset of this group on the stream's topic (-1001: none)."""
        metadata = self.consumer.list_topics(self.topic, timeout=_COMMIT_TIMEOUT_S)
        partitions = [TopicPartition(self.topic, p) for p in metadata.topics[self.topic].partitions]
        return {
            tp.partition: tp.offset
            for tp in self.consumer.committed(partitions, timeout=_COMMIT_TIMEOUT_S)
        }

    def wait_for_assignment(self, timeout_s: float = _ASSIGNMENT_TIMEOUT_S) -> None:
        """Block until the group has given this member its partitions (or raise StreamTimeout).

        A record that arrives meanwhile is kept for the next ``next_events``.
        """
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while not self._assigned and self._stashed is None:
            if time.monotonic() > deadline:
                raise StreamTimeout(
                    f"no partition of {self.topic!r} assigned to group {self.group_id!r} "
                    f"within {timeout_s:g} s"
                )
            message = self._poll_once(_POLL_INTERVAL_S)
            if message is not None:
                self._stashed = message

    def serve_group(self, timeout_s: float) -> None:
        """Take part in the group (rebalances, commit results) for ``timeout_s``, taking no record.

        For an application that holds an item longer than usual: the member
        stays in the group and a rebalance commits the done records.
        """
        self._check_open()
        # Not pause(): librdkafka keeps a partition paused across a rebalance that revokes and
        # reassigns it, and the stream would stall.
        message = self._poll_once(timeout_s)
        if message is None:
            return
        if self._stashed is None:
            self._stashed = message
            return
        # Only one record fits aside: fetch this one again later.
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        self.consumer.seek(TopicPartition(self.topic, partition, offset))

    def _finish_in_hand(self) -> None:
        message, self._in_hand = self._in_hand, None
        if message is not None:
            self._mark_done(message)

    def _mark_done(self, message: Message) -> None:
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        self._done[(self.topic, partition)] = offset + 1
        self._done_since_commit += 1

    def _commit(self, *, asynchronous: bool, only: set[_Partition] | None = None) -> None:
        # A classic-protocol broker accepts commits for partitions this member no longer
        # owns; committing them could move another member's position, so only owned ones go.
        wanted = self._assigned if only is None else only & self._assigned
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._done.items() if (t, p) in wanted]
        if not offsets:
            return
        for tp in offsets:
            del self._done[(tp.topic, tp.partition)]
        self._done_since_commit = 0
        if asynchronous:
            self.consumer.commit(offsets=offsets, asynchronous=True)
            return
        try:
            results = self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            self._retry_later(offsets)
            raise StreamError(
                f"cannot commit stream offsets of group {self.group_id!r}: {exc}"
            ) from exc
        self._committed(results or [])

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is not None and error.code() != KafkaError._NO_OFFSET:
            log.warning("stream commit of %s failed: %s; retried later", self.group_id, error)
            self._retry_later(partitions)
            return
        self._committed(partitions)

    def _committed(self, partitions: list[TopicPartition]) -> None:
        failed = [tp for tp in partitions if tp.error is not None]
        if failed:
            self._retry_later(failed)
        for tp in partitions:
            if tp.error is None and tp.offset >= 0:
                self._evict_below((tp.topic, tp.partition), tp.offset)

    def _retry_later(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in self._assigned and tp.offset > self._done.get(key, -1):
                self._done[key] = tp.offset

    # --- object lifetimes --------------------------------------------------------------

    def _take_evictions(self, message: Message, batch: EventBatch) -> None:
        keys = []
        for event in batch.events:
            if isinstance(event, NewObjectKeyEvent) and event.evict:
                keys.append((event.store_config, event.get_key()))
                # Evicting on first resolve would leave a redelivered event pointing at
                # nothing; the object goes once this record's offset is committed instead.
                event.evict = False
        if keys:
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            self._evictions.setdefault((self.topic, partition), []).append((offset, keys))

    def _evict_below(self, partition: _Partition, committed: int) -> None:
        pending = self._evictions.get(partition)
        while pending and pending[0][0] < committed:
            _, keys = pending.pop(0)
            for config, key in keys:
                try:
                    get_or_create_store(config, register=True).evict(key)
                except Exception as exc:  # the store is down or gone: the lease reclaims it
                    log.warning("cannot evict stream object %r: %s", key, exc)

    # --- rebalances --------------------------------------------------------------------

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned.update((tp.topic, tp.partition) for tp in partitions)

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Still ours for the length of this callback: commit what is done before the new
        # owner starts from the committed offsets.
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        try:
            self._commit(asynchronous=False, only=revoked)
        except StreamError as exc:
            log.warning("%s; the new owner will see those records again", exc)
        self._forget(revoked)

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget({(tp.topic, tp.partition) for tp in partitions})

    def _forget(self, partitions: set[_Partition]) -> None:
        self._assigned -= partitions
        for partition in partitions:
            self._done.pop(partition, None)
            # The new owner evicts these objects once it commits their records.
            self._evictions.pop(partition, None)
        if self._stashed is not None and (self.topic, self._stashed.partition()) in partitions:
            self._stashed = None

    # --- records -----------------------------------------------------------------------

    def _poll(self, deadline: float | None) -> Message:
        stashed, self._stashed = self._stashed, None
        if stashed is not None:
            return stashed
        while True:
            wait = _POLL_INTERVAL_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StreamTimeout(
                        f"no record on stream {self.stream!r} ({self.topic}) within "
                        f"{self.timeout_s:g} s"
                    )
                wait = min(wait, left)
            polled = self._poll_once(wait)
            if polled is not None:
                return polled

    def _poll_once(self, wait: float) -> Message | None:
        message = self.consumer.poll(wait)
        if message is None:
            return None
        error = message.error()
        if error is None:
            return message
        if error.fatal():
            raise StreamError(f"the stream consumer of {self.topic!r} failed: {error.str()}")
        # Transient (a broker restarting, a leader moving): librdkafka recovers by itself.
        log.warning("stream consumer of %s: %s", self.topic, error.str())
        return None

    def _decode(self, message: Message) -> EventBatch | None:
        value = message.value()
        try:
            if value is None:
                raise ValueError("the record has no value")
            batch = bytes_to_event(value)
            if not isinstance(batch, EventBatch):
                raise ValueError(f"the record holds a {type(batch).__name__}, not an EventBatch")
            if batch.topic != self.stream:
                raise ValueError(f"the record is for stream {batch.topic!r}, not {self.stream!r}")
        except Exception as exc:
            self._dead_letter(message, f"not a ProxyStore event batch of this stream: {exc}")
            self._mark_done(message)
            return None
        self._take_evictions(message, batch)
        return batch

    def _dead_letter(self, message: Message, reason: str) -> None:
        if self._dead_letters is None:
            self._dead_letters = Producer(
                {
                    **self.kafka.confluent_producer(),
                    "enable.idempotence": True,
                    "acks": "all",
                    "message.max.bytes": producer_message_max_bytes(self.catalogue),
                    "log_level": 3,
                    **{k: v for k, v in self._kafka_config.items() if "." in k},
                }
            )
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        record = dead_letter(
            topic=self.topic,
            partition=partition,
            offset=offset,
            key=message.key(),
            value=message.value(),
            headers=normalise_headers(message.headers()),
            reason=reason,
            error_type=DeadLetterReason.STREAM_DECODE_ERROR,
            component=f"sdk stream consumer {self.group_id}",
        )
        failures: list[str] = []

        def on_delivery(error: KafkaError | None, _message: Message) -> None:
            if error is not None:
                failures.append(error.str())

        self._dead_letters.produce(
            self.catalogue.dead_letter,
            encode(record),
            key=record.original_key,
            on_delivery=on_delivery,
        )
        # Rare, and the record is committed past right after: wait for the broker's ack.
        left = self._dead_letters.flush(_COMMIT_TIMEOUT_S)
        if left or failures:
            raise StreamError(
                f"record {self.topic}[{partition}]@{offset} is malformed ({reason}) and could "
                f"not be dead-lettered to {self.catalogue.dead_letter!r}: "
                f"{failures or 'no acknowledgement'}"
            )
        log.warning("dead-lettered %s[%d]@%d: %s", self.topic, partition, offset, reason)

    def _check_open(self) -> None:
        if self._closed:
            raise StreamError("this stream subscriber is closed; create a new one")
