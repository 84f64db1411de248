"""Partitions of a scaled-out processor: handed over between batches, co-partitioned by task.

Pure asyncio and aiokafka's own assignment structs; the processes that use them are tested
with a real broker in tests/faults/test_scaleout_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka import TopicPartition  # type: ignore[import-untyped]
from aiokafka.coordinator.protocol import (  # type: ignore[import-untyped]
    ConsumerProtocolMemberMetadata,
)
from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]

from fxstream.service.rebalance import (
    CoPartitionedAssignor,
    PartitionGuard,
    StallWatch,
    co_partitioned,
)


@dataclass
class Cluster:
    """The one method of aiokafka's ClusterMetadata an assignor asks."""

    counts: dict[str, int]

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        count = self.counts.get(topic)
        return None if count is None else set(range(count))


def owners(cluster: Cluster, members: list[str]) -> dict[tuple[str, int], str]:
    topics = sorted(cluster.counts)
    metadata = {m: ConsumerProtocolMemberMetadata(0, topics, b"") for m in members}
    plan = CoPartitionedAssignor.assign(cluster, metadata)
    return {
        (topic, partition): member
        for member, assignment in plan.items()
        for topic, partitions in assignment.assignment
        for partition in partitions
    }


def test_one_tasks_results_and_events_reach_the_same_instance() -> None:
    cluster = Cluster({"fx.results.u1": 4, "fx.results.u2": 4, "fx.task-events": 8})
    assert co_partitioned(cluster.counts) == 4
    for members in (["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d", "e"]):
        owner = owners(cluster, members)
        assert len(owner) == 16, "every partition assigned once"
        for n in range(200):
            key = f"task-{n}".encode()
            # aiokafka's (and Java's) default partitioner, which every processor writes with.
            home = {
                owner[(topic, (murmur2(key) & 0x7FFFFFFF) % count)]
                for topic, count in cluster.counts.items()
            }
            assert len(home) == 1, (members, key, home)
    # Two instances split the work evenly.
    split = owners(cluster, ["a", "b"])
    assert sorted(list(split.values()).count(m) for m in "ab") == [8, 8]


def test_a_rebalance_waits_for_the_batch_in_hand_and_drops_what_it_no_longer_owns() -> None:
    async def scenario() -> list[str]:
        steps: list[str] = []
        p0, p1 = TopicPartition("fx.from.user.u", 0), TopicPartition("fx.from.user.u", 1)
        guard = PartitionGuard("router 0")
        await guard.on_partitions_assigned({p0, p1})
        committed = asyncio.Event()

        async def batch() -> None:
            async with guard.batch({p0: ["r0"], p1: ["r1"]}) as kept:
                steps.append(f"batch of {sorted(tp.partition for tp in kept)}")
                await asyncio.sleep(0.05)  # the batch's transaction
                steps.append("committed")
                committed.set()

        async def rebalance() -> None:
            await asyncio.sleep(0.01)  # the batch is in hand
            await guard.on_partitions_revoked({p0, p1})
            steps.append(f"revoked (batch committed: {committed.is_set()})")
            await guard.on_partitions_assigned({p1})

        await asyncio.gather(batch(), rebalance())
        # Records of p0 fetched before the rebalance: p0 is another instance's now.
        async with guard.batch({p0: ["late"], p1: ["r2"]}) as kept:
            steps.append(f"next batch of {sorted(tp.partition for tp in kept)}")
        steps.append(f"dropped {guard.dropped}")
        return steps

    assert asyncio.run(scenario()) == [
        "batch of [0, 1]",
        "committed",
        "revoked (batch committed: True)",
        "next batch of [1]",
        "dropped 1",
    ]


def test_a_stall_of_the_process_is_noticed_during_and_after_it() -> None:
    async def scenario() -> list[bool]:
        watch = StallWatch(threshold_s=0.2, tick_s=0.01)
        ticking = asyncio.create_task(watch.run())
        await asyncio.sleep(0.05)
        before = time.monotonic()
        seen = [watch.stalled_since(before - 1.0)]
        time.sleep(0.3)  # the event loop stands still, as under SIGSTOP
        seen.append(watch.stalled_since(before))  # before the watch ticked again
        await asyncio.sleep(0.05)
        seen.append(watch.stalled_since(before))  # after
        seen.append(watch.stalled_since(time.monotonic()))
        ticking.cancel()
        return seen

    assert asyncio.run(scenario()) == [False, True, True, False]
