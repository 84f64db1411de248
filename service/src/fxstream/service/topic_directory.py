"""Which topics exist, and where topics end, asked through the Kafka Admin API.

The router must know whether ``tasks.ep.<endpoint>`` and ``results.<user>``
exist *before* it produces to them: a producer asked to write to a missing
topic waits for metadata until its request timeout (minutes), which would stall
every task behind that one. Calls run in a worker thread so the event loop
keeps going.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from fxstream.topics import KafkaConnection

__all__ = ["TopicDirectory"]


class TopicDirectory:
    """A cache of the cluster's topic names that refreshes when asked about a missing one."""

    def __init__(self, kafka: KafkaConnection, *, timeout_s: float = 10.0) -> None:
        self._admin = AdminClient({**kafka.confluent(), "log_level": 2})
        self._timeout_s = timeout_s
        self._partitions: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def present(self, topics: Iterable[str]) -> set[str]:
        """The subset of ``topics`` that exists.

        A topic once seen is remembered (topics are not deleted under a running
        deployment); asking about an unseen one refreshes the cache once per call,
        so a topic created a moment ago is found.
        """
        wanted = set(topics)
        if not wanted <= self._partitions.keys():
            await self.refresh()
        return wanted & self._partitions.keys()

    def known(self) -> frozenset[str]:
        """The topics seen by the last :meth:`refresh` (and any before it)."""
        return frozenset(self._partitions)

    async def refresh(self) -> None:
        """Re-read the list of topics from the cluster."""
        async with self._lock:
            metadata = await asyncio.to_thread(self._admin.list_topics, timeout=self._timeout_s)
        self._partitions = {
            name: len(topic.partitions)
            for name, topic in metadata.topics.items()
            if topic.error is None and topic.partitions
        }

    async def end_offsets(self, topics: Iterable[str]) -> dict[tuple[str, int], int]:
        """The high watermark of every partition of ``topics`` (missing topics are skipped)."""
        names = await self.present(topics)
        request = {
            TopicPartition(name, partition): OffsetSpec.latest()  # type: ignore[no-untyped-call]
            for name in names
            for partition in range(self._partitions[name])
        }
        if not request:
            return {}
        futures = self._admin.list_offsets(request, request_timeout=self._timeout_s)
        ends: dict[tuple[str, int], int] = {}
        for tp, future in futures.items():
            info = await asyncio.wrap_future(future)
            ends[(tp.topic, tp.partition)] = info.offset
        return ends
