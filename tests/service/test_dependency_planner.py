"""The dependencies processor's decisions and its held table, without Kafka: a held task
is released with its parents' results once all succeeded, failed naming the parent
that failed, and ParentUnknown for another user's task or one never seen (after the
grace). The processor itself runs in tests/e2e/test_dags.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from fxstream.service.dependencies import DependencyPlanner
from fxstream.service.held_table import HeldEntry, HeldTable
from fxstream.topics import (
    Catalogue,
    ClientInfo,
    HeldTask,
    TaskCancel,
    TaskError,
    TaskErrorType,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    decode,
    encode,
)

CATALOGUE = Catalogue()
NOW = 1_000_000.0


def _child(*parents: str, user: str = "alice", task_id: str = "child-1") -> HeldEntry:
    submission = TaskSubmission(
        task_id=task_id,
        function_id="fn-1",
        endpoint_id="ep-1",
        user_id=user,
        function_sha256="c" * 64,
        payload=b"fxdl\n...",
        client=ClientInfo(python_version="3.11.7", fxstream_version="0"),
        submitted_at=NOW,
        depends_on=list(parents),
        tags={"run": "7"},
    )
    held = HeldTask(
        task_id=task_id,
        user_id=user,
        depends_on=list(parents),
        held_at=NOW,
        submission=encode(submission),
    )
    return HeldEntry(held, (("traceparent", b"00-abc"),))


def _state(task_id: str, state: TaskStateName, **fields: Any) -> TaskState:
    values: dict[str, Any] = {
        "task_id": task_id,
        "user_id": "alice",
        "function_id": "fn-0",
        "endpoint_id": "ep-1",
        "state": state,
        "updated_at": NOW,
        **fields,
    }
    return TaskState(**values)


def _planner(states: dict[str, TaskState], now: float = NOW + 1.0) -> DependencyPlanner:
    return DependencyPlanner(CATALOGUE, states.get, grace_s=60.0, clock=lambda: now)


def test_a_task_waits_while_a_parent_runs_and_is_released_with_every_result() -> None:
    states = {
        "a": _state("a", TaskStateName.SUCCEEDED, value=b"fxdl\nA"),
        "b": _state("b", TaskStateName.RUNNING),
    }
    entry = _child("a", "b")
    assert _planner(states).decide(entry) is None
    states["b"] = _state("b", TaskStateName.SUCCEEDED, value=b"fxrf\nB-by-reference")
    decision = _planner(states).decide(entry)
    assert decision is not None and decision.outcome == "released"
    (record,) = decision.records
    assert record.topic == CATALOGUE.from_user("alice") and record.key == b"child-1"
    assert record.headers == [("traceparent", b"00-abc")]
    released = decode(record.value, TaskSubmission)
    assert released.parent_results == {"a": b"fxdl\nA", "b": b"fxrf\nB-by-reference"}
    assert released.unresolved() == [] and released.tags == {"run": "7"}


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (TaskStateName.FAILED, "failed"),
        (TaskStateName.REJECTED, "was rejected"),
        (TaskStateName.CANCELLED, "was cancelled"),
    ],
)
def test_a_parent_that_did_not_succeed_fails_the_child_naming_it(
    state: TaskStateName, words: str
) -> None:
    error = TaskError(type="ZeroDivisionError", message="division by zero")
    states = {
        "a": _state("a", TaskStateName.RUNNING),
        "b": _state("b", state, error=error),
    }
    decision = _planner(states).decide(_child("a", "b"))
    assert decision is not None and decision.outcome == "failed"
    (record,) = decision.records
    assert record.topic == CATALOGUE.results("alice")
    result = decode(record.value, TaskResult)
    assert result.outcome == "error" and result.error is not None
    assert result.error.type == TaskErrorType.PARENT_FAILED
    assert result.error.message == f"parent task b {words}: ZeroDivisionError: division by zero"
    assert result.tags == {"run": "7"} and result.function_id == "fn-1"


def test_without_a_results_topic_the_failure_is_a_failed_state() -> None:
    states = {"a": _state("a", TaskStateName.FAILED)}
    decision = _planner(states).decide(_child("a"), results_present=False)
    assert decision is not None
    (record,) = decision.records
    assert record.topic == CATALOGUE.task_state
    state = decode(record.value, TaskState)
    assert state.state is TaskStateName.FAILED and state.error is not None
    assert state.error.type == TaskErrorType.PARENT_FAILED


def test_another_users_task_and_a_task_never_seen_are_unknown_in_the_same_words() -> None:
    other = {"a": _state("a", TaskStateName.SUCCEEDED, value=b"x", user_id="mallory")}
    by_other = _planner(other).decide(_child("a"))
    assert _planner({}).decide(_child("a")) is None  # within the grace: it may come yet
    never = _planner({}, now=NOW + 61.0).decide(_child("a"))
    assert by_other is not None and never is not None
    for decision in (by_other, never):
        assert decision.error is not None
        assert decision.error.type == TaskErrorType.PARENT_UNKNOWN
        assert "parent task a is not a task of user alice" in decision.error.message
    assert by_other.error == never.error


def test_a_succeeded_parent_without_a_kept_value_is_unavailable() -> None:
    states = {"a": _state("a", TaskStateName.SUCCEEDED)}
    decision = _planner(states).decide(_child("a"))
    assert decision is not None and decision.error is not None
    assert decision.error.type == TaskErrorType.PARENT_RESULT_UNAVAILABLE
    assert "parent task a" in decision.error.message and "store_url" in decision.error.message


def test_results_too_large_to_pass_on_are_unavailable_not_sent() -> None:
    big = b"fxdl\n" + b"x" * 2_000_000
    states = {"a": _state("a", TaskStateName.SUCCEEDED, value=big)}
    decision = _planner(states).decide(_child("a"))
    assert decision is not None and decision.error is not None
    assert decision.error.type == TaskErrorType.PARENT_RESULT_UNAVAILABLE
    assert decision.records[0].topic == CATALOGUE.results("alice")


def test_an_undecodable_held_submission_is_dead_lettered() -> None:
    broken = HeldEntry(
        HeldTask(task_id="child-1", user_id="alice", depends_on=["a"], held_at=NOW, submission=b"x")
    )
    # Read only once its parents decide it: a waiting task is not decoded every sweep.
    assert _planner({}).decide(broken) is None
    states = {"a": _state("a", TaskStateName.SUCCEEDED, value=b"x")}
    decision = _planner(states).decide(broken)
    assert decision is not None and decision.outcome == "dead-lettered"
    assert decision.records[0].topic == CATALOGUE.dead_letter


def test_the_held_table_finds_children_by_parent_and_forgets_them() -> None:
    table = HeldTable()
    table.put(_child("a", "b", task_id="c-1"))
    table.put(_child("a", task_id="c-2"))
    assert table.children_of("a") == ["c-1", "c-2"] and table.children_of("b") == ["c-1"]
    assert table.waits_for("b") and len(table) == 2
    assert table.remove("c-1") is not None and table.remove("c-1") is None
    assert not table.waits_for("b") and table.children_of("a") == ["c-2"]
    table.put(_child("b", task_id="c-2"))  # the same id again: replaced
    assert table.children_of("a") == [] and table.children_of("b") == ["c-2"]
    assert [e.task_id for e in table] == ["c-2"] and "c-2" in table


def test_a_held_task_cancelled_by_its_submitter_ends_cancelled_by_another_not() -> None:
    entry = _child("a")
    mine = TaskCancel(
        task_id="child-1", user_id="alice", endpoint_id="ep-1", requested_at=NOW, reason="enough"
    )
    decision = _planner({}).cancel(entry, mine)
    assert decision.outcome == "cancelled"
    (record,) = decision.records
    result = decode(record.value, TaskResult)
    assert result.error is not None and result.error.type == TaskErrorType.CANCELLED
    assert result.error.message == "cancelled while waiting for its parents: enough"
    without_results = _planner({}).cancel(entry, mine, results_present=False)
    state = decode(without_results.records[0].value, TaskState)
    assert state.state is TaskStateName.CANCELLED
    theirs = msgspec.structs.replace(mine, user_id="mallory")
    ignored = _planner({}).cancel(entry, theirs)
    # Still held: its held record written again (compaction keeps it, not the cancel's copy).
    assert ignored.outcome == "cleared" and not ignored.tombstone
    (again,) = ignored.records
    assert again.topic == CATALOGUE.held_tasks and again.key == b"child-1"
    assert decode(again.value, HeldTask) == entry.held
    assert again.headers == [("traceparent", b"00-abc")]
