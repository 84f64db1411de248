"""The endpoint agent: pull this endpoint's queue, run tasks in warm workers, publish results.

One thread polls Kafka; tasks run on an :class:`~fxstream.agent.Engine`,
never in the poll loop. The engine is given only as many tasks as it can start
soon (workers + prefetch, funcX's batching); the rest wait, decoded, in the
agent's local queue. The local queue is bounded (``max_local_queue`` tasks and
``max_local_queue_bytes``): when it is full the agent pauses its Kafka queue,
and resumes once it has drained to half. The hysteresis matters: pausing a
partition discards what the client had prefetched, so pausing and resuming
each time a worker frees would pay a fetch round trip per handful of tasks.
The local queue costs no fairness: a partition's tasks can only go to the
agent it is assigned to, and on a rebalance the queued tasks of revoked
partitions are dropped (uncommitted, so the new owner gets them).

Latency: the poll thread blocks on Kafka, never on a fixed-size batch (``consume(n,
timeout)`` would hold a lone task until ``n`` records or the timeout). A finished
task's result is produced by the engine's thread the moment the worker
answers, which then hands the freed slot the next task of the local queue; the
poll thread is not in that path. Shared state is guarded by one lock.

Acknowledgement: a task's result and its queue offset are written in one Kafka
transaction (:class:`~fxstream.agent.publisher.TransactionalPublisher`): the
commit position is the contiguous prefix of finished tasks per partition
(:class:`OffsetTracker`), and the commit's metadata names the tasks answered
past it. Nothing is acknowledged on dispatch, so an agent killed mid-batch loses
nothing: its uncommitted tasks are delivered again when it (or a replacement)
returns, and a result whose transaction did not commit was never visible. On
assignment the agent reads the committed offsets with their metadata
(:meth:`Agent._resume`), and a redelivered record that was answered already is
settled without running. A task may therefore run twice (killed before its
result committed), but exactly one of its results is committed.

Identity: everything this agent writes (results, task events, heartbeats, warm
adverts, data locations, dead letters) goes to one topic, ``from.ep.<endpoint>``,
which only this endpoint's principal may write; the service's ingress checks each
record against the endpoint (a result only for a task routed here) and forwards it.
Only the service may write the queue, and the agent re-checks what it reads there:
a dispatch naming another endpoint, or whose submission disagrees with the
router's stamped submitter or code digest, is dead-lettered without decoding its
payload; the function's code is run only if its SHA-256 is the dispatch's
``function_sha256`` (else the task fails with ``CodeIntegrityError``, nothing
deserialized).

Cancel: a :class:`~fxstream.topics.TaskCancel` rides the queue behind its
task (same key, same partition), so this agent reads a task before its cancel.
A task still in the local queue (or waiting out a retry backoff) is taken out
and answered ``TaskCancelled``; one in the engine is cancelled there (dropped if
queued, its worker killed if running); either way the answer settles the
task's offset and the cancel's. A cancel for a task no longer held (already
answered) only settles its own offset, and one from another user than the
submitter (the dispatch's router-stamped ``user_id``) is dead-lettered. A
cancelled task is never retried: a cancel asked while it ran wins over whatever
its worker's death looked like.

Policy: a task the endpoint does not allow (``allowed_functions``,
``allowed_serializers``; :mod:`fxstream.agent.policy`) is answered with a
``NotAllowedOnEndpoint`` error as it is taken off the queue, from its record's
fields and its arguments' header alone: its code is not fetched, nothing of it is
deserialized. The agent authenticates with its endpoint's own credential (Kafka
principal and API token, :mod:`fxstream.agent.credentials`), never its owner's.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from fxstream.agent.answer import (
    Answerer,
    cancelled_outcome,
    failed_outcome,
    headers_of,
)
from fxstream.agent.config import EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.engine import Engine
from fxstream.agent.feed import EngineFeed
from fxstream.agent.function_code import (
    CodeCache,
    CodeIntegrityError,
    FunctionUnavailable,
    verified_code,
)
from fxstream.agent.heartbeat import AGENT_VERSION, Heartbeats
from fxstream.agent.held import Held, HeldTasks
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.policy import TaskPolicy
from fxstream.agent.process_engine import ProcessEngine
from fxstream.agent.publisher import TransactionalPublisher
from fxstream.agent.runner import runner_for
from fxstream.agent.worker_process import RunnerSpec
from fxstream.connectors import FileConnector, StoreSpec
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    RecordDecodeError,
    TaskCancel,
    TaskDispatch,
    TaskErrorType,
    TaskSubmission,
    decode,
    producer_message_max_bytes,
    record_kind,
)
from fxstream.topics.acls import endpoint_group, endpoint_transactional_prefix

__all__ = ["AGENT_VERSION", "Agent"]

log = logging.getLogger(__name__)

# The longest a rebalance waits for the answers in hand to commit.
CALL_FLUSH_S = 10.0
# The longest an assignment waits for the committed offsets (and what they say was answered).
# They are not readable while the previous owner's transaction is open; a stopped owner's is
# aborted after librdkafka's transaction.timeout.ms (60 s), so this waits longer.
COMMITTED_TIMEOUT_S = 90.0
# The longest the poll thread blocks on Kafka before its housekeeping (commits, beats).
POLL_S = 0.1
# A stop (SIGTERM) lets running tasks finish and their answers commit for this long; what
# is still running then is killed and handed back uncommitted (the next agent runs it).
# With the closes below, the agent is gone within 10 s of the signal.
STOP_GRACE_S = 5.0
STOP_CLOSE_S = 1.5
# How often tasks waiting for an unreachable service try to fetch their code again.
CODE_RETRY_S = 2.0

SWEEP_PERIOD_S = 300.0
"""How often an endpoint with a file store deletes objects whose lease ended."""


class Agent:
    """Serves one endpoint until :meth:`stop` (or the ``stop`` event passed to :meth:`run`)."""

    def __init__(
        self,
        config: EndpointConfig,
        *,
        runner: RunnerSpec | None = None,
        credentials: EndpointCredentials | None = None,
    ) -> None:
        config.validate()
        self.config = config
        # The endpoint's own credential (read from its 0600 file unless given).
        self._credentials = credentials if credentials is not None else config.credentials()
        self.policy = TaskPolicy.of(config)
        self.agent_id = str(uuid.uuid4())
        self.catalogue = Catalogue(prefix=config.topic_prefix)
        self.queue_topic = self.catalogue.endpoint_queue(config.endpoint_id)
        # The one topic this endpoint writes (the ingress checks and forwards it).
        self.out_topic = self.catalogue.from_endpoint(config.endpoint_id)
        self._runner: RunnerSpec = (
            runner
            if runner is not None
            else runner_for(
                config.store_url, proxy_threshold=config.proxy_threshold, site=config.endpoint_id
            )
        )
        self._stop = threading.Event()
        self._tracker = OffsetTracker()
        # Every task taken off Kafka and not yet answered durably, where it waits, and the
        # assignment epoch (bumped whenever partitions are revoked or lost: answers to
        # tasks taken in an earlier epoch are dropped by the publisher).
        self._held = HeldTasks()
        self._hostname = socket.gethostname()
        # Results, dead letters, task events and data locations (given its clients in run).
        self._answers = Answerer(
            config, self.catalogue, tracker=self._tracker, held=self._held, hostname=self._hostname
        )
        self._beats = Heartbeats(
            config, self.catalogue, agent_id=self.agent_id, hostname=self._hostname, held=self._held
        )
        self._engine: Engine | None = None
        self._feed: EngineFeed | None = None
        self._publisher: TransactionalPublisher | None = None
        # The consumer's group metadata as of the last assignment (for the publisher).
        self._group_metadata: object = None
        self._paused = False
        self.results_published = 0
        # Records settled without running: a previous owner of their partition answered them.
        self.answered_before = 0

    # --- public ------------------------------------------------------------------------

    @property
    def retries_scheduled(self) -> int:
        """Retries this agent has scheduled."""
        return 0 if self._feed is None else self._feed.retries_scheduled

    def stop(self) -> None:
        """Ask :meth:`run` to finish the tasks it holds and return."""
        self._stop.set()

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until stopped. ``ready`` is called once workers and Kafka are up."""
        kafka = self.config.kafka(self._credentials).confluent()
        engine: Engine = ProcessEngine(self.config.workers, self._runner)
        codes = CodeCache(self.config.service_url, self._credentials.token)
        self._start_lease_sweeper()
        # Heartbeats and warm adverts: outside the transactions, never delayed by them.
        producer = Producer(
            {
                **kafka,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 1,
                "message.max.bytes": producer_message_max_bytes(self.catalogue),
                "log_level": 3,
            }
        )
        consumer = Consumer(
            {
                **kafka,
                # The one group the endpoint's principal may use (fxstream.topics.acls).
                "group.id": endpoint_group(self.config.endpoint_id),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 20,
                # The lease: librdkafka's background thread keeps the session alive while
                # this process lives; a stopped or hung process loses its partitions.
                "session.timeout.ms": int(self.config.lease_timeout_s * 1000),
                "heartbeat.interval.ms": max(1000, int(self.config.lease_timeout_s * 1000 / 10)),
                "log_level": 3,
            }
        )
        publisher = TransactionalPublisher(
            {
                **kafka,
                "message.max.bytes": producer_message_max_bytes(self.catalogue),
                "log_level": 3,
            },
            transactional_id=self.transactional_id,
            queue_topic=self.queue_topic,
            tracker=self._tracker,
            group_metadata=lambda: self._group_metadata,
            on_committed=self._count_committed,
            epoch=lambda: self._held.epoch,
            on_refused=self._answers.quarantine,
        )
        self._engine, self._publisher = engine, publisher
        self._feed = EngineFeed(
            self.config,
            engine,
            held=self._held,
            answers=self._answers,
            stopping=self._stop,
            hostname=self._hostname,
        )
        self._answers.open(publisher, producer)
        try:
            engine.wait_ready(timeout=60)
            publisher.start()
            consumer.subscribe(
                [self.queue_topic],
                on_assign=lambda c, parts: self._on_assign(c, parts),
                on_revoke=lambda c, parts: self._on_revoke(c, parts),
                on_lost=lambda c, parts: self._on_lost(parts),
            )
            self._beats.send(producer, engine)
            if ready is not None:
                ready()
            self._serve(consumer, producer, engine, codes)
        finally:
            self._shutdown(consumer, producer, engine, codes)

    @property
    def transactional_id(self) -> str:
        """Stable per agent (endpoint, host, name), so a restart fences its predecessor."""
        prefix = endpoint_transactional_prefix(self.config.endpoint_id)  # what its ACLs allow
        return f"{prefix}{self._hostname}.{self.config.name}"

    def _count_committed(self, answers: int) -> None:
        self.results_published += answers

    def _start_lease_sweeper(self) -> None:
        """A file store has no TTLs: a thread deletes its objects past their lease."""
        if self.config.store_url is None:
            return
        spec = StoreSpec.parse(self.config.store_url)
        if spec.connector_type() is not FileConnector:
            return
        connector = FileConnector.from_config(spec.options)

        def sweep() -> None:
            while not self._stop.wait(SWEEP_PERIOD_S):
                try:
                    removed = connector.sweep_expired()
                except OSError as exc:
                    log.warning("cannot sweep the file store %s: %s", connector.store_dir, exc)
                    continue
                if removed:
                    log.info("swept %d objects past their lease from %s", removed, spec.url)

        threading.Thread(target=sweep, name="fxstream-lease-sweeper", daemon=True).start()

    # --- the loop ----------------------------------------------------------------------

    def _serve(
        self, consumer: Consumer, producer: Producer, engine: Engine, codes: CodeCache
    ) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_period_s
        next_code_fetch = time.monotonic()
        publisher, feed = self._publisher, self._feed
        assert publisher is not None and feed is not None
        while not self._stop.is_set():
            if not publisher.alive:
                # Fenced by a newer agent of this endpoint, or Kafka refused for good.
                raise RuntimeError(f"the result publisher stopped: {publisher.failure}")
            self._flow_control(consumer)
            for message in self._poll(consumer):
                self._take(message, codes)
            feed.feed()
            producer.poll(0)
            now = time.monotonic()
            if self._held.awaiting_code and now >= next_code_fetch:
                self._fetch_awaited_code(codes)
                next_code_fetch = time.monotonic() + CODE_RETRY_S
            if now >= next_beat:
                self._beats.send(producer, engine)
                next_beat = now + self.config.heartbeat_period_s

    def _poll(self, consumer: Consumer) -> list[Message]:
        """What Kafka has now, waiting at most ``POLL_S`` for the first record."""
        first = consumer.poll(POLL_S)
        if first is None:
            return []
        room = self.config.max_local_queue - self._held.queued
        return [first, *consumer.consume(num_messages=min(max(room, 1), 500), timeout=0)]

    def _flow_control(self, consumer: Consumer) -> None:
        # Paused partitions keep the group membership alive while we do not fetch.
        count, size = self._held.queue_size()
        if self._paused:
            want_more = (
                count <= self.config.max_local_queue // 2
                and size <= self.config.max_local_queue_bytes // 2
            )
        else:
            want_more = (
                count < self.config.max_local_queue and size < self.config.max_local_queue_bytes
            )
        if want_more == (not self._paused):
            return
        assignment = consumer.assignment()
        if not assignment:
            return
        if want_more:
            consumer.resume(assignment)
        else:
            consumer.pause(assignment)
        self._paused = not want_more

    def _take(self, message: Message, codes: CodeCache) -> None:
        """Decode a queue record into the local queue (or the dead-letter topic)."""
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("queue %s: %s", self.queue_topic, error)
            return
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        if not self._tracker.track(partition, offset):
            # Answered (and committed) by this partition's previous owner, past its commit
            # position: settled, never run again.
            self.answered_before += 1
            self._answers.settle(partition, offset)
            return
        dequeued_at = time.time()
        value = message.value() or b""
        try:
            dispatch = decode(value, TaskDispatch)
            refused = self._foreign(dispatch)
            if refused:
                # Not for this endpoint (or not as the router stamped it): nothing of it
                # is decoded further, let alone deserialized.
                log.warning("%s", refused)
                self._answers.dead_letter_message(
                    message, refused, DeadLetterReason.IDENTITY_MISMATCH
                )
                return
            submission = decode(dispatch.submission, TaskSubmission)
            refused = _disagrees(dispatch, submission)
            if refused:
                log.warning("%s", refused)
                self._answers.dead_letter_message(
                    message, refused, DeadLetterReason.IDENTITY_MISMATCH
                )
                return
        except RecordDecodeError as exc:
            # Cancels are rare: only what is not a dispatch is tried as one.
            if record_kind(value) != "cancel":
                self._answers.dead_letter_message(message, exc.reason)
                return
            try:
                cancel = decode(value, TaskCancel)
            except RecordDecodeError as cancel_exc:
                self._answers.dead_letter_message(message, cancel_exc.reason)
                return
            self._take_cancel(message, cancel)
            return
        held = Held(
            partition,
            offset,
            dispatch,
            submission,
            dequeued_at,
            len(value),
            attempt=dispatch.attempt,
            epoch=self._held.epoch,
        )
        earlier = self._held.hold(held)
        if earlier is not None:
            # The same task twice in one assignment (a redelivery): one run answers both.
            self._answers.settle_with(earlier, partition, offset)
            return
        refusal = self.policy.refusal(submission)
        if refusal is not None:
            # Before its code is fetched or anything of it deserialized.
            log.warning("task %s refused: %s", submission.task_id, refusal)
            self._answers.publish(
                held, failed_outcome(submission, TaskErrorType.NOT_ALLOWED, ValueError(refusal))
            )
            return
        try:
            # Fetched here, on the poll thread, so the collector thread never waits on HTTP.
            sha, code = verified_code(codes, dispatch, submission.function_id)
        except FunctionUnavailable as exc:
            if not exc.transient:
                self._answers.publish(held, failed_outcome(submission, "FunctionUnavailable", exc))
                return
            # The service is down or overloaded: the task waits, held (its lease renewed,
            # its offset uncommitted), and the fetch is tried again.
            self._held.await_code(held)
            return
        except CodeIntegrityError as exc:
            log.error("%s", exc)
            self._answers.publish(
                held, failed_outcome(submission, TaskErrorType.CODE_INTEGRITY, exc)
            )
            return
        self._held.enqueue(dataclasses.replace(held, code_sha256=sha, code=code))

    def _foreign(self, dispatch: TaskDispatch) -> str:
        """Why this agent must not run ``dispatch`` (another endpoint's), or ''."""
        if dispatch.endpoint_id == self.config.endpoint_id:
            return ""
        return (
            f"dispatch of task {dispatch.task_id} names endpoint {dispatch.endpoint_id!r}, "
            f"not this endpoint {self.config.endpoint_id!r}: refused, nothing deserialized"
        )

    def _fetch_awaited_code(self, codes: CodeCache) -> None:
        """Try again to fetch the code of tasks that wait for the service."""
        waiting = self._held.take_awaiting_code()
        unavailable: dict[str, FunctionUnavailable] = {}
        still: list[Held] = []
        for held in waiting:
            submission = held.submission
            if not self._held.is_current(held):
                continue  # handed back (a rebalance or a stop) meanwhile
            failure = unavailable.get(submission.function_id)
            if failure is None:
                try:
                    sha, code = verified_code(codes, held.dispatch, submission.function_id)
                except FunctionUnavailable as exc:
                    failure = unavailable[submission.function_id] = exc
                except CodeIntegrityError as exc:
                    log.error("%s", exc)
                    self._answers.publish(
                        held, failed_outcome(submission, TaskErrorType.CODE_INTEGRITY, exc)
                    )
                    continue
                else:
                    self._held.enqueue(dataclasses.replace(held, code_sha256=sha, code=code))
                    continue
            if failure.transient:
                still.append(held)
            else:
                self._answers.publish(
                    held, failed_outcome(submission, "FunctionUnavailable", failure)
                )
        if still:
            log.warning(
                "%d tasks wait for the service to give their function's code: %s",
                len(still),
                next(iter(unavailable.values())),
            )
        self._held.still_awaiting_code(still)

    # --- cancel --------------------------------------------------------------------------

    def _take_cancel(self, message: Message, cancel: TaskCancel) -> None:
        """Stop a held task (see the module notes); on the poll thread, after its dispatch."""
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        task_id = cancel.task_id
        reason = cancel.reason or f"cancelled by user {cancel.user_id}"
        claim = self._held.claim_cancel(task_id, reason, cancel.user_id)
        held, queued = claim.held, claim.waiting
        if held is None:
            # Answered already (or its partition came here after the answer): the cancel
            # changes nothing. Its offset commits now, with no record of its own.
            log.info("cancel of task %s: not held here (already answered)", task_id)
            self._answers.settle(partition, offset)
            return
        if claim.refused:
            refused = (
                f"cancel of task {task_id} by user {cancel.user_id!r} refused: the task "
                "was submitted by another user; only its submitter may cancel it"
            )
            log.warning("%s", refused)
            self._answers.settle_with_dead_letter(
                partition,
                offset,
                self._held.epoch,
                key=message.key(),
                value=message.value(),
                headers=headers_of(message),
                reason=refused,
                error_type=DeadLetterReason.CANCEL_REFUSED,
            )
            return
        # The cancel is settled by the task's answer (never before it: a successor must
        # see the cancel again if the task's answer is not committed).
        self._answers.settle_with(held, partition, offset)
        log.info("cancel of task %s: %s", task_id, "skipped (queued)" if queued else "stopping")
        if queued is not None:
            self._answers.publish(
                queued, cancelled_outcome(queued.submission, reason, started_at=None)
            )
            return
        engine = self._engine
        assert engine is not None
        if not cancel.kill:
            # Skip-only (future.cancel()): dropped if the engine has not started it, else
            # it runs on and is answered as usual.
            if not engine.cancel(task_id, reason, kill=False):
                self._held.drop_cancel(task_id)
                log.info("cancel of task %s: already started; skip-only, so it runs on", task_id)
            return
        # False while the engine's thread is between taking it off the local queue and
        # submitting it: EngineFeed.feed then sees the cancel (HeldTasks) and cancels it.
        engine.cancel(task_id, reason)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # On the poll thread: the only thread that may call the consumer.
        self._group_metadata = consumer.consumer_group_metadata()
        self._resume(consumer, partitions)

    def _resume(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Read the assigned partitions' committed offsets and the records past them their
        previous owner answered (the commit metadata), so those are not run again."""
        if not partitions:
            return
        try:
            committed = consumer.committed(partitions, timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            log.error(
                "cannot read the committed offsets of %s (%s): tasks the previous owner of "
                "partitions %s answered past their committed offset will run again, and "
                "their results be committed twice",
                self.queue_topic,
                exc,
                sorted(p.partition for p in partitions),
            )
            return
        for tp in committed:
            if tp.error is not None:
                log.error(
                    "cannot read the committed offset of %s [%d] (%s): tasks answered past "
                    "it will run again",
                    self.queue_topic,
                    tp.partition,
                    tp.error,
                )
                continue
            try:
                runs = self._tracker.resume(tp.partition, tp.offset, tp.metadata)
            except ValueError as exc:
                log.warning(
                    "%s [%d]: unreadable commit metadata (%s); tasks answered past offset %d "
                    "will run again",
                    self.queue_topic,
                    tp.partition,
                    exc,
                    tp.offset,
                )
                continue
            if runs:
                log.info(
                    "%s [%d]: records past the committed offset %d up to %d were answered "
                    "before (%d runs); they are settled, not run again",
                    self.queue_topic,
                    tp.partition,
                    tp.offset,
                    runs[-1][1],
                    len(runs),
                )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Commit what is answered while the partitions are still ours; the engine's tasks of
        # revoked partitions finish and are answered, but their offsets are the new owner's.
        publisher = self._publisher
        if publisher is not None and publisher.alive:
            # Stopping, the answers had their chance already: keep the stop within 10 s.
            publisher.flush(STOP_CLOSE_S if self._stop.is_set() else CALL_FLUSH_S)
        self._give_up(partitions)

    def _on_lost(self, partitions: list[TopicPartition]) -> None:
        # The session expired (the process was stopped or hung past its lease): the
        # partitions already have a new owner, so nothing in hand may be committed.
        log.warning(
            "lost partitions %s of %s with the group session; dropping their tasks",
            sorted(p.partition for p in partitions),
            self.queue_topic,
        )
        self._give_up(partitions)

    def _give_up(self, partitions: list[TopicPartition]) -> None:
        gone = {p.partition for p in partitions}
        self._held.give_up(gone)
        self._tracker.forget_partitions(gone)

    def _answering(self) -> bool:
        """True while a task is in the engine or a result is not yet acknowledged."""
        held = bool(self._held)
        publisher = self._publisher
        return held or (publisher is not None and publisher.alive and publisher.pending > 0)

    def _shutdown(
        self, consumer: Consumer, producer: Producer, engine: Engine, codes: CodeCache
    ) -> None:
        # Tasks not yet started stay uncommitted and go to the next agent; the engine's are
        # finished and answered first.
        self._held.hand_back_waiting()
        deadline = time.monotonic() + STOP_GRACE_S
        while self._answering() and time.monotonic() < deadline:
            producer.poll(0.05)
        producer.flush(STOP_CLOSE_S)
        if self._publisher is not None:
            # Commits what is queued; the group must still be joined for its offsets.
            self._publisher.close(STOP_CLOSE_S)
        consumer.close()
        # Tasks still running are killed; uncommitted, they run again on the next agent.
        engine.close(timeout=STOP_CLOSE_S)
        codes.close()


def _disagrees(dispatch: TaskDispatch, submission: TaskSubmission) -> str:
    """Why a dispatch's submission disagrees with the router's stamps, or ''."""
    stamped = (dispatch.task_id, dispatch.endpoint_id, dispatch.user_id, dispatch.function_sha256)
    claimed = (
        submission.task_id,
        submission.endpoint_id,
        submission.user_id,
        submission.function_sha256,
    )
    if stamped == claimed:
        return ""
    return (
        f"dispatch of task {dispatch.task_id}: its submission (task, endpoint, user, code "
        f"digest {claimed}) disagrees with what the router stamped ({stamped}): refused, "
        "nothing deserialized"
    )
