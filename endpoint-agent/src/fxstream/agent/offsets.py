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

Answered past the position
--------------------------
A commit position cannot say that a record *past* it is done, yet the results
of such records are committed as soon as they are ready (holding them back
would make every result of a partition wait for its slowest task). Without
more, whoever owns the partition next (the agent restarted after a crash, or
another agent after a rebalance) starts at the position and runs those tasks
again: a second committed result for each. So every commit also carries, in the
offset commit's metadata (same transaction, so it is exactly as durable as the
results it describes), the offsets past the position that are answered
(:meth:`OffsetTracker.commits`). The next owner reads it back on assignment
(:meth:`OffsetTracker.resume`), and :meth:`OffsetTracker.track` returns False
for those records: they are settled without running again.

The metadata lists *runs* of answered records (offsets between two tracked
records, markers and aborted records, are never delivered, so a run spans
them), so its size grows with the unanswered records interleaved between
answered ones, not with the number answered. It must fit Kafka's
``offset.metadata.max.bytes`` (4,096 by default): an answer that could make it
too large waits (:meth:`OffsetTracker.admit` says False) until earlier records
are answered. The record at a partition's position is always admitted, so the
wait always ends.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
from collections import deque
from collections.abc import Iterable

__all__ = [
    "MAX_METADATA_CHARS",
    "METADATA_TAG",
    "OffsetTracker",
    "decode_answered",
    "encode_answered",
]

log = logging.getLogger(__name__)

METADATA_TAG = "fxa1:"
"""The first characters of the offset-commit metadata this module writes (format 1)."""

MAX_METADATA_CHARS = 4_000
"""The longest metadata written: under Kafka's default ``offset.metadata.max.bytes`` (4,096)."""

# Raw bytes of varints that fit in MAX_METADATA_CHARS once base64-encoded after the tag.
_RAW_BUDGET = (MAX_METADATA_CHARS - len(METADATA_TAG)) // 4 * 3
# Runs kept free for the riders of an admitted answer (see admit()).
_RESERVED_RUNS = 8

Run = tuple[int, int]
"""Answered offsets ``first..last`` (inclusive) of one partition."""


def _varint(value: int, out: bytearray) -> None:
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def encode_answered(position: int, runs: Iterable[Run]) -> str:
    """The metadata for a commit at ``position`` saying ``runs`` (past it, sorted) are answered.

    Each run is written as two unsigned varints, its distance from the end of the
    previous run (or from ``position``) and its length minus one, then base64.
    An empty ``runs`` is the empty string.
    """
    raw = bytearray()
    cursor = position
    for first, last in runs:
        if first < cursor or last < first:
            raise ValueError(f"runs must be sorted, disjoint and at or past {position}")
        _varint(first - cursor, raw)
        _varint(last - first, raw)
        cursor = last + 1
    if not raw:
        return ""
    return METADATA_TAG + base64.b64encode(bytes(raw)).decode("ascii")


def decode_answered(position: int, metadata: str | None) -> list[Run]:
    """The answered runs a commit at ``position`` with ``metadata`` records.

    Metadata this module did not write (empty, or another client's) records none.
    Raises ValueError when it carries the tag but cannot be read.
    """
    if not metadata or not metadata.startswith(METADATA_TAG):
        return []
    try:
        raw = base64.b64decode(metadata[len(METADATA_TAG) :], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"offset metadata {metadata[:40]!r}... is not base64: {exc}") from exc
    values: list[int] = []
    value = shift = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            values.append(value)
            value = shift = 0
    if shift or len(values) % 2:
        raise ValueError(f"offset metadata {metadata[:40]!r}... is truncated")
    runs: list[Run] = []
    cursor = position
    for gap, length in zip(values[::2], values[1::2], strict=True):
        first = cursor + gap
        runs.append((first, first + length))
        cursor = first + length + 1
    return runs


def _max_runs(span: int) -> int:
    """How many runs surely fit the metadata when every value is at most ``span``."""
    per_value = max(1, -(-max(span, 1).bit_length() // 7))
    return _RAW_BUDGET // (2 * per_value) - _RESERVED_RUNS


class _Partition:
    """One partition's in-flight offsets, in the order they were tracked."""

    __slots__ = (
        "claimed",
        "finished",
        "in_order",
        "last_tracked",
        "next",
        "outstanding",
        "position",
        "prev",
        "reported",
        "riders",
        "runs",
    )

    def __init__(self) -> None:
        self.in_order: deque[int] = deque()  # tracked and not yet passed by the position
        self.outstanding: set[int] = set()  # tracked and not done
        self.finished: set[int] = set()  # done, but an earlier offset is still running
        self.last_tracked = -1
        self.position: int | None = None  # the offset to commit, once something is done
        self.reported: int | None = None  # the position committable() last returned
        # Neighbours in in_order, to count runs of finished offsets in O(1) per change.
        self.prev: dict[int, int] = {}
        self.next: dict[int, int] = {}
        self.runs = 0  # maximal runs of finished offsets in in_order (none at its head)
        # Offsets settled by another's answer (a cancel by its task's): anchor -> riders.
        self.riders: dict[int, list[int]] = {}
        # Runs answered by a previous owner (from the commit metadata), not yet reached.
        self.claimed: deque[Run] = deque()

    def start(self) -> int | None:
        """The position a commit would carry now (the first tracked offset before any is done)."""
        if self.position is not None:
            return self.position
        return self.in_order[0] if self.in_order else None

    def append(self, offset: int) -> None:
        if self.in_order:
            last = self.in_order[-1]
            self.prev[offset] = last
            self.next[last] = offset
        self.in_order.append(offset)
        self.last_tracked = offset

    def finish(self, offset: int) -> None:
        """Mark the tracked, unfinished ``offset`` finished and move the position."""
        following = self.next.get(offset)
        following_done = following is not None and following in self.finished
        if self.in_order[0] == offset:
            # The run after the head (if any) joins the done prefix.
            self.runs -= following_done
        else:
            self.runs += 1 - (self.prev[offset] in self.finished) - following_done
        self.finished.add(offset)
        self.advance()

    def advance(self) -> None:
        """Move the commit position over the done prefix."""
        while self.in_order and self.in_order[0] in self.finished:
            offset = self.in_order.popleft()
            self.finished.discard(offset)
            following = self.next.pop(offset, None)
            if following is not None:
                self.prev.pop(following, None)
            self.position = offset + 1

    def answered_runs(self) -> list[Run]:
        """Every run of answered offsets past the position, sorted."""
        runs: list[Run] = []
        first = last = -1
        for offset in self.in_order:
            if len(runs) == self.runs:
                break
            if offset in self.finished:
                if first < 0:
                    first = offset
                last = offset
            elif first >= 0:
                runs.append((first, last))
                first = -1
        if first >= 0:
            runs.append((first, last))
        for first, last in self.claimed:
            if last <= self.last_tracked:
                continue  # every offset of it is tracked now: in_order speaks for them
            runs.append((max(first, self.last_tracked + 1), last))
        return runs

    def span(self) -> int:
        """The farthest offset a run may reach, past the position."""
        start = self.start() or 0
        farthest = max(self.last_tracked, self.claimed[-1][1] if self.claimed else -1)
        return max(farthest - start + 1, 1)


class OffsetTracker:
    """Commit positions per partition that never pass a record whose result is not durable.

    Call :meth:`track` when a record is dispatched, :meth:`done` when its
    result is durably written (:meth:`admit` first), and :meth:`commits` to
    learn what to commit. After an assignment, :meth:`resume` each partition
    from its committed offset and metadata. Thread-safe: results may complete on
    another thread than the consumer's.
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

    def resume(self, partition: int, offset: int, metadata: str | None) -> list[Run]:
        """Start ``partition`` at its committed ``offset``, whose ``metadata`` says which
        records past it were answered; returns those runs.

        Call it on assignment, before the partition's first record is tracked; the
        consumer must then start the partition at ``offset``. Whatever was tracked of
        the partition before is forgotten (records taken in an earlier assignment are
        not this one's: their results no longer commit here). A negative ``offset`` (no
        commit yet) records nothing. Raises ValueError for unreadable metadata (the
        partition then starts at ``offset`` with nothing answered).
        """
        with self._lock:
            earlier = self._partitions.get(partition)
            if earlier is not None:
                if earlier.last_tracked >= 0:
                    log.warning(
                        "partition %d resumed at offset %d while records up to %d were "
                        "tracked: forgotten",
                        partition,
                        offset,
                        earlier.last_tracked,
                    )
                self._pending -= len(earlier.outstanding)
            state = self._partitions[partition] = _Partition()
            if offset < 0:
                return []
            state.position = state.reported = offset
            runs = decode_answered(offset, metadata)
            state.claimed.extend(runs)
            return runs

    def track(self, partition: int, offset: int) -> bool:
        """Record that ``offset`` of ``partition`` was taken; False if it was answered before.

        A record a previous owner answered (see :meth:`resume`) is done at once:
        the caller settles it without running it. Offsets of a partition must be
        tracked in increasing order, as a consumer delivers them; after a seek
        back, :meth:`forget_partitions` first.
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
            claimed = state.claimed
            while claimed and claimed[0][1] < offset:
                claimed.popleft()
            state.append(offset)
            if claimed and claimed[0][0] <= offset:
                state.finish(offset)
                return False
            state.outstanding.add(offset)
            self._pending += 1
            return True

    def admit(self, partition: int, offset: int) -> bool:
        """Whether the answer of ``offset`` may commit now: False when recording it (and
        the records that ride on it) could make the commit metadata too large.

        The record at the position is always admitted: once it is done, the
        runs behind it shrink, so a refused answer is admitted later.
        """
        with self._lock:
            state = self._partitions.get(partition)
            if state is None or offset not in state.outstanding:
                return True
            if state.in_order[0] == offset:
                return True
            added = 1 + len(state.riders.get(offset, ()))
            return state.runs + len(state.claimed) + added <= _max_runs(state.span())

    def done(self, partition: int, offset: int) -> bool:
        """Record that the result of ``offset`` is durable; False if it was not in flight.

        Records riding on it (:meth:`done_with`) are done too. An offset that is
        not in flight (its partition was revoked, or it was already done) is
        ignored: a task finishing after a rebalance is normal.
        """
        with self._lock:
            state = self._partitions.get(partition)
            if state is None or offset not in state.outstanding:
                return False
            self._finish(state, offset)
            return True

    def done_with(self, partition: int, offset: int, anchor: int) -> None:
        """``offset`` is settled by the answer of ``anchor`` (an earlier record of the same
        partition, e.g. the task a cancel names): done when ``anchor`` is done, or now
        if ``anchor`` is not in flight."""
        with self._lock:
            state = self._partitions.get(partition)
            if state is None or offset not in state.outstanding:
                return
            if anchor in state.outstanding:
                state.riders.setdefault(anchor, []).append(offset)
            else:
                self._finish(state, offset)

    def _finish(self, state: _Partition, offset: int) -> None:
        """Finish ``offset`` (outstanding) and its riders; the caller holds the lock."""
        state.outstanding.remove(offset)
        self._pending -= 1
        state.finish(offset)
        for rider in state.riders.pop(offset, ()):
            if rider in state.outstanding:
                self._finish(state, rider)

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

    def commits(self) -> dict[int, tuple[int, str]]:
        """What to commit now, per partition: its position and the metadata naming the
        answered records past it (:func:`encode_answered`).

        Includes a partition with answered records but nothing done at its head:
        its position is then its first tracked offset (no progress), and the
        metadata carries the answers.
        """
        with self._lock:
            commits: dict[int, tuple[int, str]] = {}
            for partition, state in self._partitions.items():
                start = state.start()
                if start is None or (state.position is None and not state.runs):
                    continue
                runs = state.answered_runs()
                try:
                    metadata = encode_answered(start, runs)
                except ValueError:
                    # A bug here must not stop the publisher (every restart would meet
                    # it again): commit the position alone; records answered past it
                    # may then run again after a move (at least once, as before).
                    log.exception("partition %d: answered runs %s not encodable", partition, runs)
                    runs, metadata = [], ""
                if len(metadata) > MAX_METADATA_CHARS:  # admit() keeps this from happening
                    log.error(
                        "partition %d: %d runs of answered records past offset %d do not fit "
                        "the commit metadata; the last are not recorded, and run again if "
                        "the partition moves before the position passes them",
                        partition,
                        len(runs),
                        start,
                    )
                    while len(metadata) > MAX_METADATA_CHARS:
                        runs.pop()
                        metadata = encode_answered(start, runs)
                commits[partition] = (start, metadata)
            return commits

    def forget_partitions(self, partitions: Iterable[int]) -> None:
        """Drop all state of ``partitions`` (revoked in a rebalance): their results no
        longer commit here, and tracking may restart at any offset."""
        with self._lock:
            for partition in partitions:
                state = self._partitions.pop(partition, None)
                if state is not None:
                    self._pending -= len(state.outstanding)
