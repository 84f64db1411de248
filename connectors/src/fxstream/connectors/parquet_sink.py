"""A Parquet sink: results metadata, events and task-state changes archived by day and hour.

:class:`ParquetSink` consumes (``read_committed``, in the consumer group
``fxstream-processors-parquet-sink`` by default) every ``results.<user>`` topic, every
``events.<source>`` topic and ``task-state`` of one deployment, and writes one row per
record to Parquet files under ``directory``::

    <directory>/<kind>/day=YYYY-MM-DD/hour=HH/<topic>+<partition>+<first>-<last>.parquet

``kind`` is ``results``, ``events`` or ``task_state``; ``day`` and ``hour`` (hive-style
directories, UTC) come from the record's Kafka timestamp; ``first`` and ``last`` (20 digits)
are the offsets of the Kafka partition that the flush covered. Every kind has an explicit
pyarrow schema (:data:`SCHEMAS`): the Kafka coordinates (``topic``, ``partition``,
``offset``, ``kafka_time``) and the record's fields, never its bulk bytes: a result's
``value`` and a task state's ``value`` are reduced to their size (``value_bytes``), an
event's ``data`` to ``data_bytes``, its ``attributes`` are a JSON string. Readers:
``pyarrow.dataset.dataset(dir, partitioning="hive")``, ``pandas.read_parquet(dir)``, and
DuckDB's ``read_parquet('<dir>/**/*.parquet', hive_partitioning = true)``. A task-state
tombstone (a deleted task) and a record that does not decode as its topic's kind make no
row (they are counted in :attr:`ParquetSink.skipped` and logged).

Exactly-once rows. The sink buffers rows per Kafka partition and flushes when
``max_rows`` rows are buffered, the oldest is ``max_age_s`` old, the partitions are revoked,
or it stops. A flush writes each file to a temporary name (``.<name>.tmp``, which the
readers above ignore), fsyncs it, renames it into place and fsyncs its directory; only then
does it commit the consumer offsets past the flushed records. On every assignment (start,
restart, rebalance) the sink first deletes the files of each assigned partition whose first
offset is at or after the group's committed offset: files a crashed run closed but never
committed. It then reads on from the committed offset and writes those rows again. So,
once the sink has committed past a record, that record is exactly one row in exactly one
file, whatever was killed when (SIGKILL included); between a crash and the restart a reader
may see rows of uncommitted files that the restart deletes and writes again (the same rows).

One sink per directory: the sink holds ``<directory>/_sink.lock`` (an ``flock``) while it
runs, and ``<directory>/_sink.json`` records its consumer group, so a sink started with
another group (whose committed offsets would not match the files) refuses the directory.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from fxstream.topics import (
    Catalogue,
    Event,
    KafkaConnection,
    RecordDecodeError,
    TaskResult,
    TaskState,
    TaskTimings,
    decode,
)
from fxstream.topics.acls import SERVICE_GROUP_PREFIX

__all__ = [
    "DEFAULT_SINK_GROUP",
    "KINDS",
    "SCHEMAS",
    "ParquetSink",
    "SinkDirectoryInUse",
    "event_row",
    "result_row",
    "task_state_row",
]

log = logging.getLogger(__name__)

DEFAULT_SINK_GROUP: Final = f"{SERVICE_GROUP_PREFIX}-parquet-sink"
KINDS: Final = ("results", "events", "task_state")
_LOCK, _STATE = "_sink.lock", "_sink.json"
_FILE_RE: Final = re.compile(
    r"^(?P<topic>.+)\+(?P<partition>\d+)\+(?P<first>\d{20})-(?P<last>\d{20})\.parquet$"
)

_US = pa.timestamp("us", tz="UTC")
_KAFKA_COLUMNS = [
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("kafka_time", pa.timestamp("ms", tz="UTC"), nullable=False),
]
_TASK_IDS = [
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("user_id", pa.string(), nullable=False),
    pa.field("function_id", pa.string(), nullable=False),
    pa.field("endpoint_id", pa.string(), nullable=False),
    pa.field("task_group_id", pa.string()),
]
_ERROR = [
    pa.field("error_type", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("error_retryable", pa.bool_()),
]
_TIMINGS = [
    pa.field(name, _US)
    for name in (
        "submitted_at",
        "routed_at",
        "dequeued_at",
        "started_at",
        "finished_at",
        "result_published_at",
    )
]

SCHEMAS: Final[dict[str, Any]] = {
    "results": pa.schema(
        [
            *_KAFKA_COLUMNS,
            *_TASK_IDS,
            pa.field("outcome", pa.string(), nullable=False),
            pa.field("attempt", pa.int32(), nullable=False),
            pa.field("worker", pa.string(), nullable=False),
            *_ERROR,
            pa.field("value_bytes", pa.int64()),
            pa.field("earlier_attempts", pa.int32(), nullable=False),
            *_TIMINGS,
        ]
    ),
    "events": pa.schema(
        [
            *_KAFKA_COLUMNS,
            pa.field("source", pa.string(), nullable=False),
            pa.field("event_key", pa.string(), nullable=False),
            pa.field("event_type", pa.string(), nullable=False),
            pa.field("occurred_at", _US, nullable=False),
            pa.field("attributes", pa.string(), nullable=False),
            pa.field("data_bytes", pa.int64()),
        ]
    ),
    "task_state": pa.schema(
        [
            *_KAFKA_COLUMNS,
            *_TASK_IDS,
            pa.field("state", pa.string(), nullable=False),
            pa.field("updated_at", _US, nullable=False),
            pa.field("attempts", pa.int32(), nullable=False),
            *_ERROR,
            pa.field("value_bytes", pa.int64()),
            *_TIMINGS,
        ]
    ),
}
"""The explicit pyarrow schema of each kind's files (hive ``day`` and ``hour`` come from
the directories, not the files)."""


def _us(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1_000_000)


def _timings(timings: TaskTimings) -> dict[str, int | None]:
    return {
        "submitted_at": _us(timings.submitted_at),
        "routed_at": _us(timings.routed_at),
        "dequeued_at": _us(timings.dequeued_at),
        "started_at": _us(timings.started_at),
        "finished_at": _us(timings.finished_at),
        "result_published_at": _us(timings.result_published_at),
    }


def result_row(result: TaskResult) -> dict[str, Any]:
    """The ``results`` columns of a task result (its value reduced to its size)."""
    error = result.error
    return {
        "task_id": result.task_id,
        "user_id": result.user_id,
        "function_id": result.function_id,
        "endpoint_id": result.endpoint_id,
        "task_group_id": result.task_group_id,
        "outcome": result.outcome,
        "attempt": result.attempt,
        "worker": result.worker,
        "error_type": error.type if error else None,
        "error_message": error.message if error else None,
        "error_retryable": error.retryable if error else None,
        "value_bytes": len(result.value) if result.value is not None else None,
        "earlier_attempts": len(result.earlier_attempts),
        **_timings(result.timings),
    }


def event_row(event: Event) -> dict[str, Any]:
    """The ``events`` columns of an event (its data reduced to its size)."""
    return {
        "source": event.source,
        "event_key": event.event_key,
        "event_type": event.event_type,
        "occurred_at": _us(event.occurred_at),
        "attributes": json.dumps(event.attributes, sort_keys=True),
        "data_bytes": len(event.data) if event.data is not None else None,
    }


def task_state_row(state: TaskState) -> dict[str, Any]:
    """The ``task_state`` columns of a task-state change (its value reduced to its size)."""
    error = state.error
    return {
        "task_id": state.task_id,
        "user_id": state.user_id,
        "function_id": state.function_id,
        "endpoint_id": state.endpoint_id,
        "task_group_id": state.task_group_id,
        "state": state.state.value,
        "updated_at": _us(state.updated_at),
        "attempts": len(state.attempts),
        "error_type": error.type if error else None,
        "error_message": error.message if error else None,
        "error_retryable": error.retryable if error else None,
        "value_bytes": len(state.value) if state.value is not None else None,
        **_timings(state.timings),
    }


_ROWS: Final[dict[str, Callable[[bytes], dict[str, Any]]]] = {
    "results": lambda value: result_row(decode(value, TaskResult)),
    "events": lambda value: event_row(decode(value, Event)),
    "task_state": lambda value: task_state_row(decode(value, TaskState)),
}


_KIND_OF_SPEC: Final = {
    "results.{user_id}": "results",
    "events.{source}": "events",
    "task-state": "task_state",
}


class SinkDirectoryInUse(RuntimeError):
    """Another sink holds the directory, or it was written under another consumer group."""


@dataclass
class _Buffer:
    first: int
    last: int
    started: float
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = field(default_factory=dict)
    count: int = 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ParquetSink:
    """Archives one deployment's results, events and task states to Parquet (module doc).

    Args:
        connection: the Kafka connection (the service principal reads all three kinds).
        directory: the archive's root directory (created if missing).
        catalogue: the deployment's topic names.
        kinds: which of ``results``, ``events``, ``task_state`` to archive.
        group: the consumer group; fixed for a directory once used.
        max_rows: rows buffered before a flush.
        max_age_s: seconds the oldest buffered row waits before a flush.
        poll_s: how long one poll waits before ``stop`` is looked at.
        session_timeout_s: the group session timeout. The sink is a static group member
            (``group.instance.id`` = the group), so a restarted sink takes over its
            partitions at once; another member would wait this long for a dead one.
    """

    def __init__(
        self,
        connection: KafkaConnection,
        directory: str | os.PathLike[str],
        *,
        catalogue: Catalogue | None = None,
        kinds: tuple[str, ...] = KINDS,
        group: str = DEFAULT_SINK_GROUP,
        max_rows: int = 10_000,
        max_age_s: float = 30.0,
        poll_s: float = 0.25,
        session_timeout_s: float = 10.0,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")
        if max_rows < 1 or max_age_s <= 0:
            raise ValueError("max_rows must be at least 1 and max_age_s positive")
        self.connection = connection
        self.root = Path(directory).absolute()
        self.catalogue = catalogue or Catalogue()
        self.kinds = kinds
        self.group = group
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.poll_s = poll_s
        self.session_timeout_s = session_timeout_s
        self.rows_written = 0
        """Rows in files this sink closed and committed."""
        self.files_written = 0
        """Files this sink closed and committed."""
        self.skipped = 0
        """Records that made no row (tombstones, undecodable records)."""
        self.deleted_uncommitted = 0
        """Files of a crashed run deleted at an assignment (their rows are written again)."""
        self.ready = threading.Event()
        """Set once the consumer has its first assignment."""
        self._buffers: dict[tuple[str, int], _Buffer] = {}
        self._lock_fd: int | None = None
        self._consumer: Consumer | None = None

    # --- the directory -------------------------------------------------------------------

    def _claim_directory(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SinkDirectoryInUse(
                f"another Parquet sink is archiving into {self.root} ({self.root / _LOCK} is "
                "locked): stop it first, or give this sink another directory"
            ) from None
        self._lock_fd = fd
        state = self.root / _STATE
        if state.exists():
            recorded = json.loads(state.read_text()).get("group")
            if recorded != self.group:
                self._release_directory()
                raise SinkDirectoryInUse(
                    f"{self.root} was archived by the consumer group {recorded!r}, whose "
                    f"committed offsets its files match: start the sink with "
                    f"group={recorded!r}, or use another directory"
                )
        else:
            temporary = self.root / f".{_STATE}.tmp"
            temporary.write_text(json.dumps({"group": self.group}))
            os.replace(temporary, state)
            _fsync_dir(self.root)
        for leftover in self.root.rglob(".*.tmp"):
            leftover.unlink(missing_ok=True)

    def _release_directory(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _files_by_partition(self) -> dict[tuple[str, int], list[tuple[Path, int]]]:
        """Every archive file, with its first offset, by the Kafka partition it holds."""
        found: dict[tuple[str, int], list[tuple[Path, int]]] = {}
        for kind in self.kinds:
            for path in self.root.glob(f"{kind}/day=*/hour=*/*.parquet"):
                match = _FILE_RE.match(path.name)
                if match:
                    where = (match["topic"], int(match["partition"]))
                    found.setdefault(where, []).append((path, int(match["first"])))
        return found

    # --- running -------------------------------------------------------------------------

    def _subscriptions(self) -> list[str]:
        topics = []
        if "results" in self.kinds:
            topics.append(self._family("results."))
        if "events" in self.kinds:
            topics.append(self._family("events."))
        if "task_state" in self.kinds:
            topics.append(self.catalogue.task_state)
        return topics

    def _family(self, head: str) -> str:
        """librdkafka's regular expression for every ``<prefix><head><id>`` topic (plain
        syntax: no bounded repetition, only ``.`` escaped; prefixes and ids are letters,
        digits, ``.`` and ``-``)."""
        fixed = (self.catalogue.prefix + head).replace(".", "\\.")
        return f"^{fixed}[A-Za-z0-9][A-Za-z0-9-]*$"

    def _kind_of(self, topic: str) -> str | None:
        spec = self.catalogue.spec_for_topic(topic)
        if spec is None:
            return None
        kind = _KIND_OF_SPEC.get(spec.name)
        return kind if kind in self.kinds else None

    def run(self, stop: threading.Event) -> None:
        """Archive until ``stop`` is set, then flush and commit what is buffered."""
        self._claim_directory()
        try:
            self._consume(stop)
        finally:
            self._release_directory()

    def _consume(self, stop: threading.Event) -> None:
        consumer = Consumer(
            {
                **self.connection.confluent(),
                "group.id": self.group,
                "group.instance.id": self.group,
                "session.timeout.ms": int(self.session_timeout_s * 1000),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "topic.metadata.refresh.interval.ms": 5000,
                "log_level": 3,
            }
        )
        self._consumer = consumer
        consumer.subscribe(
            self._subscriptions(),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        try:
            while not stop.is_set():
                for message in consumer.consume(1000, timeout=self.poll_s):
                    self._take(message)
                if self._due():
                    self.flush()
            self.flush()
        finally:
            with contextlib.suppress(KafkaException, RuntimeError):
                consumer.close()
            self._consumer = None

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if partitions:
            committed = consumer.committed(partitions, timeout=30)
            files = self._files_by_partition()
            for tp in committed:
                for path, first in files.get((tp.topic, tp.partition), []):
                    if tp.offset < 0 or first >= tp.offset:
                        log.warning("deleting %s: written but never committed (rewritten)", path)
                        path.unlink(missing_ok=True)
                        self.deleted_uncommitted += 1
        self.ready.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.flush()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._buffers.pop((tp.topic, tp.partition), None)

    def _take(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return
            if error.fatal():
                raise KafkaException(error)
            log.warning("consumer error: %s", error)
            return
        topic, partition, offset = message.topic() or "", message.partition(), message.offset()
        assert partition is not None and offset is not None
        buffer = self._buffers.get((topic, partition))
        if buffer is None:
            buffer = self._buffers[(topic, partition)] = _Buffer(offset, offset, time.monotonic())
        buffer.last = offset
        kind = self._kind_of(topic)
        value = message.value()
        if kind is None or value is None:
            self.skipped += 1
            return
        try:
            row = _ROWS[kind](value)
        except RecordDecodeError as exc:
            log.warning("%s[%d]@%d makes no row: %s", topic, partition, offset, exc)
            self.skipped += 1
            return
        _type, timestamp_ms = message.timestamp()
        if timestamp_ms <= 0:
            timestamp_ms = int(time.time() * 1000)
        when = dt.datetime.fromtimestamp(timestamp_ms / 1000, dt.UTC)
        row.update(topic=topic, partition=partition, offset=offset, kafka_time=timestamp_ms)
        slot = (kind, when.strftime("%Y-%m-%d"), when.strftime("%H"))
        buffer.rows.setdefault(slot, []).append(row)
        buffer.count += 1

    def _due(self) -> bool:
        if not self._buffers:
            return False
        if sum(b.count for b in self._buffers.values()) >= self.max_rows:
            return True
        oldest = min(b.started for b in self._buffers.values())
        return time.monotonic() - oldest >= self.max_age_s

    def flush(self) -> None:
        """Close a file per (partition, kind, day, hour) of what is buffered, then commit."""
        if not self._buffers or self._consumer is None:
            return
        buffers, self._buffers = self._buffers, {}
        files = rows = 0
        for (topic, partition), buffer in buffers.items():
            name = f"{topic}+{partition}+{buffer.first:020d}-{buffer.last:020d}.parquet"
            for (kind, day, hour), kind_rows in buffer.rows.items():
                self._write(self.root / kind / f"day={day}" / f"hour={hour}", name, kind, kind_rows)
                files += 1
                rows += len(kind_rows)
        offsets = [TopicPartition(t, p, b.last + 1) for (t, p), b in buffers.items()]
        self._consumer.commit(offsets=offsets, asynchronous=False)
        self.files_written += files
        self.rows_written += rows
        log.info("archived %d rows in %d files", rows, files)

    def _write(self, directory: Path, name: str, kind: str, rows: list[dict[str, Any]]) -> None:
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            # The new directories' entries, up to the root, are durable before any file.
            for parent in (directory.parent, directory.parent.parent, self.root):
                _fsync_dir(parent)
        table = pa.Table.from_pylist(rows, schema=SCHEMAS[kind])
        temporary = directory / f".{name}.tmp"
        pq.write_table(table, temporary)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, directory / name)
        _fsync_dir(directory)
