"""RegistryView against the real broker: folding, tombstones, bad records, heartbeats, restarts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import pytest
from confluent_kafka import OFFSET_END, Consumer, Message, Producer, TopicPartition

from fxstream.service.auth import token_sha256
from fxstream.service.registry import LIVENESS_PERIODS, RegistryView
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    FunctionRecord,
    Heartbeat,
    KafkaConnection,
    TaskState,
    TaskStateName,
    UserRecord,
    code_sha256,
    decode,
    encode,
)
from tests.conftest import RunningPlatform
from tests.service.conftest import Produce, eventually

CODE = b"fxdc\nnot really dill, the view never loads it"

BadRecords = list[tuple[str, int, str]]
ViewFactory = Callable[..., RegistryView]


@pytest.fixture
def start_view(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[ViewFactory]:
    """Start views on this module's topics (current before returned); closed after the test."""
    views: list[RegistryView] = []

    def start(**options: object) -> RegistryView:
        view = RegistryView(module_kafka, catalogue, **options)  # type: ignore[arg-type]
        views.append(view)
        view.start()
        assert view.wait_until_current(timeout_s=30)
        return view

    yield start
    for view in views:
        view.close()


def function(function_id: str, name: str = "f") -> FunctionRecord:
    """A function record."""
    return FunctionRecord(
        function_id=function_id,
        name=name,
        owner_id="owner-1",
        code=CODE,
        code_sha256=code_sha256(CODE),
        created_at=time.time(),
    )


def user(user_id: str, token: str) -> UserRecord:
    """A user record holding the hash of ``token``."""
    return UserRecord(
        user_id=user_id, name="u", token_sha256=token_sha256(token), created_at=time.time()
    )


def beat(endpoint_id: str, sent_at: float, period_s: float = 10.0) -> Heartbeat:
    """A heartbeat."""
    return Heartbeat(
        endpoint_id=endpoint_id,
        agent_id="agent-1",
        sent_at=sent_at,
        sequence=int(sent_at),
        period_s=period_s,
        hostname="node",
        pid=1,
        workers_total=2,
        workers_idle=1,
        workers_busy=1,
        queue_depth=0,
    )


def new_id() -> str:
    """A fresh id."""
    return str(uuid.uuid4())


def test_latest_record_wins_and_a_tombstone_deletes(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    view = start_view()
    topic, function_id = catalogue.functions, new_id()

    produce(topic, function_id, function(function_id, "first"))
    partition, offset = produce(topic, function_id, function(function_id, "second"))
    assert view.wait_for_offset(topic, partition, offset, timeout_s=10)
    found = view.function(function_id)
    assert found is not None
    assert found.name == "second"
    assert function_id in {f.function_id for f in view.functions()}

    partition, offset = produce(topic, function_id, None)
    assert view.wait_for_offset(topic, partition, offset, timeout_s=10)
    assert view.function(function_id) is None
    assert function_id not in {f.function_id for f in view.functions()}


def test_the_token_index_follows_user_changes(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    view = start_view()
    user_id = new_id()
    produce(catalogue.users, user_id, user(user_id, "old-token"))
    partition, offset = produce(catalogue.users, user_id, user(user_id, "new-token"))
    assert view.wait_for_offset(catalogue.users, partition, offset, timeout_s=10)
    found = view.user_by_token_hash(token_sha256("new-token"))
    assert found is not None and found.user_id == user_id
    assert view.user_by_token_hash(token_sha256("old-token")) is None

    partition, offset = produce(catalogue.users, user_id, None)
    assert view.wait_for_offset(catalogue.users, partition, offset, timeout_s=10)
    assert view.user(user_id) is None
    assert view.user_by_token_hash(token_sha256("new-token")) is None


def test_bad_bytes_are_skipped_and_reported(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    bad: BadRecords = []

    def on_bad_record(message: Message, reason: str) -> None:
        bad.append((message.topic() or "", message.offset() or 0, reason))

    view = start_view(on_bad_record=on_bad_record)
    topic = catalogue.functions
    # All under one key, so they land in one partition in this order.
    key = new_id()
    _, garbage_at = produce(topic, key, b"\x00\xffnot msgpack")
    _, wrong_kind_at = produce(topic, key, beat(key, time.time()))
    partition, good_at = produce(topic, key, function(key))

    assert view.wait_for_offset(topic, partition, good_at, timeout_s=10)
    assert view.function(key) is not None  # the good record after the bad ones is folded
    reported = [(offset, reason) for t, offset, reason in bad if t == topic]
    assert [offset for offset, _ in reported] == [garbage_at, wrong_kind_at]
    assert all(reason for _, reason in reported)
    assert "function" in reported[1][1] or "heartbeat" in reported[1][1]


def _dead_letters(
    module_kafka: KafkaConnection, catalogue: Catalogue, key: bytes, count: int
) -> list[DeadLetter]:
    reader = Consumer(
        {
            **module_kafka.confluent(),
            "group.id": f"dl-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "log_level": 2,
        }
    )
    reader.subscribe([catalogue.dead_letter])
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 20
    try:
        while len(letters) < count and time.monotonic() < deadline:
            message = reader.poll(0.5)
            if message is not None and message.error() is None and message.key() == key:
                letters.append(decode(message.value(), DeadLetter))
    finally:
        reader.close()
    return letters


def test_bad_and_mis_keyed_registry_records_are_dead_lettered_and_ignored(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce, module_kafka: KafkaConnection
) -> None:
    view = start_view(component="test view")
    topic = catalogue.functions
    key, other = new_id(), new_id()
    partition, good_at = produce(topic, key, function(key, name="good"))
    _, garbage_at = produce(topic, key, b"\x00\xffnot msgpack")
    # A record keyed by one id holding another: it must not define either function.
    _, mismatch_at = produce(topic, key, function(other, name="impostor"))
    assert view.wait_for_offset(topic, partition, mismatch_at, timeout_s=10)
    kept = view.function(key)
    assert kept is not None and kept.name == "good"  # the bad records changed nothing
    assert view.function(other) is None
    letters = _dead_letters(module_kafka, catalogue, key.encode(), 2)
    found = {(d.original_offset, d.error_type) for d in letters if d.original_topic == topic}
    assert found == {
        (garbage_at, str(DeadLetterReason.DECODE_ERROR)),
        (mismatch_at, str(DeadLetterReason.KEY_MISMATCH)),
    }
    assert all(d.component == "test view" and d.original_key == key.encode() for d in letters)
    assert good_at < garbage_at


def test_the_latest_heartbeat_wins_even_out_of_order(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    view = start_view()
    endpoint_id, topic = new_id(), catalogue.heartbeats
    assert view.endpoint_status(endpoint_id).state == "never-seen"

    produce(topic, endpoint_id, beat(endpoint_id, sent_at=1_000.0))
    partition, offset = produce(topic, endpoint_id, beat(endpoint_id, sent_at=900.0))
    assert view.wait_for_offset(topic, partition, offset, timeout_s=10)
    assert view.endpoint_status(endpoint_id, now=1_001.0).last_seen == 1_000.0

    partition, offset = produce(topic, endpoint_id, beat(endpoint_id, sent_at=2_000.0))
    assert view.wait_for_offset(topic, partition, offset, timeout_s=10)
    status = view.endpoint_status(endpoint_id, now=2_000.0 + LIVENESS_PERIODS * 10.0)
    assert (status.state, status.last_seen, status.agent_id) == ("online", 2_000.0, "agent-1")
    assert (status.workers_total, status.workers_idle, status.workers_busy) == (2, 1, 1)
    later = view.endpoint_status(endpoint_id, now=2_000.0 + LIVENESS_PERIODS * 10.0 + 0.01)
    assert later.state == "lost"


def test_a_new_view_rebuilds_the_same_state_from_the_topics(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    kept, deleted, task_id = new_id(), new_id(), new_id()
    produce(catalogue.functions, kept, function(kept))
    produce(catalogue.functions, deleted, function(deleted))
    produce(catalogue.functions, deleted, None)
    produce(
        catalogue.task_state,
        task_id,
        TaskState(
            task_id=task_id,
            user_id="u-1",
            function_id=kept,
            endpoint_id="e-1",
            state=TaskStateName.ROUTED,
            updated_at=time.time(),
        ),
    )

    view = start_view()  # reads everything that existed when it started
    assert view.function(kept) is not None
    assert view.function(deleted) is None
    task = view.task(task_id)
    assert task is not None and task.state is TaskStateName.ROUTED


def test_current_even_when_a_partition_was_emptied(
    kafka_platform: RunningPlatform,
    start_view: ViewFactory,
    catalogue: Catalogue,
    produce: Produce,
) -> None:
    # Heartbeats expire after hours: a partition can have a high watermark but no
    # records at all, and a new view must still become current.
    endpoint_id = new_id()
    partition, _ = produce(catalogue.heartbeats, endpoint_id, beat(endpoint_id, time.time()))
    admin = kafka_platform.admin()
    emptied = TopicPartition(catalogue.heartbeats, partition, OFFSET_END)
    for future in admin.delete_records([emptied]).values():
        future.result(timeout=30)

    view = start_view()  # asserts wait_until_current
    assert view.endpoint_status(endpoint_id).state == "never-seen"


def test_current_even_after_transactional_writes(
    module_kafka: KafkaConnection, start_view: ViewFactory, catalogue: Catalogue
) -> None:
    # A transactional producer (a processor writing exactly-once) leaves a commit
    # marker at the end of the partition that no consumer ever receives.
    task_id = new_id()
    producer = Producer(
        {
            **module_kafka.confluent(),
            "transactional.id": f"test-{task_id}",
            "log_level": 2,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    record = TaskState(
        task_id=task_id,
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=TaskStateName.SUCCEEDED,
        updated_at=time.time(),
    )
    producer.produce(catalogue.task_state, key=task_id.encode(), value=encode(record))
    producer.commit_transaction(30)

    view = start_view()  # asserts wait_until_current
    eventually(lambda: view.task(task_id) is not None, what="the committed task-state is read")


def test_start_names_a_missing_topic(module_kafka: KafkaConnection) -> None:
    unprovisioned = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    view = RegistryView(module_kafka, unprovisioned)
    try:
        with pytest.raises(RuntimeError, match=r"users is missing: run \./fx up"):
            view.start()
    finally:
        view.close()


def test_an_endpoints_node_key_is_shown_only_while_every_live_agent_advertises_it(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    """The node-local tier (fxstream.connectors.node_local): a client may put an argument
    in shared memory only when whichever agent takes the task shares its node."""
    view = start_view()
    endpoint_id, topic = new_id(), catalogue.heartbeats
    key_a, key_b = "a" * 32, "b" * 32

    def send(agent: str, at: float, key: str) -> None:
        record = msgspec.structs.replace(beat(endpoint_id, at), agent_id=agent, node_key=key)
        partition, offset = produce(topic, endpoint_id, record)
        assert view.wait_for_offset(topic, partition, offset, timeout_s=10)

    send("agent-a", 1_000.0, key_a)
    assert view.endpoint_status(endpoint_id, now=1_001.0).node_key == key_a
    # A second live agent on another node: neither key is safe to use.
    send("agent-b", 1_001.0, key_b)
    assert view.endpoint_status(endpoint_id, now=1_002.0).node_key == ""
    # One without a node-local store (a batch engine's remote workers) counts as another.
    send("agent-b", 1_002.0, "")
    assert view.endpoint_status(endpoint_id, now=1_003.0).node_key == ""
    # Once agent-b is silent past its liveness periods, agent-a's key holds again.
    send("agent-a", 1_000.0 + LIVENESS_PERIODS * 10.0 + 1.0, key_a)
    now = 1_002.0 + LIVENESS_PERIODS * 10.0 + 0.5
    assert view.endpoint_status(endpoint_id, now=now).node_key == key_a
    # A lost endpoint shows none.
    assert view.endpoint_status(endpoint_id, now=now + 10 * LIVENESS_PERIODS * 10.0).node_key == ""


def _state(task_id: str, state: TaskStateName, user_id: str = "user-1") -> TaskState:
    return TaskState(
        task_id=task_id,
        user_id=user_id,
        function_id="function-1",
        endpoint_id="endpoint-1",
        task_group_id="group-1",
        state=state,
        updated_at=time.time(),
        value=b"42" if state == TaskStateName.SUCCEEDED else None,
    )


def test_a_view_of_task_states_by_id_stores_them_undecoded_and_tells_their_names(
    start_view: ViewFactory, catalogue: Catalogue, produce: Produce
) -> None:
    told: list[tuple[str, TaskStateName]] = []
    bad: BadRecords = []

    def on_bad_record(message: Message, reason: str) -> None:
        bad.append((message.key().decode() if message.key() else "", message.offset() or 0, reason))

    view = start_view(
        follow=("task-state",),
        task_states_by_id=True,
        on_task_state_name=lambda task_id, name: told.append((task_id, name)),
        on_bad_record=on_bad_record,
    )
    topic = catalogue.task_state
    task, impostor = new_id(), new_id()
    produce(topic, task, _state(task, TaskStateName.ROUTED))
    _, garbage_at = produce(topic, task, b"\x00\xffnot msgpack")
    _, mismatch_at = produce(topic, task, _state(impostor, TaskStateName.FAILED))
    partition, last_at = produce(topic, task, _state(task, TaskStateName.SUCCEEDED))
    # Its id and state glance well, the rest does not decode: stored, then never handed out.
    partial = new_id()
    partial_at = produce(
        topic,
        partial,
        msgspec.msgpack.encode({"kind": "task-state", "task_id": partial, "state": "routed"}),
    )
    assert view.wait_for_offset(topic, partition, last_at, timeout_s=10)
    assert view.wait_for_offset(topic, *partial_at, timeout_s=10)
    assert view.task(partial) is None

    found = view.task(task)
    assert found is not None and found.state == TaskStateName.SUCCEEDED and found.value == b"42"
    assert view.task(impostor) is None  # a state under another task's key defines neither
    assert [t for t in told if t[0] == task] == [
        (task, TaskStateName.ROUTED),
        (task, TaskStateName.SUCCEEDED),
    ]
    # Stored by id only: no group membership was written for it.
    assert view.task_group("group-1", "user-1") == []
    # Skipped and reported (task states are dead-lettered by their own processor, not here).
    reported = [(offset, reason) for key, offset, reason in bad if key == task]
    assert [offset for offset, _ in reported] == [garbage_at, mismatch_at]
    assert "not a task state" in reported[0][1] and impostor in reported[1][1]


def test_a_view_of_task_states_by_id_refuses_what_it_cannot_give(
    module_kafka: KafkaConnection, catalogue: Catalogue
) -> None:
    with pytest.raises(ValueError, match="on_task_state_name"):
        RegistryView(
            module_kafka,
            catalogue,
            follow=("task-state",),
            task_states_by_id=True,
            on_task_state=lambda task_id, state: None,
        )
