"""Writing typed :class:`~fxstream.topics.Event` records to ``events.<source>``, once each.

Every event source (the file watcher, the ADIOS2 step source, the Kafka-topic source) writes
through an :class:`EventWriter`: a transactional confluent-kafka producer built from the
project's :class:`~fxstream.topics.KafkaConnection`, with the transactional id
``fxstream-source.<source>.<role>``. An event's Kafka key is its ``event_key``; every record
is sized against the topic's ``max.message.bytes`` (:func:`fxstream.topics.fits`) before it
is produced, and an event never carries bulk bytes (it names a file or a step by reference).

Exactly once across a restart. :meth:`EventWriter.start` first registers the transactional
id, which fences a predecessor with the same id and aborts its open transaction, and then
reads the keys of the last ``scan_records`` records of every partition of the topic with
``isolation.level=read_committed`` (:meth:`EventWriter.recent_keys`). An event is on the
topic for a reader exactly when its transaction committed, so a source that skips the keys
it finds there and emits the rest neither repeats an event whose transaction committed nor
loses one whose transaction was aborted by the crash. Readers of ``events.<source>`` must use
``read_committed`` too, or they see the aborted attempts.

Who may write: the admin, or the source's own principal ``src.<source>`` (the ACL table in
:mod:`fxstream.topics.acls`: WRITE and READ on its ``events.<source>``, READ on groups and
WRITE on transactional ids starting ``fxstream-source.<source>.``). The topic is created by
the admin (:func:`ensure_event_topic`, or ``fxstream-source create-topic``).

A hung client. librdkafka does not time out every transactional call (a dead group
coordinator leaves ``send_offsets_to_transaction`` waiting for good; see
:mod:`fxstream.topics.bounded_calls`): each is waited for at most its timeout and
``HUNG_GRACE_S``, then :exc:`~fxstream.topics.CallHung` is raised and the writer refuses
every later write. Whether a commit that hung went through is unknown here, so the only
safe continuation is the restart the guarantee above already covers: the source exits,
and its next run's registration fences the hung producer and ends its transaction.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from fxstream.topics import (
    BoundedCaller,
    CallHung,
    Catalogue,
    Event,
    KafkaConnection,
    RecordTooLarge,
    encode,
    ensure_topics,
    fits,
    producer_message_max_bytes,
    record_bytes,
)
from fxstream.topics.acls import source_prefix

__all__ = [
    "DEFAULT_SCAN_RECORDS",
    "EventTopicMissing",
    "EventWriter",
    "ensure_event_topic",
    "source_group",
    "source_transactional_id",
]

log = logging.getLogger(__name__)

DEFAULT_SCAN_RECORDS: Final = 50_000
"""Records per partition whose keys a starting source reads (the restart guarantee's bound)."""
# How many keys a running source remembers (emitted or read at start), oldest forgotten first.
_REMEMBERED_KEYS: Final = 1_000_000
_CALL_TIMEOUT_S: Final = 30.0
HUNG_GRACE_S: Final = 5.0
"""How much longer than its own timeout a transactional call is waited for."""


def source_transactional_id(source: str, role: str) -> str:
    """The transactional id of ``source``'s writer ``role`` (e.g. ``watcher``), inside the
    namespace the ACL table gives the source (:func:`fxstream.topics.acls.source_prefix`)."""
    return source_prefix(source) + role


def source_group(source: str, role: str) -> str:
    """A consumer group name inside ``source``'s namespace."""
    return source_prefix(source) + role


class EventTopicMissing(RuntimeError):
    """The source's ``events.<source>`` topic does not exist."""


def ensure_event_topic(
    connection: KafkaConnection, catalogue: Catalogue, source: str, *, timeout_s: float = 30.0
) -> str:
    """Create ``events.<source>`` as the catalogue specifies, if missing (run as the admin).

    Returns the topic name. Raises :class:`fxstream.topics.ProvisionError` when the broker
    refuses (a principal that may not create topics).
    """
    topic = catalogue.events(source)
    admin = AdminClient({**connection.confluent(), "log_level": 3})
    ensure_topics(admin, catalogue, {topic: catalogue.spec("events.{source}")}, timeout_s=timeout_s)
    return topic


class EventWriter:
    """Writes one source's events to ``events.<source>`` in transactions.

    Args:
        connection: the Kafka connection (the source's principal, or the admin).
        source: the source's id (letters, digits and '-').
        role: names the writer within the source (its transactional id is
            ``fxstream-source.<source>.<role>``); two writers with one id fence each other,
            so run one writer per (source, role).
        catalogue: the deployment's topic names (its prefix).
        scan_records: the bound of :meth:`recent_keys`, per partition.
    """

    def __init__(
        self,
        connection: KafkaConnection,
        source: str,
        *,
        role: str = "writer",
        catalogue: Catalogue | None = None,
        scan_records: int = DEFAULT_SCAN_RECORDS,
    ) -> None:
        self.catalogue = catalogue or Catalogue()
        self.source = source
        self.topic = self.catalogue.events(source)
        self.spec = self.catalogue.spec("events.{source}")
        self.connection = connection
        self.transactional_id = source_transactional_id(source, role)
        self.scan_records = scan_records
        self._remembered: OrderedDict[str, None] = OrderedDict()
        self._producer = Producer(
            {
                **connection.confluent_producer(),
                "allow.auto.create.topics": False,
                "transactional.id": self.transactional_id,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 5,
                "message.max.bytes": producer_message_max_bytes(self.catalogue),
                "log_level": 3,
            }
        )
        self._started = False
        # Transactional calls, waited for at most a deadline; the one that hung, if any
        # (its producer is then never called again, and kept: see bounded_calls).
        self._calls = BoundedCaller(f"fxstream-source-{source}")
        self._hung: CallHung | None = None
        self.written = 0
        """Events committed by this writer."""

    # --- start ---------------------------------------------------------------------------

    def start(self, timeout_s: float = _CALL_TIMEOUT_S, *, scan: bool = True) -> set[str]:
        """Check the topic, fence any predecessor, and (with ``scan``) read the recent keys.

        Returns the keys already on the topic (see :meth:`recent_keys`); they are also
        remembered, so :meth:`already_written` answers for them. A source whose input
        offsets commit with its events (the Kafka-topic source) needs no scan.
        """
        self._check_topic(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            call_s = max(1.0, deadline - time.monotonic())
            try:
                self._bounded(
                    "init_transactions",
                    functools.partial(self._producer.init_transactions, call_s),
                    call_s,
                )
                break
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or not error.retriable() or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._started = True
        if not scan:
            return set()
        keys = self.recent_keys(timeout_s=timeout_s)
        self._remember(keys)
        return keys

    def _check_topic(self, timeout_s: float) -> None:
        metadata = self._producer.list_topics(self.topic, timeout=timeout_s)
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise EventTopicMissing(
                f"the event topic {self.topic} does not exist (or this principal may not see "
                f"it): create it as the platform admin with `fxstream-source create-topic "
                f"--source {self.source} --credentials <admin credentials>`"
            )

    def recent_keys(self, *, timeout_s: float = _CALL_TIMEOUT_S) -> set[str]:
        """The keys of the last ``scan_records`` committed records of every partition.

        Read with ``read_committed`` after :meth:`start` fenced any predecessor, so no
        transaction of this writer's id is open: every committed event is visible, no
        aborted one is. Bounded: at most ``scan_records`` records per partition are read.
        """
        consumer = Consumer(
            {
                **self.connection.confluent(),
                "group.id": source_group(self.source, "scan"),
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
                "log_level": 3,
            }
        )
        keys: set[str] = set()
        try:
            metadata = consumer.list_topics(self.topic, timeout=timeout_s)
            partitions = sorted(metadata.topics[self.topic].partitions)
            assignment: list[TopicPartition] = []
            for partition in partitions:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=timeout_s, cached=False
                )
                if high > low:
                    start = max(low, high - self.scan_records)
                    assignment.append(TopicPartition(self.topic, partition, start))
            if not assignment:
                return keys
            consumer.assign(assignment)
            open_partitions = {tp.partition for tp in assignment}
            deadline = time.monotonic() + timeout_s
            while open_partitions:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"reading the recent keys of {self.topic} took over {timeout_s} s "
                        f"(partitions {sorted(open_partitions)} unfinished): is the broker "
                        "reachable? lower scan_records for a quicker start"
                    )
                for message in consumer.consume(1000, timeout=0.5):
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            open_partitions.discard(message.partition() or 0)
                            continue
                        raise KafkaException(error)
                    key = message.key()
                    if key:
                        keys.add(key.decode("utf-8", "replace"))
        finally:
            consumer.close()
        return keys

    # --- writing -------------------------------------------------------------------------

    def already_written(self, event_key: str) -> bool:
        """True when this key was read at start or written by this writer (bounded memory:
        the last million keys)."""
        return event_key in self._remembered

    def _remember(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._remembered[key] = None
            self._remembered.move_to_end(key)
        while len(self._remembered) > _REMEMBERED_KEYS:
            self._remembered.popitem(last=False)

    def check(self, event: Event) -> tuple[bytes, bytes]:
        """The key and value of ``event``, or :class:`RecordTooLarge` if its topic refuses it."""
        if event.source != self.source:
            raise ValueError(f"an event of source {event.source!r} given to {self.source!r}")
        key, value = event.event_key.encode(), encode(event)
        if not fits(self.spec, key, value):
            raise RecordTooLarge(record_bytes(key, value), self.spec.max_message_bytes, "event")
        return key, value

    def write(
        self,
        events: Sequence[Event],
        *,
        offsets: Sequence[TopicPartition] = (),
        group_metadata: object | None = None,
        timeout_s: float = _CALL_TIMEOUT_S,
    ) -> None:
        """Write ``events`` in one transaction (all or none), and remember their keys.

        With ``offsets`` and ``group_metadata`` (a consumer's), the consumer's offsets
        commit in the same transaction: the events and the input they came from are
        recorded together or not at all. Raises :class:`RecordTooLarge` before anything
        is produced if an event does not fit. A failed transaction is aborted and the
        error raised: nothing of it is visible.
        """
        if not self._started:
            raise RuntimeError("EventWriter.start() must be called before write()")
        if self._hung is not None:
            raise RuntimeError(
                f"this event writer's producer hung ({self._hung}): restart the source, "
                "which resumes exactly where the committed events end"
            )
        if not events and not offsets:
            return
        records = [self.check(event) for event in events]
        self._producer.begin_transaction()
        try:
            for key, value in records:
                self._produce(key, value)
            if offsets:
                self._bounded(
                    "send_offsets_to_transaction",
                    functools.partial(
                        self._producer.send_offsets_to_transaction,
                        list(offsets),
                        group_metadata,
                        timeout_s,
                    ),
                    timeout_s,
                )
            self._bounded(
                "commit_transaction",
                functools.partial(self._producer.commit_transaction, timeout_s),
                timeout_s,
            )
        except CallHung:
            raise  # nothing more may be asked of the hung producer
        except BaseException:
            try:
                self._bounded(
                    "abort_transaction",
                    functools.partial(self._producer.abort_transaction, timeout_s),
                    timeout_s,
                )
            except (KafkaException, CallHung) as exc:
                log.warning("could not abort the event transaction: %s", exc)
            raise
        self._remember(event.event_key for event in events)
        self.written += len(events)

    def _produce(self, key: bytes, value: bytes) -> None:
        while True:
            try:
                self._producer.produce(self.topic, key=key, value=value)
                return
            except BufferError:
                self._producer.poll(0.1)

    def _bounded(self, what: str, call: Callable[[], object], timeout_s: float) -> None:
        """``call()``, waited for at most ``timeout_s`` and the grace; a hang is remembered
        (the writer refuses later writes) and raised."""
        try:
            self._calls.call(what, call, timeout_s + HUNG_GRACE_S)
        except CallHung as hung:
            self._hung = hung
            log.error(
                "event source %s: the producer's %s (librdkafka does not time out some "
                "transactional calls while a coordinator broker is gone: "
                "confluentinc/librdkafka#5456, #5511); restart the source",
                self.source,
                hung,
            )
            raise

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and drop the producer (nothing is pending after :meth:`write` returns); a
        producer that hung is left alone."""
        self._calls.close()
        if self._hung is None:
            self._producer.flush(timeout_s)
