"""The results listener: one background thread that pushes results into futures.

It reads the user's results topic (``results.<user_id>``) with a Kafka consumer
that is *assigned* every partition at the partition's current end offset when
the listener starts, synchronously, before the Client sends its first task. So
every result of a task sent afterwards is at or after those offsets and cannot
be missed (subscribing, or assigning the logical ``OFFSET_END``, resolves the
start offset later, and a fast result could slip in before it).

Whether a task runs is not read here: the user's principal may read only its
results topic, so ``future.running()`` asks the service (:mod:`fxstream.sdk.futures`).

No consumer group is joined and no offsets are committed (librdkafka still needs a
group id: one under the user's prefix ``fxstream-user.<user id>.``, which its ACLs
allow): each Client reads its own results from the moment it starts. Results of
tasks this Client does not track (other sessions of the same user) are counted and
ignored; for those use ``Client.get_result``, which asks the service.

Replay (``Client.reload_task_group``) adopts tasks sent by an earlier process:
while it asks the service for a group's tasks, the listener *captures* the
results of that group's untracked tasks instead of ignoring them, and reports
the offsets it had handled when the capture began, so everything before them
can be read back from the topic (:mod:`fxstream.sdk.history`) and everything
after reaches the listener: no result falls in between.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Final

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from fxstream.connectors import collect_references
from fxstream.sdk.errors import FxstreamError, ResultsTopicMissing, task_failure
from fxstream.sdk.futures import TaskFuture, timings_of
from fxstream.sdk.heap import BacklogTrim
from fxstream.topics import (
    PAYLOAD_HEADER_LENGTH,
    PAYLOAD_MAGIC,
    DeserializationError,
    IntegrityError,
    KafkaConnection,
    RecordDecodeError,
    Serializer,
    TaskErrorType,
    TaskResult,
    decode,
    payload_references,
)

__all__ = ["ResultListener", "end_assignment", "load_outcome", "unreadable_result"]

log = logging.getLogger(__name__)

_BATCH: Final = 500
_POLL_S: Final = 0.1
# Errors of a topic created a moment ago, whose partitions have no leader yet.
_TRANSIENT: Final = frozenset(
    {
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)
# Task ids remembered after their result, so a duplicate is recognised (and counted);
# ~270 B each, so at most ~27 MB. An older task's duplicate counts as unknown (ignored).
_REMEMBERED: Final = 100_000

_FETCH_THREADS: Final = 4

# What the consumer may hold fetched ahead of this thread, in KiB (librdkafka's default is
# 65,536): eight of the results topic's largest records (1 MiB); a larger record would
# still come, alone.
_PREFETCH_KBYTES: Final = 8_192

Release = Callable[[list[Any]], None]
"""Called with the proxy-store objects a consumed task no longer needs (its arguments and
its fetched result); the Client evicts them."""


class ResultListener:
    """Consumes ``topic`` in a daemon thread and resolves the tracked :class:`TaskFuture` s.

    Call :meth:`start` (idempotent) before sending the first task and
    :meth:`track` for each task *before* its record is produced. Counters:
    ``delivered`` (futures resolved), ``duplicates`` (further results for a task
    already resolved, ignored), ``unknown`` (results for tasks not tracked
    here), ``discarded`` (results for futures cancelled locally) and
    ``malformed`` (records that are not valid results). ``group_id`` is the
    (never joined) consumer group librdkafka requires: the Client passes one under the
    user's prefix (:func:`fxstream.topics.acls.user_group_prefix`).

    A record that does not decode, or a further result for a task already
    resolved, is counted and ignored: no future is failed or resolved again by
    it, and its value is never loaded (the objects a duplicate put in the proxy
    store are evicted by the reference list of its envelope).
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        serializer: Serializer,
        *,
        kafka_config: Mapping[str, Any] | None = None,
        release: Release | None = None,
        group_id: str | None = None,
    ) -> None:
        self.topic = topic
        self._serializer = serializer
        self._release = release
        # Results that went by reference are fetched here, off the consumer thread, so
        # one 1 GB result does not hold back every other task's.
        self._fetcher = ThreadPoolExecutor(
            max_workers=_FETCH_THREADS, thread_name_prefix="fx-fetch"
        )
        self._config: dict[str, Any] = {
            **kafka.confluent(),
            # Required by librdkafka even though no group is joined (assign, no commits).
            "group.id": group_id or f"fxstream-sdk-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # Agents publish results in transactions.
            "isolation.level": "read_committed",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 100,
            # librdkafka prefetches up to 64 MiB by default while this thread lags (a
            # burst of results, a busy interpreter), and the process keeps much of that
            # memory after it drains: the SDK's RSS rose in steps in the 1-hour soak.
            "queued.max.messages.kbytes": _PREFETCH_KBYTES,
            "log_level": 3,
            **(kafka_config or {}),
        }
        self._lock = threading.Lock()
        self._futures: dict[str, TaskFuture] = {}
        self._resolved: OrderedDict[str, weakref.ref[TaskFuture]] = OrderedDict()
        # Per partition, the offset after the last record handled (what a capture reports).
        self._handled: dict[int, int] = {}
        # task group id -> how many captures of it are open; task id -> its captured result.
        self._capturing: dict[str, int] = {}
        self._captured: dict[str, dict[str, tuple[TaskResult, float]]] = {}
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.start_offsets: dict[int, int] = {}
        self.delivered = 0
        self.duplicates = 0
        self.unknown = 0
        self.discarded = 0
        self.malformed = 0
        # Gives a drained backlog's freed heap back to the system (fxstream.sdk.heap).
        self.heap_trim = BacklogTrim()

    @property
    def started(self) -> bool:
        """True once the consumer is assigned and the thread runs."""
        return self._thread is not None

    def start(self, timeout: float = 30.0) -> None:
        """Assign every partition of the topic at its current end and start the thread.

        Returns once the assignment is made. Raises :class:`ResultsTopicMissing`
        when the topic does not exist and :class:`FxstreamError` when the broker
        does not answer within ``timeout`` seconds.
        """
        with self._lock:
            if self._thread is not None:
                return
            if self._stop.is_set():
                raise FxstreamError("the results listener is closed")
            consumer = Consumer(self._config)
            try:
                assignment = self._end_offsets(consumer, timeout)
                consumer.assign(assignment)
            except BaseException:
                consumer.close()
                raise
            self.start_offsets = {tp.partition: tp.offset for tp in assignment}
            self._handled = dict(self.start_offsets)
            self._consumer = consumer
            self._thread = threading.Thread(
                target=self._run, name=f"fxstream-results-{self.topic}", daemon=True
            )
            self._thread.start()

    def _end_offsets(self, consumer: Consumer, timeout: float) -> list[TopicPartition]:
        return end_assignment(consumer, self.topic, timeout)

    def track(self, future: TaskFuture) -> None:
        """Resolve ``future`` when its task's result arrives (call before producing the task)."""
        with self._lock:
            self._futures[future.task_id] = future

    def future(self, task_id: str) -> TaskFuture | None:
        """The tracked future of ``task_id`` (None once its result arrived, or if untracked)."""
        with self._lock:
            return self._futures.get(task_id)

    def untrack(self, task_id: str) -> None:
        """Stop tracking a task (its record was never sent)."""
        with self._lock:
            self._futures.pop(task_id, None)

    def adopt(self, future: TaskFuture) -> TaskFuture:
        """The future for ``future.task_id``: one this listener already has, or ``future``.

        A task tracked here, or resolved here and still referenced, keeps its
        future (so a task is never delivered to two futures). Otherwise
        ``future`` is tracked, and resolved at once if a capture holds its result.
        """
        with self._lock:
            known = self._futures.get(future.task_id)
            if known is None and future.task_id in self._resolved:
                known = self._resolved[future.task_id]()
            if known is not None:
                return known
            captured = self._take_captured(future.task_id)
            if captured is None:
                self._futures[future.task_id] = future
                return future
            self._mark_resolved(future)
        self._resolve(future, *captured)
        return future

    def settle(self, future: TaskFuture) -> bool:
        """Claim ``future`` (tracked here) for resolving elsewhere, e.g. from the service's state.

        True if the caller should now resolve it; False if a result already
        did. The task counts as delivered once: a later result is a duplicate.
        """
        with self._lock:
            if self._futures.get(future.task_id) is not future:
                return False
            del self._futures[future.task_id]
            self._mark_resolved(future)
            if self._take_captured(future.task_id) is not None:
                self.duplicates += 1
                future.duplicates += 1
        self.delivered += 1
        return True

    def offer(self, result: TaskResult, received: float | None = None) -> None:
        """Handle a result found elsewhere (read back from the topic) as if it had arrived."""
        with self._lock:
            future = self._claim(result)
        if future is not None:
            self._resolve(future, result, time.time() if received is None else received)

    @contextmanager
    def capture(self, task_group_id: str) -> Iterator[dict[int, int]]:
        """Keep the results of ``task_group_id``'s untracked tasks while the block runs.

        Yields, per partition, the offset after the last record handled before
        the capture began: every later record is captured (or resolves a
        tracked future), every earlier one is for the caller to read back. A
        task adopted inside the block takes its captured result; what is left
        is dropped when the block ends.
        """
        if not self.started:
            raise FxstreamError("start the results listener before capturing")
        with self._lock:
            self._capturing[task_group_id] = self._capturing.get(task_group_id, 0) + 1
            boundary = dict(self._handled)
        try:
            yield boundary
        finally:
            with self._lock:
                left = self._capturing[task_group_id] - 1
                if left:
                    self._capturing[task_group_id] = left
                else:
                    del self._capturing[task_group_id]
                    self._captured.pop(task_group_id, None)

    def _take_captured(self, task_id: str) -> tuple[TaskResult, float] | None:
        for results in self._captured.values():
            captured = results.pop(task_id, None)
            if captured is not None:
                return captured
        return None

    def _mark_resolved(self, future: TaskFuture) -> None:
        self._resolved[future.task_id] = weakref.ref(future)
        if len(self._resolved) > _REMEMBERED:
            self._resolved.popitem(last=False)

    def _claim(self, result: TaskResult) -> TaskFuture | None:
        """The tracked future ``result`` resolves, or None (it is counted or captured)."""
        future = self._futures.pop(result.task_id, None)
        if future is not None:
            self._mark_resolved(future)
            return future
        if result.task_id in self._resolved:
            self.duplicates += 1
            earlier = self._resolved[result.task_id]()
            if earlier is not None:
                earlier.duplicates += 1
        elif result.task_group_id is not None and result.task_group_id in self._capturing:
            captured = self._captured.setdefault(result.task_group_id, {})
            if result.task_id in captured:
                self.duplicates += 1
            else:
                captured[result.task_id] = (result, time.time())
        else:
            self.unknown += 1
        return None

    @property
    def tracked(self) -> int:
        """How many tracked tasks have no result yet."""
        with self._lock:
            return len(self._futures)

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while not self._stop.is_set():
            try:
                # consume(n, timeout) would wait for n records or the whole timeout: a
                # lone result would sit there. Block for the first, then take what is in.
                first = consumer.poll(_POLL_S)
                if first is None:
                    self.heap_trim.observe(len(self._futures))
                    continue
                messages = [first, *consumer.consume(num_messages=_BATCH - 1, timeout=0)]
            except KafkaException as exc:  # pragma: no cover - a fatal consumer error
                log.error("results consumer on %s failed: %s", self.topic, exc)
                time.sleep(_POLL_S)
                continue
            received = time.time()
            for message in messages:
                self._handle(message, received)
            self.heap_trim.observe(len(self._futures))

    def _handle(self, message: Message, received: float) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("results consumer on %s: %s", self.topic, error)
            return
        partition, offset = message.partition(), message.offset()
        try:
            result: TaskResult | None = decode(message.value(), TaskResult)
        except RecordDecodeError as exc:
            # Counted and ignored, whatever its key: a record nobody can read says
            # nothing about its task, whose own result still comes (the task-state
            # processor dead-letters the bad one).
            result = None
            self.malformed += 1
            log.warning(
                "ignoring a record at %s [%s] offset %s that is not a result: %s",
                message.topic(),
                partition,
                offset,
                exc.reason,
            )
        with self._lock:
            # Under the same lock as the decision, so a capture's boundary never
            # splits a record from what was decided about it.
            if partition is not None and offset is not None:
                self._handled[partition] = offset + 1
            future = self._claim(result) if result is not None else None
            ours = result is not None and future is None and result.task_id in self._resolved
        if future is not None and result is not None:
            self._resolve(future, result, received)
        elif ours and result is not None and result.value is not None:
            # A second result of a task resolved here: ignored, never loaded. The
            # objects it put in the store are nobody's but ours; its envelope names them.
            self._release_objects([], _references_of(result.value))

    def _resolve(
        self, future: TaskFuture, result: TaskResult, received: float, *, fetching: bool = False
    ) -> None:
        if (
            not fetching
            and result.outcome == "success"
            and result.value is not None
            and _by_reference(result.value)
        ):
            self._fetcher.submit(self._resolve, future, result, received, fetching=True)
            return
        fetched: list[Any] = []
        try:
            finish = self._settle(future, result, received, fetched)
        finally:
            # Before the future resolves: its waiter may close the Client at once. A
            # result some child task reads by reference stays in the store (issue 15).
            self._release_objects(future._stored, [] if future._keep_result else fetched)
            future._stored = []
        finish()

    def _settle(
        self, future: TaskFuture, result: TaskResult, received: float, fetched: list[Any]
    ) -> Callable[[], None]:
        """Read ``result`` for ``future``; returns what resolves the future (and counts it)."""
        future.timings = timings_of(
            result.timings, submitted=future.timings["submitted"], delivered=received
        )
        future.worker = result.worker or None
        future.attempt = result.attempt
        future.stdout, future.stderr = result.stdout, result.stderr
        if result.endpoint_id in future.candidates:
            future.endpoint_id = result.endpoint_id  # a grouped task: where the router sent it
        if future.cancelled():
            if result.value is not None:
                fetched.extend(_references_of(result.value))
            return self._count_discarded
        if result.error is not None and result.error.type == TaskErrorType.CANCELLED:
            # Cancelled from elsewhere (Client.cancel): the future ends as a cancelled
            # concurrent.futures.Future does, so result() raises CancelledError.
            return lambda: self._count(future._resolve_cancelled_remotely())
        value, outcome = load_outcome(self._serializer, result, fetched)
        if outcome is None:
            return lambda: self._count(future._resolve_result(value))
        failure = outcome
        return lambda: self._count(future._resolve_exception(failure))

    def _count(self, delivered: bool) -> None:
        if delivered:
            self.delivered += 1
        else:
            self.discarded += 1

    def _count_discarded(self) -> None:
        self.discarded += 1

    def _release_objects(self, stored: list[Any], fetched: list[Any]) -> None:
        if self._release is not None and (stored or fetched):
            try:
                self._release([*stored, *fetched])
            except Exception as exc:  # never let cleanup fail a delivery
                log.warning("could not release proxy-store objects: %s", exc)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and close the consumer; tracked futures stay unresolved."""
        with self._lock:
            self._stop.set()
            thread, consumer = self._thread, self._consumer
        if thread is not None:
            thread.join(timeout)
        if consumer is not None:
            consumer.close()
            self._consumer = None
        self._fetcher.shutdown(wait=True, cancel_futures=False)


def load_outcome(
    serializer: Serializer, result: TaskResult, fetched: list[Any]
) -> tuple[Any, BaseException | None]:
    """A result record's value, or the exception it stands for: ``(value, None)`` for a
    success, ``(None, error)`` otherwise.

    A success's payload is deserialized (fetched from its store first when it went by
    reference; the store checks its digest); a payload that does not load becomes the error
    (:func:`unreadable_result`). A failure becomes :func:`~fxstream.sdk.errors.task_failure`,
    with the remote exception object when the worker sent it inline and it loads here. The
    stored objects read are appended to ``fetched`` (for the caller to evict or keep). Call
    it only for a record of the user's own results topic, which only the platform writes.
    """
    if result.outcome == "success":
        if result.value is None:
            return None, FxstreamError(
                f"task {result.task_id} succeeded but its result record carries no value "
                "(the agent must set TaskResult.value)"
            )
        try:
            with collect_references() as found:
                try:
                    return serializer.deserialize(result.value), None
                finally:
                    fetched.extend(found)
        except Exception as exc:  # DeserializationError, a user __setstate__, a fetch
            return None, unreadable_result(result.task_id, exc, result.value)
    if result.error is not None:
        return None, task_failure(
            result.task_id,
            result.error,
            endpoint_id=result.endpoint_id,
            attempt=result.attempt,
            earlier_attempts=result.earlier_attempts,
            exception=_remote_exception(serializer, result),
        )
    return None, FxstreamError(
        f"task {result.task_id} failed but its result record carries no error "
        "(the agent must set TaskResult.error)"
    )


def _remote_exception(serializer: Serializer, result: TaskResult) -> BaseException | None:
    """The exception the function raised, as the worker serialized it beside its text;
    None when it was not sent or does not load here (its type not importable)."""
    payload = result.value
    if payload is None or _by_reference(payload):
        return None
    try:
        exception = serializer.deserialize(payload)
    except Exception as exc:  # its class is not importable here: the text still says it
        log.debug("task %s: its exception does not load here: %s", result.task_id, exc)
        return None
    return exception if isinstance(exception, BaseException) else None


def end_assignment(consumer: Consumer, topic_name: str, timeout: float) -> list[TopicPartition]:
    """Every partition of the results topic ``topic_name`` at its current end offset, read
    synchronously (so a record committed after this returns is at or after it).

    Raises :class:`ResultsTopicMissing` when the topic does not exist and
    :class:`FxstreamError` when the broker does not answer within ``timeout`` seconds.
    """
    try:
        metadata = consumer.list_topics(topic_name, timeout=timeout)
    except KafkaException as exc:
        raise FxstreamError(
            f"cannot read the metadata of {topic_name!r} from Kafka ({exc}); is the broker "
            "up, and is FXSTREAM_BOOTSTRAP (bootstrap) right?"
        ) from exc
    topic = metadata.topics.get(topic_name)
    if topic is None or topic.error is not None or not topic.partitions:
        raise ResultsTopicMissing(
            f"the results topic {topic_name!r} does not exist, so no result could arrive: "
            "it is created when the user registers (Client.register_user, POST /v1/users); "
            "check the user id and the topic prefix (FXSTREAM_USER_ID, FXSTREAM_TOPIC_PREFIX)"
        )
    deadline = time.monotonic() + timeout
    assignment = []
    for partition in sorted(topic.partitions):
        tp = TopicPartition(topic_name, partition)
        while True:
            try:
                _low, high = consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)
                break
            except KafkaException as exc:
                # A topic created a moment ago may not have elected its leaders yet.
                error = exc.args[0] if exc.args else None
                retriable = isinstance(error, KafkaError) and (
                    error.retriable() or error.code() in _TRANSIENT
                )
                if not retriable or time.monotonic() > deadline:
                    raise FxstreamError(
                        f"cannot read the end offset of {topic_name} [{partition}] ({exc})"
                    ) from exc
                time.sleep(0.1)
        assignment.append(TopicPartition(topic_name, partition, high))
    return assignment


def _by_reference(payload: bytes) -> bool:
    return payload[:PAYLOAD_HEADER_LENGTH] == _ENVELOPE_HEADER


def _references_of(payload: bytes) -> list[Any]:
    """The stored objects a result payload refers to, read from its envelope (nothing is
    unpickled); an unreadable envelope gives none, and its objects are left to their lease."""
    try:
        return list(payload_references(payload)[0])
    except DeserializationError:
        return []


_ENVELOPE_HEADER: Final = PAYLOAD_MAGIC + b"rf\n"


def unreadable_result(task_id: str, exc: Exception, payload: bytes) -> Exception:
    """The error for a result payload that cannot be loaded.

    A result stored by reference gets an error about the store (an evicted
    object, an unreachable store); any other keeps its own error, and so does
    an integrity error (the stored result is not the one the worker wrote).
    """
    if not _by_reference(payload) or isinstance(exc, IntegrityError):
        # A result substituted in the store raises StoreIntegrityError itself.
        return exc
    return FxstreamError(
        f"task {task_id} succeeded but its result, stored by reference, could not be fetched: "
        f"{type(exc).__name__}: {exc}. Is the endpoint's proxy store reachable from here (its "
        "store_url)? A result is evicted from the store once its client consumed it, and "
        "any object once its lease is over (docs/data-plane.md, Lifetimes)"
    )
