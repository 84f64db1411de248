"""Prometheus metrics of the service: the API's ``GET /metrics`` and each processor's port.

Every process exports its own registry (docs/metrics.md lists every series):

- the REST API serves ``/metrics`` on its own port (:class:`ApiMetrics`): tasks by state
  and the per-hop latencies of finished tasks (from the task states its view folds, i.e.
  what the task-state processor wrote), each endpoint's queue depth, workers and blocks
  (from its latest heartbeat; at most ``max_endpoints`` endpoints, the rest counted in
  ``fxstream_endpoint_series_dropped``), the consumer lag of every processor group (the
  group's committed offsets against the partitions' ends, asked of Kafka at a scrape,
  cached a few seconds), and the dead letters written since it started (it follows the
  ``dead-letter`` topic from its end);
- each stream processor, when ``FXSTREAM_METRICS_PORT`` is set (the supervisor gives each
  a free port), serves its batches, the records it read and the records it wrote per
  topic (:data:`PROCESSOR_METRICS`, prometheus_client's default registry, with the
  process's CPU and memory).

Hot paths only increment a counter (a dict lookup for the child); labels are bounded:
states, hops, dead-letter reasons and topic families are closed sets, endpoints are capped.
No series carries a token, a user id or any task data: only counts and durations.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fxstream.service.registry import EndpointStatus, RegistryView
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    KafkaConnection,
    RecordDecodeError,
    TaskState,
    TaskTimings,
    decode,
)
from fxstream.topics.acls import SERVICE_GROUP_PREFIX

__all__ = [
    "API_METRICS_ENV",
    "HOPS",
    "LATENCY_BUCKETS",
    "MAX_ENDPOINTS_ENV",
    "METRICS_ADDR_ENV",
    "METRICS_PORT_ENV",
    "PROCESSOR_GROUPS",
    "PROCESSOR_METRICS",
    "ApiMetrics",
    "DeadLetterCounter",
    "EndpointCollector",
    "LagCollector",
    "ProcessorMetrics",
    "TaskMetrics",
    "consumer_lag",
    "exported_endpoints",
    "metrics_access",
    "serve_metrics_from_env",
]

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "FXSTREAM_METRICS_PORT"
"""A processor's (or agent's) metrics port; unset or 0: no metrics server."""
METRICS_ADDR_ENV = "FXSTREAM_METRICS_ADDR"
"""The address a processor's (or agent's) metrics server listens on (default 127.0.0.1)."""
API_METRICS_ENV = "FXSTREAM_API_METRICS"
"""Who may read the API's ``/metrics``: ``admin`` (default), ``open`` or ``off``."""
MAX_ENDPOINTS_ENV = "FXSTREAM_METRICS_MAX_ENDPOINTS"
"""How many endpoints the API exports series for (default 100)."""
DEFAULT_MAX_ENDPOINTS = 100
METRICS_ACCESS = ("admin", "open", "off")

# Each hop of a task, as (name, from, to) of its TaskTimings.
HOPS: tuple[tuple[str, str, str], ...] = (
    ("submitted_to_routed", "submitted_at", "routed_at"),
    ("routed_to_dequeued", "routed_at", "dequeued_at"),
    ("dequeued_to_started", "dequeued_at", "started_at"),
    ("started_to_finished", "started_at", "finished_at"),
    ("finished_to_result_published", "finished_at", "result_published_at"),
    ("submitted_to_result_published", "submitted_at", "result_published_at"),
)
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    float("inf"),
)
_FINISHED = frozenset({"succeeded", "failed"})
# A hop longer than this (clock skew, a task held for days) is not a latency sample.
_MAX_HOP_S = 7 * 24 * 3600.0

# The processors' consumer groups (fxstream.service.processors: <app id>-<role>; the
# liveness agent is faust's, in the app id's own group). The dependencies and analytics
# processors join no group (they read their topics whole).
PROCESSOR_GROUPS: Mapping[str, str] = {
    "router": f"{SERVICE_GROUP_PREFIX}-router",
    "ingress": f"{SERVICE_GROUP_PREFIX}-ingress",
    "task-state": f"{SERVICE_GROUP_PREFIX}-task-state",
    "liveness": SERVICE_GROUP_PREFIX,
    "trigger": f"{SERVICE_GROUP_PREFIX}-trigger",
}
_KNOWN_REASONS = frozenset(str(r) for r in DeadLetterReason)


def metrics_access(value: str | None) -> str:
    """The API's ``/metrics`` access from its setting (``admin`` when unset)."""
    access = (value or "admin").strip().lower()
    if access not in METRICS_ACCESS:
        raise ValueError(
            f"{API_METRICS_ENV} must be one of {', '.join(METRICS_ACCESS)}, not {value!r}"
        )
    return access


def _reason_label(error_type: str) -> str:
    return error_type if error_type in _KNOWN_REASONS else "other"


# --- tasks by state and hop latencies ------------------------------------------------------


class TaskMetrics:
    """``fxstream_tasks_total{state}`` and ``fxstream_task_hop_seconds{hop}``, from task states.

    Fed by a registry view's ``on_task_state`` (its thread). Counting starts at
    :meth:`enable` (the API calls it once its view has read ``task-state`` as it was at
    start), so a restart does not count every retained task again.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        """Register the series in ``registry``."""
        self._tasks = Counter(
            "fxstream_tasks",
            "Task states recorded on task-state (each task counts once per state it enters)",
            ["state"],
            registry=registry,
        )
        self._hops = Histogram(
            "fxstream_task_hop_seconds",
            "Time between two hops of a finished task (from its result's timings)",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._by_state: dict[str, Counter] = {}
        self._hop_children = {name: self._hops.labels(hop=name) for name, _, _ in HOPS}
        self._enabled = False

    def enable(self) -> None:
        """Count every state from now on."""
        self._enabled = True

    def observe(self, key: str, state: TaskState) -> None:
        """Count ``state``; a finished task's hops go to the histogram."""
        if not self._enabled:
            return
        name = str(state.state)
        child = self._by_state.get(name)
        if child is None:
            child = self._by_state[name] = self._tasks.labels(state=name)
        child.inc()
        if name in _FINISHED:
            self.observe_hops(state.timings)

    def observe_hops(self, timings: TaskTimings) -> None:
        """Add each hop ``timings`` has both ends of."""
        for name, start, end in HOPS:
            began, ended = getattr(timings, start), getattr(timings, end)
            if began is None or ended is None:
                continue
            seconds = ended - began
            if 0 <= seconds <= _MAX_HOP_S:
                self._hop_children[name].observe(seconds)
            elif -1.0 <= seconds < 0:  # clocks of two hosts a little apart
                self._hop_children[name].observe(0.0)


# --- endpoints, from their heartbeats ------------------------------------------------------


class EndpointCollector(Collector):
    """Per endpoint: up, queue depth, workers and blocks by state, from its last heartbeat.

    At most ``max_endpoints`` endpoints get series (online ones first, then the most
    recently seen); ``fxstream_endpoint_series_dropped`` counts the others, and
    ``fxstream_endpoints{state}`` counts every endpoint whatever the cap.
    """

    def __init__(self, view: RegistryView, max_endpoints: int = DEFAULT_MAX_ENDPOINTS) -> None:
        """Read ``view`` at each scrape."""
        self._view = view
        self._max = max(0, max_endpoints)

    def collect(self) -> Iterable[Metric]:
        """The endpoint series as they are now."""
        now = time.time()
        statuses = [
            (e.endpoint_id, self._view.endpoint_status(e.endpoint_id, now))
            for e in self._view.endpoints()
        ]
        counts = {"online": 0, "lost": 0, "never-seen": 0}
        for _, status in statuses:
            counts[status.state] = counts.get(status.state, 0) + 1
        endpoints = GaugeMetricFamily(
            "fxstream_endpoints", "Registered endpoints by liveness", labels=["state"]
        )
        for state, count in counts.items():
            endpoints.add_metric([state], count)
        yield endpoints
        kept, dropped = exported_endpoints(statuses, self._max)
        up = GaugeMetricFamily(
            "fxstream_endpoint_up", "1 while the endpoint's heartbeats arrive", labels=["endpoint"]
        )
        queue = GaugeMetricFamily(
            "fxstream_endpoint_queue_depth",
            "Tasks the endpoint's agent fetched and has not started (last heartbeat)",
            labels=["endpoint"],
        )
        workers = GaugeMetricFamily(
            "fxstream_endpoint_workers",
            "The endpoint's workers by state (last heartbeat)",
            labels=["endpoint", "state"],
        )
        blocks = GaugeMetricFamily(
            "fxstream_endpoint_blocks",
            "A batch engine's blocks (scheduler jobs) by state (last heartbeat)",
            labels=["endpoint", "state"],
        )
        age = GaugeMetricFamily(
            "fxstream_endpoint_heartbeat_age_seconds",
            "Seconds since the endpoint's last heartbeat was sent",
            labels=["endpoint"],
        )
        for endpoint_id, s in kept:
            up.add_metric([endpoint_id], 1.0 if s.state == "online" else 0.0)
            queue.add_metric([endpoint_id], s.queue_depth)
            for state, value in (
                ("total", s.workers_total),
                ("idle", s.workers_idle),
                ("busy", s.workers_busy),
            ):
                workers.add_metric([endpoint_id, state], value)
            for state, value in (
                ("pending", s.blocks_pending),
                ("running", s.blocks_running),
                ("idle", s.blocks_idle),
            ):
                blocks.add_metric([endpoint_id, state], value)
            age.add_metric([endpoint_id], max(0.0, now - (s.last_seen or now)))
        yield from (up, queue, workers, blocks, age)
        yield GaugeMetricFamily(
            "fxstream_endpoint_series_dropped",
            f"Endpoints seen but not exported (over {MAX_ENDPOINTS_ENV})",
            value=dropped,
        )


def exported_endpoints(
    statuses: Iterable[tuple[str, EndpointStatus]], limit: int
) -> tuple[list[tuple[str, EndpointStatus]], int]:
    """The endpoints that get series (at most ``limit``: online ones first, then the most
    recently seen; never-seen ones none) and how many seen ones were left out."""
    seen = [(eid, s) for eid, s in statuses if s.state != "never-seen"]
    seen.sort(key=lambda item: (item[1].state != "online", -(item[1].last_seen or 0.0)))
    return seen[:limit], max(0, len(seen) - limit)


# --- consumer lag --------------------------------------------------------------------------


def consumer_lag(
    committed: Mapping[int, int], earliest: Mapping[int, int], latest: Mapping[int, int]
) -> int:
    """Records of one topic a group has not gone past: per partition, its end less the
    group's committed offset (or the partition's start when the group committed nothing
    there, or when retention deleted past the committed offset), never below 0."""
    lag = 0
    for partition, end in latest.items():
        start = earliest.get(partition, 0)
        position = committed.get(partition, -1)
        lag += max(0, end - max(start, position if position >= 0 else start))
    return lag


@dataclass(frozen=True)
class _Lag:
    lag: dict[str, int]
    at: float


class LagCollector(Collector):
    """``fxstream_consumer_lag{group}`` for every processor group, asked of Kafka.

    A scrape asks the group's committed offsets, then the earliest and latest
    (``read_committed``) offsets of the partitions it committed for; the answer is kept
    ``cache_s`` seconds. A group Kafka cannot answer for is left out of that scrape
    (``fxstream_consumer_lag_errors_total`` counts it).
    """

    def __init__(
        self,
        admin: AdminClient,
        groups: Mapping[str, str] = PROCESSOR_GROUPS,
        *,
        timeout_s: float = 5.0,
        cache_s: float = 5.0,
    ) -> None:
        """Ask ``admin`` for each of ``groups`` (role -> consumer group id)."""
        self._admin = admin
        self._groups = dict(groups)
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._cached: _Lag | None = None
        self._lock = threading.Lock()
        self._errors = 0

    def lag(self) -> dict[str, int]:
        """Role -> records its group has not gone past (cached ``cache_s``)."""
        with self._lock:
            cached = self._cached
            if cached is not None and time.monotonic() - cached.at < self._cache_s:
                return cached.lag
            lag: dict[str, int] = {}
            # One scrape waits at most timeout_s for Kafka, however many groups hang.
            deadline = time.monotonic() + self._timeout_s
            for role, group in self._groups.items():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._errors += 1
                    continue
                try:
                    lag[role] = self._group_lag(group, max(0.5, left))
                except (KafkaException, ValueError, TimeoutError) as exc:
                    self._errors += 1
                    log.debug("metrics: no lag for group %s: %s", group, exc)
            self._cached = _Lag(lag, time.monotonic())
            return lag

    def _group_lag(self, group: str, timeout_s: float) -> int:
        asked = self._admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group)], request_timeout=timeout_s
        )
        listed = asked[group].result(timeout_s).topic_partitions or []
        partitions = [TopicPartition(tp.topic, tp.partition) for tp in listed]
        committed = {(tp.topic, tp.partition): tp.offset for tp in listed}
        if not partitions:
            return 0
        ends: list[dict[tuple[str, int], int]] = []
        for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):  # type: ignore[no-untyped-call]
            answers = self._admin.list_offsets(
                {tp: spec for tp in partitions},
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=timeout_s,
            )
            ends.append(
                {(tp.topic, tp.partition): f.result(timeout_s).offset for tp, f in answers.items()}
            )
        earliest, latest = ends
        total = 0
        for topic in {t for t, _ in latest}:
            total += consumer_lag(
                {p: o for (t, p), o in committed.items() if t == topic},
                {p: o for (t, p), o in earliest.items() if t == topic},
                {p: o for (t, p), o in latest.items() if t == topic},
            )
        return total

    def collect(self) -> Iterable[Metric]:
        """The lag per group as Kafka gives it now (or a few seconds ago)."""
        lag = self.lag()
        family = GaugeMetricFamily(
            "fxstream_consumer_lag",
            "Records on a processor group's input partitions past its committed offsets",
            labels=["group"],
        )
        for role, value in sorted(lag.items()):
            family.add_metric([role], value)
        yield family
        errors = GaugeMetricFamily(
            "fxstream_consumer_lag_errors",
            "Times a group's lag could not be read from Kafka (since the API started)",
            value=self._errors,
        )
        yield errors


# --- dead letters ----------------------------------------------------------------------------


class DeadLetterCounter:
    """Follows the ``dead-letter`` topic from its end and counts each dead letter by reason.

    ``fxstream_dead_letters_total{reason}``: every dead letter any component (router,
    ingress, task-state, an agent through the ingress, a registry view) wrote since this
    process started; ``reason`` is the dead letter's ``error_type`` (the closed
    ``DeadLetterReason`` vocabulary; anything else counts as ``other``).
    """

    def __init__(
        self, kafka: KafkaConnection, catalogue: Catalogue, registry: CollectorRegistry
    ) -> None:
        """Register the series; :meth:`start` begins following."""
        self._topic = catalogue.dead_letter
        self._counter = Counter(
            "fxstream_dead_letters",
            "Dead letters written (any component) since this process started, by reason",
            ["reason"],
            registry=registry,
        )
        # Every known reason shows 0 from the start (a rate needs a first sample).
        for reason in sorted(_KNOWN_REASONS):
            self._counter.labels(reason=reason)
        self._consumer = Consumer(
            {
                **kafka.confluent(),
                "group.id": "fxstream-registry-view-unused",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 500,
                "queued.max.messages.kbytes": 1_024,
                "log_level": 2,
            }
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dead-letter-count", daemon=True)

    def start(self) -> None:
        """Assign every partition of the dead-letter topic at its end and follow it."""
        metadata = self._consumer.list_topics(self._topic, timeout=30)
        described = metadata.topics.get(self._topic)
        if described is None or described.error is not None:
            raise RuntimeError(f"topic {self._topic} is missing: run ./fx up first")
        self._consumer.assign(
            [TopicPartition(self._topic, p, OFFSET_END) for p in described.partitions]
        )
        self._thread.start()

    def close(self) -> None:
        """Stop following."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._consumer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._consumer.poll(0.2)
            if message is None or message.error() is not None:
                continue
            value = message.value()
            reason = "other"
            if value is not None:
                try:
                    reason = _reason_label(decode(value, DeadLetter).error_type)
                except RecordDecodeError:
                    reason = "other"
            self._counter.labels(reason=reason).inc()


# --- the API's registry ------------------------------------------------------------------------


class ApiMetrics:
    """The REST API's registry: tasks, hops, endpoints, lag, dead letters, its process."""

    def __init__(self, *, max_endpoints: int | None = None) -> None:
        """Series for tasks and hops are made at once; :meth:`attach` adds the rest."""
        # No auto_describe: it would call the collectors (Kafka requests) at registration.
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.tasks = TaskMetrics(self.registry)
        if max_endpoints is None:
            raw = os.environ.get(MAX_ENDPOINTS_ENV, "")
            max_endpoints = int(raw) if raw.strip().isdigit() else DEFAULT_MAX_ENDPOINTS
        self._max_endpoints = max_endpoints
        self.dead_letters: DeadLetterCounter | None = None

    def attach(
        self,
        view: RegistryView,
        admin: AdminClient,
        dead_letters: DeadLetterCounter | None,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        """Add the endpoint and lag collectors (read at each scrape) and the dead letters."""
        self.registry.register(EndpointCollector(view, self._max_endpoints))
        self.registry.register(LagCollector(admin, timeout_s=timeout_s))
        self.dead_letters = dead_letters

    def close(self) -> None:
        """Stop following the dead-letter topic."""
        if self.dead_letters is not None:
            self.dead_letters.close()


# --- the processors' registry ------------------------------------------------------------------


class ProcessorMetrics:
    """A stream processor's own series (prometheus_client's default registry, with the
    process's CPU, memory and file descriptors): batches, records read, records written per
    topic family (``tasks.ep.{endpoint_id}``, ``dead-letter``, ...), per component."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        """Register the series in ``registry``."""
        self._batches = Counter(
            "fxstream_processor_batches",
            "Batches a processor committed",
            ["component"],
            registry=registry,
        )
        self._read = Counter(
            "fxstream_processor_records_read",
            "Input records in the batches a processor committed",
            ["component"],
            registry=registry,
        )
        self._written = Counter(
            "fxstream_processor_records_written",
            "Records a processor wrote, by topic (its catalogue name; templates unfilled)",
            ["component", "topic"],
            registry=registry,
        )
        self._children: dict[tuple[str, str], Counter] = {}
        self._families: dict[str, str] = {}

    def batch(
        self, component: str, catalogue: Catalogue, read: int, written: Sequence[object]
    ) -> None:
        """Count one committed batch: ``read`` inputs and the ``written`` records (each with
        a ``topic``)."""
        self._batches.labels(component=component).inc()
        self._read.labels(component=component).inc(read)
        for record in written:
            topic = getattr(record, "topic", "")
            family = self._families.get(topic)
            if family is None:
                spec = catalogue.spec_for_topic(topic)
                family = spec.name if spec is not None else "other"
                if len(self._families) < 10_000:
                    self._families[topic] = family
            child = self._children.get((component, family))
            if child is None:
                child = self._written.labels(component=component, topic=family)
                self._children[(component, family)] = child
            child.inc()


PROCESSOR_METRICS = ProcessorMetrics()
"""The processors' series, in this process's default registry."""


def serve_metrics_from_env(
    what: str,
    registry: CollectorRegistry = REGISTRY,
    env: Mapping[str, str] | None = None,
    start: Callable[..., object] = start_http_server,
) -> int | None:
    """Serve ``registry`` on ``$FXSTREAM_METRICS_PORT`` (at ``$FXSTREAM_METRICS_ADDR``,
    127.0.0.1 by default) in a daemon thread; the port, or None when unset or taken (a
    metrics port that cannot be bound is logged, never fatal)."""
    source = os.environ if env is None else env
    raw = source.get(METRICS_PORT_ENV, "").strip()
    if not raw or raw == "0":
        return None
    addr = source.get(METRICS_ADDR_ENV, "").strip() or "127.0.0.1"
    try:
        port = int(raw)
        start(port, addr=addr, registry=registry)
    except (ValueError, OSError) as exc:
        log.warning("%s: no metrics server on %s:%s (%s)", what, addr, raw, exc)
        return None
    log.info("%s: metrics on http://%s:%d/metrics", what, addr, port)
    return port
