"""The task lifecycle as the task-state processor enforces it (planner units, no broker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fxstream.service.lifecycle import TERMINAL_STATES, TaskMemory, may_follow
from fxstream.service.task_state import TaskStatePlanner
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetter,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskResult,
    TaskState,
    TaskStateName,
    decode,
    encode,
)

CATALOGUE = Catalogue(prefix="fx.")
S = TaskStateName


@dataclass(frozen=True)
class Record:
    """A consumed record, as the processors hand it over."""

    value: bytes
    topic: str
    key: bytes | None = b"t-1"
    partition: int = 0
    offset: int = 0
    headers: object = None
    timestamp: int = 0


def result(
    *,
    outcome: str = "success",
    error: TaskError | None = None,
    attempt: int = 1,
    worker: str = "node-2:11",
    earlier: list[Attempt] | None = None,
) -> Record:
    record = TaskResult(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="success" if outcome == "success" else "error",
        value=b"v" if outcome == "success" else None,
        error=error,
        attempt=attempt,
        worker=worker,
        earlier_attempts=earlier or [],
    )
    return Record(encode(record), "fx.results.u-1")


def event(
    state: TaskStateName,
    *,
    source: str = "liveness",
    attempt: int = 1,
    error: TaskError | None = None,
    worker: str = "node-1",
) -> Record:
    record = TaskEvent(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=state,
        at=1.0,
        source=source,
        attempt=Attempt(attempt=attempt, worker=worker, started_at=0.5, error=error),
    )
    return Record(encode(record), "fx.task-events")


def states(planner: TaskStatePlanner, *records: Record) -> list[TaskState]:
    out = planner.plan(records)
    return [decode(r.value, TaskState) for r in out if r.topic == "fx.task-state"]


def letters(planner: TaskStatePlanner, *records: Record) -> list[DeadLetter]:
    out = planner.plan(records)
    return [decode(r.value, DeadLetter) for r in out if r.topic == "fx.dead-letter"]


LOST = TaskError(type=TaskErrorType.AGENT_LOST, message="no heartbeat", retryable=True)
WORKER_LOST = TaskError(type="WorkerLost", message="worker died", retryable=True)


def test_the_lifecycle_table() -> None:
    assert may_follow(S.SUBMITTED, S.ROUTED) and may_follow(S.SUBMITTED, S.REJECTED)
    assert not may_follow(S.SUBMITTED, S.RUNNING)
    for active in (S.ROUTED, S.RUNNING, S.RETRYING, S.WAITING_FOR_ENDPOINT):
        for following in (S.RUNNING, S.RETRYING, S.WAITING_FOR_ENDPOINT, S.SUCCEEDED, S.FAILED):
            assert may_follow(active, following), (active, following)
        assert not may_follow(active, S.ROUTED) and not may_follow(active, S.REJECTED)
    for terminal in TERMINAL_STATES:
        assert not any(may_follow(terminal, s) for s in S), terminal


def test_a_task_lost_with_its_agent_waits_then_runs_elsewhere_and_keeps_every_attempt() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    assert [s.state for s in states(planner, event(S.RUNNING))] == [S.RUNNING]
    waiting = states(planner, event(S.WAITING_FOR_ENDPOINT, error=LOST))
    assert [s.state for s in waiting] == [S.WAITING_FOR_ENDPOINT]
    assert waiting[0].error == LOST
    running = states(planner, event(S.RUNNING, worker="node-2"))
    assert [s.state for s in running] == [S.RUNNING]
    done = states(planner, result())
    assert [s.state for s in done] == [S.SUCCEEDED]
    assert [(a.worker, a.error.type if a.error else None) for a in done[0].attempts] == [
        ("node-1", "AgentLost"),
        ("node-2:11", None),
    ]


def test_retries_are_recorded_once_each() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    first = Attempt(attempt=1, worker="node-1:5", started_at=0.5, error=WORKER_LOST)
    retrying = TaskEvent(
        task_id="t-1",
        user_id="u-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.RETRYING,
        at=1.0,
        source="agent local@node-1",
        attempt=first,
    )
    assert [s.state for s in states(planner, Record(encode(retrying), "fx.task-events"))] == [
        S.RETRYING
    ]
    done = states(planner, result(attempt=2, earlier=[first]))
    assert [(a.attempt, a.error is not None) for a in done[0].attempts] == [(1, True), (2, False)]


def test_the_first_result_stands_and_duplicates_are_counted() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    assert [s.state for s in states(planner, result())] == [S.SUCCEEDED]
    assert states(planner, result(worker="node-9:1")) == []
    assert planner.stats.duplicates == 1


def test_a_cancelled_result_ends_the_task_cancelled() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    cancelled = TaskError(type=TaskErrorType.CANCELLED, message="cancelled by its owner")
    assert [s.state for s in states(planner, result(outcome="error", error=cancelled))] == [
        S.CANCELLED
    ]


def test_late_liveness_observations_are_stale_not_errors() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    states(planner, result())
    assert letters(planner, event(S.RUNNING), event(S.WAITING_FOR_ENDPOINT, error=LOST)) == []
    assert planner.stats.stale == 2


def test_a_retry_announced_after_the_task_ended_is_dead_lettered() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    states(planner, result(outcome="error", error=WORKER_LOST, attempt=2))
    dead = letters(planner, event(S.RETRYING, source="agent a@h", attempt=2, error=WORKER_LOST))
    assert len(dead) == 1
    assert dead[0].error_type == "ImpossibleTransition"
    assert "failed -> retrying" in dead[0].reason
    assert planner.stats.impossible == 1
    # About an earlier attempt than the one that ended it: late, not impossible.
    assert letters(planner, event(S.RETRYING, source="agent a@h", attempt=1)) == []


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.ROUTED, S.SUBMITTED, S.REJECTED])
def test_an_event_may_not_announce_a_result_or_a_routing(state: TaskStateName) -> None:
    planner = TaskStatePlanner(CATALOGUE)
    dead = letters(planner, event(state, source="someone"))
    assert len(dead) == 1 and "may announce only" in dead[0].reason


def test_a_renewal_writes_nothing() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    assert len(states(planner, event(S.RUNNING))) == 1
    assert states(planner, event(S.RUNNING)) == []


def test_memory_is_bounded_and_keeps_the_most_recent() -> None:
    memory = TaskMemory(capacity=2)
    planner = TaskStatePlanner(CATALOGUE, memory=memory)
    for task in ("a", "b", "c"):
        record = TaskResult(
            task_id=task,
            user_id="u",
            function_id="f",
            endpoint_id="e",
            outcome="success",
            value=b"",
        )
        planner.plan([Record(encode(record), "fx.results.u", key=task.encode())])
    assert len(memory) == 2
    assert memory.get("a") is None and memory.get("c") is not None


def test_a_result_on_another_users_topic_is_dead_lettered() -> None:
    planner = TaskStatePlanner(CATALOGUE)
    misplaced = Record(result().value, "fx.results.someone-else")
    dead = letters(planner, misplaced)
    assert len(dead) == 1 and dead[0].error_type == "MisplacedResult"
    assert "fx.results.u-1" in dead[0].reason
