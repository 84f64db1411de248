"""LivenessMonitor: endpoint transitions from heartbeats, and bad heartbeats dead-lettered."""

from __future__ import annotations

from dataclasses import dataclass

from fxstream.service.liveness import LivenessMonitor
from fxstream.topics import Catalogue, DeadLetter, Heartbeat, decode, encode

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


def test_online_restarted_and_lost() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    changes, _ = monitor.observe([beat(100.0), beat(105.0)])
    assert [(t.endpoint_id, t.change) for t in changes] == [("ep-1", "online")]
    changes, _ = monitor.observe([beat(110.0, agent="agent-2")])
    assert [(t.change, t.agent_id) for t in changes] == [("restarted", "agent-2")]
    assert monitor.lost(now=120.0) == []  # 10 s: within 3 periods of 5 s
    lost = monitor.lost(now=126.0)
    assert [(t.endpoint_id, t.change) for t in lost] == [("ep-1", "lost")]
    assert monitor.lost(now=130.0) == [], "a loss is reported once"
    assert monitor.online() == []
    changes, _ = monitor.observe([beat(131.0, agent="agent-2")])
    assert [t.change for t in changes] == ["online"]


def test_an_older_heartbeat_does_not_roll_back_the_newer() -> None:
    monitor = LivenessMonitor(CATALOGUE)
    monitor.observe([beat(200.0, agent="new")])
    changes, _ = monitor.observe([beat(150.0, agent="old")])
    assert changes == []
    assert monitor.lost(now=210.0) == []


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
