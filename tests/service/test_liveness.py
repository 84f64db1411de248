"""LivenessMonitor: endpoint transitions from heartbeats, and bad heartbeats dead-lettered."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fxstream.service.liveness import LivenessMonitor
from fxstream.service.outgoing import Outgoing
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    Heartbeat,
    TaskEvent,
    TaskLease,
    TaskStateName,
    decode,
    encode,
)

CATALOGUE = Catalogue(prefix="fx.")


@dataclass(frozen=True)
class Record:
    """A consumed record, as the processors hand it over."""

    value: bytes
    key: bytes | None = b"ep-1"
    topic: str = "fx.heartbeats"
    partition: int = 0
    offset: int = 0
    headers: object = None
    timestamp: int = 0


def beat(sent_at: float, agent: str = "agent-1", endpoint: str = "ep-1") -> Record:
    heartbeat = Heartbeat(
        endpoint_id=endpoint,
        agent_id=agent,
        sent_at=sent_at,
        sequence=1,
        period_s=5.0,
        hostname="node",
        pid=1,
        workers_total=2,
        workers_idle=2,
        workers_busy=0,
        queue_depth=0,
    )
    return Record(encode(heartbeat), key=endpoint.encode())


def test_agents_come_online_and_are_lost_one_by_one() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    changes, _ = monitor.observe([beat(100.0), beat(105.0)])
    assert [(t.endpoint_id, t.change, t.agent_id) for t in changes] == [
        ("ep-1", "online", "agent-1")
    ]
    changes, _ = monitor.observe([beat(110.0, agent="agent-2")])
    assert [(t.change, t.agent_id) for t in changes] == [("online", "agent-2")]
    lost, _ = monitor.lost(now=120.0)  # agent-1 silent for 15 s: 3 periods of 5 s
    assert lost == []
    lost, _ = monitor.lost(now=121.0)
    assert [(t.change, t.agent_id) for t in lost] == [("lost", "agent-1")]
    assert monitor.online() == ["ep-1"], "agent-2 still serves the endpoint"
    lost, _ = monitor.lost(now=126.0)
    assert [(t.change, t.agent_id) for t in lost] == [("lost", "agent-2")]
    assert monitor.lost(now=130.0) == ([], []), "a loss is reported once"
    assert monitor.online() == []
    changes, _ = monitor.observe([beat(131.0, agent="agent-2")])
    assert [t.change for t in changes] == ["online"], "a stopped agent that wakes is back"


def leased(sent_at: float, *leases: TaskLease, agent: str = "agent-1") -> Record:
    heartbeat = Heartbeat(
        endpoint_id="ep-1",
        agent_id=agent,
        sent_at=sent_at,
        sequence=1,
        period_s=5.0,
        hostname="node-7",
        pid=1,
        workers_total=2,
        workers_idle=0,
        workers_busy=2,
        queue_depth=0,
        leases=list(leases),
    )
    return Record(encode(heartbeat))


def lease(task_id: str, started_at: float | None, attempt: int = 1) -> TaskLease:
    return TaskLease(
        task_id=task_id, user_id="u-1", function_id="fn-1", attempt=attempt, started_at=started_at
    )


def events(records: list[Outgoing]) -> list[tuple[str, TaskStateName]]:
    return [
        (e.task_id, e.state)
        for e in (decode(r.value, TaskEvent) for r in records if r.topic == "fx.task-events")
    ]


def test_a_task_running_for_a_period_is_announced_running_once() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    _, out = monitor.observe([leased(100.0, lease("long", 99.0), lease("queued", None))])
    assert events(out) == [], "a task started 1 s ago may finish before anyone asks"
    _, out = monitor.observe([leased(105.0, lease("long", 99.0), lease("queued", None))])
    assert events(out) == [("long", TaskStateName.RUNNING)]
    event = decode(out[0].value, TaskEvent)
    assert (event.user_id, event.endpoint_id, event.source) == ("u-1", "ep-1", "liveness")
    assert event.attempt is not None and event.attempt.worker == "node-7"
    _, out = monitor.observe([leased(110.0, lease("long", 99.0))])
    assert events(out) == [], "a renewal announces nothing new"
    _, out = monitor.observe([leased(115.0, lease("long", 109.0, attempt=2))])
    assert events(out) == [("long", TaskStateName.RUNNING)], "a new attempt is a new step"


def test_the_tasks_of_a_lost_agent_wait_for_the_endpoint() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    monitor.observe([leased(100.0, lease("a", 90.0), lease("b", None))])
    monitor.observe([leased(100.0, lease("c", 95.0), agent="agent-2")])
    monitor.observe([leased(120.0, lease("c", 95.0), agent="agent-2")])
    lost, out = monitor.lost(now=116.0)
    assert [t.agent_id for t in lost] == ["agent-1"]
    assert events(out) == [
        ("a", TaskStateName.WAITING_FOR_ENDPOINT),
        ("b", TaskStateName.WAITING_FOR_ENDPOINT),
    ]
    event = decode(out[0].value, TaskEvent)
    assert event.attempt is not None and event.attempt.error is not None
    assert event.attempt.error.type == "AgentLost"
    assert "no heartbeat for 16 s" in event.attempt.error.message


def test_an_older_heartbeat_does_not_roll_back_the_newer() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    monitor.observe([beat(200.0, agent="new")])
    changes, _ = monitor.observe([beat(150.0, agent="new")])
    assert changes == []
    assert monitor.lost(now=210.0) == ([], [])


def test_malformed_heartbeats_are_dead_lettered_with_the_reason() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    changes, letters = monitor.observe([Record(b"not a heartbeat", offset=7), beat(1.0)])
    assert [t.change for t in changes] == ["online"], "the good one after it is still folded"
    assert [letter.topic for letter in letters] == ["fx.dead-letter"]
    dead = decode(letters[0].value, DeadLetter)
    assert (dead.original_offset, dead.component, dead.original_value) == (
        7,
        "liveness",
        b"not a heartbeat",
    )
    assert dead.reason


def test_agents_of_a_partition_given_to_another_liveness_process_are_forgotten() -> None:
    """Several liveness processes share ``heartbeats``: one that gives a partition up
    must not declare that partition's agents lost for want of their heartbeats."""
    monitor = LivenessMonitor(CATALOGUE)
    on_0 = beat(100.0, agent="agent-1")
    on_1 = dataclasses.replace(beat(100.0, agent="agent-2", endpoint="ep-2"), partition=1)
    monitor.observe([on_0, on_1])
    assert monitor.forget({1}) == ["agent-2"]
    lost, _ = monitor.lost(now=200.0)
    assert [t.agent_id for t in lost] == ["agent-1"], "only its own partition's agent is lost"
