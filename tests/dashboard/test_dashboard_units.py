"""The dashboard's parts that need no broker: sessions, and task states counted from the
task-state table's summaries (bounded, newest first)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.service.dashboard_sessions import SessionStore
from fxstream.service.task_table import TaskStateTable
from fxstream.topics import TaskState, TaskStateName, TaskTimings, encode

T0 = 1_760_000_000.0


def test_a_session_is_found_by_its_id_only_and_ends_at_logout() -> None:
    store = SessionStore()
    first = store.open("user", "alice", "a" * 64, now=T0)
    second = store.open("admin", None, "b" * 64, now=T0)
    assert first != second and len(first) >= 40
    found = store.get(first, now=T0 + 1)
    assert found is not None and found.user_id == "alice" and found.kind == "user"
    assert store.get(first[:-1] + ("A" if first[-1] != "A" else "B"), now=T0 + 1) is None
    assert store.get(None) is None and store.get("") is None
    store.end(first)
    assert store.get(first, now=T0 + 2) is None
    assert store.get(second, now=T0 + 2) is not None


def test_a_session_ends_when_idle_and_at_its_lifetime_however_busy() -> None:
    store = SessionStore(lifetime_s=100.0, idle_s=10.0)
    idle = store.open("user", "alice", "a" * 64, now=T0)
    assert store.get(idle, now=T0 + 9) is not None
    assert store.get(idle, now=T0 + 19.5) is None  # 10.5 s since its last use
    busy = store.open("user", "alice", "a" * 64, now=T0)
    for step in range(1, 10):
        assert store.get(busy, now=T0 + step * 9) is not None
    assert store.get(busy, now=T0 + 100) is None


def test_the_store_is_bounded_and_keeps_no_session_id() -> None:
    store = SessionStore(max_sessions=3)
    opened = [store.open("user", f"u{n}", "c" * 64, now=T0) for n in range(5)]
    assert len(store) == 3
    assert store.get(opened[0], now=T0) is None and store.get(opened[1], now=T0) is None
    assert all(store.get(s, now=T0) is not None for s in opened[2:])
    # Only digests of the ids are held: no cookie value is in the store's memory.
    held = repr(vars(store))
    assert not any(session_id in held for session_id in opened)
    assert store.sweep(now=T0 + 10 * 3600) == 3 and len(store) == 0


@pytest.fixture
def table(tmp_path: Path) -> Iterator[TaskStateTable]:
    made = TaskStateTable(tmp_path / "table", indexed=True)
    yield made
    made.close()


def _put(table: TaskStateTable, task_id: str, user: str, at: float, name: TaskStateName) -> None:
    record = TaskState(
        task_id=task_id,
        user_id=user,
        function_id="fn-1",
        endpoint_id="ep-1",
        state=name,
        updated_at=T0 + at + 0.5,
        timings=TaskTimings(submitted_at=T0 + at),
    )
    table.put(task_id, record, encode(record))


def test_task_states_are_counted_per_user_from_the_newest_within_the_bound(
    table: TaskStateTable,
) -> None:
    for n in range(30):
        name = TaskStateName.SUCCEEDED if n < 20 else TaskStateName.RUNNING
        _put(table, f"a-{n:03d}", "alice", float(n), name)
    for n in range(7):
        _put(table, f"b-{n:03d}", "bob", float(n), TaskStateName.FAILED)
    # A later state of a task moves its count, not the total.
    _put(table, "a-025", "alice", 25.0, TaskStateName.FAILED)

    alice = table.count_states("alice")
    assert alice.complete and alice.scanned == 30
    assert alice.by_state == {"succeeded": 20, "running": 9, "failed": 1}
    bob = table.count_states("bob")
    assert bob.by_state == {"failed": 7} and bob.complete
    assert table.count_states("carol").by_state == {}

    # Bounded: the newest 12 of alice's (a-018 .. a-029) only, and it says so.
    newest = table.count_states("alice", max_scan=12)
    assert not newest.complete and newest.scanned == 12
    assert newest.by_state == {"succeeded": 2, "running": 9, "failed": 1}
