"""Answers and their queue offsets, written together in Kafka transactions.

An *answer* is the record that settles one queue record: a task's result on
``results.<user>``, or a dead letter for a record that cannot be a task. The
:class:`TransactionalPublisher` thread writes answers and commits the queue
offsets they settle in one transaction, so a crash leaves either both (the task
is done and never redelivered) or neither (the task is redelivered and its
result was never visible to ``read_committed`` readers). Duplicated results
from a crash therefore cannot happen through this hop; a task may still *run*
twice (killed after the run, before the commit), and its second result is then
the only one committed.

Batching adapts to load: the thread takes every answer waiting when a
transaction begins, so a lone result commits at once, and under load the
answers that arrive while one transaction commits make up the next.

A transaction's answers may settle records past a partition's commit position
(a slow task before them is still running): the offset commit's metadata then
names them (:meth:`~fxstream.agent.offsets.OffsetTracker.commits`), in the same
transaction, so the partition's next owner settles them without running them
again. An answer that would make that metadata too large waits for a later
transaction (:meth:`~fxstream.agent.offsets.OffsetTracker.admit`).

The transactional id is stable per agent (endpoint, host, name): a restarted
agent's ``init_transactions`` fences its predecessor (a zombie can no longer
commit) and aborts whatever transaction it left open. Offsets are sent with the
consumer's group metadata, so a member that lost its partitions in a rebalance
cannot commit for them either (KIP-447).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from fxstream.agent.offsets import OffsetTracker

__all__ = ["Answer", "PublisherFenced", "TransactionalPublisher"]

log = logging.getLogger(__name__)

# Most answers per transaction: bounds the work a failed commit repeats.
MAX_ANSWERS_PER_TRANSACTION = 2_000
# How long one transactional call may take before the batch is retried.
CALL_TIMEOUT_S = 30.0
# A transaction slower than this is logged: results wait for it.
SLOW_TRANSACTION_S = 1.0
# How often answers waiting for room in the commit metadata are tried again, at most.
DEFERRED_RETRY_S = 0.05


@dataclass(frozen=True, slots=True)
class Answer:
    """A record to write, and the queue record (partition, offset) it settles.

    ``topic`` None writes nothing and only settles the offset (a cancel for a task
    already answered): its commit needs a transaction all the same.
    """

    topic: str | None
    key: bytes | None
    value: bytes
    partition: int
    offset: int
    # The consumer's assignment epoch when the queue record was taken (see
    # TransactionalPublisher): an answer from an older epoch is dropped, not written.
    epoch: int = 0


class PublisherFenced(RuntimeError):
    """Another agent with this transactional id started: this one must stop."""


class TransactionalPublisher:
    """A thread that commits answers and their queue offsets in transactions.

    ``group_metadata`` returns the consumer's current group metadata (it changes
    at each rebalance). It must not call the consumer: ``consumer_group_metadata()``
    blocks while another thread is in the consumer's ``poll``, so the poll thread
    fetches it (on assignment) and this returns the cached value. ``on_committed`` is
    called with how many records were committed after each transaction.
    :meth:`publish` never blocks.

    ``epoch`` returns the agent's current assignment epoch, which the agent bumps
    whenever it loses partitions (revoked, or lost with its session). An answer
    whose queue record was taken in an earlier epoch is dropped uncommitted: its
    partition went to another agent, which runs the task again and answers it.
    Without this a zombie (a stopped agent that wakes after its lease expired)
    would retry its old transaction after rejoining the group and commit answers
    to tasks that were already answered by their new owner.
    """

    def __init__(
        self,
        kafka_config: dict[str, object],
        *,
        transactional_id: str,
        queue_topic: str,
        tracker: OffsetTracker,
        group_metadata: Callable[[], object],
        on_committed: Callable[[int], None] | None = None,
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self._producer = Producer(
            {
                **kafka_config,
                "transactional.id": transactional_id,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 0,
                # A transaction begun while the last one's markers are still being written
                # is refused (CONCURRENT_TRANSACTIONS) and retried after this backoff; at
                # librdkafka's default (100 ms) every lone result paid it.
                "retry.backoff.ms": 5,
                "retry.backoff.max.ms": 100,
            }
        )
        self.transactional_id = transactional_id
        self._queue_topic = queue_topic
        self._tracker = tracker
        self._group_metadata = group_metadata
        self._on_committed = on_committed
        self._epoch = epoch
        self._answers: queue.SimpleQueue[Answer | None] = queue.SimpleQueue()
        # Answers the last transaction could not record yet (see OffsetTracker.admit).
        self._deferred: list[Answer] = []
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.transactions = 0
        self.aborted = 0
        self.dropped = 0

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Register the transactional id (fencing any predecessor) and start the thread."""
        self._producer.init_transactions(timeout_s)
        self._thread = threading.Thread(
            target=self._run, name="fxstream-agent-publisher", daemon=True
        )
        self._thread.start()

    def publish(self, answer: Answer) -> None:
        """Queue ``answer`` for the next transaction."""
        with self._lock:
            self._pending += 1
        self._answers.put(answer)

    @property
    def pending(self) -> int:
        """Answers queued or in a transaction not yet committed."""
        with self._lock:
            return self._pending

    @property
    def alive(self) -> bool:
        """False once the thread stopped (closed, or failed: see :attr:`failure`)."""
        return self._thread is not None and self._thread.is_alive()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued answer is committed; False on timeout or failure."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending and self.alive:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.1))
            return self._pending == 0

    def close(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Commit what is queued (within ``timeout_s``), then stop the thread."""
        if self._thread is None:
            return
        self._answers.put(None)
        self._thread.join(timeout_s)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                batch, stop = self._next_batch()
                if batch:
                    self._commit(batch)
                if stop:
                    return
        except BaseException as exc:
            self.failure = exc
            log.critical("result publisher stopped: %s", exc)
        finally:
            with self._idle:
                self._idle.notify_all()

    def _next_batch(self) -> tuple[list[Answer], bool]:
        """The deferred answers and what is queued (waiting for one answer if none is
        deferred), and whether to stop after them."""
        deferred, self._deferred = self._deferred, []
        try:
            first = self._answers.get(timeout=DEFERRED_RETRY_S) if deferred else self._answers.get()
        except queue.Empty:
            return deferred, False
        if first is None:
            return deferred, True
        batch, stop = self._drain(first)
        return deferred + batch, stop

    def _drain(self, first: Answer) -> tuple[list[Answer], bool]:
        batch = [first]
        while len(batch) < MAX_ANSWERS_PER_TRANSACTION:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                break
            if answer is None:
                return batch, True
            batch.append(answer)
        return batch, False

    def _commit(self, batch: list[Answer]) -> None:
        """Commit ``batch`` and its offsets; retried until it commits or is fenced."""
        taken = len(batch)
        deferred: list[Answer] = []
        while True:
            batch = self._current(batch)
            try:
                if batch:
                    deferred = self._transaction(batch)
                break
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.code() == KafkaError._FENCED:
                    raise PublisherFenced(
                        f"transactional id {self.transactional_id!r} was fenced "
                        f"(another agent of this endpoint started?): {error}"
                    ) from exc
                self.aborted += 1
                log.warning("transaction of %d answers failed, retrying: %s", len(batch), error)
                if error.txn_requires_abort():
                    self._producer.abort_transaction(CALL_TIMEOUT_S)
                time.sleep(0.1)
        self.transactions += 1
        self._deferred = deferred
        with self._idle:
            self._pending -= taken - len(deferred)
            self._idle.notify_all()
        if self._on_committed is not None and len(batch) > len(deferred):
            waiting = {id(answer) for answer in deferred}
            self._on_committed(
                sum(1 for a in batch if a.topic is not None and id(a) not in waiting)
            )

    def _current(self, batch: list[Answer]) -> list[Answer]:
        """The answers of ``batch`` whose partitions were not lost since they were taken."""
        epoch = self._epoch()
        current = [answer for answer in batch if answer.epoch == epoch]
        if len(current) < len(batch):
            dropped = len(batch) - len(current)
            self.dropped += dropped
            log.warning(
                "dropped %d answers of partitions this agent lost since taking them; "
                "their new owner answers them",
                dropped,
            )
        return current

    def _transaction(self, batch: list[Answer]) -> list[Answer]:
        """Commit the answers of ``batch`` the offset metadata has room for; returns the rest."""
        started = time.monotonic()
        producer = self._producer
        if not any(self._tracker.admit(a.partition, a.offset) for a in batch):
            return batch  # nothing can be recorded until an earlier record is answered
        deferred: list[Answer] = []
        producer.begin_transaction()
        for answer in batch:
            if not self._tracker.admit(answer.partition, answer.offset):
                deferred.append(answer)  # settles a record too far past a running one
                continue
            if answer.topic is not None:
                producer.produce(answer.topic, key=answer.key, value=answer.value)
            # Done once it is in this transaction: the offset commits with it or not at all.
            self._tracker.done(answer.partition, answer.offset)
            producer.poll(0)
        # Each position with the answered records past it, written with the answers.
        commits = self._tracker.commits()
        if commits:
            offsets = [
                TopicPartition(self._queue_topic, p, o, metadata=m) for p, (o, m) in commits.items()
            ]
            producer.send_offsets_to_transaction(offsets, self._group_metadata(), CALL_TIMEOUT_S)
        producer.commit_transaction(CALL_TIMEOUT_S)
        took = time.monotonic() - started
        if took > SLOW_TRANSACTION_S:
            log.warning("a transaction of %d answers took %.1f s", len(batch), took)
        if deferred:
            log.debug("%d answers wait for earlier records to be answered", len(deferred))
        return deferred
