"""The topic catalogue: every fxstream topic, its key, and its Kafka settings.

This module is the single source of truth for topic names and settings. The
launcher provisions the static topics from it, the service creates per-endpoint
and per-user topics from its templates, and docs/topics.md is rendered from it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Final

__all__ = [
    "DAY_MS",
    "FROM_ENDPOINT",
    "FROM_USER",
    "HOUR_MS",
    "Catalogue",
    "CleanupPolicy",
    "InvalidTopicName",
    "TopicSpec",
]

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

# Kafka accepts [A-Za-z0-9._-]; we leave '_' out of ids because Kafka's metric
# names treat '.' and '_' as the same character and warn about collisions.
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")
_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9.-]{0,64}$")
_KAFKA_TOPIC_MAX_LEN = 249


class InvalidTopicName(ValueError):
    """A topic prefix or a templated id (endpoint, user, event source) is not usable in a name."""


class CleanupPolicy(StrEnum):
    """Kafka's ``cleanup.policy``: delete old segments, or keep the latest record per key."""

    DELETE = "delete"
    COMPACT = "compact"


@dataclass(frozen=True)
class TopicSpec:
    """One topic (or one family of topics, when ``template_field`` is set) and its settings.

    ``name`` is the name without the deployment prefix; for a template it holds
    a ``{placeholder}``, e.g. ``tasks.ep.{endpoint_id}``.
    """

    name: str
    key: str
    summary: str
    written_by: str
    read_by: str
    cleanup_policy: CleanupPolicy
    partitions: int
    retention_ms: int
    max_message_bytes: int = 1_048_576
    template_field: str | None = None
    # Kafka's segment.ms: how often the active segment rolls. Only a rolled segment is
    # compacted (or deleted), so a compacted topic written all the time sets it; Kafka's
    # default (7 days, or 1 GiB a partition) would keep every superseded record and
    # tombstone that long.
    segment_ms: int | None = None

    @property
    def is_template(self) -> bool:
        """True for a per-endpoint, per-user or per-source family of topics."""
        return self.template_field is not None

    def kafka_configs(self, *, min_insync_replicas: int) -> dict[str, str]:
        """The topic-level configs fxstream sets (and checks for drift) on this topic."""
        return {
            "cleanup.policy": self.cleanup_policy.value,
            "retention.ms": str(self.retention_ms),
            "max.message.bytes": str(self.max_message_bytes),
            "min.insync.replicas": str(min_insync_replicas),
        } | ({} if self.segment_ms is None else {"segment.ms": str(self.segment_ms)})


USERS = TopicSpec(
    name="users",
    key="user id",
    summary="Registered users and the SHA-256 of their API token (never the token itself).",
    written_by="service",
    read_by="service (API), router",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=1,
    retention_ms=-1,
)
FUNCTIONS = TopicSpec(
    name="functions",
    key="function id",
    summary="Registered functions (code, owner, sharing); the latest record per id is the truth, "
    "a tombstone deletes.",
    written_by="service",
    read_by="router; agents (on a cache miss, through the API)",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=4,
    retention_ms=-1,
    max_message_bytes=4 * 1_048_576,
)
ENDPOINTS = TopicSpec(
    name="endpoints",
    key="endpoint id",
    summary="Registered endpoints (owner, name, who may use them).",
    written_by="service",
    read_by="router",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=4,
    retention_ms=-1,
)
FROM_USER = TopicSpec(
    name="from.user.{user_id}",
    key="task id",
    summary="The only topic user U writes: its task submissions, and cancel requests for its "
    "tasks (after the task, on its partition). Only U's principal (and the service's trigger "
    "processor, for U's own rules) may write it, so the router takes the submitter from the "
    "topic name, never from the record.",
    written_by="that user's SDK (the API, as admin, on its behalf); the trigger processor, "
    "for the firings of that user's rules",
    read_by="router (every user's: those its view of the user registry holds)",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=7 * DAY_MS,
    template_field="user_id",
)
ENDPOINT_QUEUE = TopicSpec(
    name="tasks.ep.{endpoint_id}",
    key="task id",
    summary="One endpoint's durable queue of routed tasks (and their authorised cancels); it "
    "waits here while the endpoint is offline.",
    written_by="router",
    read_by="that endpoint's agent only",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=14 * DAY_MS,
    template_field="endpoint_id",
)
HEARTBEATS = TopicSpec(
    name="heartbeats",
    key="endpoint id",
    summary="Periodic liveness and load reports from agents.",
    written_by="agents",
    read_by="liveness processor",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=6 * HOUR_MS,
    max_message_bytes=262_144,
)
ENDPOINT_LOGS = TopicSpec(
    name="endpoint-logs",
    key="endpoint id",
    summary="Agents' log lines, in batches, for each endpoint's owner to read through the API.",
    written_by="ingress (each endpoint's own, checked)",
    read_by="the API, for the endpoint's owner (GET /v1/endpoints/{id}/logs)",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=3 * DAY_MS,
    max_message_bytes=4 * 1_048_576,
)
WARM = TopicSpec(
    name="warm",
    key="endpoint id / manager id",
    summary="Which functions and containers each endpoint manager holds warm.",
    written_by="agents",
    read_by="router",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=4,
    retention_ms=-1,
    segment_ms=HOUR_MS,
)
DATA_LOCATIONS = TopicSpec(
    name="data-locations",
    key="object key",
    summary="Where a proxied object lives (store, site), for locality-aware routing.",
    written_by="agents, connectors",
    read_by="nothing in the service yet (placement's locality reads a payload's own references)",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=4,
    retention_ms=-1,
    segment_ms=HOUR_MS,
)
RESULTS = TopicSpec(
    name="results.{user_id}",
    key="task id",
    summary="Result metadata (value inline or by proxy, or the error) for one user's tasks.",
    written_by="ingress (an endpoint's checked results) and the router (rejected tasks)",
    read_by="that user's SDK; task-state processor",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=7 * DAY_MS,
    template_field="user_id",
)
TASK_STATE = TopicSpec(
    name="task-state",
    key="task id",
    summary="The latest known state of every task, for status queries and de-duplication.",
    written_by="processors",
    read_by="API, SDK status",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=8,
    retention_ms=-1,
    segment_ms=HOUR_MS,
)
TASK_EVENTS = TopicSpec(
    name="task-events",
    key="task id",
    summary="Lifecycle steps other than results (running, retrying, waiting-for-endpoint, "
    "cancelled), folded into task-state when the lifecycle allows them.",
    written_by="agents, liveness processor",
    read_by="task-state processor",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=8,
    retention_ms=7 * DAY_MS,
)
EVENTS = TopicSpec(
    name="events.{source}",
    key="event key",
    summary="Events from one source (a file watcher, an instrument) that may trigger tasks.",
    written_by="event sources",
    read_by="trigger processor (the sources its rules name), Parquet sink",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=7 * DAY_MS,
    template_field="source",
)
TRIGGERS = TopicSpec(
    name="triggers",
    key="rule id",
    summary="Trigger rules (owner, event filter, function, endpoint, arguments, paused, "
    "limits); the latest record per id is the truth, a tombstone deletes.",
    written_by="service (API)",
    read_by="trigger processor; the API's view",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=1,
    retention_ms=-1,
)
HELD_TASKS = TopicSpec(
    name="held-tasks",
    key="task id",
    summary="Tasks held until their parents succeed (task DAGs): the submission as the router "
    "read it, its parents and when it was held; the dependencies processor releases it to its "
    "submitter's topic with the parents' results, or fails it, and writes a tombstone in the "
    "same transaction, so holding survives restarts. The router also copies every authorised "
    "cancel here (a TaskCancel under the task's key): a held task's cancels it; any other is "
    "cleared with a tombstone.",
    written_by="router (holds, copies of cancels), dependencies processor (tombstones)",
    read_by="dependencies processor",
    cleanup_policy=CleanupPolicy.COMPACT,
    partitions=4,
    retention_ms=-1,
    # A held record wraps a whole submission (up to from.user's limit) and its routing facts.
    max_message_bytes=2 * 1_048_576,
)

ANALYTICS = TopicSpec(
    name="analytics",
    key="window, size, step, dimension, user, key and start (WindowAggregate.topic_key)",
    summary="Windowed aggregates of task states per user, function, endpoint and trigger "
    "rule (tumbling and hopping windows): counts, outcomes, state changes and a bounded "
    "latency histogram; the latest record per key is the window's current figure.",
    written_by="analytics processor",
    read_by="the API's analytics view; operators",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=7 * DAY_MS,
    max_message_bytes=262_144,
)
STREAMS = TopicSpec(
    name="streams.{stream}",
    key="stream name (or the producer's chosen key)",
    summary="One SDK stream (StreamProducer -> StreamConsumer): each value is an opaque "
    "ProxyStore event batch (proxystore.stream.events bytes, not a fxstream record) carrying "
    "store keys of bulk objects, or small objects inline, and the end-of-stream marker.",
    written_by="SDK stream producers",
    read_by="SDK stream consumers (a consumer group each)",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=4,
    retention_ms=7 * DAY_MS,
    template_field="stream",
)
FROM_ENDPOINT = TopicSpec(
    name="from.ep.{endpoint_id}",
    key="task id (results, task events); endpoint id (heartbeats); as the shared topic",
    summary="The only topic endpoint E's agent writes: results, task events, heartbeats, warm "
    "adverts, data locations and its dead letters. The ingress processor checks each "
    "against E (a result or task event only with the router's routing stamp of its task for "
    "E, a heartbeat only for E) and forwards it to results.<user>, task-events, heartbeats, "
    "warm, data-locations or dead-letter.",
    written_by="that endpoint's agent only",
    read_by="ingress processor (every live endpoint's: those its view of the endpoint "
    "registry holds)",
    cleanup_policy=CleanupPolicy.DELETE,
    # One partition: one endpoint's agents write it and nothing needs its records spread,
    # while every partition costs the ingress on every fetch (KIP-227 sessions are not in
    # aiokafka) and the broker a log: 10,000 endpoints are 10,000 partitions, not 40,000.
    partitions=1,
    retention_ms=7 * DAY_MS,
    # It carries the agent's dead letters too, which are larger than any other record.
    max_message_bytes=5 * 1_048_576,
    template_field="endpoint_id",
)
DEAD_LETTER = TopicSpec(
    name="dead-letter",
    key="original key",
    summary="Records that could not be processed, with the reason, the component and the "
    "original bytes.",
    written_by="everyone",
    read_by="operators",
    cleanup_policy=CleanupPolicy.DELETE,
    partitions=1,
    retention_ms=30 * DAY_MS,
    # A dead letter wraps an original record plus its reason, so it needs headroom above
    # the largest record any other topic accepts.
    max_message_bytes=5 * 1_048_576,
)

_ALL_SPECS: tuple[TopicSpec, ...] = (
    USERS,
    FUNCTIONS,
    ENDPOINTS,
    FROM_USER,
    ENDPOINT_QUEUE,
    HEARTBEATS,
    ENDPOINT_LOGS,
    WARM,
    DATA_LOCATIONS,
    RESULTS,
    TASK_STATE,
    TASK_EVENTS,
    EVENTS,
    TRIGGERS,
    HELD_TASKS,
    ANALYTICS,
    STREAMS,
    FROM_ENDPOINT,
    DEAD_LETTER,
)


# Each record a processor reads or writes names its topic: the names and ids of the topics
# in use, remembered (a few hundred bytes each, at most this many of each).
_NAMES_CACHED: Final = 4_096


def _full_name(prefix: str, name: str) -> str:
    full = prefix + name
    if len(full) > _KAFKA_TOPIC_MAX_LEN:
        raise InvalidTopicName(f"topic name {full!r} is longer than Kafka's 249 characters")
    return full


@functools.lru_cache(maxsize=_NAMES_CACHED)
def _templated(prefix: str, template: str, template_field: str, value: str) -> str:
    """``template`` filled with ``value`` (checked), prefixed; a refusal is not cached."""
    return _full_name(prefix, template.format(**{template_field: _check_id(template_field, value)}))


@functools.lru_cache(maxsize=_NAMES_CACHED)
def _template_value(prefix: str, template: str, topic: str) -> str | None:
    head = prefix + template.split("{", 1)[0]
    if not topic.startswith(head):
        return None
    value = topic[len(head) :]
    return value if _ID_PATTERN.match(value) else None


def _check_id(kind: str, value: str) -> str:
    if not _ID_PATTERN.match(value):
        raise InvalidTopicName(
            f"{kind} {value!r} cannot be used in a topic name: use 1-128 characters of "
            "letters, digits and '-', starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class Catalogue:
    """The catalogue for one deployment: a name prefix and the replication settings.

    On one broker use the defaults; on the 3-broker cluster use
    ``replication_factor=3, min_insync_replicas=2`` (see ``for_cluster``).
    """

    prefix: str = "fx."
    replication_factor: int = 1
    min_insync_replicas: int = 1
    specs: tuple[TopicSpec, ...] = field(default=_ALL_SPECS)

    def __post_init__(self) -> None:
        if not _PREFIX_PATTERN.match(self.prefix):
            raise InvalidTopicName(
                f"topic prefix {self.prefix!r} is not usable: use up to 64 characters of "
                "letters, digits, '.' and '-' (set FXSTREAM_TOPIC_PREFIX)"
            )
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"min_insync_replicas ({self.min_insync_replicas}) cannot exceed "
                f"replication_factor ({self.replication_factor})"
            )

    def for_cluster(self, brokers: int) -> Catalogue:
        """The same catalogue with replication sized for ``brokers`` brokers (3 -> RF 3, ISR 2)."""
        replication = min(3, brokers)
        return replace(
            self,
            replication_factor=replication,
            min_insync_replicas=max(1, replication - 1),
        )

    def spec(self, name: str) -> TopicSpec:
        """The spec whose unprefixed name (or template) is ``name``."""
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(f"no topic {name!r} in the catalogue")

    def topic(self, spec: TopicSpec, **template_values: str) -> str:
        """The full topic name of ``spec``, filling its template from ``template_values``."""
        if spec.template_field is None:
            if template_values:
                raise TypeError(f"topic {spec.name!r} is not a template")
            name = spec.name
        else:
            value = template_values.get(spec.template_field)
            if value is None or len(template_values) != 1:
                raise TypeError(f"topic {spec.name!r} needs exactly {spec.template_field}=...")
            return _templated(self.prefix, spec.name, spec.template_field, value)
        return _full_name(self.prefix, name)

    def spec_for_topic(self, topic: str) -> TopicSpec | None:
        """The spec a full topic name belongs to (templates matched by their fixed part)."""
        if not topic.startswith(self.prefix):
            return None
        bare = topic[len(self.prefix) :]
        for spec in self.specs:
            if spec.template_field is None:
                if bare == spec.name:
                    return spec
            else:
                head = spec.name.split("{", 1)[0]
                if bare.startswith(head) and _ID_PATTERN.match(bare[len(head) :]):
                    return spec
        return None

    def static_topics(self) -> dict[str, TopicSpec]:
        """Every non-template topic by full name: what a deployment provisions at start."""
        return {self.topic(spec): spec for spec in self.specs if not spec.is_template}

    # Named accessors, so callers never spell a topic name by hand.
    @property
    def users(self) -> str:
        """The compacted user registry."""
        return self.topic(USERS)

    @property
    def functions(self) -> str:
        """The compacted function registry."""
        return self.topic(FUNCTIONS)

    @property
    def endpoints(self) -> str:
        """The compacted endpoint registry."""
        return self.topic(ENDPOINTS)

    @property
    def heartbeats(self) -> str:
        """Agent heartbeats."""
        return self.topic(HEARTBEATS)

    @property
    def endpoint_logs(self) -> str:
        """Agents' log lines, per endpoint."""
        return self.topic(ENDPOINT_LOGS)

    @property
    def warm(self) -> str:
        """Warm-container adverts (compacted)."""
        return self.topic(WARM)

    @property
    def data_locations(self) -> str:
        """Where proxied objects live (compacted)."""
        return self.topic(DATA_LOCATIONS)

    @property
    def triggers(self) -> str:
        """The compacted trigger rules."""
        return self.topic(TRIGGERS)

    @property
    def held_tasks(self) -> str:
        """The compacted table of tasks waiting for their parents."""
        return self.topic(HELD_TASKS)

    @property
    def analytics(self) -> str:
        """The windowed aggregates of the analytics processor (time-retained)."""
        return self.topic(ANALYTICS)

    @property
    def events_pattern(self) -> str:
        """The regular expression matching every source's ``events.<S>`` topic."""
        return self.pattern(EVENTS)

    def source_of(self, topic: str) -> str | None:
        """The source whose ``events.<S>`` topic ``topic`` is (None for any other topic)."""
        return self.template_value(EVENTS, topic)

    @property
    def task_state(self) -> str:
        """The compacted task-state view."""
        return self.topic(TASK_STATE)

    @property
    def task_events(self) -> str:
        """Lifecycle steps for the task-state processor."""
        return self.topic(TASK_EVENTS)

    @property
    def dead_letter(self) -> str:
        """Records nobody could process, with reasons."""
        return self.topic(DEAD_LETTER)

    def endpoint_queue(self, endpoint_id: str) -> str:
        """The queue topic of one endpoint."""
        return self.topic(ENDPOINT_QUEUE, endpoint_id=endpoint_id)

    def from_user(self, user_id: str) -> str:
        """The one topic user ``user_id`` writes: its submissions and cancels."""
        return self.topic(FROM_USER, user_id=user_id)

    def from_endpoint(self, endpoint_id: str) -> str:
        """The one topic endpoint ``endpoint_id``'s agent writes: everything it reports."""
        return self.topic(FROM_ENDPOINT, endpoint_id=endpoint_id)

    def template_value(self, spec: TopicSpec, topic: str) -> str | None:
        """The id a templated topic name carries (``from.user.U`` -> ``U``), or None when
        ``topic`` is not of ``spec``'s family."""
        if spec.template_field is None:
            return None
        return _template_value(self.prefix, spec.name, topic)

    def user_of(self, topic: str) -> str | None:
        """The user whose ``from.user.<U>`` topic ``topic`` is (None for any other topic)."""
        return self.template_value(FROM_USER, topic)

    def endpoint_of(self, topic: str) -> str | None:
        """The endpoint whose ``from.ep.<E>`` topic ``topic`` is (None for any other topic)."""
        return self.template_value(FROM_ENDPOINT, topic)

    @property
    def from_user_pattern(self) -> str:
        """The regular expression matching every user's ``from.user.<U>`` topic."""
        return self.pattern(FROM_USER)

    @property
    def from_endpoint_pattern(self) -> str:
        """The regular expression matching every endpoint's ``from.ep.<E>`` topic."""
        return self.pattern(FROM_ENDPOINT)

    def pattern(self, spec: TopicSpec) -> str:
        """The regular expression matching every topic of a template (for subscriptions)."""
        if spec.template_field is None:
            raise TypeError(f"topic {spec.name!r} is not a template")
        head = self.prefix + spec.name.split("{", 1)[0]
        return "^" + re.escape(head) + r"[A-Za-z0-9][A-Za-z0-9-]{0,127}$"

    def results(self, user_id: str) -> str:
        """The results topic of one user."""
        return self.topic(RESULTS, user_id=user_id)

    def events(self, source: str) -> str:
        """The event topic of one event source."""
        return self.topic(EVENTS, source=source)

    def stream(self, name: str) -> str:
        """The topic of one SDK stream (``streams.<name>``)."""
        return self.topic(STREAMS, stream=name)
