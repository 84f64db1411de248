"""The router's Kafka loop: each batch's writes and its input offsets in one transaction.

It reads every user's ``from.user.<user>`` topic (the users its registry view holds, by
an explicit subscription kept current, :class:`~fxstream.service.subscription.TopicFeed`:
a user registered after start is picked up within a second, without a restart;
``read_committed``) in batches of whatever has
arrived (``getmany``: a lone task is not held back to fill a batch, and under
load the batch grows while the previous transaction commits), asks the
:class:`~fxstream.service.router.Router` what to write, and then, in one Kafka
transaction, writes every record of the plan (states, dispatches, refusals,
dead letters) and commits the batch's offsets. A crash therefore leaves either
the whole batch routed and acknowledged, or nothing visible to
``read_committed`` readers (agents, the SDK, task-state) and the batch re-read.
The ``routed`` state and the dispatch become visible together, so a task's
result can never overtake its ``routed`` state.

When Kafka refuses one record of the batch for a reason of its own (a dispatch
over the endpoint queue's ``max.message.bytes``, a topic deleted meanwhile:
:func:`~fxstream.service.outgoing.refuses_record`), the transaction is aborted
and the culprit found by bisection: halves of the batch's tasks are written in
probe transactions that are always aborted (so never visible), down to the
task(s) whose records Kafka refuses. The batch is then committed without them,
each culprit refused instead (:meth:`Router.refuse`: an error result naming
the limit, a ``rejected`` state, a dead letter). If even that is refused, the
culprit is only dead-lettered, and at last dead-lettered without its value.
After each refusal the producer is replaced (same transactional id, new
epoch): the broker never took the refused batch's sequence numbers, and the
old producer's next transaction would fail with OutOfOrderSequenceNumber.
The router thus never stops for a record; it exits only when the broker
fails (below).

Why not faust's own ``processing_guarantee="exactly_once"``: faust commits its
transactions on the commit interval (seconds) with one transactional producer
per input partition, so every task would wait that long at this hop, and
faust's per-event cost (about 100 µs) alone held the router near 5,000
tasks/s. This loop runs inside the faust app as a task (beside the task-state
follower), with aiokafka's transactional producer. Its transactional id is
stable (``<app id>-router-<instance>``): a restarted router fences the previous
instance, whose open transaction is aborted.

Several routers (or ingresses) run as one consumer group, each with its own
``instance`` and so its own transactional id; Kafka spreads the input partitions over
them. A rebalance hands a partition over only between batches
(:class:`~fxstream.service.rebalance.PartitionGuard`): the batch in hand is committed
(or aborted) before its partitions are given up, and the partitions are let go only
once the group coordinator returns the offsets of the last transaction (a committed
transaction's offsets become visible when its markers are written, just after the
commit returns). The next owner, which starts from the committed offsets, therefore
never routes a record the previous owner routed or is still committing.
A *zombie* is the remaining danger: a router that stood still (SIGSTOP, a paused VM)
longer than its consumer session, whose partitions the group gave to another router
meanwhile, and which then commits a batch it held. Kafka's answer (KIP-447: the group's
generation sent with the transaction's offsets, so the broker refuses a stale member's
commit) is not in aiokafka 0.14, whose TxnOffsetCommit is version 0. So the loop watches
itself (:class:`~fxstream.service.rebalance.StallWatch`): a batch taken or held across
a stall of half the session timeout or more, or committed within half a session of one,
is aborted just before its commit, and re-read from its first offset instead (by this
router if it still owns the partitions, else, once the consumer has learnt from its next
heartbeat that they moved, by their new owner); so is a batch whose consumer learnt,
while the batch was in hand, that the group had dropped it
(:func:`~fxstream.service.rebalance.group_generation` changed). What stays open is a
stall in the instant between those checks and the commit request reaching the broker,
and a router cut off from its group coordinator alone, still committing through the
transaction coordinator before a heartbeat gets through: docs/faults.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.errors import (  # type: ignore[import-untyped]
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)

from fxstream.service.batch_loop import StoppableLoop, offsets_after
from fxstream.service.metrics import PROCESSOR_METRICS
from fxstream.service.outgoing import Outgoing, Refused, refuses_record
from fxstream.service.quarantine import (
    OUTPUT_REFUSED,
    dead_letters_for_refused,
    refusal_reason,
)
from fxstream.service.rebalance import PartitionGuard, StallWatch, group_generation
from fxstream.service.router import COMPONENT, RoutePlan
from fxstream.service.subscription import FEED_METADATA_MAX_AGE_MS, TopicFeed, follow
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    RawRecord,
    aiokafka_max_batch_size,
    aiokafka_max_request_size,
    dead_letter,
    encode,
)
from fxstream.topics.partitioner import Murmur2Partitioner

__all__ = ["EXIT_WRITE_FAILED", "Planner", "RouterLoop"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL: Kafka refused a write; restarting (by a supervisor) is the cure.
EXIT_WRITE_FAILED = 75
# Tries of one batch's transaction before the router gives up and exits.
COMMIT_ATTEMPTS = 6
# The routers' consumer session: a router silent this long is replaced in its group.
SESSION_TIMEOUT_MS = 10_000
# How long a rebalance waits for the last transaction's offsets to become visible.
HANDOVER_S = 30.0
# Rounds of setting culprits aside: refuse them, then dead-letter them, then
# dead-letter them without their value.
QUARANTINE_ROUNDS = 3


class _Stalled(Exception):
    """The batch was held across a stall of the process: abort it, do not commit it."""


class Planner(Protocol):
    """What a transactional loop asks what to write: the router, or the ingress."""

    async def start(self) -> None:
        """Get ready (catch up with what the planner reads) before the first batch."""

    async def plan(self, records: Sequence[RawRecord]) -> RoutePlan:
        """What to write for a batch of input records."""
        ...

    async def refuse(
        self, records: Sequence[RawRecord], reasons: Mapping[bytes | None, str]
    ) -> RoutePlan:
        """What to write instead for ``records`` whose outputs Kafka refused."""
        ...


class RouterLoop(StoppableLoop):
    """Routes every ``from.user.<user>`` topic until :meth:`stop`, one transaction per batch."""

    name = "router"

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        router: Planner,
        *,
        topics: TopicFeed,
        group_id: str,
        instance: str = "0",
        batch_size: int = 500,
        metadata_max_age_ms: int = FEED_METADATA_MAX_AGE_MS,
        fetch_max_wait_ms: int = 500,
        component: str = COMPONENT,
    ) -> None:
        """``topics`` says which topics to read (the users' ``from.user`` for the router);
        the subscription follows it between batches."""
        super().__init__()
        # The ingress and the trigger processor reuse this loop (another planner, feed
        # and name).
        self.name = component
        self._feed = topics
        self._subscribed: frozenset[str] = frozenset()
        self._catalogue = catalogue
        self._router = router
        self._group_id = group_id
        self._batch_size = batch_size
        self.transactional_id = f"{group_id}-{instance}"
        largest = max(spec.max_message_bytes for spec in catalogue.specs)
        self._consumer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "group_id": group_id,
            "client_id": group_id,
            "enable_auto_commit": False,
            # A new group must start from the oldest task, not skip queued ones.
            "auto_offset_reset": "earliest",
            # Never route a submission whose producer aborted it.
            "isolation_level": "read_committed",
            "max_partition_fetch_bytes": largest + 65_536,
            # Only to follow leaders: the feed, not this timer, brings new topics in.
            "metadata_max_age_ms": metadata_max_age_ms,
            # How long the broker may hold a fetch with nothing (committed) to return.
            "fetch_max_wait_ms": fetch_max_wait_ms,
            "session_timeout_ms": SESSION_TIMEOUT_MS,
            "heartbeat_interval_ms": SESSION_TIMEOUT_MS // 3,
        }
        self._producer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "client_id": group_id,
            "transactional_id": self.transactional_id,
            "enable_idempotence": True,
            # Kafka's murmur2 placement, in C (fxstream.topics.partitioner).
            "partitioner": Murmur2Partitioner(),
            "acks": "all",
            # aiokafka's default (1 MB) is below the catalogue's largest record.
            "max_request_size": aiokafka_max_request_size(catalogue),
            # Its 16 kB per-partition batches hold ~35 dispatches: a batch of tasks
            # would take many produce requests instead of one. No larger than the
            # smallest topic's limit, which the broker applies to a whole batch.
            "max_batch_size": aiokafka_max_batch_size(catalogue),
            # A send stuck on a partition without a leader fails well inside the
            # transaction timeout (60 s), so the batch is aborted and retried by this
            # loop, not timed out (and fenced) by the coordinator.
            "request_timeout_ms": 30_000,
        }
        self._producer: Any = None
        self.guard = PartitionGuard(f"{component} {instance}", on_revoked=self._hand_over)
        # The offsets the last committed transaction wrote (see _hand_over).
        self._last_offsets: dict[Any, int] = {}
        # A batch held across a stall this long is not committed (see the module).
        self.stall_watch = StallWatch(SESSION_TIMEOUT_MS / 2_000)
        self._batch_taken_at = 0.0
        self._batch_starts: dict[Any, int] = {}
        self._batch_generation: int | None = None
        self.abandoned = 0
        self.batches = 0
        self.quarantined = 0

    async def run(self) -> None:
        """Route until :meth:`stop`; exits the process if Kafka refuses a transaction."""
        # aiokafka binds its clients to the running loop, so they are made here.
        self._producer = AIOKafkaProducer(**self._producer_settings)
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        watch = asyncio.create_task(self.stall_watch.run())
        try:
            await self._router.start()
            await self._producer.start()
            await self._consumer.start()
            await self._feed.start()
            while not self._stopping.is_set():
                await self.follow_feed()
                if not self._subscribed:
                    # Nothing to read yet: aiokafka's getmany would wait for an assignment
                    # past any timeout (and a stop with it).
                    await asyncio.sleep(0.2)
                    continue
                self._batch_taken_at = time.monotonic()
                fetched = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
                if not fetched:
                    continue
                self._batch_starts = {tp: rs[0].offset for tp, rs in fetched.items() if rs}
                self._batch_generation = group_generation(self._consumer)
                # Partitions are given up only once the batch is committed (or aborted).
                async with self.guard.batch(fetched) as batch:
                    records = [r for partition in batch.values() for r in partition]
                    if records:
                        plan = await self._router.plan(records)
                        await self._commit(
                            [*plan.first, *plan.dispatches], offsets_after(batch), records
                        )
        finally:
            watch.cancel()
            if self._consumer is not None:
                await self._consumer.stop()
            if self._producer is not None:
                await self._producer.stop()
            await asyncio.to_thread(self._feed.close)
            self._done.set()

    async def follow_feed(self) -> None:
        """Subscribe to what the feed names now, if it is due and that changed (between
        batches only)."""
        self._subscribed = await follow(
            self._consumer, self._feed, self._subscribed, self.guard, self.name
        )

    async def _commit(
        self,
        records: Sequence[Outgoing],
        offsets: dict[Any, int],
        inputs: Sequence[RawRecord] = (),
    ) -> None:
        """Write ``records`` and commit ``offsets`` in one transaction.

        A transaction that fails on a retriable error (a partition changing leader
        when a broker dies, a request timing out) is aborted and the same batch is
        tried again, up to ``COMMIT_ATTEMPTS`` times. A fenced producer (the
        coordinator timed the transaction out) is replaced by a new one. A record
        Kafka refuses sets its task aside (:meth:`_quarantine`) and the rest of the
        batch is committed. Persistent failure exits the process: the batch was
        never committed, so nothing is lost.
        """
        attempt = 0
        rounds = 0
        while True:
            attempt += 1
            try:
                await self._transact(records, offsets)
            except _Stalled:
                await self._abandon(offsets, len(inputs))
                return
            except TransactionalIdAuthorizationFailed:
                self._exit(f"{self.name}: Kafka does not allow this router's transactional id")
            except ProducerFenced:
                if attempt >= COMMIT_ATTEMPTS:
                    self._exit(f"{self.name}: fenced again and again; another router has this id")
                # A transaction the coordinator timed out fences its producer too; a new
                # producer (fencing any zombie with this id in turn) carries on.
                log.warning("router: producer fenced; starting a new one", exc_info=True)
                await self._restart_producer()
            except Exception as exc:
                if refuses_record(exc) and rounds < QUARANTINE_ROUNDS:
                    rounds += 1
                    attempt -= 1  # the record's fault, not the broker's
                    try:
                        # The refused batch used up sequence numbers the broker never
                        # accepted: without a new producer (new epoch) the next
                        # transaction fails with OutOfOrderSequenceNumber.
                        await self._restart_producer()
                        records = await self._quarantine(records, inputs, exc, rounds)
                    except Exception:
                        # The broker failed while probing, or no single task is at fault.
                        self._exit(f"{self.name}: cannot set aside the records Kafka refused")
                    continue
                if attempt >= COMMIT_ATTEMPTS or not getattr(exc, "retriable", True):
                    self._exit(f"{self.name}: cannot commit a batch to Kafka")
                log.warning(
                    "%s: batch transaction failed (%r), aborted; retry %d of %d",
                    self.name,
                    exc,
                    attempt,
                    COMMIT_ATTEMPTS - 1,
                )
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            else:
                self.batches += 1
                self._last_offsets = dict(offsets)
                PROCESSOR_METRICS.batch(self.name, self._catalogue, len(inputs), records)
                return

    def _superseded(self) -> bool:
        """True if the group may have given the batch's partitions to another router: the
        consumer learnt it was dropped (its generation changed), or the process stood
        still while taking or holding the batch, or so recently that the consumer may
        not have learnt yet (its next heartbeat tells it)."""
        if group_generation(self._consumer) != self._batch_generation:
            return True
        recent = time.monotonic() - SESSION_TIMEOUT_MS / 2_000
        return self.stall_watch.stalled_since(min(self._batch_taken_at, recent))

    async def _abandon(self, offsets: dict[Any, int], count: int) -> None:
        """Re-read a batch held across a stall from its first offset; it was aborted."""
        self.abandoned += 1
        log.warning(
            "%s: the process stood still, or the group dropped it, while it held a batch "
            "of %d record(s); its partitions may be another router's by now, so the batch "
            "was aborted, not committed, and is read again",
            self.name,
            count,
        )
        for tp, first in self._batch_starts.items():
            if tp in offsets:
                with contextlib.suppress(Exception):  # not ours any more: its owner reads it
                    self._consumer.seek(tp, first)
        # Time for the consumer's next heartbeat to say whether the partitions moved.
        await asyncio.sleep(0.5)

    async def _hand_over(self, revoked: frozenset[Any]) -> None:
        """Give ``revoked`` up once the coordinator returns what the last transaction
        committed for them (its offsets are pending until its markers are written; a new
        owner fetching them before that would start from the previous offsets and route
        the batch again: aiokafka 0.14 cannot ask for stable offsets, KIP-447)."""
        pending = {tp: offset for tp, offset in self._last_offsets.items() if tp in revoked}
        self._last_offsets = {}
        deadline = time.monotonic() + HANDOVER_S
        while pending:
            found = await asyncio.gather(*(self._consumer.committed(tp) for tp in pending))
            pending = {
                tp: offset
                for (tp, offset), committed in zip(pending.items(), found, strict=True)
                if committed is None or committed < offset
            }
            if not pending:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "%s: the last transaction's offsets of %d partition(s) are still not "
                    "visible after %.0f s; giving them up anyway",
                    self.name,
                    len(pending),
                    HANDOVER_S,
                )
                return
            await asyncio.sleep(0.01)

    async def _learn_topics(self, records: Sequence[Outgoing]) -> None:
        # aiokafka 0.14 fails a transaction (NotLeaderForPartition, after the whole
        # request timeout) that learns a topic's metadata mid-transaction, as for
        # the first task of an endpoint (or refusal of a user) registered after
        # this producer started. Known topics answer at once.
        for topic in {record.topic for record in records}:
            await self._producer.partitions_for(topic)

    async def _transact(self, records: Sequence[Outgoing], offsets: dict[Any, int]) -> None:
        await self._learn_topics(records)
        async with self._producer.transaction():
            sent = [
                await self._producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                for r in records
            ]
            await asyncio.gather(*sent)
            await self._producer.send_offsets_to_transaction(offsets, self._group_id)
            if self._superseded():
                raise _Stalled  # aborts the transaction (see the module)

    async def _probe(self, records: Sequence[Outgoing]) -> BaseException | None:
        """Write ``records`` in a transaction that is always aborted; Kafka's refusal, if any.

        Raises any other failure (the broker's).
        """
        await self._producer.begin_transaction()
        refused: BaseException | None = None
        try:
            sent = [
                await self._producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                for r in records
            ]
            await asyncio.gather(*sent)
        except Exception as exc:
            if not refuses_record(exc):
                raise
            refused = exc
        finally:
            await self._producer.abort_transaction()
        if refused is not None:
            await self._restart_producer()  # sequence numbers, as in _commit
        return refused

    async def _bisect(
        self,
        groups: list[tuple[bytes | None, list[Outgoing]]],
        culprits: dict[bytes | None, Refused],
        error: BaseException | None = None,
    ) -> None:
        """Find the groups (a task's records) Kafka refuses; ``error`` when the whole is
        already known to fail with it."""
        if error is None:
            error = await self._probe([r for _, group in groups for r in group])
            if error is None:
                return
        if len(groups) == 1:
            key, group = groups[0]
            # The task's record Kafka refused is not named; its largest is the suspect.
            culprits[key] = Refused(max(group, key=lambda r: len(r.value)), error)
            return
        middle = len(groups) // 2
        await self._bisect(groups[:middle], culprits)
        await self._bisect(groups[middle:], culprits)

    async def _quarantine(
        self,
        records: Sequence[Outgoing],
        inputs: Sequence[RawRecord],
        error: BaseException,
        rounds: int,
    ) -> list[Outgoing]:
        """The batch's records without those of the tasks Kafka refuses, plus what to
        write for those tasks instead (round 1: a refusal; 2: a dead letter; 3: a dead
        letter without the original value)."""
        groups: dict[bytes | None, list[Outgoing]] = {}
        for record in records:
            groups.setdefault(record.key, []).append(record)
        culprits: dict[bytes | None, Refused] = {}
        missing = await self._missing_topics(records)
        for key, group in groups.items():
            gone = [r for r in group if r.topic in missing]
            if gone:
                culprits[key] = Refused(gone[0], missing[gone[0].topic])
        rest = [(key, group) for key, group in groups.items() if key not in culprits]
        if rest:
            await self._bisect(rest, culprits, None if culprits else error)
        if not culprits:
            # Every task alone is accepted, only the batch as a whole is not.
            raise error
        self.quarantined += len(culprits)
        kept = [r for r in records if r.key not in culprits]
        suspects = [r for r in inputs if r.key in culprits]
        log.error(
            "%s: Kafka refused the records of %d task(s) (%r); setting them aside "
            "(round %d of %d) and committing the rest of the batch",
            self.name,
            len(culprits),
            error,
            rounds,
            QUARANTINE_ROUNDS,
        )
        if rounds == 1:
            reasons = {
                key: refusal_reason(self._catalogue, self.name, refused)
                for key, refused in culprits.items()
            }
            plan = await self._router.refuse(suspects, reasons)
            return [*kept, *plan.first, *plan.dispatches]
        refused = list(culprits.values())
        if rounds == 2:
            return [
                *kept,
                *dead_letters_for_refused(self._catalogue, self.name, refused, suspects),
            ]
        return [*kept, *self._bare_dead_letters(suspects, culprits)]

    def _bare_dead_letters(
        self, suspects: Sequence[RawRecord], culprits: dict[bytes | None, Refused]
    ) -> list[Outgoing]:
        letters = []
        for record in suspects:
            reason = refusal_reason(self._catalogue, self.name, culprits[record.key])
            letter = dead_letter(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=record.key,
                value=None,
                reason=reason + " (neither a refusal nor the original value could be written)",
                error_type=OUTPUT_REFUSED,
                component=self.name,
            )
            letters.append(Outgoing(self._catalogue.dead_letter, record.key, encode(letter)))
        return letters

    async def _missing_topics(self, records: Sequence[Outgoing]) -> dict[str, BaseException]:
        """Topics of ``records`` Kafka does not know (deleted since the router checked)."""
        missing: dict[str, BaseException] = {}
        for topic in {record.topic for record in records}:
            try:
                await self._producer.partitions_for(topic)
            except Exception as exc:
                if not refuses_record(exc):
                    raise
                missing[topic] = exc
        return missing

    async def _restart_producer(self) -> None:
        try:
            await self._producer.stop()
        except Exception:  # already broken: it is replaced either way
            log.debug("%s: stopping the fenced producer failed", self.name, exc_info=True)
        self._producer = AIOKafkaProducer(**self._producer_settings)
        await self._producer.start()

    def _exit(self, message: str) -> NoReturn:
        # Exit at once: the transaction is aborted (or was never committed), so the
        # batch is re-read by the next router; nothing of it is visible or lost.
        log.critical("%s; exiting", message, exc_info=True)
        logging.shutdown()
        os._exit(EXIT_WRITE_FAILED)
