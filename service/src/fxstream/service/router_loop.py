"""The router's Kafka loop: each batch's writes and its input offsets in one transaction.

It reads ``tasks.submitted`` (``read_committed``) in batches of whatever has
arrived (``getmany``: a lone task is not held back to fill a batch, and under
load the batch grows while the previous transaction commits), asks the
:class:`~fxstream.service.router.Router` what to write, and then, in one Kafka
transaction, writes every record of the plan (states, dispatches, refusals,
dead letters) and commits the batch's offsets. A crash therefore leaves either
the whole batch routed and acknowledged, or nothing visible to
``read_committed`` readers (agents, the SDK, task-state) and the batch re-read.
The ``routed`` state and the dispatch become visible together, so a task's
result can never overtake its ``routed`` state.

Why not faust's own ``processing_guarantee="exactly_once"``: faust commits its
transactions on the commit interval (seconds) with one transactional producer
per input partition, so every task would wait that long at this hop, and
faust's per-event cost (about 100 µs) alone held the router near 5,000
tasks/s. This loop runs inside the faust app as a task (beside the task-state
follower), with aiokafka's transactional producer. Its transactional id is
stable (``<app id>-router-<instance>``): a restarted router fences the previous
instance, whose open transaction is aborted. Running several routers in one
consumer group needs a distinct ``instance`` per router.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any, NoReturn

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.errors import (  # type: ignore[import-untyped]
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)

from fxstream.service.batch_loop import StoppableLoop, offsets_after
from fxstream.service.outgoing import Outgoing
from fxstream.service.router import Router
from fxstream.topics import Catalogue, aiokafka_max_request_size

__all__ = ["EXIT_WRITE_FAILED", "RouterLoop"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL: Kafka refused a write; restarting (by a supervisor) is the cure.
EXIT_WRITE_FAILED = 75
# Tries of one batch's transaction before the router gives up and exits.
COMMIT_ATTEMPTS = 6


class RouterLoop(StoppableLoop):
    """Routes ``tasks.submitted`` until :meth:`stop`, one transaction per batch."""

    name = "router"

    def __init__(
        self,
        bootstrap_servers: str,
        catalogue: Catalogue,
        router: Router,
        *,
        group_id: str,
        instance: str = "0",
        batch_size: int = 500,
    ) -> None:
        super().__init__()
        self._catalogue = catalogue
        self._router = router
        self._group_id = group_id
        self._batch_size = batch_size
        self.transactional_id = f"{group_id}-{instance}"
        largest = max(spec.max_message_bytes for spec in catalogue.specs)
        self._consumer_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "group_id": group_id,
            "client_id": group_id,
            "enable_auto_commit": False,
            # A new group must start from the oldest task, not skip queued ones.
            "auto_offset_reset": "earliest",
            # Never route a submission whose producer aborted it.
            "isolation_level": "read_committed",
            "max_partition_fetch_bytes": largest + 65_536,
        }
        self._producer_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "client_id": group_id,
            "transactional_id": self.transactional_id,
            "enable_idempotence": True,
            "acks": "all",
            # aiokafka's default (1 MB) is below the catalogue's largest record.
            "max_request_size": aiokafka_max_request_size(catalogue),
            # Its 16 kB per-partition batches hold ~35 dispatches: a batch of tasks
            # would take many produce requests instead of one.
            "max_batch_size": 1_048_576,
            # A send stuck on a partition without a leader fails well inside the
            # transaction timeout (60 s), so the batch is aborted and retried by this
            # loop, not timed out (and fenced) by the coordinator.
            "request_timeout_ms": 30_000,
        }
        self._producer: Any = None
        self.batches = 0

    async def run(self) -> None:
        """Route until :meth:`stop`; exits the process if Kafka refuses a transaction."""
        # aiokafka binds its clients to the running loop, so they are made here.
        self._producer = AIOKafkaProducer(**self._producer_settings)
        self._consumer = AIOKafkaConsumer(
            self._catalogue.tasks_submitted, **self._consumer_settings
        )
        try:
            await self._router.start()
            await self._producer.start()
            await self._consumer.start()
            while not self._stopping.is_set():
                batch = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
                records = [r for partition in batch.values() for r in partition]
                if records:
                    plan = await self._router.plan(records)
                    await self._commit([*plan.first, *plan.dispatches], offsets_after(batch))
        finally:
            if self._consumer is not None:
                await self._consumer.stop()
            if self._producer is not None:
                await self._producer.stop()
            self._done.set()

    async def _commit(self, records: Sequence[Outgoing], offsets: dict[Any, int]) -> None:
        """Write ``records`` and commit ``offsets`` in one transaction.

        A transaction that fails on a retriable error (a partition changing leader
        when a broker dies, a request timing out) is aborted and the same batch is
        tried again, up to ``COMMIT_ATTEMPTS`` times. A fenced producer (the
        coordinator timed the transaction out) is replaced by a new one. Persistent
        failure exits the process: the batch was never committed, so nothing is lost.
        """
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                # aiokafka 0.14 fails a transaction (NotLeaderForPartition, after the whole
                # request timeout) that learns a topic's metadata mid-transaction, as for
                # the first task of an endpoint (or refusal of a user) registered after
                # this producer started. Known topics answer at once.
                for topic in {record.topic for record in records}:
                    await self._producer.partitions_for(topic)
                async with self._producer.transaction():
                    sent = [
                        await self._producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                        for r in records
                    ]
                    await asyncio.gather(*sent)
                    await self._producer.send_offsets_to_transaction(offsets, self._group_id)
            except TransactionalIdAuthorizationFailed:
                self._exit("router: Kafka does not allow this router's transactional id")
            except ProducerFenced:
                if attempt == COMMIT_ATTEMPTS:
                    self._exit("router: fenced again and again; another router has this id")
                # A transaction the coordinator timed out fences its producer too; a new
                # producer (fencing any zombie with this id in turn) carries on.
                log.warning("router: producer fenced; starting a new one", exc_info=True)
                await self._restart_producer()
            except Exception as exc:
                if attempt == COMMIT_ATTEMPTS or not getattr(exc, "retriable", True):
                    self._exit("router: cannot commit a batch to Kafka")
                log.warning(
                    "router: batch transaction failed (%r), aborted; retry %d of %d",
                    exc,
                    attempt,
                    COMMIT_ATTEMPTS - 1,
                )
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            else:
                self.batches += 1
                return

    async def _restart_producer(self) -> None:
        try:
            await self._producer.stop()
        except Exception:  # already broken: it is replaced either way
            log.debug("router: stopping the fenced producer failed", exc_info=True)
        self._producer = AIOKafkaProducer(**self._producer_settings)
        await self._producer.start()

    @staticmethod
    def _exit(message: str) -> NoReturn:
        # Exit at once: the transaction is aborted (or was never committed), so the
        # batch is re-read by the next router; nothing of it is visible or lost.
        log.critical("%s; exiting", message, exc_info=True)
        logging.shutdown()
        os._exit(EXIT_WRITE_FAILED)
