"""Result subscriptions: a trigger rule's or a task group's results, as a stream.

:meth:`Client.subscribe <fxstream.sdk.client.Client.subscribe>` returns a
:class:`ResultSubscription`: an iterator (and context manager) of
:class:`SubscribedResult` s, one per task of the group, as the results arrive, whoever
submitted the tasks (the trigger processor for a rule, another process for a group). A
rule's tasks are the task group whose id is the rule id (docs/triggers.md), so both are one
mechanism: a filter on ``task_group_id``.

**What it reads.** The user's own results topic ``results.<user_id>``, with its own
consumer (``isolation.level=read_committed``: a result of an aborted transaction is never
seen), *assigned* every partition (no consumer group is joined, no offset is committed;
librdkafka's required group id is one under the user's prefix). Only the platform may
write that topic (its ACLs: the ingress, results of tasks routed for this user; the router,
this user's rejected tasks), so a record on it is as authenticated as the SDK's own results
(docs/security.md, "Why per-principal topics, not signatures").

**Nothing is deserialized before it is known to be wanted.** Each record is decoded as a
typed :class:`~fxstream.topics.TaskResult` (msgspec: no code runs); a record that does not
decode, names another user, or belongs to another group is counted and skipped, and its
value is never loaded. Only then is the value deserialized, as the results listener does
(:func:`fxstream.sdk.results.load_outcome`): a by-reference value is fetched from its store,
which checks its SHA-256 before any deserializer sees a byte.

**Where it starts** (``since`` / ``from_offsets``):

- default, ``since="now"``: the end of every partition, read synchronously before
  :meth:`Client.subscribe` returns, so every result committed afterwards is delivered (a
  live view, like ``tail -f``);
- ``since=<seconds since the epoch>`` or a ``datetime``: replay from the first record whose
  Kafka timestamp (the ingress's clock) is at or after it, then live;
- ``since="created"`` (a rule only): replay from the rule's ``created_at``, i.e. every
  result the rule ever produced that the topic still holds (retention), then live;
- ``from_offsets=<subscription.positions>``: resume exactly where an earlier subscription
  stopped (partitions not named start at ``since``).

**Each task once.** The first result record of a task is delivered; a further record for
the same task (a duplicate the platform may commit after a failure) is counted in
``duplicates`` and skipped, for the last 100,000 tasks delivered. Order: per partition
(a task's records are keyed by its id, so all land in one partition); partitions
interleave.

**Objects by reference** are fetched but not evicted: a subscriber is one reader beside
others (the submitting client, another subscriber), so a stored result stays until its
lease ends (docs/data-plane.md, Lifetimes).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, Self

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from fxstream.sdk.errors import FxstreamError
from fxstream.sdk.futures import Timings, timings_of
from fxstream.sdk.results import end_assignment, load_outcome
from fxstream.topics import (
    KafkaConnection,
    RecordDecodeError,
    Serializer,
    TaskErrorType,
    TaskResult,
    decode,
)

__all__ = [
    "DEFAULT_BUFFER",
    "ResultSubscription",
    "Since",
    "SubscribedResult",
    "SubscriptionClosed",
    "since_timestamp",
    "subscription_group",
]

log = logging.getLogger(__name__)

DEFAULT_BUFFER: Final = 10_000
"""Results decoded ahead of the application, at most; the consumer waits beyond that."""

_POLL_S: Final = 0.1
_BATCH: Final = 500
_REMEMBERED: Final = 100_000
# What the consumer may hold fetched ahead of this thread, in KiB (as the listener's).
_PREFETCH_KBYTES: Final = 8_192

Since = float | datetime | Literal["now", "created"]
"""Where a subscription starts: ``"now"``, a time (epoch seconds or a ``datetime``), or
``"created"`` (a rule's registration time)."""


class SubscriptionClosed(FxstreamError):
    """The subscription was closed (by :meth:`ResultSubscription.close` or its client)."""


@dataclass(frozen=True)
class SubscribedResult:
    """One task's result as a subscription delivers it.

    ``ok`` is True for a success, whose ``value`` is the function's return value (loaded
    here); otherwise ``error`` is the exception :meth:`result` raises (the same
    :class:`~fxstream.sdk.errors.TaskExecutionFailed` subclass a future raises; a task
    cancelled elsewhere has ``cancelled`` True and a
    :class:`concurrent.futures.CancelledError`). ``timings`` are the task's hops
    (:data:`~fxstream.sdk.futures.TIMING_KEYS`), ``delivered`` being when this
    subscription received the record; ``partition`` and ``offset`` are where the record
    is on ``results.<user>`` and ``kafka_timestamp`` its Kafka timestamp (seconds).
    """

    task_id: str
    task_group_id: str
    function_id: str
    endpoint_id: str
    ok: bool
    value: Any
    error: BaseException | None
    cancelled: bool
    attempt: int
    worker: str
    tags: Mapping[str, str]
    timings: Timings
    partition: int
    offset: int
    kafka_timestamp: float | None = None
    references: tuple[Any, ...] = field(default=(), repr=False)
    """The stored objects the value was fetched from (by reference), for the caller to
    evict when it alone consumes them (``fxstream.connectors.evict_objects``)."""

    def result(self) -> Any:
        """The value; raises the task's error if it failed (or was cancelled)."""
        if self.error is not None:
            raise self.error
        return self.value


class ResultSubscription:
    """The results of one task group (a rule's: the rule id), from ``results.<user_id>``.

    Made by :meth:`Client.subscribe <fxstream.sdk.client.Client.subscribe>` (see the module
    notes for what it reads, where it starts and what it skips). Iterate it (blocks until
    the next result, ends once :meth:`close` is called), or call :meth:`get` with a timeout;
    use it as a context manager to close it. A consumer thread decodes ahead of the
    application, at most ``buffer`` results.

    Counters: ``delivered`` (results handed over), ``duplicates`` (further records of a
    task already delivered), ``skipped`` (results of other groups), ``foreign`` (records
    naming another user: the platform never writes one; never loaded) and ``malformed``
    (records that are not results).
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        serializer: Serializer,
        *,
        user_id: str,
        task_group_id: str,
        group_id: str,
        since: float | None = None,
        from_offsets: Mapping[int, int] | None = None,
        buffer: int = DEFAULT_BUFFER,
        kafka_config: Mapping[str, Any] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        if buffer < 1:
            raise ValueError(f"buffer must be at least 1, not {buffer}")
        self.topic = topic
        self.user_id = user_id
        self.task_group_id = task_group_id
        self._serializer = serializer
        self._buffer = buffer
        self._config: dict[str, Any] = {
            **kafka.confluent(),
            # Required by librdkafka although no group is joined (assign, no commits).
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # The ingress publishes results in transactions.
            "isolation.level": "read_committed",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 100,
            "queued.max.messages.kbytes": _PREFETCH_KBYTES,
            "log_level": 3,
            **(kafka_config or {}),
        }
        self._cond = threading.Condition()
        self._queue: deque[SubscribedResult] = deque()
        self._handled: dict[int, int] = {}
        self._remembered: OrderedDict[str, None] = OrderedDict()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self.delivered = 0
        self.duplicates = 0
        self.skipped = 0
        self.foreign = 0
        self.malformed = 0
        consumer = Consumer(self._config)
        try:
            assignment = self._assignment(consumer, since, from_offsets or {}, start_timeout)
            consumer.assign(assignment)
        except BaseException:
            consumer.close()
            raise
        self.start_offsets: dict[int, int] = {tp.partition: tp.offset for tp in assignment}
        """Per partition, the offset the subscription started at."""
        self._handled = dict(self.start_offsets)
        self._consumer: Consumer | None = consumer
        self._thread = threading.Thread(
            target=self._run, name=f"fxstream-subscription-{task_group_id}", daemon=True
        )
        self._thread.start()

    # --- start ----------------------------------------------------------------------------

    def _assignment(
        self,
        consumer: Consumer,
        since: float | None,
        from_offsets: Mapping[int, int],
        timeout: float,
    ) -> list[TopicPartition]:
        """Every partition at its end, or at ``since``, or at its offset in ``from_offsets``."""
        ends = end_assignment(consumer, self.topic, timeout)
        unknown = set(from_offsets) - {tp.partition for tp in ends}
        if unknown:
            raise ValueError(
                f"from_offsets names partitions {sorted(unknown)} that {self.topic!r} does not "
                f"have (it has {len(ends)}); pass the positions of a subscription of this topic"
            )
        starts = {tp.partition: tp.offset for tp in ends}
        located: dict[int, int] = {}
        if since is not None:
            wanted = [
                TopicPartition(self.topic, tp.partition, max(0, int(since * 1000)))
                for tp in ends
                if tp.partition not in from_offsets
            ]
            if wanted:
                try:
                    found = consumer.offsets_for_times(wanted, timeout=timeout)
                except KafkaException as exc:
                    raise FxstreamError(
                        f"cannot locate {self.topic!r} at {since} ({exc}); is the broker up?"
                    ) from exc
                for tp in found:
                    # -1: no record at or after the time, so start at the end.
                    if tp.error is None and tp.offset >= 0:
                        located[tp.partition] = min(tp.offset, starts[tp.partition])
        for partition, offset in from_offsets.items():
            if offset < 0:
                raise ValueError(f"from_offsets[{partition}] must not be negative, not {offset}")
            located[partition] = offset
        return [
            TopicPartition(self.topic, p, located.get(p, end)) for p, end in sorted(starts.items())
        ]

    # --- the consumer thread -------------------------------------------------------------

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while not self._stop.is_set():
                try:
                    first = consumer.poll(_POLL_S)
                    if first is None:
                        continue
                    messages = [first, *consumer.consume(num_messages=_BATCH - 1, timeout=0)]
                except KafkaException as exc:
                    error = exc.args[0] if exc.args else None
                    if isinstance(error, KafkaError) and error.fatal():
                        raise
                    log.warning("subscription consumer on %s: %s", self.topic, exc)
                    time.sleep(_POLL_S)
                    continue
                received = time.time()
                for message in messages:
                    if self._stop.is_set():
                        return
                    self._handle(message, received)
        except BaseException as exc:  # a fatal consumer error: the reader gets it
            log.error("subscription on %s failed: %s", self.topic, exc)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()

    def _handle(self, message: Message, received: float) -> None:
        error = message.error()
        partition, offset = message.partition(), message.offset()
        if error is not None or partition is None or offset is None:
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                log.warning("subscription consumer on %s: %s", self.topic, error)
            return
        item = self._read(message, partition, offset, received)
        with self._cond:
            if item is not None:
                while len(self._queue) >= self._buffer and not self._stop.is_set():
                    self._cond.wait(_POLL_S)
                self._queue.append(item)
                self._cond.notify_all()
            # Under the lock with the append: positions never skip a record in hand.
            self._handled[partition] = offset + 1

    def _read(
        self, message: Message, partition: int, offset: int, received: float
    ) -> SubscribedResult | None:
        """The record as a result of this subscription, or None (counted, never loaded)."""
        try:
            result = decode(message.value(), TaskResult)
        except RecordDecodeError as exc:
            self.malformed += 1
            log.warning(
                "skipping a record at %s [%s] offset %s that is not a result: %s",
                self.topic,
                partition,
                offset,
                exc.reason,
            )
            return None
        if result.user_id != self.user_id:
            self.foreign += 1
            log.warning(
                "skipping the result of task %s at %s [%s] offset %s: it names user %s, not "
                "this topic's user",
                result.task_id,
                self.topic,
                partition,
                offset,
                result.user_id,
            )
            return None
        if result.task_group_id != self.task_group_id:
            self.skipped += 1
            return None
        if result.task_id in self._remembered:
            self.duplicates += 1
            return None
        self._remembered[result.task_id] = None
        if len(self._remembered) > _REMEMBERED:
            self._remembered.popitem(last=False)
        return self._load(result, partition, offset, received, message.timestamp())

    def _load(
        self,
        result: TaskResult,
        partition: int,
        offset: int,
        received: float,
        timestamp: tuple[int, int],
    ) -> SubscribedResult:
        fetched: list[Any] = []
        cancelled = result.error is not None and result.error.type == TaskErrorType.CANCELLED
        value: Any = None
        error: BaseException | None
        if cancelled:
            error = CancelledError(f"task {result.task_id} was cancelled")
        else:
            value, error = load_outcome(self._serializer, result, fetched)
        kind, millis = timestamp
        return SubscribedResult(
            task_id=result.task_id,
            task_group_id=self.task_group_id,
            function_id=result.function_id,
            endpoint_id=result.endpoint_id,
            ok=error is None,
            value=value,
            error=error,
            cancelled=cancelled,
            attempt=result.attempt,
            worker=result.worker,
            tags=dict(result.tags),
            timings=timings_of(result.timings, submitted=None, delivered=received),
            partition=partition,
            offset=offset,
            kafka_timestamp=millis / 1000 if kind != 0 and millis >= 0 else None,
            references=tuple(fetched),
        )

    # --- the application's side ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._stop.is_set()

    @property
    def positions(self) -> dict[int, int]:
        """Per partition, the offset from which a new subscription (``from_offsets=``)
        continues exactly after the results handed over so far: each result not yet
        handed over (buffered or not yet read) is at or after it."""
        with self._cond:
            positions = dict(self._handled)
            for result in self._queue:
                positions[result.partition] = min(
                    positions.get(result.partition, result.offset), result.offset
                )
            return positions

    def get(self, timeout: float | None = None) -> SubscribedResult | None:
        """The next result; None if none arrives within ``timeout`` seconds (None: wait).

        Raises :class:`SubscriptionClosed` once closed, and the consumer's error if it failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._stop.is_set():
                    raise SubscriptionClosed(
                        f"the subscription to task group {self.task_group_id} is closed"
                    )
                if self._queue:
                    break
                if self._failure is not None:
                    raise FxstreamError(
                        f"the subscription to task group {self.task_group_id} stopped: "
                        f"{self._failure}"
                    ) from self._failure
                left = _POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, _POLL_S))
            result = self._queue.popleft()
            self.delivered += 1
            self._cond.notify_all()
        return result

    def __iter__(self) -> Iterator[SubscribedResult]:
        return self

    def __next__(self) -> SubscribedResult:
        try:
            result = self.get()
        except SubscriptionClosed:
            raise StopIteration from None
        assert result is not None  # get() without a timeout waits
        return result

    def close(self, timeout: float = 10.0) -> None:
        """Stop the consumer thread and close the consumer; iteration ends (idempotent).

        Results buffered but not yet handed over are never handed over (``positions``
        still names them, so a subscription from those positions gets them).
        """
        with self._cond:
            if self._stop.is_set() and self._consumer is None:
                return
            self._stop.set()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ResultSubscription(topic={self.topic!r}, task_group_id={self.task_group_id!r}, "
            f"delivered={self.delivered}, closed={self.closed})"
        )


def since_timestamp(since: Since, created_at: float | None = None) -> float | None:
    """``since`` as seconds since the epoch (None for ``"now"``).

    ``"created"`` needs ``created_at`` (a rule's registration time). A naive ``datetime``
    is local time, as ``datetime.timestamp`` reads it.
    """
    if isinstance(since, str):
        if since == "now":
            return None
        if since == "created":
            if created_at is None:
                raise ValueError(
                    "since='created' is a rule's registration time: subscribe with rule_id=, "
                    "or give a time"
                )
            return created_at
        raise ValueError(f"since must be 'now', 'created', a time or a datetime, not {since!r}")
    if isinstance(since, datetime):
        return since.timestamp()
    if isinstance(since, bool) or not isinstance(since, int | float):
        raise ValueError(f"since must be 'now', 'created', a time or a datetime, not {since!r}")
    if since < 0:
        raise ValueError(f"since must be seconds since the epoch, not {since}")
    return float(since)


def subscription_group(prefix: str) -> str:
    """A never-joined consumer group id under the user's group ``prefix``."""
    return f"{prefix}sdk-subscription-{uuid.uuid4()}"
