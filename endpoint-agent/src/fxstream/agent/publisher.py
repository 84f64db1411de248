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
cannot commit for them either (KIP-447). That check only holds if the answers, the
offsets and the metadata belong to one assignment: the poll thread changes the
assignment (a new epoch, the lost partitions' offsets forgotten, a new member's
metadata) only under the ``rebalancing`` lock, which the publisher holds from
checking its answers' epoch until the offsets are sent. Without it a zombie that
woke could check its answers' epoch before the poll thread noticed the lost
session, and send them with no offsets (the tracker had forgotten the partition,
so nothing asked the broker) or with the metadata of the group it had rejoined
since: results committed a second time.

Quarantine: one answer Kafka refuses must not stop the others. An answer to a
topic that does not exist is found before its transaction begins (a metadata
look-up, cached per topic); one Kafka refuses while producing (too large for the
producer or the topic, an unknown partition, a refused authorisation) fails the
transaction, which is aborted, and its delivery report names the answer (the
broker refuses a whole record batch for one record too large for the topic: when
several answers are refused together, each is tried alone in a transaction that
is aborted, to find the one). Every
refused answer is handed to ``on_refused``, which returns its replacements (a
small error result, a dead letter of the original as a digest); the batch is
then committed again without it. A failure no answer is to blame for (the broker
is unreachable) is retried after an abort; a batch is never re-sent in a state
the producer refuses (``_STATE``), and a replacement that is refused in turn
settles its offset with nothing written, so no answer can wedge the publisher.

Hung calls: librdkafka does not time out every transactional call (a dead group
coordinator leaves ``send_offsets_to_transaction`` waiting for good; see
:mod:`fxstream.topics.bounded_calls`). Each call is waited for at most its own
timeout and ``HUNG_GRACE_S``; past that the producer is left where it hangs and a
new one registers the same transactional id, which fences the old one and ends
its transaction (aborted, unless its commit had begun on the coordinator, which
then completes it). The answers are sent again, except after a hung commit that
went through: the group's committed offsets, read back, are then the ones it
carried. If that cannot be read, the publisher stops (the agent's successor
resumes from the committed offsets, whichever way it went).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from fxstream.agent.offsets import OffsetTracker
from fxstream.topics import PRODUCER_PARTITIONER, BoundedCaller, CallHung

__all__ = ["Answer", "PublisherFenced", "PublisherWedged", "Refusal", "TransactionalPublisher"]

log = logging.getLogger(__name__)

# Most answers per transaction: bounds the work a failed commit repeats.
MAX_ANSWERS_PER_TRANSACTION = 2_000
# How long one transactional call may take before the batch is retried.
CALL_TIMEOUT_S = 30.0
# send_offsets_to_transaction's own timeout: shorter, as the publisher holds the agent's
# rebalancing lock while it runs (a retriable timeout only costs an abort and a retry).
SEND_OFFSETS_TIMEOUT_S = 10.0
# How much longer than its own timeout a transactional call is waited for before the
# producer is taken to be wedged in it and replaced (see fxstream.topics.bounded_calls).
HUNG_GRACE_S = 5.0
# The coordinator aborts (and fences) a transaction open longer than this
# (``transaction.timeout.ms``, set to match); commits are retried only within it.
TRANSACTION_TIMEOUT_S = 60.0
SAFETY_MARGIN_S = 10.0
# How long start() keeps trying to register the transactional id while the
# coordinator is unavailable (a broker just died and its partitions move).
INIT_TIMEOUT_S = 120.0
# How long a look-up of whether an answer's topic exists may take.
METADATA_TIMEOUT_S = 5.0
# Per-record errors a retry cannot cure: the answer is quarantined, not re-sent.
_PERMANENT = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError._INVALID_ARG,
    }
)
_MISSING_TOPIC = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}
)
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
    # A replacement for a refused answer: if Kafka refuses it too, only its offset settles.
    replacement: bool = False

    @property
    def settles(self) -> bool:
        """False for an extra record written beside another answer (partition -1)."""
        return self.partition >= 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why Kafka refused an answer: its error, and whether the topic does not exist."""

    code: int
    reason: str
    topic_missing: bool


class _Rebalanced(Exception):
    """The epoch moved since the batch was checked: nothing was sent, check it again."""


class PublisherFenced(RuntimeError):
    """Another agent with this transactional id started: this one must stop."""


class PublisherWedged(RuntimeError):
    """A commit hung and whether it went through cannot be learned: the agent must stop
    (its successor resumes from the group's committed offsets, whichever way it went)."""


class _Refused(Exception):
    """Answers of the running transaction that Kafka refused for good, by batch index.

    ``exact`` is false when the broker refused them: it refuses a whole record batch
    (every answer of the transaction on one partition) for one record too large for
    the topic, so any of them may be the culprit.
    """

    def __init__(self, refused: dict[int, Refusal], *, exact: bool) -> None:
        super().__init__(f"{len(refused)} answers refused")
        self.refused = refused
        self.exact = exact


OnRefused = Callable[[Answer, Refusal], list[Answer]]


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

    ``rebalancing`` is the lock the poll thread holds while it changes the
    assignment (bumps the epoch and forgets partitions, or records new group
    metadata). The publisher holds it from the epoch check to the sending of the
    offsets, so a transaction's answers, offsets and metadata are of one
    assignment, which the broker then validates; the commit itself runs without it.
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
        on_refused: OnRefused | None = None,
        rebalancing: threading.Lock | None = None,
        group_id: str | None = None,
        on_replaced: Callable[[], None] | None = None,
    ) -> None:
        # The group whose offsets the transactions commit: read back after a commit hung,
        # to learn whether it went through (None: such a hang stops the publisher).
        self._group_id = group_id
        self._on_replaced = on_replaced
        self._kafka_config = kafka_config
        # The offsets sent with the transaction being committed, and its deferred answers.
        self._in_flight: tuple[list[TopicPartition], list[Answer]] = ([], [])
        self._producer_config: dict[str, object] = {
            # Never create a missing results topic with broker defaults by writing to it.
            "allow.auto.create.topics": False,
            **kafka_config,
            "partitioner": PRODUCER_PARTITIONER,
            "transactional.id": transactional_id,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 0,
            "transaction.timeout.ms": int(TRANSACTION_TIMEOUT_S * 1000),
            # A transaction begun while the last one's markers are still being written
            # is refused (CONCURRENT_TRANSACTIONS) and retried after this backoff; at
            # librdkafka's default (100 ms) every lone result paid it.
            "retry.backoff.ms": 5,
            "retry.backoff.max.ms": 100,
        }
        self._producer = Producer(self._producer_config)
        # The transactional calls librdkafka may not return from (see bounded_calls), and
        # the producers left wedged in one: kept, as destroying one mid-call crashes.
        self._calls = BoundedCaller("fxstream-agent-publisher")
        self._wedged: list[Producer] = []
        self.transactional_id = transactional_id
        self._queue_topic = queue_topic
        self._tracker = tracker
        self._group_metadata = group_metadata
        self._on_committed = on_committed
        self._epoch = epoch
        self._on_refused = on_refused
        self._rebalancing = rebalancing if rebalancing is not None else threading.Lock()
        self._topics_seen: set[str] = set()
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
        self.refused = 0
        self.replaced = 0
        """Producers replaced after a transactional call hung past its deadline."""

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = INIT_TIMEOUT_S) -> None:
        """Register the transactional id (fencing any predecessor) and start the thread.

        A retriable failure (the transaction coordinator is moving after a broker
        died) is tried again for up to ``timeout_s`` before it is raised.
        """
        self._init_transactions(timeout_s)
        self._thread = threading.Thread(
            target=self._run, name="fxstream-agent-publisher", daemon=True
        )
        self._thread.start()

    def _init_transactions(self, timeout_s: float) -> None:
        """Register the transactional id (fencing any other producer of it, and aborting the
        transaction it left open), retried while the coordinator is moving; a producer
        that hangs in it is replaced, until ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            call_s = max(min(CALL_TIMEOUT_S, left), 1.0)
            producer = self._producer
            try:
                self._bounded("init_transactions", producer.init_transactions, call_s)
                return
            except CallHung as hung:
                if time.monotonic() > deadline:
                    raise KafkaException(
                        KafkaError(KafkaError._TIMED_OUT, f"producer {hung}", fatal=True)
                    ) from hung
                self._abandon_producer(hung)
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or not error.retriable() or time.monotonic() > deadline:
                    raise
                log.warning("cannot register the transactional id yet, trying again: %s", error)
                time.sleep(1.0)

    def _bounded(
        self, what: str, call: Callable[..., object], timeout_s: float, *args: object
    ) -> None:
        """``call(*args, timeout_s)`` (the producer's call ``what``) on the caller thread,
        waited for at most ``timeout_s`` and ``HUNG_GRACE_S`` (:exc:`CallHung` past that)."""
        self._calls.call(what, functools.partial(call, *args, timeout_s), timeout_s + HUNG_GRACE_S)

    def _abandon_producer(self, hung: CallHung) -> None:
        """Leave the producer wedged in ``hung`` (referenced, never called again) for a new
        one with the same transactional id: its registration fences the old one, so
        nothing the old one had sent can commit, and aborts the old one's transaction."""
        self.replaced += 1
        log.error(
            "the transactional producer's %s; replacing the producer (librdkafka does not "
            "time out some transactional calls while a coordinator broker is gone: "
            "confluentinc/librdkafka#5456, #5511). The new one's registration fences it "
            "and ends its open transaction.",
            hung,
        )
        self._wedged.append(self._producer)
        self._producer = Producer(self._producer_config)
        if self._on_replaced is not None:
            self._on_replaced()

    def _replace_producer(self, hung: CallHung) -> None:
        """A transactional call hung: a new producer, registered, for the next attempt."""
        self._abandon_producer(hung)
        self._init_transactions(INIT_TIMEOUT_S)

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

    def _commit(self, batch: list[Answer]) -> None:
        """Commit ``batch`` and its offsets, quarantining answers Kafka refuses (see the
        module notes); retried until it commits or the publisher is fenced. Answers the
        offset metadata has no room for yet wait for the next transaction.

        ``pending`` counts answers taken from the queue: a replacement (made here for a
        refused answer) stands in for one already counted, so it is never counted.
        """
        taken = sum(1 for a in batch if not a.replacement)
        written, deferred = self._settle(batch)
        self.transactions += 1
        self._deferred = deferred
        with self._idle:
            self._pending -= taken - sum(1 for a in deferred if not a.replacement)
            self._idle.notify_all()
        if self._on_committed is not None and written:
            self._on_committed(written)

    def _settle(self, batch: list[Answer]) -> tuple[int, list[Answer]]:
        """Commit ``batch`` (with its replacements): the number of results written, and
        the answers left for a later transaction (see :meth:`OffsetTracker.admit`)."""
        unexplained = 0
        while True:
            batch = self._current(batch)
            try:
                batch = self._quarantine(batch, self._missing_topics(batch))
                deferred = self._transaction(batch) if batch else []
                waiting = {id(a) for a in deferred}
                written = sum(
                    1 for a in batch if a.topic is not None and a.settles and id(a) not in waiting
                )
                return written, deferred
            except _Rebalanced:
                continue  # the answers of lost partitions are dropped on the next turn
            except CallHung as hung:
                # The new producer's registration ends the hung transaction: it aborts one
                # that was not being committed, and completes a commit the coordinator had
                # begun. Only a hung commit can have gone through; else (or if it did not)
                # the answers go again in the new producer's first transaction.
                offsets, deferred = (
                    self._in_flight if hung.what == "commit_transaction" else ([], [])
                )
                self._replace_producer(hung)
                if offsets and self._went_through(offsets, hung):
                    waiting = {id(a) for a in deferred}
                    written = sum(
                        1
                        for a in batch
                        if a.topic is not None and a.settles and id(a) not in waiting
                    )
                    return written, deferred
                self.aborted += 1
            except _Refused as refused:
                self._abort()
                found = refused.refused
                if not refused.exact and len(found) > 1:
                    # Refused together: which one is too large is found by trying each.
                    found = self._probe(batch) or found
                batch = self._quarantine(batch, found)
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.code() == KafkaError._FENCED:
                    raise PublisherFenced(
                        f"transactional id {self.transactional_id!r} was fenced "
                        f"(another agent of this endpoint started?): {error}"
                    ) from exc
                self.aborted += 1
                self._abort()
                if error.code() in _PERMANENT:
                    # Refused for good, but no delivery report said which answer.
                    found = {0: _refusal(error)} if len(batch) == 1 else self._probe(batch)
                    unexplained += not found
                    if found or unexplained >= 3:
                        batch = self._quarantine(
                            batch, found or dict.fromkeys(range(len(batch)), _refusal(error))
                        )
                        continue
                log.warning("transaction of %d answers failed, retrying: %s", len(batch), error)
                time.sleep(0.1)

    def _went_through(self, offsets: list[TopicPartition], hung: CallHung) -> bool:
        """Whether the transaction whose commit hung committed: the group's committed
        offsets are the ones it carried (read once the transaction has ended)."""
        if self._group_id is None:
            raise PublisherWedged(f"{hung}; no consumer group to learn whether it went through")
        reader = Consumer(
            {
                **self._kafka_config,
                "group.id": self._group_id,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        try:
            committed = reader.committed(offsets, timeout=CALL_TIMEOUT_S)
        except KafkaException as exc:
            raise PublisherWedged(
                f"{hung}, and whether it went through cannot be read ({exc})"
            ) from exc
        finally:
            reader.close()
        now = {tp.partition: (tp.offset, tp.metadata or "") for tp in committed}
        went = all(now.get(tp.partition) == (tp.offset, tp.metadata or "") for tp in offsets)
        log.warning(
            "the hung commit %s: its answers are %s",
            "went through" if went else "did not go through",
            "not sent again" if went else "sent again",
        )
        return went

    def _probe(self, batch: list[Answer]) -> dict[int, Refusal]:
        """The answers Kafka refuses when each is sent alone, in a transaction that is
        then aborted (so nothing of it is ever visible, and no offset moves)."""
        log.warning("finding which of %d answers Kafka refuses, one at a time", len(batch))
        refused: dict[int, Refusal] = {}
        for index, answer in enumerate(batch):
            if answer.topic is None:
                continue
            producer = self._producer  # replaced if an abort below hung
            reports: list[KafkaError] = []
            try:
                producer.begin_transaction()
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.code() == KafkaError._FENCED:
                    raise PublisherFenced(
                        f"transactional id {self.transactional_id!r} was fenced: {error}"
                    ) from exc
                log.warning("cannot try the answers one at a time: %s", error)
                return refused
            try:
                producer.produce(
                    answer.topic,
                    key=answer.key,
                    value=answer.value,
                    on_delivery=_collect(reports),
                )
                producer.flush(CALL_TIMEOUT_S)
            except KafkaException as exc:
                reports.append(exc.args[0])
            finally:
                self._abort()
            permanent = [e for e in reports if e.code() in _PERMANENT]
            if permanent:
                refused[index] = _refusal(permanent[0])
        return refused

    def _commit_transaction(self, began: float) -> None:
        """``commit_transaction``, called again while its error is retriable and the
        transaction is still within the coordinator's ``transaction.timeout.ms``.

        A commit that timed out may still have gone through: aborting and sending its
        answers again in a new transaction could then commit them twice, so a
        retriable failure is retried as librdkafka advises. But a transaction kept
        open past ``transaction.timeout.ms`` is aborted by the coordinator, which
        fences this producer (the agent would exit): once the time left is under a
        second the error is raised, the batch is aborted and sent again (the one path
        left that could duplicate a result; see faults.md).
        """
        while True:
            left = TRANSACTION_TIMEOUT_S - SAFETY_MARGIN_S - (time.monotonic() - began)
            call_s = max(min(CALL_TIMEOUT_S, left), 0.1)
            producer = self._producer
            try:
                self._bounded("commit_transaction", producer.commit_transaction, call_s)
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.txn_requires_abort() or not error.retriable():
                    raise
                if TRANSACTION_TIMEOUT_S - SAFETY_MARGIN_S - (time.monotonic() - began) < 1.0:
                    raise
                log.warning("commit of a transaction failed, trying it again: %s", error)
                time.sleep(0.1)

    def _abort(self) -> None:
        """Abort the open transaction, if any (a no-op error when none is open); a producer
        that hangs in the abort is replaced (the new one's registration ends it)."""
        producer = self._producer
        try:
            self._bounded("abort_transaction", producer.abort_transaction, CALL_TIMEOUT_S)
        except CallHung as hung:
            self._replace_producer(hung)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal() or error.code() == KafkaError._FENCED:
                raise PublisherFenced(
                    f"transactional id {self.transactional_id!r} was fenced: {error}"
                ) from exc
            if error.code() != KafkaError._STATE:
                log.warning("abort of a failed transaction failed: %s", error)

    def _missing_topics(self, batch: list[Answer]) -> dict[int, Refusal]:
        """Answers whose topic does not exist, found before the transaction begins
        (librdkafka would hold them for ``topic.metadata.propagation.max.ms`` and then
        fail the whole transaction)."""
        refused: dict[int, Refusal] = {}
        for topic in {a.topic for a in batch if a.topic is not None} - self._topics_seen:
            try:
                metadata = self._producer.list_topics(topic, timeout=METADATA_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("cannot look up topic %r (%s); producing anyway", topic, exc)
                continue
            found = metadata.topics.get(topic)
            error = None if found is None else found.error
            if found is not None and (error is None or error.code() not in _MISSING_TOPIC):
                if error is None and found.partitions:
                    self._topics_seen.add(topic)
                continue
            reason = f"topic {topic!r} does not exist" + (f" ({error})" if error else "")
            code = error.code() if error is not None else KafkaError.UNKNOWN_TOPIC_OR_PART
            for index, answer in enumerate(batch):
                if answer.topic == topic:
                    refused[index] = Refusal(code, reason, topic_missing=True)
        return refused

    def _quarantine(self, batch: list[Answer], refused: dict[int, Refusal]) -> list[Answer]:
        """``batch`` with each refused answer replaced by what ``on_refused`` gives."""
        if not refused:
            return batch
        kept: list[Answer] = []
        for index, answer in enumerate(batch):
            refusal = refused.get(index)
            if refusal is None:
                kept.append(answer)
                continue
            self.refused += 1
            log.error(
                "answer to %s (queue offset %d:%d) refused by Kafka: %s; quarantined",
                answer.topic,
                answer.partition,
                answer.offset,
                refusal.reason,
            )
            if answer.replacement or self._on_refused is None:
                # Nothing more to try: settle the queue record with nothing written.
                if answer.settles:
                    kept.append(
                        Answer(None, None, b"", answer.partition, answer.offset, answer.epoch)
                    )
                continue
            for replacement in self._on_refused(answer, refusal):
                kept.append(dataclasses.replace(replacement, epoch=answer.epoch, replacement=True))
        return kept

    def _transaction(self, batch: list[Answer]) -> list[Answer]:
        """Commit the answers of ``batch`` the offset metadata has room for; returns the
        rest. Raises :class:`_Refused` naming the answers Kafka refused (by index), and
        :class:`_Rebalanced` (nothing sent) if an answer's epoch is no longer current."""
        started = time.monotonic()
        producer = self._producer
        refused: dict[int, Refusal] = {}
        try:
            # The assignment cannot change from the epoch check until the offsets are sent
            # (see the module notes); the broker then refuses them if it changed before.
            with self._rebalancing:
                epoch = self._epoch()
                if any(answer.epoch != epoch for answer in batch):
                    raise _Rebalanced
                if not any(self._tracker.admit(a.partition, a.offset) for a in batch):
                    return batch  # nothing can be recorded until an earlier record is answered
                deferred = self._produce(batch, refused)
                if refused:
                    raise _Refused(refused, exact=True)
                # Each position with the answered records past it, written with the answers.
                commits = self._tracker.commits()
                if commits:
                    offsets = [
                        TopicPartition(self._queue_topic, p, o, metadata=m)
                        for p, (o, m) in commits.items()
                    ]
                    metadata = self._group_metadata()
                    self._bounded(
                        "send_offsets_to_transaction",
                        producer.send_offsets_to_transaction,
                        SEND_OFFSETS_TIMEOUT_S,
                        offsets,
                        metadata,
                    )
            self._in_flight = (offsets if commits else [], deferred)
            self._commit_transaction(started)
        except KafkaException:
            producer.poll(0)  # serve the delivery reports that name the refused answers
            if refused:
                raise _Refused(refused, exact=False) from None
            raise
        took = time.monotonic() - started
        if took > SLOW_TRANSACTION_S:
            log.warning("a transaction of %d answers took %.1f s", len(batch), took)
        if deferred:
            log.debug("%d answers wait for earlier records to be answered", len(deferred))
        return deferred

    def _produce(self, batch: list[Answer], refused: dict[int, Refusal]) -> list[Answer]:
        """Begin a transaction and produce the answers the offset metadata has room for,
        marking their records done; returns the others. Answers refused before they were
        sent, or in a delivery report, are added to ``refused`` by batch index."""
        producer = self._producer

        def reported(index: int) -> Callable[[KafkaError | None, Message], None]:
            def on_delivery(error: KafkaError | None, _message: Message) -> None:
                if error is not None and error.code() in _PERMANENT:
                    refused[index] = _refusal(error)

            return on_delivery

        deferred: list[Answer] = []
        producer.begin_transaction()
        for index, answer in enumerate(batch):
            if not self._tracker.admit(answer.partition, answer.offset):
                deferred.append(answer)  # settles a record too far past a running one
                continue
            if answer.topic is not None:
                try:
                    producer.produce(
                        answer.topic,
                        key=answer.key,
                        value=answer.value,
                        on_delivery=reported(index),
                    )
                except KafkaException as exc:
                    error: KafkaError = exc.args[0]
                    if error.code() not in _PERMANENT:
                        raise
                    # Refused before it was sent (too large for the producer): the rest
                    # of the transaction is fine, but it commits without this answer.
                    refused[index] = _refusal(error)
                    continue
            if answer.settles:
                # Done once it is in this transaction: the offset commits with it or not at all.
                self._tracker.done(answer.partition, answer.offset)
            producer.poll(0)
        return deferred


def _collect(reports: list[KafkaError]) -> Callable[[KafkaError | None, Message], None]:
    def on_delivery(error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            reports.append(error)

    return on_delivery


def _refusal(error: KafkaError) -> Refusal:
    code = error.code()
    return Refusal(code, f"{error.name()}: {error.str()}", topic_missing=code in _MISSING_TOPIC)
