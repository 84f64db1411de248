"""Several instances of one processor in a consumer group: partitions change hands between
batches only, and a task's records stay together.

:class:`PartitionGuard` is the consumer's rebalance listener. A processor holds it
(:meth:`PartitionGuard.batch`) from the moment it takes a batch in hand until the batch's
writes and offsets are committed; a rebalance revokes partitions only once that batch is
done. Without it, a rebalance in the middle of a batch hands its partitions to another
instance, which reads their last *committed* offsets (aiokafka 0.14 fetches offsets
without KIP-447's ``require_stable``, so a pending transactional offset commit is not
waited for) and processes the same records again while the first instance is still
committing them: each input written twice. Records a consumer hands back for partitions
it no longer owns (fetched before the revocation) are dropped by :meth:`batch`; their new
owner reads them from the committed offset.

:class:`CoPartitionedAssignor` assigns every subscribed topic's partition ``p`` to the
member owning ``p mod g`` (``g``: the greatest common divisor of the topics' partition
counts). Records keyed by task id land on partition ``hash mod n`` of a topic of ``n``
partitions, so one task's records on topics of 4 and 8 partitions (``results.<user>``,
``task-events``) all go to the same instance, which alone folds that task's state.

:class:`StallWatch` notices the process standing still (SIGSTOP, a paused VM, a blocked
event loop): a consumer that stood still past its session may have had its partitions
given to another instance without knowing it yet (a *zombie*), so a transactional loop
does not commit a batch it held across such a stall (KIP-447 would have the broker refuse
it; aiokafka 0.14 cannot ask for that). :func:`group_generation` tells it when the
consumer has learnt that it was dropped from the group.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import ConsumerRebalanceListener  # type: ignore[import-untyped]
from aiokafka.coordinator.assignors.abstract import (  # type: ignore[import-untyped]
    AbstractPartitionAssignor,
)
from aiokafka.coordinator.protocol import (  # type: ignore[import-untyped]
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

__all__ = [
    "CoPartitionedAssignor",
    "PartitionGuard",
    "StallWatch",
    "co_partitioned",
    "group_generation",
]

log = logging.getLogger(__name__)

# Called with the partitions a rebalance took away, or gave.
PartitionsHook = Callable[[frozenset[Any]], Awaitable[None]]


class PartitionGuard(ConsumerRebalanceListener):  # type: ignore[misc]
    """A consumer's rebalance listener that lets partitions go only between batches.

    ``on_revoked`` and ``on_assigned`` run under the same lock as a batch, after the
    batch in hand is committed: a processor drops state it derived from partitions it
    lost, and reads what the previous owner wrote before it takes new ones.
    """

    def __init__(
        self,
        name: str,
        *,
        on_revoked: PartitionsHook | None = None,
        on_assigned: PartitionsHook | None = None,
    ) -> None:
        self._name = name
        self._lock = asyncio.Lock()
        self._on_revoked = on_revoked
        self._on_assigned = on_assigned
        self.owned: frozenset[Any] = frozenset()
        self.rebalances = 0
        self.dropped = 0

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        """Wait for the batch in hand to be committed, then give the partitions up."""
        async with self._lock:
            gone = frozenset(revoked)
            self.owned = frozenset()
            if gone:
                log.info("%s: giving up %d partition(s)", self._name, len(gone))
            if self._on_revoked is not None and gone:
                await self._on_revoked(gone)

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        """Take the partitions the group assigned (before any batch of them)."""
        async with self._lock:
            taken = frozenset(assigned)
            self.rebalances += 1
            log.info("%s: assigned %d partition(s)", self._name, len(taken))
            if self._on_assigned is not None:
                await self._on_assigned(taken)
            self.owned = taken

    @asynccontextmanager
    async def batch(self, batch: Mapping[Any, list[Any]]) -> AsyncIterator[dict[Any, list[Any]]]:
        """Hold the partitions while the batch is processed and committed.

        Yields the part of a ``getmany`` batch this consumer still owns: records of a
        partition revoked after they were fetched are dropped (their new owner reads them
        again from the last committed offset, and so would this consumer, were the
        partition assigned back: a new assignment restarts from the committed offsets).
        """
        async with self._lock:
            kept = {tp: records for tp, records in batch.items() if tp in self.owned}
            dropped = sum(len(records) for tp, records in batch.items() if tp not in kept)
            if dropped:
                self.dropped += dropped
                log.info(
                    "%s: dropped %d record(s) of partitions given up since they were fetched",
                    self._name,
                    dropped,
                )
            yield kept


def co_partitioned(partition_counts: Mapping[str, int]) -> int:
    """The number of partition groups of topics with these partition counts: their gcd
    (1 when there is no topic)."""
    return math.gcd(*partition_counts.values()) if partition_counts else 1


class CoPartitionedAssignor(AbstractPartitionAssignor):  # type: ignore[misc]
    """Assigns partition ``p`` of every topic to the member owning group ``p mod g``.

    ``g`` is :func:`co_partitioned` of the subscribed topics' partition counts; groups go
    to the members, sorted by member id, in turn. Every member must subscribe to the same
    topics (the instances of one processor do).
    """

    name = "fxstream-copartitioned"
    version = 0

    @classmethod
    def assign(
        cls,
        cluster: Any,
        members: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The assignment of ``members`` (member id -> metadata) over ``cluster``."""
        topics: set[str] = set()
        for metadata in members.values():
            topics.update(metadata.subscription)
        counts: dict[str, int] = {}
        for topic in sorted(topics):
            partitions = cluster.partitions_for_topic(topic)
            if partitions is None:
                log.warning("no partition metadata for topic %s", topic)
                continue
            counts[topic] = len(partitions)
        groups = co_partitioned(counts)
        ordered = sorted(members)
        plan: dict[str, dict[str, list[int]]] = {m: collections.defaultdict(list) for m in ordered}
        for topic, count in counts.items():
            for partition in range(count):
                owner = ordered[(partition % groups) % len(ordered)]
                plan[owner][topic].append(partition)
        return {
            member: ConsumerProtocolMemberAssignment(cls.version, sorted(plan[member].items()), b"")
            for member in ordered
        }

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> Any:
        """What this member tells the group: its subscription."""
        return ConsumerProtocolMemberMetadata(cls.version, list(topics), b"")

    @classmethod
    def on_assignment(cls, assignment: Any) -> None:
        """Nothing to remember."""


class StallWatch:
    """Notices the event loop standing still for ``threshold_s`` or more.

    Runs as a task ticking every ``tick_s``; :meth:`stalled_since` says whether a stall
    ended after a given moment, or one is ending now (the task has not ticked yet).
    """

    def __init__(self, threshold_s: float, tick_s: float = 0.1) -> None:
        self._threshold_s = threshold_s
        self._tick_s = tick_s
        self._last_tick = time.monotonic()
        self._last_stall_end = float("-inf")
        self.stalls = 0

    async def run(self) -> None:
        """Tick until cancelled."""
        self._last_tick = time.monotonic()  # the time before it ran was no stall
        while True:
            self._tick()
            await asyncio.sleep(self._tick_s)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= self._threshold_s:
            self._last_stall_end = now
            self.stalls += 1
            log.warning("the process stood still for %.1f s", now - self._last_tick)
        self._last_tick = now

    def stalled_since(self, since: float) -> bool:
        """True if the process stood still for ``threshold_s`` after ``since`` (monotonic)."""
        now = time.monotonic()
        return now - self._last_tick >= self._threshold_s or self._last_stall_end >= since


def group_generation(consumer: Any) -> int | None:
    """The consumer's group generation as it knows it; None if the client does not say.

    aiokafka resets it (to -1) as soon as a heartbeat learns that the group dropped this
    member (unknown member id, stale generation), and changes it only when it rejoins,
    which a :class:`PartitionGuard` holds back until the batch in hand is done: a batch
    taken in one generation and about to commit in another was taken by a member the
    group had already replaced. (aiokafka 0.14 keeps it on the consumer's coordinator,
    not in its public API, hence the care.)
    """
    generation = getattr(getattr(consumer, "_coordinator", None), "generation", None)
    return generation if isinstance(generation, int) else None
