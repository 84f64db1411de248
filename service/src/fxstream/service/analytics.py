"""The analytics processor: windowed aggregates of task states, and the API's view of them.

Issue 15 item 5. The processor (role ``analytics``, :class:`AnalyticsLoop`) reads
``task-state`` (every state change the router and the task-state processor record) and
folds each state into windows (:class:`WindowedAggregates`): per user, and per function,
endpoint and trigger rule *of that user*, over a tumbling and a hopping window
(:data:`DEFAULT_WINDOWS`). A window counts its finished tasks and their outcomes
(succeeded, failed, cancelled, rejected), every state change by state, and the latency
from submission to result in a fixed log-scale histogram
(:func:`fxstream.topics.latency_bucket`: 100 buckets, each 2^(1/4) wider than the last,
so a percentile read from it is at most 19 % high). Every ``flush_s`` the series that
changed are written to the ``analytics`` topic as :class:`~fxstream.topics.WindowAggregate`
records, the latest per key being the window's figure; once a window's end and its grace
have passed it is written once more with ``final`` set.

**Why not a faust windowed table.** faust-streaming's ``Table.tumbling``/``hopping``
keeps its state in a changelog topic of its own (named for the app, outside the
catalogue's ACLs and budgets), writes that changelog at least once (a crash between a
table update and the offset commit counts a task twice), and places a key's changelog
record in the partition of the event that updated it, so one function's count is spread
over task-state's partitions and a restart's recovery keeps whichever partition it read
last (faust 0.15.3; its ``_del_old_keys`` also never hands ``on_window_close`` the
window's aggregate, as the installed source notes). This processor needs none of that:
``task-state`` is compacted, so every task's terminal state stays on it with its
timestamp, and the processor's state is a pure function of the states recorded in its
horizon. At start it reads ``task-state`` from ``retain_s`` (plus a clock-skew margin)
before now, folds only windows that begin after that moment, and re-publishes them with
the same figures: a restart neither loses nor repeats a count, with no changelog and no
consumer group. Windows older than the horizon were final on the topic before.

**Bounds.** A state is folded once, into its *pane* (the greatest common divisor of the
window families' sizes and steps: 60 s by default); a window's figure is the sum of its
panes, made when it is written. In memory: the panes some window still in retention
needs (the longest window plus ``retain_s``: 20 panes with the defaults); in each, one
series per user, and per user and dimension at most ``max_keys`` function, endpoint or
rule ids (256; further ids count under the key ``~other``, so the user's totals stay
exact); a series is its counts, at most 9 states and at most 100 histogram buckets. Users
are as many as the registry holds. A duplicate state (the task-state processor re-writes
a batch after a crash) is recognised among the last ``dedup_size`` state changes
(65,536). Rule ids are read from the ``triggers`` topic (a task group id that is a rule
of the task's user); up to 10,000 rule ids seen are remembered after their rule is
deleted. A state recorded more than ``retain_s`` after its window's end is not counted
(``too_late`` in the log line at shutdown).

One analytics process runs per platform (it assigns itself every partition of
``task-state``; ``analytics_instances`` must be 1).

The API reads the topic back through
:class:`~fxstream.service.analytics_view.AnalyticsView` (a thread following ``analytics``
from ``horizon_s`` ago, keeping the latest record per key, bounded) and answers
``GET /v1/analytics`` with :func:`~fxstream.service.analytics_view.summarize`: a user
sees only the series of its own tasks, the platform admin every user's (and, unless it
names a user, their sums).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]
from aiokafka.structs import TopicPartition as AioTopicPartition  # type: ignore[import-untyped]

from fxstream.service.batch_loop import StoppableLoop
from fxstream.service.lifecycle import TERMINAL_STATES
from fxstream.service.outgoing import Outgoing
from fxstream.service.registry import RegistryView
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    OTHER_KEY,
    Catalogue,
    KafkaConnection,
    RecordDecodeError,
    TaskState,
    TaskStateName,
    WindowAggregate,
    decode,
    encode,
    latency_bucket,
)

__all__ = [
    "COMPONENT",
    "DEFAULT_WINDOWS",
    "DIMENSIONS",
    "AnalyticsLoop",
    "AnalyticsStats",
    "WindowSpec",
    "WindowedAggregates",
]

log = logging.getLogger(__name__)

COMPONENT: Final = "analytics"
Dimension = Literal["user", "function", "endpoint", "rule"]
DIMENSIONS: Final[tuple[Dimension, ...]] = ("user", "function", "endpoint", "rule")
WindowKind = Literal["tumbling", "hopping"]

# How long after a window's end its figure is called final (states recorded that late
# still update it, and it is written again).
DEFAULT_GRACE_S: Final = 10.0
# How long a window stays in memory after its end, and how far back a start re-reads.
DEFAULT_RETAIN_S: Final = 900.0
# task-state's record timestamps are set when the record is produced, after its
# updated_at (same host); the start reads this much earlier still, for clock skew.
CLOCK_SKEW_S: Final = 30.0
DEFAULT_FLUSH_S: Final = 1.0
DEFAULT_MAX_KEYS: Final = 256
DEFAULT_DEDUP_SIZE: Final = 65_536
MAX_REMEMBERED_RULES: Final = 10_000


@dataclass(frozen=True)
class WindowSpec:
    """A window family: tumbling (``step_s`` == ``size_s``) or hopping (``step_s`` <
    ``size_s``; every window that holds a moment counts it), aligned to the epoch."""

    kind: WindowKind
    size_s: int
    step_s: int

    def __post_init__(self) -> None:
        if not 1 <= self.step_s <= self.size_s <= 86_400:
            raise ValueError(f"need 1 <= step <= size <= 86400 s; got {self}")
        if (self.kind == "tumbling") != (self.step_s == self.size_s):
            raise ValueError(f"a tumbling window steps by its size, a hopping one less: {self}")

    @classmethod
    def tumbling(cls, size_s: int) -> WindowSpec:
        """Windows of ``size_s`` seconds, one after the other."""
        return cls("tumbling", size_s, size_s)

    @classmethod
    def hopping(cls, size_s: int, step_s: int) -> WindowSpec:
        """Windows of ``size_s`` seconds starting every ``step_s`` seconds."""
        return cls("hopping", size_s, step_s)

    def starts(self, moment: float) -> list[int]:
        """The starts of the windows that hold ``moment`` (start <= moment < end), oldest
        first."""
        last = math.floor(moment / self.step_s) * self.step_s
        first = last - self.size_s + self.step_s
        return [s for s in range(first, last + 1, self.step_s) if s <= moment < s + self.size_s]


DEFAULT_WINDOWS: Final = (WindowSpec.tumbling(60), WindowSpec.hopping(300, 60))


@dataclass(slots=True)
class _Series:
    """One pane's (or one window's) running figures for one user and one key."""

    finished: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    states: dict[TaskStateName, int] = field(default_factory=dict)
    histogram: dict[int, int] = field(default_factory=dict)
    # Whole microseconds: a sum that does not depend on the order states arrive in.
    latency_sum_us: int = 0
    latency_max_s: float = 0.0

    def add(self, other: _Series) -> None:
        """Add ``other``'s figures to these."""
        self.finished += other.finished
        self.succeeded += other.succeeded
        self.failed += other.failed
        self.cancelled += other.cancelled
        self.rejected += other.rejected
        for name, count in other.states.items():
            self.states[name] = self.states.get(name, 0) + count
        for bucket, count in other.histogram.items():
            self.histogram[bucket] = self.histogram.get(bucket, 0) + count
        self.latency_sum_us += other.latency_sum_us
        self.latency_max_s = max(self.latency_max_s, other.latency_max_s)


SeriesKey = tuple[Dimension, str, str]


@dataclass
class AnalyticsStats:
    """What the aggregator has seen; logged at shutdown."""

    states: int = 0
    duplicates: int = 0
    too_late: int = 0
    undecodable: int = 0
    written: int = 0
    over_key_bound: int = 0


class WindowedAggregates:
    """The figures in memory and what changed since the last flush (pure: no I/O).

    A state is folded once, into its *pane* (the greatest common divisor of every window
    family's size and step: 60 s with the defaults); a window's figure is the sum of its
    panes, made when it is written. ``not_before``: windows that begin earlier are never
    written (at start, the moment from which every state was re-read).
    ``is_rule(group, user)`` says whether a task group id is a trigger rule of that user.
    """

    def __init__(
        self,
        windows: Sequence[WindowSpec] = DEFAULT_WINDOWS,
        *,
        not_before: float = 0.0,
        retain_s: float = DEFAULT_RETAIN_S,
        grace_s: float = DEFAULT_GRACE_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        dedup_size: int = DEFAULT_DEDUP_SIZE,
        is_rule: Callable[[str, str], bool] = lambda group, user: False,
    ) -> None:
        if not windows:
            raise ValueError("at least one window family")
        if grace_s > retain_s:
            raise ValueError("a window must stay in memory at least its grace")
        self.specs = tuple(windows)
        self.pane_s = math.gcd(*(n for spec in self.specs for n in (spec.size_s, spec.step_s)))
        self._longest_s = max(spec.size_s for spec in self.specs)
        self.not_before = not_before
        self.retain_s = retain_s
        self.grace_s = grace_s
        self.max_keys = max_keys
        self.stats = AnalyticsStats()
        self._dedup_size = dedup_size
        self._is_rule = is_rule
        self._panes: dict[int, dict[SeriesKey, _Series]] = {}
        # Per pane and (user, dimension): how many keys of its own it holds (max_keys).
        self._pane_keys: dict[int, dict[tuple[str, Dimension], int]] = {}
        self._dirty: dict[int, set[SeriesKey]] = {}
        # Windows written but not yet as final: (family index, start).
        self._open: set[tuple[int, int]] = set()
        self._seen: OrderedDict[tuple[str, str, int], None] = OrderedDict()

    @property
    def pane_count(self) -> int:
        """How many panes are in memory."""
        return len(self._panes)

    @property
    def series_count(self) -> int:
        """How many series all panes in memory hold."""
        return sum(len(p) for p in self._panes.values())

    def observe(self, state: TaskState, now: float) -> None:
        """Fold one recorded state into the pane holding its ``updated_at``."""
        mark = (state.task_id, str(state.state), len(state.attempts))
        seen = self._seen
        if mark in seen:
            seen.move_to_end(mark)
            self.stats.duplicates += 1
            return
        seen[mark] = None
        if len(seen) > self._dedup_size:
            seen.popitem(last=False)
        moment = state.updated_at
        pane = math.floor(moment / self.pane_s) * self.pane_s
        if pane < self.not_before or now >= pane + self._longest_s + self.retain_s:
            self.stats.too_late += 1
            return
        self.stats.states += 1
        latency: float | None = None
        terminal = state.state in TERMINAL_STATES
        if terminal and state.timings.submitted_at is not None:
            ended = state.timings.result_published_at or state.updated_at
            latency = max(0.0, ended - state.timings.submitted_at)
        user = state.user_id
        group = state.task_group_id
        series = self._panes.get(pane)
        if series is None:
            series = self._panes[pane] = {}
            self._pane_keys[pane] = {}
        dirty = self._dirty.get(pane)
        if dirty is None:
            dirty = self._dirty[pane] = set()
        wanted: list[SeriesKey] = [
            ("user", user, user),
            self._bounded(pane, series, ("function", user, state.function_id)),
            self._bounded(pane, series, ("endpoint", user, state.endpoint_id)),
        ]
        if group is not None and self._is_rule(group, user):
            wanted.append(self._bounded(pane, series, ("rule", user, group)))
        for key in wanted:
            figures = series.get(key)
            if figures is None:
                figures = series[key] = _Series()
            _fold(figures, state.state, terminal, latency)
            dirty.add(key)

    def _bounded(self, pane: int, series: dict[SeriesKey, _Series], key: SeriesKey) -> SeriesKey:
        if key in series:
            return key
        dimension, user, _ = key
        held = self._pane_keys[pane]
        count = held.get((user, dimension), 0)
        if count >= self.max_keys:
            self.stats.over_key_bound += 1
            return (dimension, user, OTHER_KEY)
        held[(user, dimension)] = count + 1
        return key

    def flush(self, now: float) -> list[WindowAggregate]:
        """The windows whose figures changed, as records (and, once more with ``final``
        set, every series of a window whose end and grace have passed); panes no window
        in retention needs are then dropped."""
        changed: dict[tuple[int, int], set[SeriesKey]] = {}
        for pane, keys in self._dirty.items():
            for index, spec in enumerate(self.specs):
                for start in spec.starts(pane):
                    if start >= self.not_before and now < start + spec.size_s + self.retain_s:
                        changed.setdefault((index, start), set()).update(keys)
        self._dirty.clear()
        for index, start in list(self._open):
            spec = self.specs[index]
            if now >= start + spec.size_s + self.grace_s:
                self._open.discard((index, start))
                every = changed.setdefault((index, start), set())
                for pane in range(start, start + spec.size_s, self.pane_s):
                    every.update(self._panes.get(pane, ()))
        records: list[WindowAggregate] = []
        for (index, start), keys in sorted(changed.items()):
            spec = self.specs[index]
            final = now >= start + spec.size_s + self.grace_s
            if not final:
                self._open.add((index, start))
            for key in sorted(keys):
                records.append(self._record(spec, start, key, final, now))
        for pane in [p for p in self._panes if now >= p + self._longest_s + self.retain_s]:
            del self._panes[pane]
            del self._pane_keys[pane]
        self.stats.written += len(records)
        return records

    def _record(
        self, spec: WindowSpec, start: int, key: SeriesKey, final: bool, now: float
    ) -> WindowAggregate:
        dimension, user, name = key
        s = _Series()
        for pane in range(start, start + spec.size_s, self.pane_s):
            figures = self._panes.get(pane, {}).get(key)
            if figures is not None:
                s.add(figures)
        return WindowAggregate(
            window=spec.kind,
            size_s=spec.size_s,
            step_s=spec.step_s,
            start=float(start),
            end=float(start + spec.size_s),
            dimension=dimension,
            key=name,
            user_id=user,
            finished=s.finished,
            succeeded=s.succeeded,
            failed=s.failed,
            cancelled=s.cancelled,
            rejected=s.rejected,
            states=dict(sorted(s.states.items())),
            latency_histogram=dict(sorted(s.histogram.items())),
            latency_sum_s=s.latency_sum_us / 1e6,
            latency_max_s=s.latency_max_s,
            final=final,
            updated_at=now,
        )


def _fold(series: _Series, state: TaskStateName, terminal: bool, latency: float | None) -> None:
    series.states[state] = series.states.get(state, 0) + 1
    if not terminal:
        return
    series.finished += 1
    if state is TaskStateName.SUCCEEDED:
        series.succeeded += 1
    elif state is TaskStateName.FAILED:
        series.failed += 1
    elif state is TaskStateName.CANCELLED:
        series.cancelled += 1
    elif state is TaskStateName.REJECTED:
        series.rejected += 1
    if latency is not None:
        bucket = latency_bucket(latency)
        series.histogram[bucket] = series.histogram.get(bucket, 0) + 1
        series.latency_sum_us += round(latency * 1e6)
        series.latency_max_s = max(series.latency_max_s, latency)


# --- the processor ----------------------------------------------------------------------------

Send = Callable[[Sequence[Outgoing]], Awaitable[None]]


class AnalyticsLoop(StoppableLoop):
    """Reads ``task-state`` (every partition, no consumer group) from the horizon on,
    folds each state into the windows, and writes what changed every ``flush_s``.

    ``rules`` is a view that follows ``triggers`` (for the rule dimension): started and
    read to its end before the first state, closed at the end.
    """

    name = "analytics"

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        send: Send,
        *,
        rules: RegistryView | None = None,
        windows: Sequence[WindowSpec] = DEFAULT_WINDOWS,
        retain_s: float = DEFAULT_RETAIN_S,
        grace_s: float = DEFAULT_GRACE_S,
        flush_s: float = DEFAULT_FLUSH_S,
        batch_size: int = 500,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.catalogue = catalogue
        self._send = send
        self._rules = rules
        self._directory = TopicDirectory(kafka)
        self._remembered_rules: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._clock = clock
        self._flush_s = flush_s
        self._batch_size = batch_size
        self._began = clock()
        self.aggregates = WindowedAggregates(
            windows,
            not_before=self._began - retain_s,
            retain_s=retain_s,
            grace_s=grace_s,
            is_rule=self._is_rule,
        )
        self._consumer_settings: dict[str, Any] = {
            **kafka.aiokafka(),
            "group_id": None,
            "client_id": f"{catalogue.prefix}analytics",
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "isolation_level": "read_committed",
            # Analytics is off every task's path: fuller fetches, <= 200 ms of lag.
            "fetch_min_bytes": 64 * 1024,
            "fetch_max_wait_ms": 200,
        }

    def _is_rule(self, group: str, user: str) -> bool:
        if (group, user) in self._remembered_rules:
            return True
        rule = self._rules.trigger(group) if self._rules is not None else None
        if rule is None or rule.owner_id != user:
            return False
        self._remembered_rules[(group, user)] = None
        if len(self._remembered_rules) > MAX_REMEMBERED_RULES:
            self._remembered_rules.popitem(last=False)
        return True

    async def run(self) -> None:
        """Fold ``task-state`` into windows until :meth:`stop`."""
        self._consumer = AIOKafkaConsumer(**self._consumer_settings)
        try:
            if self._rules is not None:
                await asyncio.to_thread(self._rules.start)
                await asyncio.to_thread(self._rules.wait_until_current, 60.0)
            await self._consumer.start()
            await self._seek_to_horizon()
            last_flush = time.monotonic()
            while not self._stopping.is_set():
                fetched = await self._consumer.getmany(timeout_ms=200, max_records=self._batch_size)
                now = self._clock()
                for records in fetched.values():
                    for record in records:
                        self._observe(record.value, now)
                if time.monotonic() - last_flush >= self._flush_s:
                    await self._flush()
                    last_flush = time.monotonic()
            await self._flush()
        finally:
            await self._consumer.stop()
            if self._rules is not None:
                await asyncio.to_thread(self._rules.close)
            self._done.set()

    async def _seek_to_horizon(self) -> None:
        topic = self.catalogue.task_state
        deadline = time.monotonic() + 60
        partitions: set[int] = set()
        while not partitions:
            try:
                ends = await self._directory.end_offsets([topic])
                partitions = {p for (t, p) in ends if t == topic}
            except Exception as exc:  # the broker is away or the topic is not there yet
                log.warning("analytics: cannot describe %s yet (%r)", topic, exc)
            if not partitions:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"analytics: topic {topic} is missing: run ./fx up first")
                await asyncio.sleep(0.5)
        tps = [AioTopicPartition(topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        since_ms = int((self.aggregates.not_before - CLOCK_SKEW_S) * 1000)
        found = await self._consumer.offsets_for_times({tp: since_ms for tp in tps})
        for tp in tps:
            position = found.get(tp)
            if position is None:
                await self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, position.offset)
        log.info(
            "analytics: reading %s from %.0f s ago (windows from %.0f s ago on)",
            topic,
            self._began - since_ms / 1000,
            self._began - self.aggregates.not_before,
        )

    def _observe(self, value: bytes | None, now: float) -> None:
        if value is None:
            return  # a tombstone: nothing was recorded
        try:
            state = decode(value, TaskState)
        except RecordDecodeError:
            self.aggregates.stats.undecodable += 1
            return
        self.aggregates.observe(state, now)

    async def _flush(self) -> None:
        records = self.aggregates.flush(self._clock())
        if not records:
            return
        topic = self.catalogue.analytics
        await self._send(
            [Outgoing(topic, record.topic_key().encode(), encode(record)) for record in records]
        )
