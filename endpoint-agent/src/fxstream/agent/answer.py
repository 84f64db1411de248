"""The answer hop: results, dead letters, task events and data locations of held tasks.

Everything a task's answer writes goes to this endpoint's one topic,
``from.ep.<endpoint>`` (the service's ingress checks each record and forwards
it). What settles a queue record (a result, a dead letter, or nothing but the
offset) goes through the :class:`~fxstream.agent.publisher.TransactionalPublisher`,
so the answer and its queue offset commit in one transaction; task events
(``RETRYING``) are best-effort hints on the agent's plain producer, never delaying a
commit; data locations (where a result stored by reference lives) are written beside
their result, in its transaction, so they reach the ingress in the same batch.

Every result and task event carries the dispatch's ``routing_stamp`` unchanged: the
agent cannot check it (it holds no key), and the ingress forwards nothing of a task
without the router's stamp of it for this endpoint.

A result is fitted to the results topic (:func:`~fxstream.topics.fit_result`);
one above the endpoint's ``max_result_bytes`` or the topic's limit is answered
``ResultTooLarge`` and its original dead-lettered as a digest. An answer Kafka
refuses is replaced (:meth:`Answerer.quarantine`, on the publisher's thread) so
the task still settles exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec
from confluent_kafka import KafkaException, Message, Producer

from fxstream.agent.config import EndpointConfig
from fxstream.agent.engine import WorkOutcome
from fxstream.agent.held import Held, HeldTasks
from fxstream.agent.metrics import AgentMetrics
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.publisher import Answer, Refusal, TransactionalPublisher
from fxstream.connectors import location_of
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetterReason,
    DeserializationError,
    RecordDecodeError,
    RecordTooLarge,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskResult,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    dead_letter,
    decode,
    encode,
    fit_result,
    payload_references,
    record_kind,
)

__all__ = ["Answerer", "cancelled_outcome", "failed_outcome", "headers_of", "task_error"]

log = logging.getLogger(__name__)


class Answerer:
    """Answers held tasks for one agent: what it writes, and what settles its queue records.

    Made with the agent; :meth:`open` gives it the transactional publisher and the
    plain producer once they exist (answers need both). Thread-safe: the poll
    thread answers refusals and cancels, the engine's thread answers outcomes.
    """

    def __init__(
        self,
        config: EndpointConfig,
        catalogue: Catalogue,
        *,
        tracker: OffsetTracker,
        held: HeldTasks,
        hostname: str,
    ) -> None:
        self._config = config
        self._catalogue = catalogue
        self._queue_topic = catalogue.endpoint_queue(config.endpoint_id)
        self._out_topic = catalogue.from_endpoint(config.endpoint_id)
        self._tracker = tracker
        self._held = held
        self._source = f"agent {config.name}@{hostname}"
        self._publisher: TransactionalPublisher | None = None
        self._events: Producer | None = None
        self._metrics = AgentMetrics(config.endpoint_id)

    def open(self, publisher: TransactionalPublisher, events: Producer) -> None:
        """Answer through ``publisher`` (what settles records) and ``events`` (hints)."""
        self._publisher, self._events = publisher, events

    def settle(self, partition: int, offset: int) -> None:
        """Settle a queue record with no record of its own (answered already, or a cancel
        of a task no longer held)."""
        publisher = self._publisher
        assert publisher is not None
        publisher.publish(Answer(None, None, b"", partition, offset, self._held.epoch))

    def settle_with(self, held: Held, partition: int, offset: int) -> None:
        """Settle the record at ``offset`` with the answer of the task ``held``."""
        if held.partition == partition:
            self._tracker.done_with(partition, offset, held.offset)
            return
        # Not the task's partition (the router keys both by task id, so never expected):
        # settled on its own.
        self.settle(partition, offset)

    def announce(
        self, held: Held, state: TaskStateName, attempt: Attempt | None, reason: str
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
            endpoint_id=self._config.endpoint_id,
            task_group_id=submission.task_group_id,
            state=state,
            at=time.time(),
            source=self._source,
            attempt=attempt,
            reason=reason,
            # The router's stamp of the task, unchanged: the ingress checks it.
            routing_stamp=held.dispatch.routing_stamp,
        )
        try:
            events.produce(self._out_topic, key=submission.task_id.encode(), value=encode(event))
        except (BufferError, KafkaException) as exc:
            log.warning("task %s: cannot announce %s: %s", submission.task_id, state, exc)

    def publish(self, held: Held, outcome: WorkOutcome) -> None:
        """Answer ``held`` with ``outcome``: its result (fitted to the results topic), its
        queue offset, and where a result stored by reference lives. The task is no longer
        held: only its offset waits for the transaction."""
        publisher = self._publisher
        assert publisher is not None
        submission = held.submission
        key = submission.task_id.encode()
        # Forwarded to results.<user> by the ingress, once it has checked the result's
        # routing stamp (the task was routed here).
        topic = self._out_topic
        result, oversized = self._fitted_result(held, outcome, key)
        value = encode(result)
        # The worker is free now; only the offset waits for the transaction, so a
        # commit round trip does not idle the workers.
        self._held.release(held)
        if oversized is not None:
            original, reason = oversized
            publisher.publish(
                self._letter_for_answer(
                    topic, key, original, reason, DeadLetterReason.RESULT_TOO_LARGE
                )
            )
        if result.value is not None:
            self._publish_locations(publisher, result.value, held.epoch)
        publisher.publish(Answer(topic, key, value, held.partition, held.offset, held.epoch))
        self._metrics.answered(result.outcome == "success", outcome.started_at, outcome.finished_at)

    def _fitted_result(
        self, held: Held, outcome: WorkOutcome, key: bytes
    ) -> tuple[TaskResult, tuple[bytes, str] | None]:
        """The result to publish, fitted to the results topic (errors cut in bytes), and,
        when the outcome's value was too large, the original's bytes and why."""
        result = self._result(held, outcome)
        spec = self._catalogue.spec("results.{user_id}")
        try:
            fitted = fit_result(result, spec, key=key)
        except RecordTooLarge as exc:
            limit, setting = exc.limit, f"the results topic's max.message.bytes ({exc.limit:,})"
            size = exc.size
        else:
            # max_result_bytes bounds the serialized return value (the record around it
            # adds a few hundred bytes, and fit_result has checked the topic's limit).
            size = len(fitted.value or b"")
            if not outcome.ok or size <= self._config.max_result_bytes:
                return fitted, None
            limit = self._config.max_result_bytes
            setting = f"this endpoint's max_result_bytes ({limit:,})"
        too_large = failed_outcome(
            held.submission,
            TaskErrorType.RESULT_TOO_LARGE,
            ValueError(
                f"the result is {size:,} bytes, above {setting}. Set store_url in the "
                "endpoint config (e.g. redis://HOST:6379) so results above proxy_threshold "
                "travel by reference, or return a smaller value"
                + (
                    "; or raise max_result_bytes (up to the results topic's max.message.bytes)"
                    if limit == self._config.max_result_bytes
                    else ""
                )
            ),
        )
        original = encode(result)
        return fit_result(self._result(held, too_large), spec, key=key), (
            original,
            f"result of task {held.submission.task_id} too large: {size:,} bytes > {limit:,}",
        )

    def quarantine(self, answer: Answer, refusal: Refusal) -> list[Answer]:
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
                f"dead-letter topic {self._catalogue.dead_letter!r} (key: the task id)"
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
            component=f"agent {self._config.endpoint_id}",
        )
        partition, offset = settles
        return Answer(self._out_topic, key, encode(letter), partition, offset)

    def _publish_locations(
        self, publisher: TransactionalPublisher, payload: bytes, epoch: int
    ) -> None:
        """Say where a result stored by reference lives: records beside the result, in its
        transaction (settling nothing). On the plain producer they reached the ingress
        before the result and took an ingress transaction of their own, which the result
        then waited for (about 30 ms per by-reference result, `bench payload`)."""
        try:
            references = payload_references(payload)[0]
        except DeserializationError:
            return
        # Only objects stored here: the ingress forwards a location only at this site (a
        # proxy the function passed through was stored, and announced, by its writer).
        for reference in references:
            if reference.site == self._config.endpoint_id:
                location = encode(location_of(reference))
                key = reference.object_key.encode()
                publisher.publish(Answer(self._out_topic, key, location, -1, -1, epoch))

    def _result(self, held: Held, outcome: WorkOutcome) -> TaskResult:
        submission = held.submission
        return TaskResult(
            task_id=submission.task_id,
            user_id=submission.user_id,
            function_id=submission.function_id,
            endpoint_id=self._config.endpoint_id,
            task_group_id=submission.task_group_id,
            outcome="success" if outcome.ok else "error",
            # On an error: the exception serialized by the runner, if it was (bounded).
            value=outcome.value,
            error=None if outcome.ok else task_error(outcome),
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
            tags=submission.tags,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            # The router's stamp of the task, unchanged: the ingress forwards the result only
            # with it (fit_result sizes the record with it).
            routing_stamp=held.dispatch.routing_stamp,
        )

    def dead_letter_message(
        self,
        message: Message,
        reason: str,
        error_type: DeadLetterReason = DeadLetterReason.DECODE_ERROR,
    ) -> None:
        """Dead-letter a queue record this agent will not run, settling its offset."""
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        self.settle_with_dead_letter(
            partition,
            offset,
            self._held.epoch,
            key=message.key(),
            value=message.value(),
            headers=headers_of(message),
            reason=reason,
            error_type=error_type,
        )

    def settle_with_dead_letter(
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
        """Settle the queue record at ``partition``/``offset`` (taken in ``epoch``) with a
        dead letter of it (bounded: a large original as a digest)."""
        publisher = self._publisher
        assert publisher is not None
        record = dead_letter(
            topic=self._queue_topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            headers=headers,
            reason=reason,
            error_type=error_type,
            component=f"agent {self._config.endpoint_id}",
        )
        letter = encode(record)
        publisher.publish(
            Answer(
                self._out_topic,
                record.original_key,
                letter,
                partition,
                offset,
                epoch,
            )
        )


def headers_of(message: Message) -> list[tuple[str, bytes | None]]:
    """A Kafka message's headers as a list of (name, bytes) pairs, for its dead letter."""
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]


def task_error(outcome: WorkOutcome) -> TaskError:
    """The ``TaskError`` record of a failed outcome."""
    return TaskError(
        type=outcome.error_type or "Error",
        message=outcome.error_message,
        traceback=outcome.traceback,
        retryable=outcome.retryable,
    )


def failed_outcome(submission: TaskSubmission, error_type: str, exc: BaseException) -> WorkOutcome:
    """The outcome of a task that failed before (or instead of) running: ``error_type``
    with ``exc``'s text."""
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


def cancelled_outcome(
    submission: TaskSubmission, reason: str, *, started_at: float | None
) -> WorkOutcome:
    """The outcome of a cancelled task, never retried."""
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
