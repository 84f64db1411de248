"""The pull hop: this endpoint's queue into the agent's bounded local queue.

The poll thread blocks on Kafka, never on a fixed-size batch (``consume(n,
timeout)`` would hold a lone task until ``n`` records or the timeout), and
takes what it polls into the local queue (:class:`~fxstream.agent.held.HeldTasks`).
The local queue is bounded (``max_local_queue`` tasks and
``max_local_queue_bytes``): when it is full the agent pauses its Kafka queue,
and resumes once it has drained to half. The hysteresis matters: pausing a
partition discards what the client had prefetched, so pausing and resuming
each time a worker frees would pay a fetch round trip per handful of tasks.
The local queue costs no fairness: a partition's tasks can only go to the
agent it is assigned to, and on a rebalance the queued tasks of revoked
partitions are dropped (uncommitted, so the new owner gets them).

Taking a record checks it before anything of it is deserialized: a dispatch
naming another endpoint, or whose submission disagrees with the router's
stamped task, endpoint, submitter or code digest, is dead-lettered
(``IdentityMismatch``); a task the endpoint does not allow (``allowed_functions``,
``allowed_serializers``; :mod:`fxstream.agent.policy`) is answered
``NotAllowedOnEndpoint`` from its record's fields and its arguments' header
alone; its function's code is fetched (:mod:`fxstream.agent.function_code`) and
used only if its SHA-256 is the dispatch's ``function_sha256``. Then the task
goes to the worker environment of its function's container and its client's
Python version (:mod:`fxstream.agent.python_envs`), or, when no environment of
the endpoint runs that version, is answered ``PythonVersionMismatch`` before it
runs (nothing of it deserialized). A redelivered
record its partition's previous owner answered (the commit metadata read on
assignment, :meth:`Intake.assigned`) is settled without running, and the same
task twice in one assignment is answered by one run.

A :class:`~fxstream.topics.TaskCancel` rides the queue behind its task (same
key, same partition), so the agent reads a task before its cancel. A task still
in the local queue (or waiting out a retry backoff, or for its code) is taken
out and answered ``TaskCancelled``; one in the engine is cancelled there; either
way the task's answer settles the cancel's offset too. A cancel for a task no
longer held only settles its own offset, and one from another user than the
submitter (the dispatch's router-stamped ``user_id``) is dead-lettered
(``CancelRefused``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from fxstream.agent.answer import Answerer, cancelled_outcome, failed_outcome
from fxstream.agent.config import EndpointConfig
from fxstream.agent.engine import Engine
from fxstream.agent.function_code import (
    CodeCache,
    CodeIntegrityError,
    FunctionUnavailable,
    verified_code,
)
from fxstream.agent.held import Held, HeldTasks
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.policy import TaskPolicy
from fxstream.agent.python_envs import PythonEnvironments
from fxstream.agent.staging import Stager
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    RecordDecodeError,
    TaskCancel,
    TaskDispatch,
    TaskErrorType,
    TaskSubmission,
    decode,
    record_kind,
)

__all__ = ["COMMITTED_TIMEOUT_S", "POLL_S", "Intake"]

log = logging.getLogger(__name__)

# The longest an assignment waits for the committed offsets (and what they say was answered).
# They are not readable while the previous owner's transaction is open; a stopped owner's is
# aborted after librdkafka's transaction.timeout.ms (60 s), so this waits longer.
COMMITTED_TIMEOUT_S = 90.0
# The longest the poll thread blocks on Kafka before its housekeeping (commits, beats).
POLL_S = 0.1


class Intake:
    """Takes one endpoint's queue records into held tasks (on the poll thread only)."""

    def __init__(
        self,
        config: EndpointConfig,
        catalogue: Catalogue,
        engine: Engine,
        *,
        policy: TaskPolicy,
        codes: CodeCache,
        tracker: OffsetTracker,
        held: HeldTasks,
        answers: Answerer,
        pythons: PythonEnvironments | None = None,
        stager: Stager | None = None,
    ) -> None:
        self._config = config
        # Tasks staging their inputs in are cancelled there (they have not started).
        self._stager = stager
        # The workers' Python environments (None: every task goes to the default one).
        self._pythons = pythons
        self._queue_topic = catalogue.endpoint_queue(config.endpoint_id)
        self._engine = engine
        self._policy = policy
        self._codes = codes
        self._tracker = tracker
        self._held = held
        self._answers = answers
        self._paused = False
        self.group_metadata: object = None
        """The consumer's group metadata as of the last assignment (for the publisher)."""
        self.rebalancing = threading.Lock()
        """Held while the assignment changes (a new epoch and forgotten partitions, or new
        group metadata): the publisher holds it from checking its answers' epoch until
        their offsets are sent (see fxstream.agent.publisher)."""
        self.answered_before = 0
        """Records settled without running: a previous owner of their partition answered
        them."""
        self.stale_records = 0
        """Records left untaken: fetched before their partition was revoked or lost."""
        # The partitions assigned now (their records are taken; others' are stale).
        self._owned: set[int] = set()
        # Where each partition started, by assignment (logged once, with its first record).
        self._starts: dict[int, int] = {}

    def pull(self, consumer: Consumer) -> None:
        """Pause or resume the queue for the local queue's room, then take what Kafka has,
        waiting at most ``POLL_S`` for the first record.

        Each record is taken before the consumer is called again: a call may serve a
        rebalance (the partitions revoked or lost, then perhaps assigned again), and a
        record polled before it but taken after it would be tracked in the next
        assignment, past the committed offset its records start again from."""
        self._flow_control(consumer)
        first = consumer.poll(POLL_S)
        if first is None:
            return
        self._take(first)
        room = self._config.max_local_queue - self._held.queued
        for message in consumer.consume(num_messages=min(max(room, 1), 500), timeout=0):
            self._take(message)

    def _flow_control(self, consumer: Consumer) -> None:
        # Paused partitions keep the group membership alive while we do not fetch.
        count, size = self._held.queue_size()
        if self._paused:
            want_more = (
                count <= self._config.max_local_queue // 2
                and size <= self._config.max_local_queue_bytes // 2
            )
        else:
            want_more = (
                count < self._config.max_local_queue and size < self._config.max_local_queue_bytes
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

    def _take(self, message: Message) -> None:
        """Decode a queue record into the local queue (or the dead-letter topic)."""
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("queue %s: %s", self._queue_topic, error)
            return
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        if partition not in self._owned:
            # Fetched before its partition was revoked or lost: its new owner (or this
            # agent, assigned it again) takes it from the committed offset.
            self.stale_records += 1
            log.debug("record %d:%d of a partition no longer assigned: left", partition, offset)
            return
        start = self._starts.pop(partition, None) if self._starts else None
        if start is not None:
            # One line per partition and assignment: where its records really started.
            log.info(
                "partition %d: first record taken at offset %d (start asked: %s)",
                partition,
                offset,
                "the reset policy" if start < 0 else start,
            )
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
            log.info(
                "task %s at %d:%d is held already (from %d:%d): answered by that run",
                held.task_id,
                partition,
                offset,
                earlier.partition,
                earlier.offset,
            )
            self._answers.settle_with(earlier, partition, offset)
            return
        refusal = self._policy.refusal(submission)
        if refusal is not None:
            # Before its code is fetched or anything of it deserialized.
            log.warning("task %s refused: %s", submission.task_id, refusal)
            self._answers.publish(
                held, failed_outcome(submission, TaskErrorType.NOT_ALLOWED, ValueError(refusal))
            )
            return
        refusal = self._config.resource_refusal(submission.resource_specification)
        if refusal is not None:  # an MPI task here without MPI, or the other way round
            log.warning("task %s refused: %s", submission.task_id, refusal)
            self._answers.publish(
                held,
                failed_outcome(
                    submission, TaskErrorType.RESOURCES_UNAVAILABLE, ValueError(refusal)
                ),
            )
            return
        try:
            # Fetched here, on the poll thread, so the engine's thread never waits on HTTP.
            sha, code = verified_code(self._codes, dispatch, submission.function_id)
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
        self._enqueue(held, sha, code)

    def _enqueue(self, held: Held, sha: str, code: bytes) -> None:
        """Queue a task whose code is in hand, for the image its function's container names
        and the environment of its client's Python version, unless the endpoint does not
        allow that container or runs no such environment (refused before it runs: nothing
        deserialized)."""
        submission = held.submission
        container = self._codes.container(submission.function_id)
        image, refusal = self._policy.image_for(submission.function_id, container)
        if refusal is not None:
            log.warning("task %s refused: %s", submission.task_id, refusal)
            self._answers.publish(
                held, failed_outcome(submission, TaskErrorType.NOT_ALLOWED, ValueError(refusal))
            )
            return
        if self._pythons is not None:
            image, refusal = self._pythons.environment_for(
                submission.function_id, submission.client.python_version, image
            )
            if refusal is not None:
                log.warning("task %s refused: %s", submission.task_id, refusal)
                mismatch = failed_outcome(
                    submission, TaskErrorType.PYTHON_MISMATCH, ValueError(refusal)
                )
                self._answers.publish(held, mismatch)
                return
        self._held.enqueue(dataclasses.replace(held, code_sha256=sha, code=code, image=image))

    def _foreign(self, dispatch: TaskDispatch) -> str:
        """Why this agent must not run ``dispatch`` (another endpoint's), or ''."""
        if dispatch.endpoint_id == self._config.endpoint_id:
            return ""
        return (
            f"dispatch of task {dispatch.task_id} names endpoint {dispatch.endpoint_id!r}, "
            f"not this endpoint {self._config.endpoint_id!r}: refused, nothing deserialized"
        )

    def fetch_awaited_code(self) -> None:
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
                    sha, code = verified_code(self._codes, held.dispatch, submission.function_id)
                except FunctionUnavailable as exc:
                    failure = unavailable[submission.function_id] = exc
                except CodeIntegrityError as exc:
                    log.error("%s", exc)
                    self._answers.publish(
                        held, failed_outcome(submission, TaskErrorType.CODE_INTEGRITY, exc)
                    )
                    continue
                else:
                    self._enqueue(held, sha, code)
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
            self._answers.dead_letter_message(message, refused, DeadLetterReason.CANCEL_REFUSED)
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
        if self._stager is not None and self._stager.cancel(task_id, reason):
            log.info("cancel of task %s: stopped while its files were staging in", task_id)
            return
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

    def assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions were assigned (on the poll thread: the only one that may call the
        consumer, inside its rebalance callback): note the group metadata for the
        publisher, resume the partitions where they were committed, and start fetching
        each exactly there.

        The start offsets are given to the consumer, not left to its own look-up of the
        committed offsets: the tracker counts from the offsets read here, and a fetch that
        started anywhere else (a client keeping its position across a lost and regained
        assignment) would skip tasks for good or meet offsets the tracker is past. The
        agent's group uses the eager protocol (every assignment is the whole one), so
        ``assign`` is the call; a partition whose committed offset could not be read
        starts where the client finds it."""
        metadata = consumer.consumer_group_metadata()
        with self.rebalancing:
            self.group_metadata = metadata
            self._owned = {p.partition for p in partitions}
        read = self._resume(consumer, partitions)
        self._starts = {p.partition: read.get(p.partition, OFFSET_INVALID) for p in partitions}
        consumer.assign(
            [TopicPartition(p.topic, p.partition, self._starts[p.partition]) for p in partitions]
        )

    def _resume(self, consumer: Consumer, partitions: list[TopicPartition]) -> dict[int, int]:
        """Read the assigned partitions' committed offsets and the records past them their
        previous owner answered (the commit metadata), so those are not run again; returns
        the committed offsets read (``OFFSET_INVALID`` where none was committed yet)."""
        starts: dict[int, int] = {}
        if not partitions:
            return starts
        try:
            committed = consumer.committed(partitions, timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            log.error(
                "cannot read the committed offsets of %s (%s): tasks the previous owner of "
                "partitions %s answered past their committed offset will run again, and "
                "their results be committed twice",
                self._queue_topic,
                exc,
                sorted(p.partition for p in partitions),
            )
            return starts
        for tp in committed:
            if tp.error is not None:
                log.error(
                    "cannot read the committed offset of %s [%d] (%s): tasks answered past "
                    "it will run again",
                    self._queue_topic,
                    tp.partition,
                    tp.error,
                )
                continue
            starts[tp.partition] = tp.offset if tp.offset >= 0 else OFFSET_INVALID
            try:
                runs = self._tracker.resume(tp.partition, tp.offset, tp.metadata)
            except ValueError as exc:
                log.warning(
                    "%s [%d]: unreadable commit metadata (%s); tasks answered past offset %d "
                    "will run again",
                    self._queue_topic,
                    tp.partition,
                    exc,
                    tp.offset,
                )
                continue
            if runs:
                log.info(
                    "%s [%d]: records past the committed offset %d up to %d were answered "
                    "before (%d runs); they are settled, not run again",
                    self._queue_topic,
                    tp.partition,
                    tp.offset,
                    runs[-1][1],
                    len(runs),
                )
        return starts

    def lost(self, partitions: list[TopicPartition]) -> None:
        """The session expired (the process was stopped or hung past its lease): the
        partitions already have a new owner, so nothing in hand may be committed."""
        log.warning(
            "lost partitions %s of %s with the group session; dropping their tasks",
            sorted(p.partition for p in partitions),
            self._queue_topic,
        )
        self.give_up(partitions)

    def give_up(self, partitions: list[TopicPartition]) -> None:
        """Hand back the waiting tasks of revoked or lost partitions, in a new epoch."""
        gone = {p.partition for p in partitions}
        with self.rebalancing:
            self._owned -= gone
            self._held.give_up(gone)
            self._tracker.forget_partitions(gone)


def _disagrees(dispatch: TaskDispatch, submission: TaskSubmission) -> str:
    """Why a dispatch's submission disagrees with the router's stamps, or ''.

    The router's endpoint must be the submission's, or one of its endpoint group (the
    router chose it there)."""
    stamped = (dispatch.task_id, dispatch.endpoint_id, dispatch.user_id, dispatch.function_sha256)
    endpoint = (
        dispatch.endpoint_id
        if dispatch.endpoint_id in submission.candidates()
        else submission.endpoint_id
    )
    claimed = (submission.task_id, endpoint, submission.user_id, submission.function_sha256)
    if stamped == claimed:
        return ""
    return (
        f"dispatch of task {dispatch.task_id}: its submission (task, endpoint, user, code "
        f"digest {claimed}) disagrees with what the router stamped ({stamped}): refused, "
        "nothing deserialized"
    )
