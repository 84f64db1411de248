"""A live, in-memory view of the registry topics, rebuilt from Kafka at start.

The compacted topics (users, functions, endpoints, triggers, task-state) are the
service's only state: the view reads each from the beginning, folds the latest
record per key (a tombstone deletes), and keeps following them. Heartbeats
(a delete-policy topic) are folded to the latest per endpoint, which is the
liveness processor's output: an endpoint's status is computed from its last
heartbeat when asked. Kill the service and restart it, and the view is back
as it was.

The router's view also follows ``warm`` (compacted: the latest advert per endpoint
manager), folded into a bounded :class:`~fxstream.service.warm_table.WarmTable`
(:attr:`RegistryView.warm`), and ``heartbeats`` for liveness and backlog.

Task states are not held in memory: ``task-state`` grows with every task ever
run, so the view folds it into a :class:`~fxstream.service.task_table.TaskStateTable`
(RocksDB on local disk, rebuilt at every start) whose memory is bounded by its
settings. The other tables grow with the registry (users, functions, endpoints),
not with tasks. A view that needs only some tasks' states (the trigger processor's: its
rules' tasks) passes ``keep_task_state``, which sees each record's bytes before they are
decoded; the states it refuses cost a glance, not a decode and a table write. What such
a filter asks about (the rules) can be read to its end before ``task-state`` is assigned
(``read_first``), so a state read at start is never judged before what it belongs to.

A record on users, functions, endpoints or triggers that does not decode, or whose Kafka
key is not the id inside it, is ignored (the key keeps what it had) and
dead-lettered (``RecordDecodeError`` / ``KeyMismatch``) by the view that read it:
each view (the API's, the router's) writes its own dead letter, once per
process start, since a compacted topic keeps the bad record until a later
record under its key replaces it; the dead letters of one bad record share its
original topic, partition and offset. A bad record on ``heartbeats`` or
``task-state`` is skipped and logged but not dead-lettered here: the processor
that consumes that topic (liveness; task-state, which alone writes its topic)
dead-letters it, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar, get_args

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from fxstream.service.task_table import QueryPage, StateCounts, TaskQuery, TaskStateTable
from fxstream.service.warm_table import WarmTable
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    EndpointRecord,
    FunctionRecord,
    Heartbeat,
    KafkaConnection,
    Record,
    RecordDecodeError,
    TaskState,
    TaskStateName,
    TriggerRule,
    UserRecord,
    WarmAdvert,
    dead_letter,
    decode,
    encode,
    normalise_headers,
    producer_message_max_bytes,
    task_state_name,
)

__all__ = ["LIVENESS_PERIODS", "PREFETCH_KBYTES", "EndpointStatus", "RegistryView"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)

# An endpoint is lost once this many heartbeat periods pass without one.
LIVENESS_PERIODS = 3.0

# What the view's consumer may hold fetched ahead of its thread, in KiB (librdkafka's
# queued.max.messages.kbytes; its default is 65,536). A record larger than this still
# comes, alone.
PREFETCH_KBYTES = 4_096

# Errors a partition reports while its new leader is being elected or announced.
_NO_LEADER_YET = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError._UNKNOWN_PARTITION,
    }
)

Followed = Literal[
    "users", "functions", "endpoints", "heartbeats", "task-state", "warm", "triggers"
]
ALL_FOLLOWED: tuple[Followed, ...] = (
    "users",
    "functions",
    "endpoints",
    "heartbeats",
    "task-state",
    "triggers",
)


@dataclass(frozen=True)
class EndpointStatus:
    """What the last heartbeat says about an endpoint."""

    state: Literal["online", "lost", "never-seen"]
    last_seen: float | None = None
    workers_total: int = 0
    workers_idle: int = 0
    workers_busy: int = 0
    queue_depth: int = 0
    agent_id: str | None = None
    # Image pools it runs at once when fewer than its images (0: every pool fits).
    pool_slots: int = 0
    # A batch engine's blocks (scheduler jobs): pending, running, running and idle.
    blocks_pending: int = 0
    blocks_running: int = 0
    blocks_idle: int = 0
    # The node key every live agent of the endpoint advertises (its workers share that
    # node-local store, fxstream.connectors.node_local); '' when none does or they differ.
    node_key: str = ""


# The most agents per endpoint whose node keys the view remembers (the newest kept).
_MAX_AGENT_NODES = 16

BadRecord = Callable[[Message, str], None]
# The id field each registry topic's key must equal.
_ID_FIELDS: dict[Followed, str] = {
    "users": "user_id",
    "functions": "function_id",
    "endpoints": "endpoint_id",
    "triggers": "rule_id",
}


class RegistryView:
    """Follows the registry topics in a background thread; lookups are thread-safe dict reads."""

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        *,
        follow: Iterable[Followed] = ALL_FOLLOWED,
        on_bad_record: BadRecord | None = None,
        task_table_dir: Path | None = None,
        component: str | None = "registry view",
        fetch_wait_max_ms: int = 500,
        index_tasks: bool = False,
        on_task_state: Callable[[str, TaskState], None] | None = None,
        keep_task_state: Callable[[bytes], bool] | None = None,
        read_first: Iterable[Followed] = (),
        task_states_by_id: bool = False,
        on_task_state_name: Callable[[str, TaskStateName], None] | None = None,
    ) -> None:
        """``on_bad_record`` is told of every record skipped; ``component`` names the
        dead letters the view writes for them (None: write none). ``fetch_wait_max_ms``
        is how long the broker may hold a fetch that finds nothing new (a write ends the
        wait at once). ``index_tasks``: keep the task-state table's query index (the
        API's view, for :meth:`query_tasks`; the processors' views need none).
        ``on_task_state`` is called, from the view's thread, with each task state once it
        is in the table (so a lookup from the callback, or after it, finds it).

        ``keep_task_state``: which task states the view keeps (None: every one). It is
        given each ``task-state`` record's bytes before they are decoded (so it should
        glance, e.g. :func:`~fxstream.topics.task_state_group`); a record it refuses is
        neither decoded nor stored, and a tombstone costs a write only for a task the
        table holds. ``read_first``: followed topics read to their ends (as at
        :meth:`start`) before the others are assigned, e.g. the rules a filter of task
        states asks about.

        ``task_states_by_id``: the view is only asked :meth:`task` (no groups, queries or
        routing marks), so it stores each state's bytes as read, having glanced at its
        task id and state name (:func:`~fxstream.topics.task_state_name`), and decodes a
        state only when :meth:`task` is asked for it. ``on_task_state_name`` is then told
        each state's task id and name (``on_task_state`` is refused)."""
        if task_states_by_id and (on_task_state is not None or index_tasks):
            raise ValueError(
                "a view of task states by id decodes no state as it reads it, so it can "
                "neither call on_task_state nor index tasks: give on_task_state_name instead"
            )
        self._catalogue = catalogue
        self._kinds: dict[str, tuple[Followed, type[Record]]] = {}
        kind_types: dict[Followed, tuple[str, type[Record]]] = {
            "users": (catalogue.users, UserRecord),
            "functions": (catalogue.functions, FunctionRecord),
            "endpoints": (catalogue.endpoints, EndpointRecord),
            "heartbeats": (catalogue.heartbeats, Heartbeat),
            "task-state": (catalogue.task_state, TaskState),
            "warm": (catalogue.warm, WarmAdvert),
            "triggers": (catalogue.triggers, TriggerRule),
        }
        for followed in follow:
            topic, record_type = kind_types[followed]
            self._kinds[topic] = (followed, record_type)
        self._tables: dict[Followed, dict[str, Record]] = {k: {} for k in get_args(Followed)}
        self.warm = WarmTable()
        """What endpoint managers hold warm (filled only when the view follows ``warm``)."""
        self._token_index: dict[str, UserRecord] = {}
        self._endpoint_token_index: dict[str, EndpointRecord] = {}
        self._identity_index: dict[str, UserRecord] = {}
        # Endpoint -> agent -> (its node key, until when it counts as live): kept only for
        # endpoints one of whose agents ever advertised a key.
        self._agent_nodes: dict[str, dict[str, tuple[str, float]]] = {}
        # Task states and task groups live on disk (a temporary directory by default).
        self._task_table: TaskStateTable | None = None
        if "task-state" in (followed for followed, _ in self._kinds.values()):
            self._task_table = TaskStateTable(task_table_dir, indexed=index_tasks)
        self._positions: dict[tuple[str, int], int] = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._on_bad_record = on_bad_record
        self._on_task_state = on_task_state
        self._by_id = task_states_by_id
        self._on_task_state_name = on_task_state_name
        self._keep_task_state = keep_task_state
        self._read_first = frozenset(read_first)
        # Assigned once the read-first topics reach their ends as at start.
        self._later: list[TopicPartition] = []
        self._first_targets: dict[tuple[str, int], int] = {}
        self._component = component
        self._kafka = kafka
        self._dead_letters: Producer | None = None
        self._consumer = Consumer(
            {
                **kafka.confluent(),
                # No group: the view assigns every partition itself and never commits.
                "group.id": "fxstream-registry-view-unused",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                # The broker answers a fetch as soon as anything (committed) is there, and
                # holds an empty one for fetch.wait.max.ms: a write is seen at once, and an
                # idle view costs the broker two requests a second, not hundreds.
                "fetch.min.bytes": 1,
                "fetch.wait.max.ms": fetch_wait_max_ms,
                # librdkafka prefetches up to 64 MiB by default while the view's thread
                # lags (a burst, a catch-up), and the process keeps much of that memory
                # after it drains: each burst raised the RSS of every task-state follower
                # in the 1-hour soak. A few MiB keep up with any steady load here.
                "queued.max.messages.kbytes": PREFETCH_KBYTES,
                "log_level": 2,
            }
        )
        self._thread = threading.Thread(target=self._run, name="registry-view", daemon=True)
        self._targets: dict[tuple[str, int], int] = {}
        self._assigned: list[TopicPartition] = []

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Assign every partition from the beginning and start following (the
        ``read_first`` topics' alone until they are read to their ends as now)."""
        partitions: list[TopicPartition] = []
        later: list[TopicPartition] = []
        metadata = self._consumer.list_topics(timeout=30)
        for topic, (followed, _) in self._kinds.items():
            described = metadata.topics.get(topic)
            if described is None or described.error is not None:
                raise RuntimeError(f"registry topic {topic} is missing: run ./fx up first")
            first = followed in self._read_first
            for partition in described.partitions:
                (partitions if first else later).append(
                    TopicPartition(topic, partition, OFFSET_BEGINNING)
                )
                low, high = self._watermarks(TopicPartition(topic, partition), timeout_s=30)
                # A partition whose records all expired or were deleted (low == high) has
                # nothing to read: waiting for its high watermark would never end.
                if high > low:
                    self._targets[(topic, partition)] = high
                    if first:
                        self._first_targets[(topic, partition)] = high
        if self._first_targets:
            self._later = later
        else:
            partitions += later
        self._assigned = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        self._consumer.assign(partitions)
        self._thread.start()

    def _watermarks(self, partition: TopicPartition, timeout_s: float) -> tuple[int, int]:
        # Right after a topic is created its leader may not be known yet: retry the
        # transient "no leader" errors instead of failing the start.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                low, high = self._consumer.get_watermark_offsets(partition, timeout=timeout_s)
                return low, high
            except KafkaException as exc:
                error = exc.args[0]
                transient = isinstance(error, KafkaError) and error.code() in _NO_LEADER_YET
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    @property
    def following(self) -> bool:
        """True while the view's thread reads its topics (False once closed or dead)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        """Stop following and close the consumer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._consumer.close()
        if self._dead_letters is not None:
            left = self._dead_letters.flush(5)
            if left:
                log.error("registry view: %d dead letters not delivered at close", left)
        if self._task_table is not None:
            self._task_table.close()

    def wait_until_current(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything that existed at ``start`` has been read."""
        return self._wait(lambda: self._reached(self._targets), timeout_s)

    def wait_for_offset(self, topic: str, partition: int, offset: int, timeout_s: float) -> bool:
        """Wait until the record at ``offset`` has been folded in (read-your-writes)."""
        return self._wait(lambda: self._positions.get((topic, partition), 0) > offset, timeout_s)

    def wait_until_read(self, ends: dict[tuple[str, int], int], timeout_s: float) -> bool:
        """Wait until each ``(topic, partition)`` has been read up to its offset in ``ends``."""
        return self._wait(lambda: self._reached(ends), timeout_s)

    # --- lookups -------------------------------------------------------------------------

    def user_by_token_hash(self, token_sha256: str) -> UserRecord | None:
        """The user whose current or rotated-away token hashes to ``token_sha256``.

        Whether that token is still accepted is :func:`fxstream.service.auth.check_user_token`'s
        question.
        """
        return self._token_index.get(token_sha256)

    def endpoint_by_token_hash(self, token_sha256: str) -> EndpointRecord | None:
        """The live endpoint whose own token hashes to ``token_sha256``."""
        return self._endpoint_token_index.get(token_sha256)

    def user_by_external_identity(self, identity: str) -> UserRecord | None:
        """The user linked to ``"<provider>:<subject>"``."""
        return self._identity_index.get(identity)

    def routed(self, endpoint_id: str, function_id: str) -> bool:
        """True once a task of ``function_id`` was routed to ``endpoint_id`` (task-state)."""
        return self._task_table is not None and self._task_table.routed(endpoint_id, function_id)

    def user(self, user_id: str) -> UserRecord | None:
        """A user by id."""
        return _as(self._tables["users"].get(user_id), UserRecord)

    def users(self) -> list[UserRecord]:
        """Every user."""
        return [r for r in self._tables["users"].copy().values() if isinstance(r, UserRecord)]

    def function(self, function_id: str) -> FunctionRecord | None:
        """A live (not deleted) function by id."""
        return _as(self._tables["functions"].get(function_id), FunctionRecord)

    def functions(self) -> list[FunctionRecord]:
        """Every live function."""
        return [
            r for r in self._tables["functions"].copy().values() if isinstance(r, FunctionRecord)
        ]

    def endpoint(self, endpoint_id: str) -> EndpointRecord | None:
        """A live endpoint by id."""
        return _as(self._tables["endpoints"].get(endpoint_id), EndpointRecord)

    def endpoints(self) -> list[EndpointRecord]:
        """Every live endpoint."""
        return [
            r for r in self._tables["endpoints"].copy().values() if isinstance(r, EndpointRecord)
        ]

    def trigger(self, rule_id: str) -> TriggerRule | None:
        """A live (not deleted) trigger rule by id."""
        return _as(self._tables["triggers"].get(rule_id), TriggerRule)

    def triggers(self) -> list[TriggerRule]:
        """Every live trigger rule."""
        return [r for r in self._tables["triggers"].copy().values() if isinstance(r, TriggerRule)]

    def task(self, task_id: str) -> TaskState | None:
        """The latest state of a task (None unless this view follows task-state; None
        too, logged, for a state a view by id stored that does not decode)."""
        if self._task_table is None:
            return None
        try:
            return self._task_table.get(task_id)
        except RecordDecodeError as exc:
            log.warning("registry view: the state of task %s does not decode: %s", task_id, exc)
            return None

    def count_tasks(self) -> int:
        """How many tasks its task-state table holds, exactly (0 unless this view follows
        task-state; a scan: for tests and diagnostics)."""
        return 0 if self._task_table is None else self._task_table.count_tasks()

    def memory_figures(self) -> dict[str, int]:
        """Its on-disk task table's memory in bytes, RocksDB's own account (empty unless
        this view follows task-state); see :meth:`TaskStateTable.memory_figures`."""
        return {} if self._task_table is None else self._task_table.memory_figures()

    def task_group(self, task_group_id: str, user_id: str) -> list[str]:
        """The ids of ``user_id``'s tasks in ``task_group_id``, in the order first seen."""
        if self._task_table is None:
            return []
        return self._task_table.group(task_group_id, user_id)

    def query_tasks(
        self, query: TaskQuery, *, limit: int, after: bytes | None = None, max_scan: int
    ) -> QueryPage:
        """The tasks matching ``query``, a page at a time (see
        :meth:`TaskStateTable.query`); an empty page unless the view indexes task-state."""
        if self._task_table is None or not self._task_table.indexed:
            return QueryPage([], None, 0)
        return self._task_table.query(query, limit=limit, after=after, max_scan=max_scan)

    def count_task_states(self, user_id: str, *, max_scan: int) -> StateCounts:
        """``user_id``'s newest tasks (at most ``max_scan``) per state (see
        :meth:`TaskStateTable.count_states`); none unless the view indexes task-state."""
        if self._task_table is None or not self._task_table.indexed:
            return StateCounts({}, 0, complete=True)
        return self._task_table.count_states(user_id, max_scan=max_scan)

    def task_group_users(self, task_group_id: str) -> set[str]:
        """The users with at least one task in ``task_group_id`` (a client picks group ids)."""
        if self._task_table is None:
            return set()
        return self._task_table.group_users(task_group_id)

    def endpoint_status(self, endpoint_id: str, now: float | None = None) -> EndpointStatus:
        """Online while the last heartbeat is younger than LIVENESS_PERIODS periods."""
        beat = _as(self._tables["heartbeats"].get(endpoint_id), Heartbeat)
        if beat is None:
            return EndpointStatus(state="never-seen")
        now = time.time() if now is None else now
        online = now - beat.sent_at <= LIVENESS_PERIODS * beat.period_s
        return EndpointStatus(
            state="online" if online else "lost",
            last_seen=beat.sent_at,
            workers_total=beat.workers_total,
            workers_idle=beat.workers_idle,
            workers_busy=beat.workers_busy,
            queue_depth=beat.queue_depth,
            agent_id=beat.agent_id,
            pool_slots=beat.pool_slots,
            blocks_pending=beat.blocks_pending,
            blocks_running=beat.blocks_running,
            blocks_idle=beat.blocks_idle,
            node_key=self._node_key(endpoint_id, now) if online else "",
        )

    def _node_key(self, endpoint_id: str, now: float) -> str:
        """The node key all of the endpoint's live agents advertise, or ''."""
        agents = self._agent_nodes.get(endpoint_id)
        if not agents:
            return ""
        keys = {key for key, until in list(agents.values()) if until >= now}
        return keys.pop() if len(keys) == 1 else ""

    def _fold_node_key(self, beat: Heartbeat) -> None:
        agents = self._agent_nodes.get(beat.endpoint_id)
        if agents is None:
            if not beat.node_key:
                return
            agents = self._agent_nodes[beat.endpoint_id] = {}
        until = beat.sent_at + LIVENESS_PERIODS * beat.period_s
        previous = agents.pop(beat.agent_id, None)  # re-inserted last: the newest stay
        if previous is not None and previous[1] > until:
            until, key = previous[1], previous[0]  # an older beat read late changes nothing
        else:
            key = beat.node_key
        agents[beat.agent_id] = (key, until)
        while len(agents) > _MAX_AGENT_NODES:
            del agents[next(iter(agents))]

    # --- the follower thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            # consume() alone waits out its whole timeout unless the batch fills, which
            # would delay every read-your-writes by that timeout: wait for one record,
            # then take whatever else is already fetched without waiting.
            messages: list[Message] = []
            first = self._consumer.poll(0.2)
            if first is not None:
                messages = [first, *self._consumer.consume(num_messages=499, timeout=0)]
            with self._changed:
                for message in messages:
                    self._fold(message)
                advanced = self._advance_past_gaps()
                if self._later and self._reached(self._first_targets):
                    self._assign_later()
                if messages or advanced:
                    self._changed.notify_all()

    def _assign_later(self) -> None:
        """The read-first topics are read to their ends as at start: add the others."""
        self._consumer.incremental_assign(self._later)
        self._assigned += [TopicPartition(tp.topic, tp.partition) for tp in self._later]
        self._later = []

    def _advance_past_gaps(self) -> bool:
        # The consumer's position moves past records it never hands over (transaction
        # markers, compacted-away tails); without this a partition written by a
        # transactional producer would never look "current". Positions are only
        # updated by our own poll calls, so they never run ahead of what was folded.
        moved = False
        for tp in self._consumer.position(self._assigned):
            key = (tp.topic, tp.partition)
            if tp.offset > self._positions.get(key, 0):
                self._positions[key] = tp.offset
                moved = True
        return moved

    def _fold(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("registry view: %s", error)
            return
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            return
        self._positions[(topic, partition)] = offset + 1
        followed, record_type = self._kinds[topic]
        key = (message.key() or b"").decode(errors="replace")
        value = message.value()
        table = self._tables[followed]
        if value is None and followed != "heartbeats":
            if followed == "warm":
                self.warm.fold(key, None)
            elif followed == "task-state" and self._task_table is not None:
                self._task_table.delete(key, if_held=self._keep_task_state is not None)
            else:
                self._remove(followed, key)
            return
        keep = self._keep_task_state
        if followed == "task-state" and keep is not None and value is not None and not keep(value):
            return
        if followed == "task-state" and self._by_id:
            self._fold_by_id(message, key, value)
            return
        try:
            record = decode(value, record_type)
        except RecordDecodeError as exc:
            self._bad(message, exc.reason, DeadLetterReason.DECODE_ERROR)
            return
        id_field = _ID_FIELDS.get(followed)
        if id_field is not None and getattr(record, id_field) != key:
            self._bad(
                message,
                f"the record's key {key!r} is not its {id_field} "
                f"{getattr(record, id_field)!r}: a registry record is keyed by its id",
                DeadLetterReason.KEY_MISMATCH,
            )
            return
        if isinstance(record, Heartbeat):
            previous = _as(table.get(record.endpoint_id), Heartbeat)
            if previous is None or previous.sent_at <= record.sent_at:
                table[record.endpoint_id] = record
            self._fold_node_key(record)
            return
        if isinstance(record, WarmAdvert):
            if not self.warm.fold(key, record):
                # The ingress wrote it, checked: only a forged or rewritten topic gets here.
                log.warning(
                    "registry view: skipping a warm advert on %s [%s] @ %s: its key %r is "
                    "not '<endpoint>/<manager>' of the advert, or it is older than the last",
                    topic,
                    partition,
                    offset,
                    key,
                )
            return
        if isinstance(record, TaskState):
            if self._task_table is not None and value is not None:
                self._task_table.put(key, record, value)
                if self._on_task_state is not None:
                    try:
                        self._on_task_state(key, record)
                    except Exception:  # the follower thread must outlive a listener's bug
                        log.exception("registry view: a task-state listener failed")
            return
        self._remove(followed, key)
        table[key] = record
        if isinstance(record, UserRecord):
            self._token_index[record.token_sha256] = record
            if record.previous_token_sha256 is not None:
                self._token_index[record.previous_token_sha256] = record
            if record.external_identity is not None:
                self._identity_index[record.external_identity] = record
        elif isinstance(record, EndpointRecord) and record.token_sha256 is not None:
            self._endpoint_token_index[record.token_sha256] = record

    def _fold_by_id(self, message: Message, key: str, value: bytes | None) -> None:
        """Store a task state's bytes as read, checked only for its task id and state."""
        glance = task_state_name(value)
        if glance is None or value is None:
            self._bad(message, "not a task state", DeadLetterReason.DECODE_ERROR)
            return
        task_id, state = glance
        if task_id != key:
            self._bad(
                message,
                f"the record's key {key!r} is not its task_id {task_id!r}: a registry "
                "record is keyed by its id",
                DeadLetterReason.KEY_MISMATCH,
            )
            return
        if self._task_table is None:
            return
        self._task_table.put_state_only(key, value)
        if self._on_task_state_name is not None:
            try:
                self._on_task_state_name(key, state)
            except Exception:  # the follower thread must outlive a listener's bug
                log.exception("registry view: a task-state listener failed")

    def _bad(self, message: Message, reason: str, kind: DeadLetterReason) -> None:
        """Skip a bad record: log it, tell ``on_bad_record``, and dead-letter it."""
        log.warning(
            "registry view: skipping a bad record on %s [%s] @ %s: %s",
            message.topic(),
            message.partition(),
            message.offset(),
            reason,
        )
        if self._on_bad_record is not None:
            self._on_bad_record(message, reason)
        followed, _ = self._kinds[message.topic() or ""]
        if self._component is None or followed not in _ID_FIELDS:
            # Heartbeats and task states have an owning processor that dead-letters them.
            return
        if self._dead_letters is None:
            self._dead_letters = Producer(
                {
                    **self._kafka.confluent_producer(),
                    "enable.idempotence": True,
                    "acks": "all",
                    "message.max.bytes": producer_message_max_bytes(self._catalogue),
                    "log_level": 2,
                }
            )
        letter = dead_letter(
            topic=message.topic() or "",
            partition=message.partition() or 0,
            offset=message.offset() or 0,
            key=message.key(),
            value=message.value(),
            headers=normalise_headers(message.headers()),
            reason=reason,
            error_type=kind,
            component=self._component,
        )
        try:
            self._dead_letters.produce(
                self._catalogue.dead_letter, key=letter.original_key, value=encode(letter)
            )
        except (BufferError, KafkaException) as exc:
            log.error("registry view: cannot dead-letter a bad record: %s", exc)
        self._dead_letters.poll(0)

    def _remove(self, followed: Followed, key: str) -> None:
        old = self._tables[followed].pop(key, None)
        if isinstance(old, UserRecord):
            for digest in (old.token_sha256, old.previous_token_sha256):
                if digest is not None and self._token_index.get(digest) is old:
                    del self._token_index[digest]
            if old.external_identity is not None:
                self._identity_index.pop(old.external_identity, None)
        elif isinstance(old, EndpointRecord) and old.token_sha256 is not None:
            self._endpoint_token_index.pop(old.token_sha256, None)

    def _reached(self, targets: dict[tuple[str, int], int]) -> bool:
        return all(self._positions.get(tp, 0) >= end for tp, end in targets.items() if end > 0)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout=timeout_s)


def _as(record: Record | None, kind: type[R]) -> R | None:
    return record if isinstance(record, kind) else None
