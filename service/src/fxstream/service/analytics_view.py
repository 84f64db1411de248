"""The API's view of the analytics processor's windows, and how a window is summarised.

:class:`AnalyticsView` follows the ``analytics`` topic (written by
:mod:`fxstream.service.analytics`) in a background thread, from ``horizon_s`` ago, keeping
the latest record per key for windows that ended within the horizon, at most
``max_entries`` of them (the oldest windows go first). :func:`summarize` turns one
:class:`~fxstream.topics.WindowAggregate` into what ``GET /v1/analytics`` answers: counts,
error rate, finished tasks per second and latency percentiles (:func:`percentile_s`, read
from the bounded histogram); :func:`merge` sums several users' figures of one window.

Kept apart from the processor so the API imports neither aiokafka nor faust.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import Any, Final, Literal

import msgspec
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from fxstream.topics import (
    LATENCY_BUCKETS,
    Catalogue,
    KafkaConnection,
    RecordDecodeError,
    TaskStateName,
    WindowAggregate,
    decode,
    latency_bucket_upper_s,
)

__all__ = [
    "DEFAULT_VIEW_HORIZON_S",
    "DEFAULT_VIEW_MAX_ENTRIES",
    "AnalyticsView",
    "merge",
    "percentile_s",
    "summarize",
]

log = logging.getLogger(__name__)

Dimension = Literal["user", "function", "endpoint", "rule"]
WindowKind = Literal["tumbling", "hopping"]


# --- reading: merging and summaries ---------------------------------------------------------


def merge(aggregates: Iterable[WindowAggregate]) -> WindowAggregate:
    """The sum of several series of one window (several users' figures for one key):
    counts, states and histograms add up, the maximum is the largest."""
    items = list(aggregates)
    if not items:
        raise ValueError("nothing to merge")
    first = items[0]
    states: dict[TaskStateName, int] = {}
    histogram: dict[int, int] = {}
    for item in items:
        for name, count in item.states.items():
            states[name] = states.get(name, 0) + count
        for bucket, count in item.latency_histogram.items():
            histogram[bucket] = histogram.get(bucket, 0) + count
    return msgspec.structs.replace(
        first,
        finished=sum(i.finished for i in items),
        succeeded=sum(i.succeeded for i in items),
        failed=sum(i.failed for i in items),
        cancelled=sum(i.cancelled for i in items),
        rejected=sum(i.rejected for i in items),
        states=states,
        latency_histogram=histogram,
        latency_sum_s=sum(i.latency_sum_s for i in items),
        latency_max_s=max(i.latency_max_s for i in items),
        final=all(i.final for i in items),
        updated_at=max(i.updated_at for i in items),
    )


def percentile_s(aggregate: WindowAggregate, q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of the window's latencies, read as the upper bound
    of the bucket holding it (never above the exact maximum); None without samples."""
    samples = sum(aggregate.latency_histogram.values())
    if samples == 0:
        return None
    rank = max(1, math.ceil(q * samples))
    seen = 0
    for bucket in sorted(aggregate.latency_histogram):
        seen += aggregate.latency_histogram[bucket]
        if seen >= rank:
            return min(latency_bucket_upper_s(bucket), aggregate.latency_max_s)
    return aggregate.latency_max_s  # not reached: the ranks add up to samples


def summarize(aggregate: WindowAggregate) -> dict[str, Any]:
    """The API's view of one window: its figures, rates and latency percentiles."""
    samples = sum(aggregate.latency_histogram.values())
    errors = aggregate.failed + aggregate.rejected
    return {
        "window": aggregate.window,
        "size_s": aggregate.size_s,
        "step_s": aggregate.step_s,
        "start": aggregate.start,
        "end": aggregate.end,
        "dimension": aggregate.dimension,
        "key": aggregate.key,
        "user_id": aggregate.user_id,
        "finished": aggregate.finished,
        "succeeded": aggregate.succeeded,
        "failed": aggregate.failed,
        "cancelled": aggregate.cancelled,
        "rejected": aggregate.rejected,
        "errors": errors,
        "error_rate": errors / aggregate.finished if aggregate.finished else None,
        "finished_per_s": aggregate.finished / aggregate.size_s,
        "states": {str(name): count for name, count in sorted(aggregate.states.items())},
        "latency_s": {
            "samples": samples,
            "mean": aggregate.latency_sum_s / samples if samples else None,
            "p50": percentile_s(aggregate, 0.50),
            "p90": percentile_s(aggregate, 0.90),
            "p99": percentile_s(aggregate, 0.99),
            "max": aggregate.latency_max_s if samples else None,
            "histogram": [
                [
                    None if bucket == LATENCY_BUCKETS - 1 else latency_bucket_upper_s(bucket),
                    count,
                ]
                for bucket, count in sorted(aggregate.latency_histogram.items())
            ],
        },
        "final": aggregate.final,
        "updated_at": aggregate.updated_at,
    }


# --- the API's view -------------------------------------------------------------------------

DEFAULT_VIEW_HORIZON_S: Final = 6 * 3600.0
DEFAULT_VIEW_MAX_ENTRIES: Final = 200_000


class AnalyticsView:
    """Follows ``analytics`` in a background thread from ``horizon_s`` ago and keeps the
    latest record per key, for windows that ended less than ``horizon_s`` ago, at most
    ``max_entries`` (the oldest windows go first)."""

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        *,
        horizon_s: float = DEFAULT_VIEW_HORIZON_S,
        max_entries: int = DEFAULT_VIEW_MAX_ENTRIES,
    ) -> None:
        self._topic = catalogue.analytics
        self._horizon_s = horizon_s
        self._max_entries = max_entries
        self._latest: dict[str, WindowAggregate] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **kafka.confluent(),
                "group.id": "fxstream-registry-view-unused",  # assigned, never joined
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                "fetch.wait.max.ms": 500,
                "queued.max.messages.kbytes": 4096,
                "log_level": 2,
            }
        )
        self._thread = threading.Thread(target=self._run, name="analytics-view", daemon=True)
        self.undecodable = 0

    def start(self) -> None:
        """Assign every partition of ``analytics`` at the horizon and start following."""
        metadata = self._consumer.list_topics(self._topic, timeout=30)
        described = metadata.topics.get(self._topic)
        if described is None or described.error is not None:
            raise RuntimeError(f"topic {self._topic} is missing: run ./fx up first")
        since_ms = int((time.time() - self._horizon_s) * 1000)
        wanted = [TopicPartition(self._topic, p, since_ms) for p in described.partitions]
        found = self._consumer.offsets_for_times(wanted, timeout=30)
        # A partition with nothing that recent answers -1 (its end): start there.
        self._consumer.assign([TopicPartition(tp.topic, tp.partition, tp.offset) for tp in found])
        self._thread.start()

    def close(self) -> None:
        """Stop following and close the consumer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._consumer.close()

    @property
    def following(self) -> bool:
        """True while the view's thread reads the topic."""
        return self._thread.is_alive() and not self._stop.is_set()

    def query(
        self,
        *,
        user_id: str | None,
        window: WindowKind | None = None,
        dimension: Dimension | None = None,
        key: str | None = None,
        since: float | None = None,
        until: float | None = None,
        combine_users: bool = False,
    ) -> list[WindowAggregate]:
        """The windows that match, oldest first. ``user_id`` None: every user's (the
        admin); with ``combine_users`` one figure per window and key, summed over users
        (its ``user_id`` is then the first user's and means nothing)."""
        with self._lock:
            found = [
                a
                for a in self._latest.values()
                if (user_id is None or a.user_id == user_id)
                and (window is None or a.window == window)
                and (dimension is None or a.dimension == dimension)
                and (key is None or a.key == key)
                and (since is None or a.end > since)
                and (until is None or a.start <= until)
            ]
        if combine_users:
            groups: dict[tuple[Any, ...], list[WindowAggregate]] = {}
            for a in found:
                place = (a.window, a.size_s, a.step_s, a.start, a.dimension, a.key)
                groups.setdefault(place, []).append(a)
            found = [merge(items) for items in groups.values()]
        found.sort(key=lambda a: (a.start, a.window, a.dimension, a.key, a.user_id))
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._consumer.poll(0.2)
            if first is None:
                continue
            messages = [first, *self._consumer.consume(num_messages=499, timeout=0)]
            with self._lock:
                for message in messages:
                    self._fold(message)
                if len(self._latest) > self._max_entries:
                    self._prune()

    def _fold(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("analytics view: %s", error)
            return
        value = message.value()
        if value is None:
            return
        try:
            aggregate = decode(value, WindowAggregate)
        except RecordDecodeError:
            self.undecodable += 1
            return
        self._latest[aggregate.topic_key()] = aggregate

    def _prune(self) -> None:
        cutoff = time.time() - self._horizon_s
        kept = sorted(
            (a for a in self._latest.values() if a.end >= cutoff),
            key=lambda a: a.start,
            reverse=True,
        )[: int(self._max_entries * 0.9)]
        self._latest = {a.topic_key(): a for a in kept}
