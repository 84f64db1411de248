"""Bounded task-state views: the on-disk table, the view over it, the planner's recall.

The table is unit-tested on its own; the view and the planner's recall read a real
``task-state`` topic on the session broker.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from fxstream.service.lifecycle import TaskMemory, known_from_state
from fxstream.service.registry import RegistryView
from fxstream.service.task_state import TaskStatePlanner, recall_from
from fxstream.service.task_table import DEFAULT_RECENT_ENTRIES, TABLE_DIR_PREFIX, TaskStateTable
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetter,
    KafkaConnection,
    RawRecord,
    TaskEvent,
    TaskResult,
    TaskState,
    TaskStateName,
    decode,
    encode,
    task_state_group,
)
from tests.service.conftest import Produce, eventually

S = TaskStateName


def state(
    task_id: str,
    name: TaskStateName = S.SUCCEEDED,
    *,
    group: str | None = "g-1",
    user: str = "u-1",
    attempts: list[Attempt] | None = None,
) -> TaskState:
    """A task state of ``task_id``."""
    return TaskState(
        task_id=task_id,
        user_id=user,
        function_id="fn-1",
        endpoint_id="ep-1",
        task_group_id=group,
        state=name,
        updated_at=time.time(),
        attempts=attempts or [],
    )


@pytest.fixture
def table(tmp_path: Path) -> Iterator[TaskStateTable]:
    """A table with a 2-entry cache in a directory of the test's own."""
    made = TaskStateTable(tmp_path / "table", cache_entries=2)
    yield made
    made.close()


# --- the table alone ------------------------------------------------------------------------


def put(table: TaskStateTable, record: TaskState) -> None:
    """Store a state as the view does (with its encoded record)."""
    table.put(record.task_id, record, encode(record))


def test_a_state_evicted_from_the_cache_is_read_back_from_disk(table: TaskStateTable) -> None:
    for i in range(10):
        put(table, state(f"t-{i}", S.RUNNING))
    for i in range(10):
        got = table.get(f"t-{i}")
        assert got is not None and got.task_id == f"t-{i}" and got.state == S.RUNNING
    assert len(table._cache) == 2
    put(table, state("t-0", S.FAILED))
    got = table.get("t-0")
    assert got is not None and got.state == S.FAILED, "a cached state must not outlive a write"
    assert table.get("never-seen") is None


def test_a_state_stored_by_id_only_is_read_back_and_joins_no_group(table: TaskStateTable) -> None:
    table.put_state_only("t-1", encode(state("t-1", S.ROUTED)))
    assert table.get("t-1") is not None  # now cached
    table.put_state_only("t-1", encode(state("t-1", S.SUCCEEDED)))
    got = table.get("t-1")
    assert got is not None and got.state == S.SUCCEEDED, "a cached state must not outlive a write"
    assert table.group("g-1", "u-1") == []
    assert table.count_tasks() == 1
    table.delete("t-1", if_held=True)
    assert table.get("t-1") is None


def test_an_indexed_table_refuses_states_without_their_summary(tmp_path: Path) -> None:
    made = TaskStateTable(tmp_path / "t", indexed=True)
    try:
        with pytest.raises(ValueError, match="put"):
            made.put_state_only("t-1", encode(state("t-1")))
    finally:
        made.close()


def test_groups_keep_first_seen_order_and_follow_a_task_that_moves(
    table: TaskStateTable,
) -> None:
    for task_id in ("c", "a", "b"):
        put(table, state(task_id, S.ROUTED))
    put(table, state("a", S.SUCCEEDED))  # a later state keeps its place
    put(table, state("x", S.ROUTED, user="u-10"))  # a user id that extends u-1
    assert table.group("g-1", "u-1") == ["c", "a", "b"]
    assert table.group("g-1", "u-10") == ["x"]
    assert table.group_users("g-1") == {"u-1", "u-10"}
    put(table, state("c", S.SUCCEEDED, group="g-2"))
    assert table.group("g-1", "u-1") == ["a", "b"]
    assert table.group("g-2", "u-1") == ["c"]
    put(table, state("b", S.SUCCEEDED, group=None))
    assert table.group("g-1", "u-1") == ["a"]
    table.delete("a")
    assert table.get("a") is None
    assert table.group("g-1", "u-1") == []
    assert table.group_users("g-1") == {"u-10"}


def memtable_entries(table: TaskStateTable) -> int:
    """The writes (puts and deletes) in the table's active memtable: what a write costs."""
    return table._db.property_int_value("rocksdb.num-entries-active-mem-table") or 0


@pytest.mark.parametrize("recent_entries", [0, DEFAULT_RECENT_ENTRIES])
def test_a_tombstone_if_held_writes_nothing_for_a_task_the_table_does_not_hold(
    tmp_path: Path, recent_entries: int
) -> None:
    # recent_entries=0: whether the task is held is asked of RocksDB (key_may_exist, then a
    # read), not of the memo of recent writes.
    made = TaskStateTable(tmp_path / "t", recent_entries=recent_entries)
    try:
        put(made, state("kept", S.RUNNING))
        put(made, state("gone", S.RUNNING))
        made.delete("gone")
        before = memtable_entries(made)
        for i in range(50):
            made.delete(f"never-held-{i}", if_held=True)
        made.delete("gone", if_held=True)  # deleted before: not held either
        assert memtable_entries(made) == before, "a tombstone of an unheld task was written"
        made.delete("kept", if_held=True)
        assert memtable_entries(made) > before
        assert made.get("kept") is None and made.group("g-1", "u-1") == []
        assert made.count_tasks() == 0
    finally:
        made.close()


def test_count_tasks_counts_the_states_held(table: TaskStateTable) -> None:
    assert table.count_tasks() == 0
    for i in range(5):
        put(table, state(f"t-{i}", S.RUNNING))
    put(table, state("t-0", S.SUCCEEDED))
    table.delete("t-1")
    assert table.count_tasks() == 4


def test_close_removes_the_directory_and_reads_after_it_find_nothing(tmp_path: Path) -> None:
    made = TaskStateTable(tmp_path / "t")
    put(made, state("t-1"))
    made.close()
    assert not (tmp_path / "t").exists()
    assert made.get("t-1") is None and made.group("g-1", "u-1") == []


def test_a_table_left_by_a_dead_process_is_swept(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    orphan = Path(tempfile.gettempdir()) / f"{TABLE_DIR_PREFIX}{dead.stdout.strip()}-orphan"
    orphan.mkdir()
    alive = Path(tempfile.gettempdir()) / f"{TABLE_DIR_PREFIX}{os.getppid()}-alive"
    alive.mkdir()
    made = TaskStateTable()
    try:
        assert not orphan.exists(), "the table of a process that is gone was not removed"
        assert alive.exists(), "the table of a live process was removed"
        assert made.directory.name.startswith(f"{TABLE_DIR_PREFIX}{os.getpid()}-")
    finally:
        made.close()
        alive.rmdir()
    assert not made.directory.exists()


# --- the view over a real task-state topic ---------------------------------------------------


@pytest.fixture
def view(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[RegistryView]:
    """A view of task-state alone, started."""
    made = RegistryView(module_kafka, catalogue, follow=("task-state",))
    made.start()
    assert made.wait_until_current(timeout_s=30)
    yield made
    made.close()


def test_the_view_holds_task_states_on_disk_not_in_python_memory(
    view: RegistryView, module_kafka: KafkaConnection, catalogue: Catalogue, produce: Produce
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    tasks = 5_000
    # More than the table's bounded memo of recent writes (DEFAULT_RECENT_ENTRIES) is
    # written before memory is measured, so the memo is full and the measured states
    # show what the view holds per state beyond its bounded caches.
    assert tasks > DEFAULT_RECENT_ENTRIES
    warm = [state(f"warm-{group}-{i}", S.SUCCEEDED, group=f"warm-{group}") for i in range(tasks)]
    records = [state(f"{group}-{i}", S.SUCCEEDED, group=group) for i in range(tasks)]
    # A realistic record: the states the API kept in memory were ~1.4 kB each.
    padding = b"x" * 1_000
    warm = [msgspec.structs.replace(r, value=padding) for r in warm]
    records = [msgspec.structs.replace(r, value=padding) for r in records]
    producer = Producer({**module_kafka.confluent(), "log_level": 2})
    gc.collect()
    # Traced from before the first states: what the caches free of them as they take the
    # measured ones counts (tracemalloc subtracts only frees of blocks it traced).
    tracemalloc.start()
    try:
        for record in warm:
            producer.produce(
                catalogue.task_state, key=record.task_id.encode(), value=encode(record)
            )
        assert producer.flush(30) == 0
        eventually(
            lambda: len(view.task_group(f"warm-{group}", "u-1")) == tasks,
            timeout_s=60,
            what="the first states folded",
        )
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for record in records:
            producer.produce(
                catalogue.task_state, key=record.task_id.encode(), value=encode(record)
            )
        assert producer.flush(30) == 0
        eventually(
            lambda: len(view.task_group(group, "u-1")) == tasks,
            timeout_s=60,
            what="every state folded",
        )
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Held in a dict, 5,000 such states cost over 5 MB; on disk only the caches stay.
    assert grown < 100 * tasks, f"the view's Python memory grew {grown:,} B for {tasks:,} states"
    first = view.task(f"{group}-0")
    assert first is not None and first.state == S.SUCCEEDED and first.value == padding
    members = view.task_group(group, "u-1")
    assert sorted(members) == sorted(r.task_id for r in records)
    produce(catalogue.task_state, f"{group}-0", None)
    eventually(lambda: view.task(f"{group}-0") is None, what="the tombstone folded")
    assert view.task_group(group, "u-1") == [m for m in members if m != f"{group}-0"]


def test_a_filtered_view_keeps_only_the_states_its_filter_keeps(
    module_kafka: KafkaConnection, catalogue: Catalogue, produce: Produce
) -> None:
    group = f"kept-{uuid.uuid4().hex[:8]}"
    seen: list[bytes] = []

    def keep(value: bytes) -> bool:
        seen.append(value)
        glance = task_state_group(value)
        return glance is not None and glance[1] == group

    kept = [state(f"{group}-{i}", S.RUNNING, group=group) for i in range(3)]
    dropped = [state(f"other-{group}-{i}", S.RUNNING, group=None) for i in range(20)]
    for record in [*kept, *dropped]:
        produce(catalogue.task_state, record.task_id, record)
    view = RegistryView(module_kafka, catalogue, follow=("task-state",), keep_task_state=keep)
    try:
        view.start()
        assert view.wait_until_current(timeout_s=30)
        assert len(seen) >= len(kept) + len(dropped)
        assert sorted(view.task_group(group, "u-1")) == sorted(r.task_id for r in kept)
        assert all(view.task(r.task_id) is None for r in dropped)
        assert view.count_tasks() == len(kept)
        table = view._task_table
        assert table is not None
        before = memtable_entries(table)
        # Tombstones: of tasks the view never kept, nothing is written; a kept one's goes.
        for record in dropped:
            produce(catalogue.task_state, record.task_id, None)
        partition, offset = produce(catalogue.task_state, kept[0].task_id, None)
        assert view.wait_for_offset(catalogue.task_state, partition, offset, timeout_s=30)
        assert view.task(kept[0].task_id) is None
        assert view.count_tasks() == len(kept) - 1
        # The kept task's tombstone: a state delete, its group entry and member entry.
        assert memtable_entries(table) == before + 3
    finally:
        view.close()


# --- the planner's memory recalls evicted tasks from the table ---------------------------------


def raw(topic: str, key: str, value: bytes, offset: int = 0) -> RawRecord:
    """A consumed record as the processors hand it over."""
    from tests.service.test_lifecycle import Record

    return Record(value=value, topic=topic, key=key.encode(), offset=offset)


def result_of(task_id: str, attempt: int = 1) -> TaskResult:
    """A successful result of ``task_id``."""
    return TaskResult(
        task_id=task_id,
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="success",
        value=b"v",
        attempt=attempt,
    )


@pytest.fixture(params=[False, True], ids=["full view", "view by id"])
def processor_view(
    request: pytest.FixtureRequest, module_kafka: KafkaConnection, catalogue: Catalogue
) -> Iterator[RegistryView]:
    """A view of task-state alone, started: a full one, and one of states by id as the
    task-state processor runs it."""
    made = RegistryView(
        module_kafka, catalogue, follow=("task-state",), task_states_by_id=request.param
    )
    made.start()
    assert made.wait_until_current(timeout_s=30)
    yield made
    made.close()


def test_lifecycle_is_enforced_for_a_task_evicted_from_memory(
    processor_view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    view = processor_view
    memory = TaskMemory(capacity=1, recall=recall_from(view))
    planner = TaskStatePlanner(catalogue, memory=memory)
    results = catalogue.results("u-1")
    first, other = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"

    def plan_and_write(task_id: str, value: bytes) -> list[TaskState]:
        written = []
        for out in planner.plan([raw(results, task_id, value)]):
            if out.topic == catalogue.task_state:
                produce(out.topic, task_id, out.value)
                written.append(decode(out.value, TaskState))
        return written

    assert [s.state for s in plan_and_write(first, encode(result_of(first)))] == [S.SUCCEEDED]
    eventually(lambda: view.task(first) is not None, what="the first task's state folded")
    plan_and_write(other, encode(result_of(other)))  # evicts the first from memory
    assert len(memory) == 1

    # A second result of the evicted task: recalled as succeeded, a duplicate, dropped.
    assert plan_and_write(first, encode(result_of(first, attempt=2))) == []
    assert planner.stats.duplicates == 1 and memory.recalled >= 1

    plan_and_write(other, encode(result_of(other, attempt=2)))  # evict it again
    late = TaskEvent(
        task_id=first,
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.RUNNING,
        at=time.time(),
        source="agent-x",
        attempt=Attempt(attempt=3, worker="w"),
    )
    out = planner.plan([raw(catalogue.task_events, first, encode(late))])
    letters = [decode(o.value, DeadLetter) for o in out if o.topic == catalogue.dead_letter]
    assert [o.topic for o in out] == [catalogue.dead_letter]
    assert "already ended" in letters[0].reason


def test_known_from_state_takes_the_latest_attempt() -> None:
    attempts = [Attempt(attempt=1, worker="a"), Attempt(attempt=3, worker="b")]
    known = known_from_state(state("t", S.FAILED, attempts=attempts))
    assert known.state == S.FAILED and known.attempt == 3 and len(known.attempts) == 2
    assert known_from_state(state("t", S.ROUTED)).attempt == 1


def test_without_recall_an_evicted_task_is_folded_again() -> None:
    """The control: what the recall prevents (a duplicate result applied over the first)."""
    catalogue = Catalogue(prefix="fx.")
    planner = TaskStatePlanner(catalogue, memory=TaskMemory(capacity=1))
    results = catalogue.results("u-1")
    planner.plan([raw(results, "a", encode(result_of("a")))])
    planner.plan([raw(results, "b", encode(result_of("b")))])
    again = planner.plan([raw(results, "a", encode(result_of("a", attempt=2)))])
    assert [o.topic for o in again] == [catalogue.task_state]
