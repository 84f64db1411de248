"""The endpoint agent: pull this endpoint's queue, run tasks in warm workers, publish results.

One thread polls Kafka; tasks run in a :class:`~fxstream.agent.WorkerPool`,
never in the poll loop. The pool is given only as many tasks as it can start
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
task's result is produced by the pool's collector thread the moment the worker
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
and answered ``TaskCancelled``; one in the pool is cancelled there (dropped if
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

import base64
import dataclasses
import functools
import heapq
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import httpx
import msgspec
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from fxstream.agent.config import EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.policy import TaskPolicy
from fxstream.agent.publisher import Answer, Refusal, TransactionalPublisher
from fxstream.agent.runner import runner_for
from fxstream.agent.workers import RunnerSpec, WorkerPool, WorkItem, WorkOutcome
from fxstream.connectors import FileConnector, LocationPublisher, StoreSpec
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetterReason,
    DeserializationError,
    Heartbeat,
    RecordDecodeError,
    RecordTooLarge,
    TaskCancel,
    TaskDispatch,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskLease,
    TaskResult,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    WarmAdvert,
    WarmWorker,
    code_sha256,
    dead_letter,
    decode,
    encode,
    fit_result,
    fits,
    payload_references,
    producer_message_max_bytes,
    record_kind,
)
from fxstream.topics.acls import endpoint_group, endpoint_transactional_prefix

__all__ = ["AGENT_VERSION", "Agent"]

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
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
# Failures a retry cannot cure, even with retry_user_errors.
_NEVER_RETRIED = frozenset(
    {
        str(TaskErrorType.CANCELLED),
        str(TaskErrorType.RESULT_TOO_LARGE),
        str(TaskErrorType.NOT_ALLOWED),
    }
)
# How often tasks waiting for an unreachable service try to fetch their code again.
CODE_RETRY_S = 2.0

SWEEP_PERIOD_S = 300.0
"""How often an endpoint with a file store deletes objects whose lease ended."""
# Keeps a heartbeat well under the heartbeats topic's 256 kB records.
MAX_LEASES_PER_HEARTBEAT = 1_000


@dataclass(frozen=True)
class _Held:
    """A task taken off the queue and not yet answered durably."""

    partition: int
    offset: int
    dispatch: TaskDispatch
    submission: TaskSubmission
    dequeued_at: float
    size: int
    code_sha256: str = ""
    code: bytes = b""
    # This agent's attempt number (the dispatch's, then one more per local retry) and
    # the failed attempts before it, oldest first.
    attempt: int = 1
    earlier: tuple[Attempt, ...] = ()
    # The assignment epoch it was taken in (see TransactionalPublisher).
    epoch: int = 0


class FunctionUnavailable(Exception):
    """The service would not give the function's code (unknown, deleted, forbidden, down).

    ``transient`` is true when the service could not answer (unreachable, 5xx, 429):
    the task waits for it instead of failing.
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class _CodeCache:
    """Function code by id, fetched from the service's API on a miss; the ``capacity``
    most recently used functions are kept (a client that registers a fresh function per
    task must not grow the agent)."""

    def __init__(self, service_url: str, token: str, capacity: int = 1_024) -> None:
        self._http = httpx.Client(
            base_url=service_url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0
        )
        self._capacity = capacity
        self._code: dict[str, tuple[str, bytes]] = {}

    def get(self, function_id: str) -> tuple[str, bytes]:
        cached = self._code.pop(function_id, None)
        if cached is not None:
            self._code[function_id] = cached  # re-inserted last: the dict is in LRU order
            return cached
        try:
            response = self._http.get(f"/v1/functions/{function_id}")
        except httpx.HTTPError as exc:
            raise FunctionUnavailable(
                f"cannot reach the service to fetch function {function_id}: {exc}",
                transient=True,
            ) from exc
        status = response.status_code
        if status != 200:
            try:
                detail = response.json().get("detail", response.text) if response.content else ""
            except ValueError:
                detail = response.text
            raise FunctionUnavailable(
                f"the service refused function {function_id} ({status}): {detail}",
                transient=status >= 500 or status == 429,
            )
        code = base64.b64decode(response.json()["code"])
        entry = (code_sha256(code), code)
        self._code[function_id] = entry
        if len(self._code) > self._capacity:
            del self._code[next(iter(self._code))]
        return entry

    def forget(self, function_id: str) -> None:
        """Drop a cached function (its code did not have the digest a task expects)."""
        self._code.pop(function_id, None)

    def close(self) -> None:
        self._http.close()


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
        self._hostname = socket.gethostname()
        self._stop = threading.Event()
        self._tracker = OffsetTracker()
        # Every task taken off Kafka and not yet answered durably, by task id; the ones
        # not yet given to the pool are also in _local_queue, in arrival order.
        self._held: dict[str, _Held] = {}
        self._local_queue: deque[_Held] = deque()
        self._local_queue_bytes = 0
        self._in_pool = 0
        # When each task in the pool was given to it (a lease's started_at), by task id.
        self._given_to_pool: dict[str, float] = {}
        # Tasks whose function's code the service could not give yet (it is down).
        self._awaiting_code: list[_Held] = []
        # Tasks waiting out a retry backoff: (due on the monotonic clock, tie-break, task).
        self._retries: list[tuple[float, int, _Held]] = []
        self._retry_order = itertools.count()
        self.retries_scheduled = 0
        # Held tasks a cancel asked to stop (task id -> reason), until they are answered.
        self._cancelled: dict[str, str] = {}
        # Guards the fields above: the poll thread takes tasks, the pool's collector
        # thread publishes results and feeds the pool.
        self._lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._publisher: TransactionalPublisher | None = None
        self._events: Producer | None = None
        # The consumer's group metadata as of the last assignment (for the publisher).
        self._group_metadata: object = None
        # Bumped whenever partitions are revoked or lost: answers to tasks taken in an
        # earlier epoch are dropped by the publisher (their partition has a new owner).
        self._epoch = 0
        self._paused = False
        self._sequence = 0
        self._last_warm: list[WarmWorker] | None = None
        self.results_published = 0
        # Records settled without running: a previous owner of their partition answered them.
        self.answered_before = 0

    # --- public ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to finish the tasks it holds and return."""
        self._stop.set()

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until stopped. ``ready`` is called once workers and Kafka are up."""
        kafka = self.config.kafka(self._credentials).confluent()
        pool = WorkerPool(self.config.workers, self._runner)
        codes = _CodeCache(self.config.service_url, self._credentials.token)
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
            epoch=lambda: self._epoch,
            on_refused=self._quarantine,
        )
        self._pool, self._publisher, self._events = pool, publisher, producer
        try:
            # The transactional id is registered while the workers start up (both take
            # a while, one on the broker, the other in the worker processes).
            publisher.start()
            pool.wait_ready(timeout=60)
            consumer.subscribe(
                [self.queue_topic],
                on_assign=lambda c, parts: self._on_assign(c, parts),
                on_revoke=lambda c, parts: self._on_revoke(c, parts),
                on_lost=lambda c, parts: self._on_lost(parts),
            )
            self._heartbeat(producer, pool)
            if ready is not None:
                ready()
            self._serve(consumer, producer, pool, codes)
        finally:
            self._shutdown(consumer, producer, pool, codes)

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
        self, consumer: Consumer, producer: Producer, pool: WorkerPool, codes: _CodeCache
    ) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_period_s
        next_code_fetch = time.monotonic()
        publisher = self._publisher
        assert publisher is not None
        while not self._stop.is_set():
            if not publisher.alive:
                # Fenced by a newer agent of this endpoint, or Kafka refused for good.
                raise RuntimeError(f"the result publisher stopped: {publisher.failure}")
            self._flow_control(consumer)
            for message in self._poll(consumer):
                self._take(message, codes)
            self._feed_pool()
            producer.poll(0)
            now = time.monotonic()
            if self._awaiting_code and now >= next_code_fetch:
                self._fetch_awaited_code(codes)
                next_code_fetch = time.monotonic() + CODE_RETRY_S
            if now >= next_beat:
                self._heartbeat(producer, pool)
                next_beat = now + self.config.heartbeat_period_s

    def _poll(self, consumer: Consumer) -> list[Message]:
        """What Kafka has now, waiting at most ``POLL_S`` for the first record."""
        first = consumer.poll(POLL_S)
        if first is None:
            return []
        room = self.config.max_local_queue - len(self._local_queue)
        return [first, *consumer.consume(num_messages=min(max(room, 1), 500), timeout=0)]

    def _flow_control(self, consumer: Consumer) -> None:
        # Paused partitions keep the group membership alive while we do not fetch.
        with self._lock:
            count, size = len(self._local_queue), self._local_queue_bytes
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

    def _take(self, message: Message, codes: _CodeCache) -> None:
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
            publisher = self._publisher
            assert publisher is not None
            publisher.publish(Answer(None, None, b"", partition, offset, self._epoch))
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
                self._dead_letter(message, refused, DeadLetterReason.IDENTITY_MISMATCH)
                return
            submission = decode(dispatch.submission, TaskSubmission)
            refused = _disagrees(dispatch, submission)
            if refused:
                log.warning("%s", refused)
                self._dead_letter(message, refused, DeadLetterReason.IDENTITY_MISMATCH)
                return
        except RecordDecodeError as exc:
            # Cancels are rare: only what is not a dispatch is tried as one.
            if record_kind(value) != "cancel":
                self._dead_letter(message, exc.reason)
                return
            try:
                cancel = decode(value, TaskCancel)
            except RecordDecodeError as cancel_exc:
                self._dead_letter(message, cancel_exc.reason)
                return
            self._take_cancel(message, cancel)
            return
        held = _Held(
            partition,
            offset,
            dispatch,
            submission,
            dequeued_at,
            len(value),
            attempt=dispatch.attempt,
            epoch=self._epoch,
        )
        with self._lock:
            earlier = self._held.get(submission.task_id)
            if earlier is not None and earlier.epoch == held.epoch:
                # The same task twice in one assignment (a redelivery): one run answers both.
                self._settle_with(earlier, partition, offset)
                return
            # A run from before a lost assignment is answered nowhere: this one replaces it.
            self._held[submission.task_id] = held
        refusal = self.policy.refusal(submission)
        if refusal is not None:
            # Before its code is fetched or anything of it deserialized.
            log.warning("task %s refused: %s", submission.task_id, refusal)
            self._publish(held, _failed(submission, TaskErrorType.NOT_ALLOWED, ValueError(refusal)))
            return
        try:
            # Fetched here, on the poll thread, so the collector thread never waits on HTTP.
            sha, code = _verified_code(codes, dispatch, submission.function_id)
        except FunctionUnavailable as exc:
            if not exc.transient:
                self._publish(held, _failed(submission, "FunctionUnavailable", exc))
                return
            # The service is down or overloaded: the task waits, held (its lease renewed,
            # its offset uncommitted), and the fetch is tried again.
            with self._lock:
                self._awaiting_code.append(held)
            return
        except CodeIntegrityError as exc:
            log.error("%s", exc)
            self._publish(held, _failed(submission, TaskErrorType.CODE_INTEGRITY, exc))
            return
        self._enqueue(dataclasses.replace(held, code_sha256=sha, code=code))

    def _foreign(self, dispatch: TaskDispatch) -> str:
        """Why this agent must not run ``dispatch`` (another endpoint's), or ''."""
        if dispatch.endpoint_id == self.config.endpoint_id:
            return ""
        return (
            f"dispatch of task {dispatch.task_id} names endpoint {dispatch.endpoint_id!r}, "
            f"not this endpoint {self.config.endpoint_id!r}: refused, nothing deserialized"
        )

    def _enqueue(self, held: _Held) -> None:
        with self._lock:
            current = self._held.get(held.submission.task_id)
            if current is None or (current.offset, current.epoch) != (held.offset, held.epoch):
                return  # handed back, or replaced by a later delivery, meanwhile
            self._held[held.submission.task_id] = held
            self._local_queue.append(held)
            self._local_queue_bytes += held.size

    def _fetch_awaited_code(self, codes: _CodeCache) -> None:
        """Try again to fetch the code of tasks that wait for the service."""
        with self._lock:
            waiting, self._awaiting_code = self._awaiting_code, []
        unavailable: dict[str, FunctionUnavailable] = {}
        still: list[_Held] = []
        for held in waiting:
            submission = held.submission
            if self._held.get(submission.task_id) is not held:
                continue  # handed back (a rebalance or a stop) meanwhile
            failure = unavailable.get(submission.function_id)
            if failure is None:
                try:
                    sha, code = _verified_code(codes, held.dispatch, submission.function_id)
                except FunctionUnavailable as exc:
                    failure = unavailable[submission.function_id] = exc
                except CodeIntegrityError as exc:
                    log.error("%s", exc)
                    self._publish(held, _failed(submission, TaskErrorType.CODE_INTEGRITY, exc))
                    continue
                else:
                    self._enqueue(dataclasses.replace(held, code_sha256=sha, code=code))
                    continue
            if failure.transient:
                still.append(held)
            else:
                self._publish(held, _failed(submission, "FunctionUnavailable", failure))
        if still:
            log.warning(
                "%d tasks wait for the service to give their function's code: %s",
                len(still),
                next(iter(unavailable.values())),
            )
        with self._lock:
            self._awaiting_code = still + self._awaiting_code

    # --- cancel --------------------------------------------------------------------------

    def _take_cancel(self, message: Message, cancel: TaskCancel) -> None:
        """Stop a held task (see the module notes); on the poll thread, after its dispatch."""
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        task_id = cancel.task_id
        reason = cancel.reason or f"cancelled by user {cancel.user_id}"
        queued: _Held | None = None
        refused = ""
        with self._lock:
            held = self._held.get(task_id)
            # The dispatch's user is the router's (the broker-authenticated submitter),
            # and so is the cancel's (the router forwards only its user's own cancels).
            if held is not None and held.dispatch.user_id != cancel.user_id:
                refused = (
                    f"cancel of task {task_id} by user {cancel.user_id!r} refused: the task "
                    "was submitted by another user; only its submitter may cancel it"
                )
            elif held is not None:
                self._cancelled[task_id] = reason
                queued = next(
                    (h for h in self._local_queue if h.submission.task_id == task_id), None
                )
                if queued is not None:
                    self._local_queue.remove(queued)
                    self._local_queue_bytes -= queued.size
                    self._cancelled.pop(task_id, None)
                else:
                    queued = self._take_waiting_retry(task_id)
        publisher = self._publisher
        assert publisher is not None
        if held is None:
            # Answered already (or its partition came here after the answer): the cancel
            # changes nothing. Its offset commits now, with no record of its own.
            log.info("cancel of task %s: not held here (already answered)", task_id)
            publisher.publish(Answer(None, None, b"", partition, offset, self._epoch))
            return
        if refused:
            log.warning("%s", refused)
            self._settle_with_dead_letter(
                partition,
                offset,
                self._epoch,
                key=message.key(),
                value=message.value(),
                headers=_headers(message),
                reason=refused,
                error_type=DeadLetterReason.CANCEL_REFUSED,
            )
            return
        # The cancel is settled by the task's answer (never before it: a successor must
        # see the cancel again if the task's answer is not committed).
        self._settle_with(held, partition, offset)
        log.info("cancel of task %s: %s", task_id, "skipped (queued)" if queued else "stopping")
        if queued is not None:
            self._publish(queued, _cancelled(queued.submission, reason, started_at=None))
            return
        pool = self._pool
        assert pool is not None
        if not cancel.kill:
            # Skip-only (future.cancel()): dropped if the pool has not started it, else
            # it runs on and is answered as usual.
            if not pool.cancel(task_id, reason, kill=False):
                with self._lock:
                    self._cancelled.pop(task_id, None)
                log.info("cancel of task %s: already started; skip-only, so it runs on", task_id)
            return
        # False while the collector thread is between taking it off the local queue and
        # submitting it: _feed_pool then sees it in _cancelled and cancels it itself.
        pool.cancel(task_id, reason)

    def _settle_with(self, held: _Held, partition: int, offset: int) -> None:
        """Settle the record at ``offset`` with the answer of the task ``held``."""
        if held.partition == partition:
            self._tracker.done_with(partition, offset, held.offset)
            return
        # Not the task's partition (the router keys both by task id, so never expected):
        # settled on its own.
        publisher = self._publisher
        assert publisher is not None
        publisher.publish(Answer(None, None, b"", partition, offset, self._epoch))

    def _take_waiting_retry(self, task_id: str) -> _Held | None:
        """Take a task out of its retry backoff, or out of the wait for its function's
        code (for a cancel); the caller holds the lock."""
        for entry in self._retries:
            if entry[2].submission.task_id == task_id:
                self._retries.remove(entry)
                heapq.heapify(self._retries)
                self._cancelled.pop(task_id, None)
                return entry[2]
        for held in self._awaiting_code:
            if held.submission.task_id == task_id:
                self._awaiting_code.remove(held)
                self._cancelled.pop(task_id, None)
                return held
        return None

    def _cancel_requested(self, task_id: str) -> str | None:
        """The reason a cancel gave for a held task, or None: a cancelled task is never retried."""
        with self._lock:
            return self._cancelled.get(task_id)

    def _cancel_wins(self, held: _Held, outcome: WorkOutcome) -> WorkOutcome:
        """The outcome to answer: a cancelled task's failure (say its worker died under the
        kill) is reported as the cancel, so it is never retried; a success stays one."""
        if not self._cancelled:  # the common case, without the lock: nothing cancelled
            return outcome
        with self._lock:
            reason = self._cancelled.pop(held.submission.task_id, None)
        if reason is None or outcome.ok or outcome.error_type == TaskErrorType.CANCELLED:
            return outcome
        return _cancelled(held.submission, reason, started_at=outcome.started_at)

    def _feed_pool(self) -> None:
        """Give the pool tasks from the local queue, up to workers + prefetch in it."""
        pool = self._pool
        assert pool is not None
        capacity = self.config.workers + self.config.prefetch
        self._requeue_due_retries()
        while True:
            with self._lock:
                if not self._local_queue or self._in_pool >= capacity:
                    return
                held = self._local_queue.popleft()
                self._local_queue_bytes -= held.size
                self._in_pool += 1
                self._given_to_pool[held.submission.task_id] = time.time()
            submission = held.submission
            item = WorkItem(
                task_id=submission.task_id,
                function_id=submission.function_id,
                code_sha256=held.code_sha256,
                code=held.code,
                payload=held.dispatch.submission,
                walltime_s=submission.walltime_s,
            )
            future = pool.submit(item)
            future.add_done_callback(functools.partial(self._finished, held))
            reason = self._cancel_requested(submission.task_id) if self._cancelled else None
            if reason is not None:  # cancelled between the local queue and the pool
                pool.cancel(submission.task_id, reason)

    def _finished(self, held: _Held, future: Future[WorkOutcome]) -> None:
        # On the pool's collector thread: answer at once, then give the slot new work.
        outcome = self._cancel_wins(held, future.result())
        with self._lock:
            self._in_pool -= 1
            self._given_to_pool.pop(held.submission.task_id, None)
        if not self._retry(held, outcome):
            self._publish(held, outcome)
        self._feed_pool()

    # --- retries -----------------------------------------------------------------------

    def _should_retry(self, held: _Held, outcome: WorkOutcome) -> bool:
        submission = held.submission
        if outcome.ok or len(held.earlier) >= submission.max_retries:
            return False
        if outcome.retryable:
            return True
        # A function's own exception (or its walltime) is retried only when asked for.
        return submission.retry_user_errors and outcome.error_type not in _NEVER_RETRIED

    def _retry(self, held: _Held, outcome: WorkOutcome) -> bool:
        """Schedule another attempt after a backoff; False when the outcome is final.

        The task stays held (its offset uncommitted, its lease renewed), so a crash
        during the backoff hands it to the next agent rather than losing it.
        """
        if not self._should_retry(held, outcome):
            return False
        if self._stop.is_set():
            # Stopping: hand the task back uncommitted; the next agent runs it again.
            with self._lock:
                self._held.pop(held.submission.task_id, None)
            return True
        failed = Attempt(
            attempt=held.attempt,
            worker=outcome.worker or self._hostname,
            started_at=outcome.started_at,
            finished_at=outcome.finished_at,
            error=_task_error(outcome),
        )
        retry = dataclasses.replace(held, attempt=held.attempt + 1, earlier=(*held.earlier, failed))
        delay = min(
            self.config.retry_backoff_s * 2 ** len(held.earlier), self.config.retry_backoff_max_s
        )
        with self._lock:
            if held.submission.task_id not in self._held:
                return True  # handed back (a rebalance or a stop) while it ran
            self._held[held.submission.task_id] = retry
            heapq.heappush(
                self._retries, (time.monotonic() + delay, next(self._retry_order), retry)
            )
            self.retries_scheduled += 1
        log.info(
            "task %s: attempt %d failed with %s; retry %d of %d in %.1f s",
            held.submission.task_id,
            held.attempt,
            outcome.error_type,
            len(retry.earlier),
            held.submission.max_retries,
            delay,
        )
        self._announce(retry, TaskStateName.RETRYING, failed, f"retry in {delay:.1f} s")
        return True

    def _requeue_due_retries(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._retries and self._retries[0][0] <= now:
                held = heapq.heappop(self._retries)[2]
                if self._held.get(held.submission.task_id) is not held:
                    continue  # dropped by a rebalance or a stop meanwhile
                # Ahead of tasks not yet tried: it has waited its turn already.
                self._local_queue.appendleft(held)
                self._local_queue_bytes += held.size

    def _announce(
        self, held: _Held, state: TaskStateName, attempt: Attempt | None, reason: str
    ) -> None:
        """Tell the task-state processor of a lifecycle step (best effort: status only)."""
        events = self._events
        if events is None:
            return
        submission = held.submission
        event = TaskEvent(
            task_id=submission.task_id,
            user_id=submission.user_id,
            function_id=submission.function_id,
            endpoint_id=self.config.endpoint_id,
            task_group_id=submission.task_group_id,
            state=state,
            at=time.time(),
            source=f"agent {self.config.name}@{self._hostname}",
            attempt=attempt,
            reason=reason,
        )
        try:
            events.produce(self.out_topic, key=submission.task_id.encode(), value=encode(event))
        except (BufferError, KafkaException) as exc:
            log.warning("task %s: cannot announce %s: %s", submission.task_id, state, exc)

    def _publish(self, held: _Held, outcome: WorkOutcome) -> None:
        publisher = self._publisher
        assert publisher is not None
        submission = held.submission
        key = submission.task_id.encode()
        # Forwarded to results.<user> by the ingress, once it has checked the task was
        # routed here.
        topic = self.out_topic
        result, oversized = self._fitted_result(held, outcome, key)
        value = encode(result)
        with self._lock:
            # The worker is free now; only the offset waits for the transaction, so a
            # commit round trip does not idle the workers.
            if self._held.get(submission.task_id) is held:
                del self._held[submission.task_id]
        if oversized is not None:
            original, reason = oversized
            publisher.publish(
                self._letter_for_answer(
                    topic, key, original, reason, DeadLetterReason.RESULT_TOO_LARGE
                )
            )
        publisher.publish(Answer(topic, key, value, held.partition, held.offset, held.epoch))
        if result.value is not None:
            self._publish_locations(result.value)

    def _fitted_result(
        self, held: _Held, outcome: WorkOutcome, key: bytes
    ) -> tuple[TaskResult, tuple[bytes, str] | None]:
        """The result to publish, fitted to the results topic (errors cut in bytes), and,
        when the outcome's value was too large, the original's bytes and why."""
        result = self._result(held, outcome)
        spec = self.catalogue.spec("results.{user_id}")
        try:
            fitted = fit_result(result, spec, key=key)
        except RecordTooLarge as exc:
            limit, setting = exc.limit, f"the results topic's max.message.bytes ({exc.limit:,})"
            size = exc.size
        else:
            # max_result_bytes bounds the serialized return value (the record around it
            # adds a few hundred bytes, and fit_result has checked the topic's limit).
            size = len(fitted.value or b"")
            if not outcome.ok or size <= self.config.max_result_bytes:
                return fitted, None
            limit = self.config.max_result_bytes
            setting = f"this endpoint's max_result_bytes ({limit:,})"
        too_large = _failed(
            held.submission,
            TaskErrorType.RESULT_TOO_LARGE,
            ValueError(
                f"the result is {size:,} bytes, above {setting}. Set store_url in the "
                "endpoint config (e.g. redis://HOST:6379) so results above proxy_threshold "
                "travel by reference, or return a smaller value"
                + (
                    "; or raise max_result_bytes (up to the results topic's max.message.bytes)"
                    if limit == self.config.max_result_bytes
                    else ""
                )
            ),
        )
        original = encode(result)
        return fit_result(self._result(held, too_large), spec, key=key), (
            original,
            f"result of task {held.submission.task_id} too large: {size:,} bytes > {limit:,}",
        )

    def _quarantine(self, answer: Answer, refusal: Refusal) -> list[Answer]:
        """What replaces an answer Kafka refused (on the publisher's thread).

        A result gets a small error result naming the limit (and its original is
        dead-lettered as a digest); a result whose user has no results topic is
        dead-lettered, settling the task; anything else settles with a dead letter.
        """
        topic = answer.topic or ""
        key = answer.key
        letter = self._letter_for_answer(
            topic,
            key,
            answer.value,
            f"Kafka refused the answer: {refusal.reason}",
            DeadLetterReason.TASK_UNDELIVERABLE
            if refusal.topic_missing
            else DeadLetterReason.PRODUCE_FAILED,
            settles=(answer.partition, answer.offset),
        )
        if record_kind(answer.value) == "dead-letter":
            return [Answer(None, None, b"", answer.partition, answer.offset, answer.epoch)]
        try:
            result = decode(answer.value, TaskResult)
        except RecordDecodeError:
            return [letter]
        if refusal.topic_missing:
            log.error(
                "task %s: this endpoint's topic %r does not exist; the result is "
                "dead-lettered. Re-register the endpoint (POST /v1/endpoints creates it)",
                result.task_id,
                topic,
            )
            return [letter]
        error = TaskError(
            type=TaskErrorType.RESULT_REFUSED,
            message=(
                f"Kafka refused this task's result ({len(answer.value):,} bytes) on {topic!r}: "
                f"{refusal.reason}. The results topic accepts records up to its "
                "max.message.bytes; set store_url in the endpoint config so large results "
                "travel by reference, or return a smaller value. The original is on the "
                f"dead-letter topic {self.catalogue.dead_letter!r} (key: the task id)"
            ),
        )
        small = msgspec.structs.replace(
            result, outcome="error", value=None, error=error, earlier_attempts=[]
        )
        extra = dataclasses.replace(letter, partition=-1, offset=-1)
        return [extra, Answer(topic, key, encode(small), answer.partition, answer.offset)]

    def _letter_for_answer(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        reason: str,
        error_type: DeadLetterReason,
        *,
        settles: tuple[int, int] = (-1, -1),
    ) -> Answer:
        """A dead letter (bounded: a large original as a digest) of an answer this agent
        could not write; it settles the queue record ``settles`` (none by default)."""
        letter = dead_letter(
            topic=topic,
            partition=-1,
            offset=-1,
            key=key,
            value=value,
            reason=reason,
            error_type=error_type,
            component=f"agent {self.config.endpoint_id}",
        )
        partition, offset = settles
        return Answer(self.out_topic, key, encode(letter), partition, offset)

    def _publish_locations(self, payload: bytes) -> None:
        """Say where a result stored by reference lives (best effort: routing hints only)."""
        events = self._events
        try:
            references = payload_references(payload)[0]
        except DeserializationError:
            return
        # Only objects stored here: the ingress forwards a location only at this site (a
        # proxy the function passed through was stored, and announced, by its writer).
        references = [r for r in references if r.site == self.config.endpoint_id]
        if events is None or not references:
            return
        try:
            LocationPublisher(events, self.out_topic).created(references)
        except (BufferError, KafkaException) as exc:
            log.warning("cannot publish data locations: %s", exc)

    def _result(self, held: _Held, outcome: WorkOutcome) -> TaskResult:
        submission = held.submission
        return TaskResult(
            task_id=submission.task_id,
            user_id=submission.user_id,
            function_id=submission.function_id,
            endpoint_id=self.config.endpoint_id,
            task_group_id=submission.task_group_id,
            outcome="success" if outcome.ok else "error",
            # On an error: the exception serialized by the runner, if it was (bounded).
            value=outcome.value,
            error=None if outcome.ok else _task_error(outcome),
            attempt=held.attempt,
            earlier_attempts=list(held.earlier),
            worker=outcome.worker,
            timings=TaskTimings(
                submitted_at=submission.submitted_at,
                routed_at=held.dispatch.routed_at,
                dequeued_at=held.dequeued_at,
                started_at=outcome.started_at,
                finished_at=outcome.finished_at,
                result_published_at=time.time(),
            ),
        )

    def _drop(self, held: _Held, reason: str) -> None:
        """Settle a task that cannot be answered with a dead letter (so it is not re-run)."""
        log.error("task %s dropped: %s", held.submission.task_id, reason)
        with self._lock:
            if self._held.get(held.submission.task_id) is held:
                del self._held[held.submission.task_id]
        self._settle_with_dead_letter(
            held.partition,
            held.offset,
            held.epoch,
            key=held.submission.task_id.encode(),
            value=encode(held.dispatch),
            headers=[],
            reason=reason,
            error_type=DeadLetterReason.TASK_UNDELIVERABLE,
        )

    def _dead_letter(
        self,
        message: Message,
        reason: str,
        error_type: DeadLetterReason = DeadLetterReason.DECODE_ERROR,
    ) -> None:
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        self._settle_with_dead_letter(
            partition,
            offset,
            self._epoch,
            key=message.key(),
            value=message.value(),
            headers=_headers(message),
            reason=reason,
            error_type=error_type,
        )

    def _settle_with_dead_letter(
        self,
        partition: int,
        offset: int,
        epoch: int,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]],
        reason: str,
        error_type: DeadLetterReason,
    ) -> None:
        publisher = self._publisher
        assert publisher is not None
        record = dead_letter(
            topic=self.queue_topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            headers=headers,
            reason=reason,
            error_type=error_type,
            component=f"agent {self.config.endpoint_id}",
        )
        letter = encode(record)
        publisher.publish(
            Answer(
                self.out_topic,
                record.original_key,
                letter,
                partition,
                offset,
                epoch,
            )
        )

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
        # Commit what is answered while the partitions are still ours; the pool's tasks of
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
        with self._lock:
            self._epoch += 1
            waiting = [*self._local_queue, *(r[2] for r in self._retries), *self._awaiting_code]
            self._unqueue([held for held in waiting if held.partition in gone])
        self._tracker.forget_partitions(gone)

    def _leases(self, limit: int) -> tuple[list[TaskLease], bool]:
        """The tasks held now (at most ``limit``), and whether more were left out."""
        with self._lock:
            held = list(itertools.islice(self._held.values(), limit))
            truncated = len(self._held) > limit
            started = dict(self._given_to_pool)
        leases = [
            TaskLease(
                task_id=h.submission.task_id,
                user_id=h.submission.user_id,
                function_id=h.submission.function_id,
                task_group_id=h.submission.task_group_id,
                attempt=h.dispatch.attempt,
                started_at=started.get(h.submission.task_id),
            )
            for h in held
        ]
        return leases, truncated

    def _answering(self) -> bool:
        """True while a task is in the pool or a result is not yet acknowledged."""
        with self._lock:
            held = bool(self._held)
        publisher = self._publisher
        return held or (publisher is not None and publisher.alive and publisher.pending > 0)

    def _unqueue(self, dropped: Iterable[_Held]) -> None:
        """Forget tasks of the local queue; uncommitted, they are redelivered.

        The caller holds the lock.
        """
        gone = {held.submission.task_id for held in dropped}
        if not gone:
            return
        for task_id in gone:
            self._held.pop(task_id, None)
            self._cancelled.pop(task_id, None)
        self._local_queue = deque(h for h in self._local_queue if h.submission.task_id not in gone)
        self._local_queue_bytes = sum(h.size for h in self._local_queue)
        self._retries = [r for r in self._retries if r[2].submission.task_id not in gone]
        heapq.heapify(self._retries)
        self._awaiting_code = [h for h in self._awaiting_code if h.submission.task_id not in gone]

    def _heartbeat(self, producer: Producer, pool: WorkerPool) -> None:
        self._sequence += 1
        leases, truncated = self._leases(MAX_LEASES_PER_HEARTBEAT)
        beat = Heartbeat(
            endpoint_id=self.config.endpoint_id,
            agent_id=self.agent_id,
            sent_at=time.time(),
            sequence=self._sequence,
            period_s=self.config.heartbeat_period_s,
            hostname=self._hostname,
            pid=os.getpid(),
            workers_total=pool.size,
            workers_idle=pool.idle_count,
            workers_busy=pool.busy_count,
            queue_depth=pool.queued_count + len(self._local_queue),
            leases=leases,
            leases_truncated=truncated,
            agent_version=AGENT_VERSION,
        )
        key = self.config.endpoint_id.encode()
        value = encode(beat)
        spec = self.catalogue.spec("heartbeats")
        while not fits(spec, key, value) and beat.leases:
            # Long ids: list fewer leases (the rest are renewed by the group session).
            leases = beat.leases[: len(beat.leases) // 2]
            beat = msgspec.structs.replace(beat, leases=leases, leases_truncated=True)
            value = encode(beat)
        producer.produce(self.out_topic, key=key, value=value)
        warm = [
            WarmWorker(worker_id=worker, function_ids=functions)
            for worker, functions in sorted(pool.warm_functions().items())
        ]
        if warm != self._last_warm:
            advert = WarmAdvert(
                endpoint_id=self.config.endpoint_id,
                manager_id=self._hostname,
                advertised_at=time.time(),
                workers=warm,
            )
            warm_key = f"{self.config.endpoint_id}/{self._hostname}".encode()
            value = encode(advert)
            while not fits(self.catalogue.spec("warm"), warm_key, value) and any(
                w.function_ids for w in advert.workers
            ):
                # Many workers with many functions: advertise a subset of each (a hint).
                advert = msgspec.structs.replace(
                    advert,
                    workers=[
                        msgspec.structs.replace(
                            w, function_ids=w.function_ids[: len(w.function_ids) // 2]
                        )
                        for w in advert.workers
                    ],
                )
                value = encode(advert)
            producer.produce(self.out_topic, key=warm_key, value=value)
            self._last_warm = warm

    def _shutdown(
        self, consumer: Consumer, producer: Producer, pool: WorkerPool, codes: _CodeCache
    ) -> None:
        # Tasks not yet started stay uncommitted and go to the next agent; the pool's are
        # finished and answered first.
        with self._lock:
            self._unqueue(
                [*self._local_queue, *(r[2] for r in self._retries), *self._awaiting_code]
            )
        deadline = time.monotonic() + STOP_GRACE_S
        while self._answering() and time.monotonic() < deadline:
            producer.poll(0.05)
        producer.flush(STOP_CLOSE_S)
        if self._publisher is not None:
            # Commits what is queued; the group must still be joined for its offsets.
            self._publisher.close(STOP_CLOSE_S)
        consumer.close()
        # Tasks still running are killed; uncommitted, they run again on the next agent.
        pool.close(timeout=STOP_CLOSE_S)
        codes.close()


class CodeIntegrityError(Exception):
    """Function code whose SHA-256 is not the digest its task was routed with."""


def _verified_code(
    codes: _CodeCache, dispatch: TaskDispatch, submission_function: str
) -> tuple[str, bytes]:
    """The code of the dispatch's function, whose SHA-256 must be the dispatch's digest.

    A cached copy with another digest is dropped and fetched once more (the function
    may have been fetched before a change); still another digest raises
    :class:`CodeIntegrityError`, before anything is deserialized.
    """
    sha, code = codes.get(submission_function)
    if sha == dispatch.function_sha256:
        return sha, code
    codes.forget(submission_function)
    sha, code = codes.get(submission_function)
    if sha == dispatch.function_sha256:
        return sha, code
    raise CodeIntegrityError(
        f"task {dispatch.task_id}: the code fetched for function {submission_function} has "
        f"SHA-256 {sha}, not {dispatch.function_sha256} as the task was routed with; it was "
        "not loaded. The function changed after the task was submitted, or the code was "
        "tampered with on its way: submit the task again to run the current code"
    )


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


def _headers(message: Message) -> list[tuple[str, bytes | None]]:
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]


def _task_error(outcome: WorkOutcome) -> TaskError:
    return TaskError(
        type=outcome.error_type or "Error",
        message=outcome.error_message,
        traceback=outcome.traceback,
        retryable=outcome.retryable,
    )


def _failed(submission: TaskSubmission, error_type: str, exc: BaseException) -> WorkOutcome:
    return WorkOutcome(
        task_id=submission.task_id,
        ok=False,
        value=None,
        error_type=error_type,
        error_message=str(exc),
        traceback="",
        worker="",
        started_at=None,
        finished_at=time.time(),
    )


def _cancelled(submission: TaskSubmission, reason: str, *, started_at: float | None) -> WorkOutcome:
    return WorkOutcome(
        task_id=submission.task_id,
        ok=False,
        value=None,
        error_type=TaskErrorType.CANCELLED,
        error_message=f"task {submission.task_id} was cancelled: {reason}",
        traceback="",
        worker="",
        started_at=started_at,
        finished_at=time.time(),
    )
