"""The router's decisions: authorise each submitted task and say what to write for it.

The router reads every user's ``from.user.<user>`` topic (by pattern) in
batches. Who submitted a record is the user of the topic it is on: only that
user's principal may write there (the broker's ACLs), so the identity comes
from the broker, never from the record, which carries no credential. A record
whose ``user_id`` names another user is dead-lettered (``IdentityMismatch``)
and changes nothing else. For each submission it decodes the envelope (never
the payload: arguments stay opaque bytes), looks up the user, function and
endpoint in a :class:`RegistryView`, and applies :func:`auth.refusal_reason`;
then it checks that the submission's ``function_sha256`` is the registered
code's digest (``FunctionChanged`` otherwise). What it writes:

- allowed: a :class:`TaskDispatch` on ``tasks.ep.<endpoint>`` carrying the
  submission's bytes exactly as read (and its headers), stamped with the
  submitter, the checked code digest and the routing stamp (an HMAC under the
  service's signing key over the task, the endpoint, the user and the function:
  :mod:`fxstream.topics.routing_stamp`, which the ingress verifies on every result
  and event the agent answers with), and a ``routed`` :class:`TaskState`;
- refused: an error :class:`TaskResult` (``TaskRejected``) on
  ``results.<user>`` when that topic exists, a ``rejected`` state, and a
  dead letter;
- undecodable, or not the topic's user: a dead letter only.

``from.user.<user>`` also carries :class:`TaskCancel` records, keyed by task id
like the submission they follow. An authorised cancel (the topic's user, an
endpoint the user may use) is forwarded, bytes untouched, to
``tasks.ep.<endpoint>`` after the batch's dispatches, and to ``held-tasks`` (under the
task's key: a task held for its parents is cancelled there by the dependencies
processor); a refused one is dead-lettered (``CancelRefused``) and changes nothing else.
Same key, same partition number: the cancel reaches the endpoint queue after its task's
dispatch, so the agent holding the task reads the task first and its cancel
next, without any lookup of task state here (see docs/architecture.md).

A submission with an ``endpoint_group`` (:meth:`TaskSubmission.candidates`) is
refused unless the user may use every candidate (the refusal names the first one
that is not shared with them); otherwise a :class:`~fxstream.service.placement.Placement`
chooses one (liveness, warmth, backlog, data locality, a tie-break: see that module),
and the chosen endpoint is the dispatch's and the ``routed`` state's ``endpoint_id``,
so nothing downstream knows groups exist. A cancel of a grouped task is sent by the
SDK once per candidate (no state lookup here): the agents that do not hold the task
ignore it.

A submission with parents whose results it does not carry
(:meth:`TaskSubmission.unresolved`, issue 15's task DAGs) is authorised the same way,
but held instead of dispatched: the router writes a :class:`HeldTask` (the submission's
bytes, its parents) to ``held-tasks`` and a ``waiting-for-parents`` state, in the same
transaction. The dependencies processor (:mod:`fxstream.service.dependencies`) releases
it to the submitter's own topic with the parents' results once they have all
succeeded; the router then authorises and routes it like any other submission.

Every record is keyed by task id, so Kafka's default partitioner puts all of a
task's records on the same partition number of each topic. :meth:`Router.plan`
does no writing: the faust agent in :mod:`fxstream.service.processors` sends
what it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fxstream.service.auth import cancel_refusal_reason, refusal_reason
from fxstream.service.outgoing import Outgoing
from fxstream.service.placement import Choice, Placement, tie_break
from fxstream.service.quarantine import OUTPUT_REFUSED
from fxstream.service.registry import RegistryView
from fxstream.service.routing_keys import RoutingKeyFile
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import (
    ROUTING_STAMP_MAX_CHARS,
    Catalogue,
    DeadLetterReason,
    FunctionRecord,
    HeldTask,
    RawRecord,
    RecordDecodeError,
    RoutingKeys,
    TaskCancel,
    TaskDispatch,
    TaskError,
    TaskErrorType,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    dead_letter_for,
    decode,
    encode,
    normalise_headers,
    record_bytes,
    record_kind,
)

__all__ = [
    "CANCEL_REFUSED_ERROR_TYPE",
    "COMPONENT",
    "REJECTED_ERROR_TYPE",
    "RoutePlan",
    "Router",
    "RouterStats",
]

log = logging.getLogger(__name__)

COMPONENT = "router"
# The error type of a refused task's result; the task-state processor leaves these
# alone, since the router writes the rejected state itself.
REJECTED_ERROR_TYPE = str(TaskErrorType.REJECTED)
# The dead letter's error type for a cancel the router will not forward.
CANCEL_REFUSED_ERROR_TYPE = DeadLetterReason.CANCEL_REFUSED
_CANCEL_KIND = "cancel"


@dataclass
class RouterStats:
    """Counts since start, logged at shutdown."""

    routed: int = 0
    held: int = 0
    rejected: int = 0
    dead_lettered: int = 0
    catch_ups: int = 0
    cancels_forwarded: int = 0
    cancels_refused: int = 0
    identity_mismatches: int = 0
    functions_changed: int = 0


@dataclass
class RoutePlan:
    """What to write for one batch, in two waves.

    ``first`` (task states, results, dead letters) is written and acknowledged
    before ``dispatches``, so a task's ``routed`` state is on the broker before
    any agent can see the task, and so before any result can overtake it.
    """

    first: list[Outgoing] = field(default_factory=list)
    dispatches: list[Outgoing] = field(default_factory=list)


@dataclass(frozen=True)
class _Decision:
    record: RawRecord
    submission: TaskSubmission
    refusal: str | None
    error_type: DeadLetterReason = DeadLetterReason.REJECTED
    endpoint_id: str = ""
    """Where it goes: the submission's endpoint, or the one placement chose of its group."""

    @property
    def endpoint(self) -> str:
        return self.endpoint_id or self.submission.endpoint_id


class Router:
    """Authorises and routes batches of submissions; owns the registry view it reads."""

    def __init__(
        self,
        catalogue: Catalogue,
        view: RegistryView,
        directory: TopicDirectory,
        *,
        keys: RoutingKeyFile | RoutingKeys,
        catch_up_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        placement: Placement | None = None,
    ) -> None:
        """``keys`` are the service's routing keys: every dispatch is stamped with their
        signing key (there is no default key); a
        :class:`~fxstream.service.routing_keys.RoutingKeyFile` (what the processors pass)
        is re-read when it changes, so a rotation's new signing key is used within about a
        second, without a restart. ``placement`` chooses among a grouped
        submission's endpoints (default: the ``warm`` policy over ``view``, which should
        then follow ``heartbeats`` and ``warm``; a view that does not sees no candidate
        live and no warmth)."""
        self._keys = keys
        self._catalogue = catalogue
        self._view = view
        self._directory = directory
        self._follower = ViewFollower(
            view,
            directory,
            (catalogue.users, catalogue.functions, catalogue.endpoints),
            name="router",
            catch_up_s=catch_up_s,
            start_timeout_s=60.0,
        )
        self._clock = clock
        self.placement = placement if placement is not None else Placement(view, clock=clock)
        self._queue_limit = catalogue.spec("tasks.ep.{endpoint_id}").max_message_bytes
        self.stats = RouterStats()

    @property
    def keys(self) -> RoutingKeys:
        """The keys dispatches are stamped with now (the key file looked at if a second has
        passed since the last look)."""
        return self._keys.current() if isinstance(self._keys, RoutingKeyFile) else self._keys

    async def start(self) -> None:
        """Start the registry view and wait until it holds everything registered so far."""
        log.info("router: stamping dispatches with routing key %s", self.keys.signing.key_id)
        await self._follower.start()

    def close(self) -> None:
        """Stop following the registry."""
        self._follower.close()

    # --- planning ------------------------------------------------------------------------

    async def plan(self, records: Sequence[RawRecord]) -> RoutePlan:
        """Decide what to write for a batch of ``from.user.<user>`` records."""
        plan = RoutePlan()
        submissions: list[tuple[RawRecord, TaskSubmission]] = []
        cancels: list[tuple[RawRecord, TaskCancel]] = []
        for record in records:
            sender = self._catalogue.user_of(record.topic)
            if sender is None:
                self._dead_letter(
                    plan,
                    record,
                    f"topic {record.topic!r} is not a user's submission topic "
                    f"({self._catalogue.from_user('<user>')!r})",
                    DeadLetterReason.IDENTITY_MISMATCH,
                )
                continue
            try:
                submission = decode(record.value, TaskSubmission)
            except RecordDecodeError as exc:
                # Cancels are rare: only bytes that are not a submission are tried as one.
                if record_kind(record.value) != _CANCEL_KIND:
                    self._dead_letter(plan, record, str(exc), DeadLetterReason.DECODE_ERROR)
                    continue
                try:
                    cancel = decode(record.value, TaskCancel)
                except RecordDecodeError as cancel_exc:
                    self._dead_letter(plan, record, str(cancel_exc), DeadLetterReason.DECODE_ERROR)
                    continue
                if self._sent_by(plan, record, sender, cancel.user_id, cancel.task_id):
                    cancels.append((record, cancel))
                continue
            if self._sent_by(plan, record, sender, submission.user_id, submission.task_id):
                submissions.append((record, submission))
        if any(self._has_unknown(s) for _, s in submissions) or any(
            self._cancel_has_unknown(c) for _, c in cancels
        ):
            await self._catch_up()
        decisions = [self._decide(r, s) for r, s in submissions]
        decisions = await self._refuse_unroutable(decisions)
        results_present = await self._directory.present(
            self._catalogue.results(d.submission.user_id) for d in decisions if d.refusal
        )
        now = self._clock()
        for decision in decisions:
            try:
                self._plan_one(plan, decision, now, results_present)
            except Exception as exc:  # a bug here must cost one task, not the router
                log.exception("router: cannot plan task %s", decision.submission.task_id)
                self._dead_letter(
                    plan, decision.record, f"router failed: {exc!r}", DeadLetterReason.ROUTER_ERROR
                )
        if cancels:
            # After every dispatch of the batch: a cancel follows its task on the queue.
            await self._plan_cancels(plan, cancels)
        return plan

    def _sent_by(
        self, plan: RoutePlan, record: RawRecord, sender: str, claimed: str, task_id: str
    ) -> bool:
        """True when the record's ``user_id`` is its topic's user; else it is dead-lettered."""
        if claimed == sender:
            return True
        self.stats.identity_mismatches += 1
        self._dead_letter(
            plan,
            record,
            f"a record on {record.topic!r} (written by user {sender!r}) names user "
            f"{claimed!r}: a user submits and cancels only as itself, on its own topic",
            DeadLetterReason.IDENTITY_MISMATCH,
            task_id,
        )
        return False

    async def refuse(
        self, records: Sequence[RawRecord], reasons: Mapping[bytes | None, str]
    ) -> RoutePlan:
        """What to write instead for ``records`` whose outputs Kafka refused.

        Each submission is refused with ``reasons[its key]``: an error result to
        its user (when their results topic exists), a ``rejected`` state and a
        dead letter, so the caller's future fails with the reason instead of
        waiting forever. Anything else (a cancel) is dead-lettered.
        """
        plan = RoutePlan()
        decisions: list[_Decision] = []
        for record in records:
            reason = reasons.get(record.key, "Kafka refused this task's output")
            try:
                submission = decode(record.value, TaskSubmission)
            except RecordDecodeError:
                self._dead_letter(plan, record, reason, OUTPUT_REFUSED)
                continue
            decisions.append(_Decision(record, submission, reason))
        present = await self._directory.present(
            self._catalogue.results(d.submission.user_id) for d in decisions
        )
        now = self._clock()
        for decision in decisions:
            self._plan_refused(plan, decision, now, present)
        return plan

    async def _plan_cancels(
        self, plan: RoutePlan, cancels: list[tuple[RawRecord, TaskCancel]]
    ) -> None:
        refusals = [
            cancel_refusal_reason(
                cancel, self._view.user(cancel.user_id), self._view.endpoint(cancel.endpoint_id)
            )
            for _, cancel in cancels
        ]
        present = await self._directory.present(
            self._catalogue.endpoint_queue(cancel.endpoint_id)
            for (_, cancel), refusal in zip(cancels, refusals, strict=True)
            if refusal is None
        )
        for (record, cancel), refusal in zip(cancels, refusals, strict=True):
            queue = self._catalogue.endpoint_queue(cancel.endpoint_id)
            if refusal is None and queue not in present:
                refusal = (
                    f"cancel of task {cancel.task_id}: endpoint {cancel.endpoint_id!r} has no "
                    f"queue topic {queue!r}, so it holds no task to cancel"
                )
            if refusal is not None:
                self._dead_letter(plan, record, refusal, CANCEL_REFUSED_ERROR_TYPE, cancel.task_id)
                self.stats.cancels_refused += 1
                log.info("router: refused a cancel of task %s: %s", cancel.task_id, refusal)
                continue
            plan.dispatches.append(
                Outgoing(
                    queue,
                    cancel.task_id.encode(),
                    record.value or b"",
                    _forwarded_headers(record.headers),
                )
            )
            # And to held-tasks, under the task's key (so after its held record, if it is
            # held): the dependencies processor cancels a held task, and clears the cancel
            # of any other (issue 15). The router does not know which tasks are held.
            plan.dispatches.append(
                Outgoing(self._catalogue.held_tasks, cancel.task_id.encode(), record.value or b"")
            )
            self.stats.cancels_forwarded += 1

    def _plan_one(
        self, plan: RoutePlan, decision: _Decision, now: float, results_present: set[str]
    ) -> None:
        if decision.refusal is None and decision.submission.unresolved():
            self._plan_held(plan, decision.record, decision.submission, now)
        elif decision.refusal is None:
            self._plan_routed(plan, decision.record, decision.submission, decision.endpoint, now)
        else:
            self._plan_refused(plan, decision, now, results_present)

    def _decide(self, record: RawRecord, submission: TaskSubmission) -> _Decision:
        function = self._view.function(submission.function_id)
        user = self._view.user(submission.user_id)
        candidates = submission.candidates()
        for endpoint_id in candidates:
            # Every candidate: a group never reaches an endpoint the user may not use.
            refusal = refusal_reason(
                submission,
                user,
                function,
                self._view.endpoint(endpoint_id),
                endpoint_id=endpoint_id,
            )
            if refusal is not None:
                return _Decision(record, submission, refusal)
        changed = _code_changed(submission, function)
        if changed is not None:
            self.stats.functions_changed += 1
            return _Decision(record, submission, changed, DeadLetterReason.FUNCTION_CHANGED)
        if len(candidates) == 1:
            return _Decision(record, submission, None, endpoint_id=candidates[0])
        try:
            choice = self.placement.choose(submission, function, candidates)
        except Exception:  # a bug in placement must cost the task its best choice, no more
            log.exception("router: placement failed for task %s", submission.task_id)
            choice = Choice(tie_break(submission.task_id, candidates), "placement failed")
        log.debug(
            "router: task %s to %s of %s (%s)",
            submission.task_id,
            choice.endpoint_id,
            candidates,
            choice.reason,
        )
        return _Decision(record, submission, None, endpoint_id=choice.endpoint_id)

    def _has_unknown(self, submission: TaskSubmission) -> bool:
        return (
            self._view.user(submission.user_id) is None
            or self._view.function(submission.function_id) is None
            or any(self._view.endpoint(e) is None for e in submission.candidates())
        )

    def _cancel_has_unknown(self, cancel: TaskCancel) -> bool:
        return (
            self._view.user(cancel.user_id) is None
            or self._view.endpoint(cancel.endpoint_id) is None
        )

    async def _catch_up(self) -> None:
        """Wait until the view has read what the registry topics hold right now:
        a function registered a moment before its first submission may not be in it yet."""
        self.stats.catch_ups += 1
        await self._follower.catch_up()

    async def _refuse_unroutable(self, decisions: list[_Decision]) -> list[_Decision]:
        """Refuse allowed tasks that cannot be delivered: no queue topic, or too large."""
        present = await self._directory.present(
            self._catalogue.endpoint_queue(d.endpoint) for d in decisions if d.refusal is None
        )
        checked: list[_Decision] = []
        for d in decisions:
            reason = d.refusal
            if reason is None:
                reason = self._unroutable(d, present)
            checked.append(_Decision(d.record, d.submission, reason, d.error_type, d.endpoint_id))
        return checked

    def _unroutable(self, decision: _Decision, present: set[str]) -> str | None:
        submission = decision.submission
        queue = self._catalogue.endpoint_queue(decision.endpoint)
        if queue not in present:
            return (
                f"endpoint {decision.endpoint!r} has no queue topic {queue!r}: "
                "ask the operator to re-register the endpoint (POST /v1/endpoints creates it)"
            )
        size = len(decision.record.value or b"")
        # The dispatch as it will be written: the submission, the routing fields around
        # it, the key and the forwarded headers.
        wire = record_bytes(
            submission.task_id.encode(), None, _forwarded_headers(decision.record.headers)
        ) + _dispatch_bytes(submission, decision.endpoint, size)
        if wire > self._queue_limit:
            return (
                f"the task is {size:,} bytes ({wire:,} as routed, with its headers), too "
                f"large for an endpoint queue (max.message.bytes {self._queue_limit:,}): pass "
                "large arguments by reference (a client with a store sends them so)"
            )
        return None

    # --- what to write -------------------------------------------------------------------

    def _plan_routed(
        self,
        plan: RoutePlan,
        record: RawRecord,
        submission: TaskSubmission,
        endpoint_id: str,
        now: float,
    ) -> None:
        key = submission.task_id.encode()
        dispatch = TaskDispatch(
            task_id=submission.task_id,
            endpoint_id=endpoint_id,
            # The topic's user (plan() dead-lettered any other) and the digest
            # _code_changed checked against the registry: facts the agent trusts.
            user_id=submission.user_id,
            function_sha256=submission.function_sha256,
            routed_at=now,
            # Always 1: a task is routed once, to one endpoint (a retry is a redelivery
            # within its queue), which is what lets its stamp stand for the routing.
            attempt=1,
            submission=record.value or b"",
            routing_stamp=self._stamp(submission, endpoint_id),
        )
        state = _state(
            submission,
            TaskStateName.ROUTED,
            now,
            TaskTimings(submitted_at=submission.submitted_at, routed_at=now),
            endpoint_id=endpoint_id,
        )
        plan.first.append(Outgoing(self._catalogue.task_state, key, encode(state)))
        plan.dispatches.append(
            Outgoing(
                self._catalogue.endpoint_queue(endpoint_id),
                key,
                encode(dispatch),
                _forwarded_headers(record.headers),
            )
        )
        self.stats.routed += 1

    def _stamp(self, submission: TaskSubmission, endpoint_id: str) -> str:
        """The routing stamp of ``submission`` routed to ``endpoint_id`` (its user is the
        topic's, its function the one authorised), with the latest good signing key."""
        return self.keys.stamp(
            task_id=submission.task_id,
            endpoint_id=endpoint_id,
            user_id=submission.user_id,
            function_id=submission.function_id,
        )

    def _plan_held(
        self, plan: RoutePlan, record: RawRecord, submission: TaskSubmission, now: float
    ) -> None:
        """Hold an authorised task until its parents succeed (the dependencies processor
        releases or fails it): its held record and its ``waiting-for-parents`` state."""
        key = submission.task_id.encode()
        held = HeldTask(
            task_id=submission.task_id,
            user_id=submission.user_id,
            depends_on=list(submission.depends_on),
            held_at=now,
            submission=record.value or b"",
        )
        state = _state(
            submission,
            TaskStateName.WAITING_FOR_PARENTS,
            now,
            TaskTimings(submitted_at=submission.submitted_at),
        )
        plan.first.append(Outgoing(self._catalogue.task_state, key, encode(state)))
        plan.first.append(
            Outgoing(
                self._catalogue.held_tasks,
                key,
                encode(held),
                _forwarded_headers(record.headers),
            )
        )
        self.stats.held += 1

    def _plan_refused(
        self, plan: RoutePlan, decision: _Decision, now: float, results_present: set[str]
    ) -> None:
        submission, reason = decision.submission, decision.refusal or ""
        key = submission.task_id.encode()
        error = TaskError(type=REJECTED_ERROR_TYPE, message=reason)
        timings = TaskTimings(submitted_at=submission.submitted_at)
        results = self._catalogue.results(submission.user_id)
        if results in results_present:
            result = TaskResult(
                task_id=submission.task_id,
                user_id=submission.user_id,
                function_id=submission.function_id,
                endpoint_id=submission.endpoint_id,
                task_group_id=submission.task_group_id,
                outcome="error",
                error=error,
                timings=timings,
                tags=submission.tags,
            )
            plan.first.append(Outgoing(results, key, encode(result)))
        state = _state(submission, TaskStateName.REJECTED, now, timings, error=error)
        plan.first.append(Outgoing(self._catalogue.task_state, key, encode(state)))
        self._dead_letter(plan, decision.record, reason, decision.error_type, submission.task_id)
        self.stats.rejected += 1
        log.info("router: refused task %s: %s", submission.task_id, reason)

    def _dead_letter(
        self,
        plan: RoutePlan,
        record: RawRecord,
        reason: str,
        error_type: DeadLetterReason,
        task_id: str | None = None,
    ) -> None:
        letter = dead_letter_for(
            record, reason=reason, error_type=error_type, component=COMPONENT, task_id=task_id
        )
        plan.first.append(
            Outgoing(self._catalogue.dead_letter, letter.original_key, encode(letter))
        )
        self.stats.dead_lettered += 1
        if error_type not in (
            DeadLetterReason.REJECTED,
            DeadLetterReason.CANCEL_REFUSED,
            DeadLetterReason.FUNCTION_CHANGED,
        ):
            log.warning(
                "router: dead-lettered %s[%d]@%d: %s",
                record.topic,
                record.partition,
                record.offset,
                reason,
            )


def _state(
    submission: TaskSubmission,
    name: TaskStateName,
    now: float,
    timings: TaskTimings,
    *,
    error: TaskError | None = None,
    endpoint_id: str | None = None,
) -> TaskState:
    return TaskState(
        task_id=submission.task_id,
        user_id=submission.user_id,
        function_id=submission.function_id,
        endpoint_id=submission.endpoint_id if endpoint_id is None else endpoint_id,
        task_group_id=submission.task_group_id,
        state=name,
        updated_at=now,
        timings=timings,
        error=error,
        tags=submission.tags,
    )


def _dispatch_bytes(submission: TaskSubmission, endpoint_id: str, submission_bytes: int) -> int:
    """The encoded size of the dispatch of a submission of ``submission_bytes`` bytes (with
    the longest routing stamp: a few bytes more than its real one, and no HMAC spent)."""
    empty = TaskDispatch(
        task_id=submission.task_id,
        endpoint_id=endpoint_id,
        user_id=submission.user_id,
        function_sha256=submission.function_sha256,
        routed_at=0.0,
        attempt=1,
        submission=b"",
        routing_stamp="x" * ROUTING_STAMP_MAX_CHARS,
    )
    # msgpack's bin header grows from 2 to at most 5 bytes with the payload's length.
    return len(encode(empty)) + submission_bytes + 5


def _code_changed(submission: TaskSubmission, function: FunctionRecord | None) -> str | None:
    """Why a submission's pinned digest does not match the registered code, or None."""
    if function is None or function.code_sha256 == submission.function_sha256:
        return None
    return (
        f"function {submission.function_id!r} has changed since this task was prepared: its "
        f"code's SHA-256 is now {function.code_sha256}, the task was pinned to "
        f"{submission.function_sha256}. Fetch the function again (Client.get_function) and "
        "submit anew if you trust the new code"
    )


def _forwarded_headers(headers: object) -> list[tuple[str, bytes]] | None:
    # Headers (e.g. trace context) travel with the task; null-valued ones carry nothing.
    pairs = [(name, value) for name, value in normalise_headers(headers) if value is not None]
    return pairs or None
