"""The ingress: check what each endpoint reports, and forward only what it may say.

An endpoint's agent writes one topic only, ``from.ep.<endpoint>`` (the broker lets
no other principal write it, and lets the endpoint write nothing else that anyone
trusts). The ingress reads every live endpoint's (subscribed by name from its view of the
endpoint registry, :mod:`fxstream.service.subscription`: a new endpoint's topic is
read within about a second of its registration) and, for each record, checks it against the
endpoint ``E`` of the topic it is on:

- a :class:`~fxstream.topics.TaskResult` or :class:`~fxstream.topics.TaskEvent`
  only naming ``E`` and carrying the router's routing stamp of its task, ``E``, its
  user and its function; it goes to ``results.<user>`` (the user the stamp
  authenticates) or ``task-events``;
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

Where the routing fact lives: in the records themselves. A task is routed once, to one
endpoint, and the router's dispatch carries a *routing stamp*, an HMAC-SHA256 under the
service's key over (task, endpoint, user, function)
(:mod:`fxstream.topics.routing_stamp`); the agent copies it into every result and event
of the task. The ingress recomputes it for ``E`` (the topic's endpoint) and the record's
task, user and function: a valid stamp is the router's word that it routed this task to
``E`` for that user and function, so the record's ``user_id`` names the results topic. A
missing stamp (an agent older than stamps), one under a key the ingress does not hold,
or one for another task, endpoint, user or function is dead-lettered ``NotRoutedHere``
with what is wrong. No view of ``task-state`` and no wait for one: each record is decided
from itself and the keys, in a few microseconds.

The keys are the routing keys file's, re-read when it changes
(:class:`~fxstream.service.routing_keys.RoutingKeyFile`: a look at most once a second).
A stamp under a key id the ingress does not hold makes it look at the file again at once
(one ``stat`` a batch; read only if it changed) before refusing: a router that read a
rotated file first (its new key signing) loses no result to an ingress that has not read
it yet, and a flood of made-up key ids costs a ``stat`` a batch, never a wait.

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
from fxstream.service.router import RoutePlan
from fxstream.service.routing_keys import RoutingKeyFile
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Catalogue,
    DataLocation,
    DeadLetter,
    DeadLetterReason,
    EndpointLogs,
    Heartbeat,
    RawRecord,
    RecordDecodeError,
    RoutingKeys,
    RoutingStampError,
    TaskEvent,
    TaskResult,
    UnknownRoutingKeyError,
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


@dataclass
class IngressStats:
    """Counts since start, logged at shutdown."""

    forwarded: int = 0
    not_routed_here: int = 0
    identity_mismatches: int = 0
    dead_lettered: int = 0


class Ingress:
    """Plans, per batch of ``from.ep.<endpoint>`` records, what to forward and what to refuse."""

    def __init__(
        self,
        catalogue: Catalogue,
        directory: TopicDirectory,
        *,
        keys: RoutingKeyFile | RoutingKeys,
    ) -> None:
        """``keys`` are the service's routing keys: a stamp under any of them verifies
        (the signing key and those retired but still accepted during a rotation). A
        :class:`~fxstream.service.routing_keys.RoutingKeyFile` (what the processors pass)
        is re-read when it changes; fixed :class:`~fxstream.topics.RoutingKeys` never
        change."""
        self._catalogue = catalogue
        self._directory = directory
        self._keys = keys
        self.stats = IngressStats()

    @property
    def keys(self) -> RoutingKeys:
        """The keys stamps are verified with now (the key file looked at if a second has
        passed since the last look)."""
        return self._keys.current() if isinstance(self._keys, RoutingKeyFile) else self._keys

    async def start(self) -> None:
        """Nothing to catch up with: every record is checked on its own (the key ids are
        logged, never the keys)."""
        log.info("ingress: accepting routing stamps of keys %s", ", ".join(self.keys.key_ids))

    def close(self) -> None:
        """Nothing to release."""

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
        # Results and events are checked first: only a routed task's user (the stamp
        # authenticates it) makes the results topics below be looked up.
        keys = self.keys
        verdicts = [self._verdict(keys, value, endpoint) for _, endpoint, value in decoded]
        if isinstance(self._keys, RoutingKeyFile) and any(
            isinstance(v, UnknownRoutingKeyError) for v in verdicts
        ):
            # A key the file may have gained since the last look (a rotation the router
            # read first): look at the file now before refusing.
            keys = self._keys.recheck()
            verdicts = [
                self._verdict(keys, value, endpoint)
                if isinstance(verdict, UnknownRoutingKeyError)
                else verdict
                for (_, endpoint, value), verdict in zip(decoded, verdicts, strict=True)
            ]
        refusals = [
            self._refusal(value, endpoint, verdict)
            for (_, endpoint, value), verdict in zip(decoded, verdicts, strict=True)
        ]
        # A user deleted since its task was routed has no results topic: its results are
        # dead-lettered here rather than refused by Kafka mid-transaction.
        present = await self._directory.present(
            self._catalogue.results(value.user_id)
            for (_, _, value), refusal in zip(decoded, refusals, strict=True)
            if isinstance(value, TaskResult) and refusal is None
        )
        for (record, endpoint, value), refusal in zip(decoded, refusals, strict=True):
            try:
                self._plan_one(plan, record, endpoint, value, refusal, present)
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
        self,
        plan: RoutePlan,
        record: RawRecord,
        endpoint: str,
        value: object,
        refusal: tuple[str, DeadLetterReason] | None,
        present: set[str],
    ) -> None:
        """Forward or refuse one record; ``refusal`` is a result's or event's verdict."""
        catalogue = self._catalogue
        if isinstance(value, TaskResult | TaskEvent):
            if refusal is not None:
                reason, kind = refusal
                self._refuse(plan, record, reason, kind, value.task_id)
                return
            # The stamp authenticated the record's user: the task was routed for them.
            topic = (
                catalogue.results(value.user_id)
                if isinstance(value, TaskResult)
                else catalogue.task_events
            )
            if isinstance(value, TaskResult) and topic not in present:
                self._refuse(
                    plan,
                    record,
                    f"the result of task {value.task_id} cannot be delivered: user "
                    f"{value.user_id!r} has no results topic {topic!r} (deleted since the task "
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

    @staticmethod
    def _verdict(keys: RoutingKeys, value: object, endpoint: str) -> Exception | None:
        """What verifying a result's or event's stamp under ``keys`` raised (None: it
        verified, or ``value`` is neither)."""
        if not isinstance(value, TaskResult | TaskEvent):
            return None
        try:
            keys.verify(
                value.routing_stamp,
                task_id=value.task_id,
                endpoint_id=endpoint,
                user_id=value.user_id,
                function_id=value.function_id,
            )
        except Exception as exc:  # a bug here must cost one record, not the ingress
            return exc
        return None

    def _refusal(
        self, value: object, endpoint: str, verdict: Exception | None
    ) -> tuple[str, DeadLetterReason] | None:
        """Why a result or event must not be forwarded (None: it may; or not one)."""
        if not isinstance(value, TaskResult | TaskEvent):
            return None
        if verdict is not None and not isinstance(verdict, RoutingStampError):
            log.error("ingress: cannot check task %s", value.task_id, exc_info=verdict)
            return f"ingress failed: {verdict!r}", DeadLetterReason.ROUTER_ERROR
        try:
            return self._not_routed_here(value, endpoint, verdict)
        except Exception as exc:  # a bug here must cost one record, not the ingress
            log.exception("ingress: cannot check task %s", value.task_id)
            return f"ingress failed: {exc!r}", DeadLetterReason.ROUTER_ERROR

    def _not_routed_here(
        self, value: TaskResult | TaskEvent, endpoint: str, verdict: RoutingStampError | None
    ) -> tuple[str, DeadLetterReason] | None:
        """Why ``value`` (on ``endpoint``'s topic, its stamp's ``verdict``: None if it
        verified) must not be forwarded, or None."""
        what = "result" if isinstance(value, TaskResult) else "task event"
        if verdict is not None:
            self.stats.not_routed_here += 1
            return (
                f"endpoint {endpoint!r} sent a {what} for task {value.task_id} (user "
                f"{value.user_id!r}, function {value.function_id!r}) that the router did not "
                f"route to it: {verdict}",
                DeadLetterReason.NOT_ROUTED_HERE,
            )
        if value.endpoint_id != endpoint:
            self.stats.identity_mismatches += 1
            return (
                f"a {what} on endpoint {endpoint!r}'s topic for task {value.task_id} names "
                f"endpoint {value.endpoint_id!r}: an endpoint reports only for itself",
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
