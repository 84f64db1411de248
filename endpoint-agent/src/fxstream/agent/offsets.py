"""Which Kafka offsets may be committed, when tasks finish out of order.

The agent reads task records in offset order but their results become durable
in any order (a long task, a retry). Committing offset ``n`` tells Kafka "every
record before ``n`` is processed", so the agent may only commit past a record
once it and every record before it are done. :class:`OffsetTracker` keeps that
bookkeeping per partition.

Offsets handed out by a consumer are increasing but not consecutive: compaction
removes records and transactions leave control markers. The tracker never does
``offset + 1`` arithmetic across records; the commit position is "one past the
last offset of the contiguous prefix of tracked offsets that are all done".
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

__all__ = ["OffsetTracker"]


class _Partition:
    """One partition's in-flight offsets, in the order they were tracked."""

    __slots__ = ("finished", "in_order", "last_tracked", "outstanding", "position", "reported")

    def __init__(self) -> None:
        self.in_order: deque[int] = deque()  # tracked and not yet passed by the position
        self.outstanding: set[int] = set()  # tracked and not done
        self.finished: set[int] = set()  # done, but an earlier offset is still running
        self.last_tracked = -1
        self.position: int | None = None  # the offset to commit, once something is done
        self.reported: int | None = None  # the position committable() last returned

    def advance(self) -> None:
        """Move the commit position over the done prefix."""
        while self.in_order and self.in_order[0] in self.finished:
            offset = self.in_order.popleft()
            self.finished.discard(offset)
            self.position = offset + 1


class OffsetTracker:
    """Commit positions per partition that never pass a record whose result is not durable.

    Call :meth:`track` when a record is dispatched, :meth:`done` when its
    result is durably written, and :meth:`committable` to learn what to commit.
    Thread-safe: results may complete on another thread than the consumer's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[int, _Partition] = {}
        self._pending = 0

    @property
    def pending_count(self) -> int:
        """Records tracked and not yet done, over all partitions."""
        with self._lock:
            return self._pending

    def track(self, partition: int, offset: int) -> None:
        """Record that ``offset`` of ``partition`` was dispatched.

        Offsets of a partition must be tracked in increasing order, as a
        consumer delivers them; after a seek back, :meth:`forget_partitions` first.
        """
        if offset < 0:
            raise ValueError(f"offset must not be negative, got {offset}")
        with self._lock:
            state = self._partitions.get(partition)
            if state is None:
                state = self._partitions[partition] = _Partition()
            if offset <= state.last_tracked:
                raise ValueError(
                    f"offset {offset} of partition {partition} is not after the last "
                    f"tracked offset {state.last_tracked}"
                )
            state.last_tracked = offset
            state.in_order.append(offset)
            state.outstanding.add(offset)
            self._pending += 1

    def done(self, partition: int, offset: int) -> bool:
        """Record that the result of ``offset`` is durable; False if it was not in flight.

        An offset that is not in flight (its partition was revoked, or it was
        already done) is ignored: a task finishing after a rebalance is normal.
        """
        with self._lock:
            state = self._partitions.get(partition)
            if state is None or offset not in state.outstanding:
                return False
            state.outstanding.remove(offset)
            state.finished.add(offset)
            self._pending -= 1
            state.advance()
            return True

    def committable(self) -> dict[int, int]:
        """Per partition whose position moved since the last call, the offset to commit.

        The value is Kafka's "next offset to consume": one past the last offset
        of the done prefix, so every tracked offset below it is done.
        """
        moved: dict[int, int] = {}
        with self._lock:
            for partition, state in self._partitions.items():
                if state.position is not None and state.position != state.reported:
                    moved[partition] = state.reported = state.position
        return moved

    def positions(self) -> dict[int, int]:
        """Every partition's current commit position, moved or not (e.g. after an aborted
        transaction, to commit again what :meth:`committable` already returned)."""
        with self._lock:
            return {
                partition: state.position
                for partition, state in self._partitions.items()
                if state.position is not None
            }

    def forget_partitions(self, partitions: Iterable[int]) -> None:
        """Drop all state of ``partitions`` (revoked in a rebalance): their results no
        longer commit here, and tracking may restart at any offset."""
        with self._lock:
            for partition in partitions:
                state = self._partitions.pop(partition, None)
                if state is not None:
                    self._pending -= len(state.outstanding)
