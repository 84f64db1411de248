"""Finished tasks leave ``task-state`` once their retention period has passed.

``task-state`` is compacted: without a tombstone a task's last state stays for
ever, in the topic and in every processor's on-disk copy of it (the API's, the
ingress's, the trigger and dependencies processors'), and each copy's cost per
task grows with it (docs/benchmarks.md, "bench profile"). :class:`TaskExpiry`,
run beside the task-state processor, writes a tombstone for each task once it
has been finished (succeeded, failed, cancelled or rejected) for longer than
the retention period (``FXSTREAM_TASK_RETENTION_S``, 7 days by default: as long
as ``results.<user>`` keeps results). Every view drops the task when it reads
the tombstone; compaction then removes both from the topic.

Candidates are found without scanning a table: a consumer of its own group
reads ``task-state`` *trailing the log* by the retention period. A record is
looked at once its timestamp is older than the cutoff; a partition whose next
record is younger is paused (and that record sought back to) until it is not.
Only a record holding a finished state is a candidate (read with
:func:`~fxstream.topics.task_state_glance`, the rest of it not decoded), and the
task is expired only if its *current* state (``lookup``, the processor's view)
is finished and older than the cutoff: a task that changed since is looked at
again when its newer record's turn comes. Offsets are committed once the
tombstones are acknowledged, so a restart looks at a few records again (a task
already gone is skipped) and never skips one.

Never expired: a task not finished, however old (one waiting for its endpoint
keeps its state as long as it waits). Not handled: a result arriving for a task
after it expired (``results.<user>`` keeps results as long, so only a duplicate
older than the retention period could) is folded as a new finished state, which
expires in turn.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from fxstream.service.lifecycle import TERMINAL_STATES
from fxstream.topics import Catalogue, KafkaConnection, TaskState, task_state_glance

__all__ = [
    "DEFAULT_RETENTION_S",
    "EXIT_EXPIRY_FAILED",
    "RETENTION_ENV",
    "ExpiryStats",
    "TaskExpiry",
    "exit_when_failed",
    "retention_from_env",
    "retention_s",
]

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 7 * 24 * 3600.0
# The expiry consumer's prefetch bound, in KiB (librdkafka's queued.max.messages.kbytes).
EXPIRY_PREFETCH_KB = 4096
"""How long a finished task stays in task-state by default: as long as its result."""
RETENTION_ENV = "FXSTREAM_TASK_RETENTION_S"
"""The environment variable that sets the retention period, in seconds."""
# Records looked at per poll, and the longest a poll waits.
BATCH = 500
POLL_S = 1.0
# How long delivering a batch's tombstones may take before the loop gives up on the batch
# (its offsets stay uncommitted, so the records are looked at again).
FLUSH_TIMEOUT_S = 30.0

# How often exit_when_failed looks at the thread.
WATCH_S = 5.0
EXIT_EXPIRY_FAILED = 76
"""The exit code of a processor process whose expiry thread failed (it is restarted)."""

Lookup = Callable[[str], TaskState | None]


def retention_s(option: float | None, environ: dict[str, str] | None = None) -> float:
    """The retention period: ``option`` (a command-line value) if given, else
    :func:`retention_from_env`. Raises ValueError, saying what to write, for a value that
    is not a positive number of seconds."""
    if option is None:
        return retention_from_env(environ)
    if not 0 < option < float("inf"):
        raise ValueError(
            f"--task-retention-s {option}: write how long a finished task stays in "
            f"task-state, in seconds (a positive number; {DEFAULT_RETENTION_S:.0f} is 7 days)"
        )
    return option


def retention_from_env(environ: dict[str, str] | None = None) -> float:
    """The retention period in seconds from ``FXSTREAM_TASK_RETENTION_S``, else the default.

    Raises ValueError, saying what to write, for a value that is not a positive number.
    """
    raw = (os.environ if environ is None else environ).get(RETENTION_ENV, "").strip()
    if not raw:
        return DEFAULT_RETENTION_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"${RETENTION_ENV}={raw!r}: write how long a finished task stays in task-state, "
            f"in seconds (a positive number; {DEFAULT_RETENTION_S:.0f} is 7 days)"
        )
    return value


@dataclass
class ExpiryStats:
    """Counts since start."""

    looked_at: int = 0
    """Records of finished tasks past the cutoff that were looked up."""
    expired: int = 0
    """Tombstones written."""
    changed: int = 0
    """Tasks whose current state was newer than the record (looked at again later)."""
    gone: int = 0
    """Tasks no longer in the view (expired before, or never readable)."""


class TaskExpiry:
    """A thread writing tombstones to task-state for tasks finished longer than
    ``retention_s`` ago (see the module notes).

    ``lookup`` returns a task's current state (the processor's view of task-state);
    ``ready(timeout_s)`` says whether that view has read what task-state held when it
    started (the thread waits for it before it looks at anything: a view still reading
    would hide tasks from it). ``group_id`` is the consumer group that keeps how far the
    expiry has looked (one per platform: instances share the partitions).
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        *,
        lookup: Lookup,
        group_id: str,
        ready: Callable[[float], bool] = lambda _timeout_s: True,
        retention_s: float = DEFAULT_RETENTION_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be positive; got {retention_s}")
        self._kafka = kafka
        self._topic = catalogue.task_state
        self._lookup = lookup
        self._ready = ready
        self._group_id = group_id
        self.retention_s = retention_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Per paused partition: when its next record comes of age (clock seconds).
        self._paused: dict[int, float] = {}
        self.stats = ExpiryStats()
        self.failure: BaseException | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fxstream-task-expiry", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread: what it tombstoned is committed, the rest is looked at next time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._ready(POLL_S):
            if self._stop.is_set():
                return
        consumer = Consumer(
            {
                **self._kafka.confluent(),
                "group.id": self._group_id,
                "client.id": self._group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                # Prefetch little: a partition paused at a young record drops what was
                # fetched past it, and librdkafka's default (64 MiB queued) held about
                # 90 MB of the process's heap for that (docs/benchmarks.md, soak).
                "queued.max.messages.kbytes": EXPIRY_PREFETCH_KB,
                "log_level": 3,
            }
        )
        producer = Producer(
            {
                **self._kafka.confluent_producer(),
                "client.id": self._group_id,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 20,
                "log_level": 3,
            }
        )
        try:
            consumer.subscribe(
                [self._topic],
                on_assign=lambda _c, parts: self._forget(parts),
                on_revoke=lambda c, parts: self._forget(parts),
                on_lost=lambda _c, parts: self._forget(parts),
            )
            while not self._stop.is_set():
                self._resume_due(consumer)
                messages = consumer.consume(BATCH, POLL_S)
                if messages:
                    self._look_at(consumer, producer, messages)
        except BaseException as exc:
            log.exception("task expiry stopped: %s", exc)
            # Without its traceback, which would keep this frame's clients alive.
            self.failure = exc.with_traceback(None)
        finally:
            producer.flush(FLUSH_TIMEOUT_S)
            consumer.close()
            log.info("task expiry: %s", self.stats)

    def _forget(self, partitions: list[TopicPartition]) -> None:
        """A rebalance: paused partitions start again from their committed offsets."""
        for tp in partitions:
            self._paused.pop(tp.partition, None)

    def _resume_due(self, consumer: Consumer) -> None:
        now = self._clock()
        due = [p for p, at in self._paused.items() if at <= now]
        if due:
            consumer.resume([TopicPartition(self._topic, p) for p in due])
            for partition in due:
                del self._paused[partition]

    def _look_at(self, consumer: Consumer, producer: Producer, messages: list[Message]) -> None:
        """Tombstone the tasks of ``messages`` that expired; pause a partition at its first
        record that is too young; commit what was looked at once the tombstones are in."""
        cutoff = self._clock() - self.retention_s
        looked: dict[int, int] = {}
        first: dict[int, int] = {}
        failed: list[KafkaError] = []

        def delivered(error: KafkaError | None, _message: Message) -> None:
            if error is not None:
                failed.append(error)

        for message in messages:
            partition, offset = message.partition(), message.offset()
            if message.error() is not None or partition is None or offset is None:
                continue
            if partition in self._paused:
                continue  # past a record too young: it is read again when resumed
            _kind, stamp_ms = message.timestamp()
            if stamp_ms / 1000.0 > cutoff:
                consumer.seek(TopicPartition(self._topic, partition, offset))
                consumer.pause([TopicPartition(self._topic, partition)])
                self._paused[partition] = stamp_ms / 1000.0 + self.retention_s
                continue
            looked[partition] = offset + 1
            key = message.key()
            first.setdefault(partition, offset)
            if key is None or not self._expired(key, message.value(), cutoff):
                continue
            producer.produce(self._topic, key=key, value=None, on_delivery=delivered)
            producer.poll(0)
        if producer.flush(FLUSH_TIMEOUT_S) or failed:
            # Nothing committed: the batch's records are looked at again.
            log.warning(
                "task expiry: tombstones not acknowledged (%s); looking at %d records again",
                failed[0] if failed else f"not within {FLUSH_TIMEOUT_S:.0f} s",
                sum(looked[p] - first[p] for p in first),
            )
            for partition, offset in first.items():
                consumer.seek(TopicPartition(self._topic, partition, offset))
            self._stop.wait(POLL_S)
            return
        if looked:
            try:
                consumer.commit(
                    offsets=[TopicPartition(self._topic, p, o) for p, o in looked.items()],
                    asynchronous=False,
                )
            except KafkaException as exc:
                # A rebalance took them: their next owner looks at these records again.
                log.warning("task expiry: commit failed (%s); continuing", exc)

    def _expired(self, key: bytes, value: bytes | None, cutoff: float) -> bool:
        """Whether the task of a record past the cutoff is to be tombstoned now."""
        glance = task_state_glance(value)
        if glance is None or glance[0] not in TERMINAL_STATES:
            return False  # a tombstone, a state not finished, or bytes the views refuse
        self.stats.looked_at += 1
        task_id = key.decode(errors="replace")
        current = self._lookup(task_id)
        if current is None:
            self.stats.gone += 1
            return False
        if current.state not in TERMINAL_STATES or current.updated_at > cutoff:
            self.stats.changed += 1
            return False
        self.stats.expired += 1
        return True


async def exit_when_failed(
    expiry: TaskExpiry,
    *,
    every_s: float = WATCH_S,
    exit_process: Callable[[int], object] | None = None,
) -> None:
    """Exit the process (code :data:`EXIT_EXPIRY_FAILED`) once ``expiry``'s thread has
    stopped on an error, so that the supervisor restarts it: a dead thread would let
    task-state grow for ever, unnoticed. Runs until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        if expiry.failure is not None:
            log.critical("the task expiry stopped (%r); exiting to be restarted", expiry.failure)
            (exit_process or _exit_now)(EXIT_EXPIRY_FAILED)
            return


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)
