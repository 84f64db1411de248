"""What the dashboard reads beside the API's registry view: warm adverts and dead letters.

The API's :class:`~fxstream.service.registry.RegistryView` follows neither ``warm`` nor
``dead-letter``. :class:`DashboardFeeds` follows both with one consumer in a background
thread, started at the first dashboard request that needs it (an API nobody opens a
dashboard on pays nothing) and closed with the API:

- ``warm`` (compacted, the latest advert per ``<endpoint>/<manager>``) from the
  beginning, summarised per manager: its workers, how many are idle, the containers they
  run and how many functions they hold loaded. At most :data:`MAX_WARM_ENTRIES` managers
  (the least recently advertised go first); a tombstone removes one.
- ``dead-letter`` from the last :data:`DEAD_LETTER_TAIL` records of each partition on,
  keeping the newest :data:`DEAD_LETTER_TAIL` letters' *descriptions* only: when, which
  component gave up, the error type, the reason (cut to :data:`REASON_CHARS`), the
  original topic, partition and offset, and the task id when known. The original key,
  value and headers are dropped as each letter is decoded: they are never kept, shown or
  sent to a browser.

The API connects as the platform's admin principal (it manages accounts), which may read
both topics.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from fxstream.topics import (
    Catalogue,
    DeadLetter,
    KafkaConnection,
    RecordDecodeError,
    WarmAdvert,
    decode,
)
from fxstream.topics.acls import SERVICE_VIEW_GROUP

__all__ = [
    "DEAD_LETTER_TAIL",
    "MAX_WARM_ENTRIES",
    "REASON_CHARS",
    "DashboardFeeds",
    "DeadLetterNote",
    "WarmManager",
]

log = logging.getLogger(__name__)

MAX_WARM_ENTRIES: Final = 4_096
"""Managers' adverts kept (as the router's warm table)."""
DEAD_LETTER_TAIL: Final = 200
"""Dead letters read back per partition at start, and kept (newest) in all."""
REASON_CHARS: Final = 500
"""A dead letter's reason is cut to this many characters."""
_METADATA_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class WarmManager:
    """One endpoint manager's latest advert, summarised."""

    endpoint_id: str
    manager_id: str
    advertised_at: float
    workers: int
    idle: int
    containers: tuple[str, ...]
    functions: int


@dataclass(frozen=True)
class DeadLetterNote:
    """A dead letter without its original bytes."""

    failed_at: float
    component: str
    error_type: str
    reason: str
    original_topic: str
    original_partition: int
    original_offset: int
    task_id: str | None


class DashboardFeeds:
    """Follows ``warm`` and the tail of ``dead-letter`` (see the module notes)."""

    def __init__(self, kafka: KafkaConnection, catalogue: Catalogue) -> None:
        self._warm_topic = catalogue.warm
        self._dead_letter_topic = catalogue.dead_letter
        self._warm: OrderedDict[str, WarmManager] = OrderedDict()
        self._letters: deque[DeadLetterNote] = deque(maxlen=DEAD_LETTER_TAIL)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **kafka.confluent(),
                "group.id": SERVICE_VIEW_GROUP,  # assigned, never joined
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                "fetch.wait.max.ms": 500,
                "queued.max.messages.kbytes": 4096,
                "log_level": 2,
            }
        )
        self._thread = threading.Thread(target=self._run, name="dashboard-feeds", daemon=True)
        self.undecodable = 0

    def start(self) -> None:
        """Assign ``warm`` from the beginning and ``dead-letter``'s tail; start following."""
        assigned: list[TopicPartition] = []
        metadata = self._consumer.list_topics(timeout=_METADATA_TIMEOUT_S)
        for topic in (self._warm_topic, self._dead_letter_topic):
            described = metadata.topics.get(topic)
            if described is None or described.error is not None:
                raise RuntimeError(f"topic {topic} is missing: run ./fx up first")
            for partition in sorted(described.partitions):
                if topic == self._warm_topic:
                    assigned.append(TopicPartition(topic, partition, OFFSET_BEGINNING))
                    continue
                low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=_METADATA_TIMEOUT_S
                )
                assigned.append(TopicPartition(topic, partition, max(low, high - DEAD_LETTER_TAIL)))
        self._consumer.assign(assigned)
        self._thread.start()

    def close(self) -> None:
        """Stop following and close the consumer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._consumer.close()

    @property
    def following(self) -> bool:
        """True while the thread reads the topics."""
        return self._thread.is_alive() and not self._stop.is_set()

    def warm(self, endpoint_id: str) -> list[WarmManager]:
        """The managers of ``endpoint_id`` with an advert, by manager id."""
        with self._lock:
            found = [m for m in self._warm.values() if m.endpoint_id == endpoint_id]
        return sorted(found, key=lambda m: m.manager_id)

    def warm_by_endpoint(self) -> dict[str, list[WarmManager]]:
        """Every advertised manager, grouped by endpoint."""
        grouped: dict[str, list[WarmManager]] = {}
        with self._lock:
            managers = list(self._warm.values())
        for manager in managers:
            grouped.setdefault(manager.endpoint_id, []).append(manager)
        return grouped

    def dead_letters(self, limit: int) -> list[DeadLetterNote]:
        """The newest ``limit`` dead letters read, newest first."""
        with self._lock:
            notes = list(self._letters)
        notes.sort(key=lambda n: n.failed_at, reverse=True)
        return notes[:limit]

    # --- the follower thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._consumer.poll(0.2)
            if first is None:
                continue
            messages = [first, *self._consumer.consume(num_messages=499, timeout=0)]
            with self._lock:
                for message in messages:
                    self._fold(message)

    def _fold(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("dashboard feeds: %s", error)
            return
        if message.topic() == self._warm_topic:
            self._fold_warm(message)
        else:
            self._fold_letter(message)

    def _fold_warm(self, message: Message) -> None:
        key = (message.key() or b"").decode(errors="replace")
        value = message.value()
        if value is None:
            self._warm.pop(key, None)
            return
        try:
            advert = decode(value, WarmAdvert)
        except RecordDecodeError:
            self.undecodable += 1
            return
        if key != f"{advert.endpoint_id}/{advert.manager_id}":
            self.undecodable += 1  # the ingress writes it checked: a forged record
            return
        containers = sorted({w.container for w in advert.workers if w.container is not None})
        functions = {f for w in advert.workers for f in w.function_ids}
        self._warm.pop(key, None)
        self._warm[key] = WarmManager(
            endpoint_id=advert.endpoint_id,
            manager_id=advert.manager_id,
            advertised_at=advert.advertised_at,
            workers=len(advert.workers),
            idle=sum(1 for w in advert.workers if w.idle),
            containers=tuple(containers[:64]),
            functions=len(functions),
        )
        while len(self._warm) > MAX_WARM_ENTRIES:
            self._warm.popitem(last=False)

    def _fold_letter(self, message: Message) -> None:
        value = message.value()
        if value is None:
            return
        try:
            letter = decode(value, DeadLetter)
        except RecordDecodeError:
            self.undecodable += 1
            return
        # Only the description is kept: the original key, value and headers go here.
        self._letters.append(
            DeadLetterNote(
                failed_at=letter.failed_at,
                component=letter.component,
                error_type=letter.error_type,
                reason=letter.reason[:REASON_CHARS],
                original_topic=letter.original_topic,
                original_partition=letter.original_partition,
                original_offset=letter.original_offset,
                task_id=letter.task_id,
            )
        )
