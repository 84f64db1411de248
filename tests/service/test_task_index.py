"""Task tags and queries without a broker: the table's query index, the task-state
processor carrying tags and timings from state to state, and the event log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from fxstream.service.lifecycle import TaskMemory, known_from_state
from fxstream.service.task_query import decode_cursor, encode_cursor, event_log, parse_tag
from fxstream.service.task_state import TaskStatePlanner
from fxstream.service.task_table import TaskQuery, TaskStateTable
from fxstream.topics import (
    Attempt,
    Catalogue,
    TaskError,
    TaskEvent,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    decode,
    encode,
)
from tests.service.test_lifecycle import Record

S = TaskStateName
T0 = 1_760_000_000.0
CATALOGUE = Catalogue(prefix="fx.")


def state(
    task_id: str,
    user: str = "alice",
    at: float = 0.0,
    name: TaskStateName = S.ROUTED,
    *,
    tags: dict[str, str] | None = None,
    function: str = "fn-1",
    endpoint: str = "ep-1",
    group: str | None = None,
    submitted: bool = True,
) -> TaskState:
    """A state of ``user``'s task submitted ``at`` seconds after T0."""
    return TaskState(
        task_id=task_id,
        user_id=user,
        function_id=function,
        endpoint_id=endpoint,
        task_group_id=group,
        state=name,
        updated_at=T0 + at + 0.5,
        timings=TaskTimings(submitted_at=T0 + at if submitted else None),
        tags=tags or {},
    )


@pytest.fixture
def table(tmp_path: Path) -> Iterator[TaskStateTable]:
    """An indexed table in a directory of the test's own."""
    made = TaskStateTable(tmp_path / "table", indexed=True)
    yield made
    made.close()


def put(table: TaskStateTable, record: TaskState) -> None:
    """Fold ``record`` as the view would."""
    table.put(record.task_id, record, encode(record))


def ids(table: TaskStateTable, query: TaskQuery, limit: int = 1_000, **kw: int) -> list[str]:
    """Every task id ``query`` matches, following the cursors."""
    found: list[str] = []
    after: bytes | None = None
    while True:
        page = table.query(query, limit=limit, after=after, **kw)
        found += [task_id for task_id, _ in page.matches]
        assert len(page.matches) <= limit
        if page.cursor is None:
            return found
        after = page.cursor


# --- the index -----------------------------------------------------------------------------


def test_a_query_returns_only_the_users_matching_tasks_in_submission_order(
    table: TaskStateTable,
) -> None:
    for i in range(30):
        put(table, state(f"a-{i}", "alice", at=i, tags={"run": str(i % 3)}))
        put(table, state(f"b-{i}", "bob", at=i, tags={"run": str(i % 3)}))
    every = [f"a-{i}" for i in range(30)]
    assert ids(table, TaskQuery("alice")) == every
    assert ids(table, TaskQuery("alice", descending=True)) == every[::-1]
    assert ids(table, TaskQuery("alice", tags={"run": "1"})) == every[1::3]
    assert ids(table, TaskQuery("bob", tags={"run": "1"})) == [f"b-{i}" for i in range(1, 30, 3)]
    assert ids(table, TaskQuery("carol")) == []
    assert ids(table, TaskQuery("alice", tags={"run": "9"})) == []
    # since and until are inclusive, on the submission time.
    assert ids(table, TaskQuery("alice", since=T0 + 10, until=T0 + 12)) == every[10:13]
    assert ids(table, TaskQuery("alice", since=T0 + 10, until=T0 + 12, descending=True)) == [
        "a-12",
        "a-11",
        "a-10",
    ]


def test_filters_on_state_function_endpoint_group_and_several_tags(
    table: TaskStateTable,
) -> None:
    put(table, state("t-1", tags={"run": "1", "beam": "x"}, function="f-a", group="g-1"))
    put(table, state("t-2", at=1, tags={"run": "1"}, function="f-b", endpoint="ep-2"))
    put(table, state("t-3", at=2, tags={"run": "1", "beam": "y"}, group="g-1"))
    put(table, state("t-2", at=1, name=S.SUCCEEDED, tags={"run": "1"}, function="f-b"))
    assert ids(table, TaskQuery("alice", states=frozenset({"succeeded"}))) == ["t-2"]
    assert ids(table, TaskQuery("alice", states=frozenset({"routed"}))) == ["t-1", "t-3"]
    assert ids(table, TaskQuery("alice", function_id="f-a")) == ["t-1"]
    # The latest state's endpoint counts (t-2 ran on ep-1 in the end).
    assert ids(table, TaskQuery("alice", endpoint_id="ep-2")) == []
    assert ids(table, TaskQuery("alice", task_group_id="g-1")) == ["t-1", "t-3"]
    assert ids(table, TaskQuery("alice", tags={"run": "1", "beam": "y"})) == ["t-3"]
    assert ids(table, TaskQuery("alice", tags={"beam": "x", "run": "1"})) == ["t-1"]
    assert ids(table, TaskQuery("alice", tags={"run": "1"}, function_id="f-b")) == ["t-2"]


def test_pages_neither_skip_nor_repeat_and_a_scan_is_bounded(table: TaskStateTable) -> None:
    for i in range(700):
        put(table, state(f"t-{i:03}", at=i, tags={"odd": str(i % 2)}))
    odd = [f"t-{i:03}" for i in range(1, 700, 2)]
    for limit in (1, 7, 350, 1_000):
        assert ids(table, TaskQuery("alice", tags={"odd": "1"}), limit) == odd
    # Filtering on what the walked order does not hold: each page reads at most max_scan
    # entries, so a page may be short, and the cursors still reach every match once.
    query = TaskQuery("alice", tags={"odd": "1"}, states=frozenset({"routed"}))
    first = table.query(query, limit=1_000, max_scan=100)
    assert first.scanned == 100 and len(first.matches) == 100 and first.cursor is not None
    everything = TaskQuery("alice", function_id="fn-1")
    page = table.query(everything, limit=1_000, max_scan=64)
    assert page.scanned == 64 and page.cursor is not None
    assert ids(table, everything, 1_000, max_scan=64) == [f"t-{i:03}" for i in range(700)]
    assert ids(table, TaskQuery("alice", descending=True), 9, max_scan=50)[:2] == [
        "t-699",
        "t-698",
    ]


def test_a_group_query_walks_only_the_groups_tasks(table: TaskStateTable) -> None:
    # A user with many tasks outside the group: the group's 5 are on the first page, found
    # by reading 5 index entries, not by paging through the user's other tasks.
    for i in range(500):
        put(table, state(f"other-{i:03}", at=i))
    for i in range(5):
        put(table, state(f"g-{i}", at=1_000 + i, group="grp-1"))
    put(table, state("bob-g", user="bob", at=1_001, group="grp-1"))
    page = table.query(TaskQuery("alice", task_group_id="grp-1"), limit=100, max_scan=50)
    assert [task_id for task_id, _ in page.matches] == [f"g-{i}" for i in range(5)]
    assert page.scanned == 5 and page.cursor is None
    # A task that moves to another group moves in the index, and a delete removes it.
    put(table, state("g-4", at=1_004, group="grp-2", name=S.RUNNING))
    assert ids(table, TaskQuery("alice", task_group_id="grp-1")) == [f"g-{i}" for i in range(4)]
    assert ids(table, TaskQuery("alice", task_group_id="grp-2")) == ["g-4"]
    table.delete("g-0")
    assert ids(table, TaskQuery("alice", task_group_id="grp-1", descending=True)) == [
        "g-3",
        "g-2",
        "g-1",
    ]
    assert ids(table, TaskQuery("bob", task_group_id="grp-1")) == ["bob-g"]


def test_a_task_moves_in_the_index_when_its_submission_time_arrives_and_leaves_on_delete(
    table: TaskStateTable,
) -> None:
    put(table, state("early", at=5))
    # Known first from a state without submitted_at: placed at the time first seen ...
    put(table, state("late", at=50, submitted=False, tags={"k": "v"}))
    assert ids(table, TaskQuery("alice")) == ["early", "late"]
    # ... then placed at its submission time, and the tag entry moves with it.
    put(table, state("late", at=1, tags={"k": "v"}))
    assert ids(table, TaskQuery("alice")) == ["late", "early"]
    assert ids(table, TaskQuery("alice", tags={"k": "v"})) == ["late"]
    # A later state without submitted_at keeps the task where it was.
    put(table, state("late", at=99, name=S.RUNNING, submitted=False, tags={"k": "v"}))
    assert ids(table, TaskQuery("alice", since=T0 + 1, until=T0 + 1)) == ["late"]
    table.delete("late")
    assert ids(table, TaskQuery("alice")) == ["early"]
    assert ids(table, TaskQuery("alice", tags={"k": "v"})) == []
    assert table.get("late") is None


def test_an_unindexed_table_refuses_queries(tmp_path: Path) -> None:
    plain = TaskStateTable(tmp_path / "plain")
    try:
        put(plain, state("t-1"))
        with pytest.raises(RuntimeError, match="no query index"):
            plain.query(TaskQuery("alice"), limit=10)
    finally:
        plain.close()


# --- cursors and tags in queries -------------------------------------------------------------


def test_cursors_round_trip_and_forged_ones_are_refused() -> None:
    position = (123).to_bytes(8, "big") + b"task-1"
    assert decode_cursor(encode_cursor(position)) == position
    for bad in (
        "",
        "!!!",
        encode_cursor(b"short"),
        encode_cursor(b"\0" * 8 + b"no\0pe"),
        "A" * 999,
    ):
        with pytest.raises(ValueError, match="next_cursor of the previous page"):
            decode_cursor(bad)


def test_query_tags_are_key_colon_value() -> None:
    assert parse_tag("run:42") == ("run", "42")
    assert parse_tag("path:a:b") == ("path", "a:b")
    for bad in ("run", ":42", "run:", "a b:c", "k:" + "v" * 65):
        with pytest.raises(ValueError, match="tag=KEY:VALUE"):
            parse_tag(bad)


# --- the processor keeps tags and timings ----------------------------------------------------


def test_the_processor_carries_tags_and_router_timings_through_events_and_results() -> None:
    routed = msgspec.structs.replace(
        state("t-1", "u-1", name=S.ROUTED, tags={"run": "7"}),
        timings=TaskTimings(submitted_at=T0, routed_at=T0 + 0.01),
    )
    memory = TaskMemory(recall=lambda task_id: known_from_state(routed))
    planner = TaskStatePlanner(CATALOGUE, memory=memory, lookup={"t-1": routed}.get)
    running = TaskEvent(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.RUNNING,
        at=T0 + 1,
        source="liveness",
        attempt=Attempt(attempt=1, worker="node-1", started_at=T0 + 0.5),
    )
    out = planner.plan([Record(encode(running), "fx.task-events")])
    now = decode(out[0].value, TaskState)
    assert now.state == S.RUNNING and now.tags == {"run": "7"}
    assert now.timings == TaskTimings(submitted_at=T0, routed_at=T0 + 0.01, started_at=T0 + 0.5)
    # A result carries the agent's copy of the tags; one from an agent that sends none
    # takes the router's.
    result = TaskResult(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="success",
        value=b"v",
    )
    out = planner.plan([Record(encode(result), "fx.results.u-1")])
    assert decode(out[0].value, TaskState).tags == {"run": "7"}


def test_a_result_folded_before_the_routed_state_was_read_keeps_its_own_tags() -> None:
    planner = TaskStatePlanner(CATALOGUE, lookup=lambda task_id: None)
    result = TaskResult(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="success",
        value=b"v",
        tags={"run": "7"},
    )
    out = planner.plan([Record(encode(result), "fx.results.u-1")])
    assert decode(out[0].value, TaskState).tags == {"run": "7"}


# --- the event log ---------------------------------------------------------------------------


def test_the_event_log_lists_every_site_in_lifecycle_order() -> None:
    lost = TaskError(type="WorkerLost", message="worker died", retryable=True)
    finished = TaskState(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.SUCCEEDED,
        updated_at=T0 + 9,
        timings=TaskTimings(
            submitted_at=T0,
            routed_at=T0 + 1,
            dequeued_at=T0 + 5,
            started_at=T0 + 6,
            finished_at=T0 + 7,
            result_published_at=T0 + 8,
        ),
        attempts=[
            Attempt(attempt=1, worker="h:1", started_at=T0 + 2, finished_at=T0 + 3, error=lost),
            Attempt(attempt=2, worker="h:2", started_at=T0 + 6, finished_at=T0 + 7),
        ],
    )
    assert [(e["state"], e["at"] - T0, e["where"], e["attempt"]) for e in event_log(finished)] == [
        ("submitted", 0, "client", None),
        ("routed", 1, "router", None),
        ("started", 2, "worker:h:1", 1),
        ("finished", 3, "worker:h:1", 1),
        ("dequeued", 5, "endpoint:ep-1", 2),
        ("started", 6, "worker:h:2", 2),
        ("finished", 7, "worker:h:2", 2),
        ("result-published", 8, "endpoint:ep-1", None),
        ("succeeded", 9, "task-state", None),
    ]
    # A task still routed has two steps (the routed state is the router's own); a refused
    # one, its refusal by the router.
    routed = msgspec.structs.replace(
        state("t-2", "u-1"), timings=TaskTimings(submitted_at=T0, routed_at=T0 + 1)
    )
    assert [(e["state"], e["where"]) for e in event_log(routed)] == [
        ("submitted", "client"),
        ("routed", "router"),
    ]
    refused = TaskState(
        task_id="t-3",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.REJECTED,
        updated_at=T0 + 1,
        timings=TaskTimings(submitted_at=T0),
    )
    assert [(e["state"], e["where"]) for e in event_log(refused)] == [
        ("submitted", "client"),
        ("rejected", "router"),
    ]
