"""The ingress: check what each endpoint reports, and forward only what it may say.

An endpoint's agent writes one topic only, ``from.ep.<endpoint>`` (the broker lets
no other principal write it, and lets the endpoint write nothing else that anyone
trusts). The ingress reads all of them by pattern (a new endpoint's topic is picked
up within ``metadata_max_age_ms``) and, for each record, checks it against the
endpoint ``E`` of the topic it is on:

- a :class:`~fxstream.topics.TaskResult` or :class:`~fxstream.topics.TaskEvent`
  only for a task the router routed to ``E``, naming ``E`` and the task's own
  user and function; it goes to ``results.<user>`` (the user the task was routed
  for, not the one the record names) or ``task-events``;
- a :class:`~fxstream.topics.Heartbeat`, :class:`~fxstream.topics.EndpointLogs` or
  :class:`~fxstream.topics.WarmAdvert` only for ``E``; a
  :class:`~fxstream.topics.DataLocation` only at site ``E``; they go to ``heartbeats``,
  ``endpoint-logs``, ``warm``, ``data-locations``;
- the agent's own :class:`~fxstream.topics.DeadLetter` records go to
  ``dead-letter`` (operators read them; nothing acts on them).

Each record's key must be the one its shared topic is keyed by (the task id, the
endpoint id, ``<endpoint>/<manager>``, the object key): a compacted topic keeps
the latest record per key, so a foreign key could overwrite another endpoint's
advert. Anything else is dead-lettered (``NotRoutedHere``, ``IdentityMismatch``,
``RecordDecodeError``) and forwarded nowhere, so no SDK, task-state or liveness
reader ever sees it.

Where the routing fact lives: the router writes a task's ``routed`` state (with
its endpoint and user) to ``task-state`` in the same transaction as its dispatch,
so by the time any agent can answer a task, that fact is committed. The ingress
follows ``task-state`` with the same :class:`~fxstream.service.registry.RegistryView`
the API uses (states on disk in RocksDB, memory bounded by its settings, not by the
number of tasks) and looks each task up there: no second copy of the routing
table, no join against the dispatch topics (which hold the payloads). A task the
view does not know yet makes it wait until the view has read what ``task-state``
held at that moment, however long a loaded machine makes that (a lagging view once
turned valid results into ``NotRoutedHere`` dead letters under a steady 350 tasks/s);
only partitions that grew since the last completed wait are waited for, so a flood of
forged task ids costs one end-offset request each while the view is current.

The writes of a batch and its input offsets are one Kafka transaction (the
router's loop, :class:`~fxstream.service.router_loop.RouterLoop`, with this
planner): a crash forwards a batch entirely or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxstream.service.outgoing import Outgoing
from fxstream.service.quarantine import OUTPUT_REFUSED
from fxstream.service.registry import RegistryView
from fxstream.service.router import RoutePlan
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import (
    Catalogue,
    DataLocation,
    DeadLetter,
    DeadLetterReason,
    EndpointLogs,
    Heartbeat,
    RawRecord,
    RecordDecodeError,
    TaskEvent,
    TaskResult,
    TaskState,
    TaskStateName,
    WarmAdvert,
    dead_letter_for,
    decode_any,
    encode,
    normalise_headers,
    record_kind,
)

__all__ = ["COMPONENT", "Ingress", "IngressStats"]

log = logging.getLogger(__name__)

COMPONENT = "ingress"
# A task in these states was never dispatched: no endpoint may answer it.
_NOT_DISPATCHED = frozenset(
    {TaskStateName.SUBMITTED, TaskStateName.REJECTED, TaskStateName.WAITING_FOR_PARENTS}
)


@dataclass
class IngressStats:
    """Counts since start, logged at shutdown."""

    forwarded: int = 0
    not_routed_here: int = 0
    identity_mismatches: int = 0
    dead_lettered: int = 0
    catch_ups: int = 0


class Ingress:
    """Plans, per batch of ``from.ep.<endpoint>`` records, what to forward and what to refuse."""

    def __init__(
        self,
        catalogue: Catalogue,
        states: RegistryView,
        directory: TopicDirectory,
        *,
        catch_up_s: float = 2.0,
    ) -> None:
        """``states`` must follow ``task-state`` (``follow=("task-state",)``)."""
        self._catalogue = catalogue
        self._states = states
        self._directory = directory
        self._follower = ViewFollower(
            states,
            directory,
            (catalogue.task_state,),
            name="ingress",
            catch_up_s=catch_up_s,
            start_timeout_s=120.0,
        )
        self.stats = IngressStats()

    async def start(self) -> None:
        """Start following task-state and wait until the view holds what it held at start."""
        await self._follower.start()

    def close(self) -> None:
        """Stop following task-state."""
        self._follower.close()

    async def plan(self, records: Sequence[RawRecord]) -> RoutePlan:
        """What to forward (and dead-letter) for a batch of ``from.ep.<endpoint>`` records."""
        plan = RoutePlan()
        decoded: list[tuple[RawRecord, str, object]] = []
        for record in records:
            endpoint = self._catalogue.endpoint_of(record.topic)
            if endpoint is None:
                self._refuse(
                    plan,
                    record,
                    f"topic {record.topic!r} is not an endpoint's topic",
                    DeadLetterReason.IDENTITY_MISMATCH,
                )
                continue
            try:
                decoded.append((record, endpoint, decode_any(record.value)))
            except RecordDecodeError as exc:
                self._refuse(plan, record, str(exc), DeadLetterReason.DECODE_ERROR)
        # A task held for its parents (issue 15) is routed later, by a state the view may
        # not have read yet: like a task it does not know, it makes the view catch up.
        unknown = any(
            isinstance(r, TaskResult | TaskEvent) and _not_yet_routed(self._states.task(r.task_id))
            for _, _, r in decoded
        )
        if unknown:
            await self._catch_up()
        # A user deleted since its task was routed has no results topic: its results are
        # dead-lettered here rather than refused by Kafka mid-transaction.
        present = await self._directory.present(
            self._catalogue.results(state.user_id)
            for _, _, r in decoded
            if isinstance(r, TaskResult) and (state := self._states.task(r.task_id)) is not None
        )
        for record, endpoint, value in decoded:
            try:
                self._plan_one(plan, record, endpoint, value, present)
            except Exception as exc:  # a bug here must cost one record, not the ingress
                log.exception("ingress: cannot check %s@%d", record.topic, record.offset)
                self._refuse(
                    plan, record, f"ingress failed: {exc!r}", DeadLetterReason.ROUTER_ERROR
                )
        return plan

    async def refuse(
        self, records: Sequence[RawRecord], reasons: Mapping[bytes | None, str]
    ) -> RoutePlan:
        """Dead letters for ``records`` whose forwarded copies Kafka refused (a results
        topic deleted with its user, say)."""
        plan = RoutePlan()
        for record in records:
            reason = reasons.get(record.key, "Kafka refused this record's forwarded copy")
            self._refuse(plan, record, reason, OUTPUT_REFUSED)
        return plan

    # --- one record ----------------------------------------------------------------------

    def _plan_one(
        self, plan: RoutePlan, record: RawRecord, endpoint: str, value: object, present: set[str]
    ) -> None:
        catalogue = self._catalogue
        if isinstance(value, TaskResult | TaskEvent):
            why = self._not_routed_here(value, endpoint)
            if why is not None:
                reason, kind = why
                self._refuse(plan, record, reason, kind, value.task_id)
                return
            state = self._states.task(value.task_id)
            assert state is not None  # checked by _not_routed_here
            topic = (
                catalogue.results(state.user_id)
                if isinstance(value, TaskResult)
                else catalogue.task_events
            )
            if isinstance(value, TaskResult) and topic not in present:
                self._refuse(
                    plan,
                    record,
                    f"the result of task {value.task_id} cannot be delivered: user "
                    f"{state.user_id!r} has no results topic {topic!r} (deleted since the task "
                    "was routed?)",
                    DeadLetterReason.TASK_UNDELIVERABLE,
                    value.task_id,
                )
                return
            self._forward(plan, record, topic, value.task_id)
        elif isinstance(value, Heartbeat):
            if self._claims(plan, record, endpoint, value.endpoint_id, "heartbeat"):
                self._forward(plan, record, catalogue.heartbeats, endpoint)
        elif isinstance(value, EndpointLogs):
            if self._claims(plan, record, endpoint, value.endpoint_id, "log batch"):
                self._forward(plan, record, catalogue.endpoint_logs, endpoint)
        elif isinstance(value, WarmAdvert):
            if self._claims(plan, record, endpoint, value.endpoint_id, "warm advert"):
                self._forward(plan, record, catalogue.warm, f"{endpoint}/{value.manager_id}")
        elif isinstance(value, DataLocation):
            if self._claims(plan, record, endpoint, value.site, "data location's site"):
                self._forward(plan, record, catalogue.data_locations, value.object_key)
        elif isinstance(value, DeadLetter):
            self._forward(plan, record, catalogue.dead_letter, None)
        else:
            self._refuse(
                plan,
                record,
                f"endpoint {endpoint!r} wrote a {record_kind(record.value)!r} record; an endpoint "
                "reports only results, task events, heartbeats, log batches, warm adverts, "
                "data locations and dead letters",
                DeadLetterReason.IDENTITY_MISMATCH,
            )

    def _not_routed_here(
        self, value: TaskResult | TaskEvent, endpoint: str
    ) -> tuple[str, DeadLetterReason] | None:
        what = "result" if isinstance(value, TaskResult) else "task event"
        state = self._states.task(value.task_id)
        if state is None or state.state in _NOT_DISPATCHED or state.endpoint_id != endpoint:
            self.stats.not_routed_here += 1
            return (
                f"endpoint {endpoint!r} sent a {what} for task {value.task_id}, which the "
                "router did not route to it",
                DeadLetterReason.NOT_ROUTED_HERE,
            )
        claimed = (value.endpoint_id, value.user_id, value.function_id)
        if claimed != (endpoint, state.user_id, state.function_id):
            self.stats.identity_mismatches += 1
            return (
                f"a {what} on endpoint {endpoint!r}'s topic for task {value.task_id} names "
                f"endpoint {value.endpoint_id!r}, user {value.user_id!r} and function "
                f"{value.function_id!r}; the task was routed to {state.endpoint_id!r} for "
                f"user {state.user_id!r} to run {state.function_id!r}",
                DeadLetterReason.IDENTITY_MISMATCH,
            )
        return None

    def _claims(
        self, plan: RoutePlan, record: RawRecord, endpoint: str, named: str, what: str
    ) -> bool:
        """True when the record speaks for its own endpoint; else it is dead-lettered."""
        if named == endpoint:
            return True
        self.stats.identity_mismatches += 1
        self._refuse(
            plan,
            record,
            f"endpoint {endpoint!r} sent a {what} naming endpoint {named!r}: an endpoint "
            "reports only for itself",
            DeadLetterReason.IDENTITY_MISMATCH,
        )
        return False

    def _forward(
        self, plan: RoutePlan, record: RawRecord, topic: str, expected_key: str | None
    ) -> None:
        if expected_key is not None and record.key != expected_key.encode():
            self.stats.identity_mismatches += 1
            self._refuse(
                plan,
                record,
                f"a record for {topic!r} must be keyed {expected_key!r}, not {record.key!r} "
                "(a foreign key could replace another's record in a compacted topic)",
                DeadLetterReason.IDENTITY_MISMATCH,
            )
            return
        headers = [(n, v) for n, v in normalise_headers(record.headers) if v is not None]
        plan.first.append(Outgoing(topic, record.key, record.value or b"", headers or None))
        self.stats.forwarded += 1

    def _refuse(
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
        log.warning(
            "ingress: dead-lettered %s[%d]@%d (%s): %s",
            record.topic,
            record.partition,
            record.offset,
            error_type,
            reason,
        )

    async def _catch_up(self) -> None:
        """Wait until the task-state view has read what the topic holds now."""
        self.stats.catch_ups += 1
        await self._follower.catch_up()


def _not_yet_routed(state: TaskState | None) -> bool:
    """True for a task the view holds no routed (or later) state of yet."""
    return state is None or state.state is TaskStateName.WAITING_FOR_PARENTS
