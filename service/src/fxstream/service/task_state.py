"""The task-state processor: fold every user's results into the compacted ``task-state`` topic.

It follows every ``results.<user>`` topic by *pattern*, so a user registered
after start is picked up (within ``metadata_max_age_ms``) without a restart.
faust cannot do this: ``app.topic(pattern=...)`` subscribes to no topic at all
and crashes the worker (faust-streaming 0.15.3: its conductor only subscribes
to named topics), so this loop uses an aiokafka consumer of its own inside the
faust app, and writes through the app's producer.

The first terminal result per task wins. A task may run twice (its agent
crashed after publishing), so later results for a task already folded are
counted and dropped. The memory of folded tasks is bounded (see
:class:`RecentTasks`), so a duplicate arriving after many newer tasks, or after
a restart of this processor, is folded again (over the first).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]
from aiokafka.errors import CommitFailedError, IllegalStateError  # type: ignore[import-untyped]

from fxstream.service.batch_loop import StoppableLoop, offsets_after
from fxstream.service.deadletter import RawRecord, dead_letter_for
from fxstream.service.outgoing import Outgoing, fits
from fxstream.service.router import REJECTED_ERROR_TYPE
from fxstream.topics import (
    Attempt,
    Catalogue,
    RecordDecodeError,
    TaskResult,
    TaskState,
    TaskStateName,
    decode,
    encode,
)

__all__ = [
    "COMPONENT",
    "RecentTasks",
    "ResultsFollower",
    "TaskStatePlanner",
    "TaskStateStats",
    "fold_result",
    "results_pattern",
]

log = logging.getLogger(__name__)

COMPONENT = "task-state"
Send = Callable[[Sequence[Outgoing]], Awaitable[None]]


def results_pattern(catalogue: Catalogue) -> str:
    """The regular expression matching every user's results topic of this deployment."""
    return "^" + re.escape(catalogue.prefix + "results.") + r"[A-Za-z0-9][A-Za-z0-9-]*$"


class RecentTasks:
    """The ids of the last ``capacity`` tasks whose terminal state was written.

    Bounded on purpose: task-state is unbounded, this memory must not be. Ids
    are kept as 64-bit hashes (about 75 bytes each, so the default 500,000
    take about 40 MB); a collision, at odds near 1e-8, would drop one result
    from task-state (never from the user's results topic).
    """

    def __init__(self, capacity: int = 500_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._seen: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, task_id: str) -> bool:
        """Remember ``task_id``; False when it was already remembered."""
        key = hash(task_id)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            # dicts keep insertion order, so the first key is the oldest.
            del self._seen[next(iter(self._seen))]
        return True


def fold_result(result: TaskResult, now: float) -> TaskState:
    """The terminal task state one result stands for: succeeded with its value, or failed."""
    succeeded = result.outcome == "success"
    attempt = Attempt(
        attempt=result.attempt,
        worker=result.worker,
        started_at=result.timings.started_at,
        finished_at=result.timings.finished_at,
        error=result.error,
    )
    return TaskState(
        task_id=result.task_id,
        user_id=result.user_id,
        function_id=result.function_id,
        endpoint_id=result.endpoint_id,
        task_group_id=result.task_group_id,
        state=TaskStateName.SUCCEEDED if succeeded else TaskStateName.FAILED,
        updated_at=now,
        timings=result.timings,
        attempts=[attempt],
        error=None if succeeded else result.error,
        value=result.value if succeeded else None,
    )


@dataclass
class TaskStateStats:
    """Counts since start, logged at shutdown."""

    folded: int = 0
    duplicates: int = 0
    rejections_skipped: int = 0
    values_dropped: int = 0
    dead_lettered: int = 0


@dataclass
class TaskStatePlanner:
    """Decides what to write to task-state (and dead-letter) for a batch of result records."""

    catalogue: Catalogue
    recent: RecentTasks = field(default_factory=RecentTasks)
    clock: Callable[[], float] = time.time
    stats: TaskStateStats = field(default_factory=TaskStateStats)

    def __post_init__(self) -> None:
        self._state_limit = self.catalogue.spec("task-state").max_message_bytes

    def plan(self, records: Sequence[RawRecord]) -> list[Outgoing]:
        """The task-state and dead-letter records for ``records``."""
        out: list[Outgoing] = []
        now = self.clock()
        for record in records:
            try:
                self._plan_one(out, record, now)
            except RecordDecodeError as exc:
                self._dead_letter(out, record, str(exc), "RecordDecodeError")
            except Exception as exc:  # a bug here must cost one record, not the processor
                log.exception("task-state: cannot fold %s@%d", record.topic, record.offset)
                self._dead_letter(out, record, f"task-state failed: {exc!r}", "TaskStateError")
        return out

    def _plan_one(self, out: list[Outgoing], record: RawRecord, now: float) -> None:
        result = decode(record.value, TaskResult)
        if result.error is not None and result.error.type == REJECTED_ERROR_TYPE:
            # The router refused it and wrote the rejected state itself; folding this
            # into "failed" would overwrite it.
            self.stats.rejections_skipped += 1
            return
        if not self.recent.add(result.task_id):
            self.stats.duplicates += 1
            log.info(
                "task-state: duplicate result for task %s (attempt %d) ignored; the first stands",
                result.task_id,
                result.attempt,
            )
            return
        key = result.task_id.encode()
        state = fold_result(result, now)
        value = encode(state)
        if not fits(len(key) + len(value), self._state_limit):
            # The value stays on the user's results topic; status shows the outcome only.
            self.stats.values_dropped += 1
            value = encode(msgspec.structs.replace(state, value=None))
        out.append(Outgoing(self.catalogue.task_state, key, value))
        self.stats.folded += 1

    def _dead_letter(
        self, out: list[Outgoing], record: RawRecord, reason: str, error_type: str
    ) -> None:
        letter = dead_letter_for(record, reason=reason, error_type=error_type, component=COMPONENT)
        out.append(Outgoing(self.catalogue.dead_letter, record.key, encode(letter)))
        self.stats.dead_lettered += 1
        log.warning(
            "task-state: dead-lettered %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            reason,
        )


class ResultsFollower(StoppableLoop):
    """Consumes every results topic by pattern in batches, plans, writes, then commits.

    Offsets are committed only after the batch's writes are acknowledged, so a
    crash re-reads (at least once) and never skips a result.
    """

    name = "task-state"

    def __init__(
        self,
        bootstrap_servers: str,
        planner: TaskStatePlanner,
        send: Send,
        *,
        group_id: str,
        batch_size: int = 500,
        metadata_max_age_ms: int = 5_000,
    ) -> None:
        super().__init__()
        self._planner = planner
        self._send = send
        self._batch_size = batch_size
        self._consumer_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "group_id": group_id,
            "client_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            # Agents publish results in transactions: never fold an aborted one.
            "isolation_level": "read_committed",
            # How soon a new user's results topic is noticed and subscribed.
            "metadata_max_age_ms": metadata_max_age_ms,
            # task-state is a status view, off the task's critical path: under load, fewer
            # and fuller fetches (the broker's cost is per request) for <= 100 ms of lag.
            "fetch_min_bytes": 64 * 1024,
            "fetch_max_wait_ms": 100,
        }

    async def run(self) -> None:
        """Follow the results topics until :meth:`stop`."""
        # aiokafka binds a consumer to the running loop, so it is made here, not in __init__.
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        try:
            await self._consumer.start()
            self._consumer.subscribe(pattern=results_pattern(self._planner.catalogue))
            while not self._stopping.is_set():
                batch = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
                records = [r for partition in batch.values() for r in partition]
                if records:
                    await self._send(self._planner.plan(records))
                    await self._commit(batch)
        finally:
            await self._consumer.stop()
            self._done.set()

    async def _commit(self, batch: dict[Any, list[Any]]) -> None:
        try:
            await self._consumer.commit(offsets_after(batch))
        except (CommitFailedError, IllegalStateError) as exc:
            # A rebalance took the partitions away; their new owner re-reads from the
            # last commit, and the recent-task memory there absorbs most repeats.
            log.warning("task-state: commit after a rebalance failed (%s); continuing", exc)
