"""Windowed analytics on a running platform: tasks run through the platform (some
failing, some fired by a trigger rule), and the windows the analytics processor writes
hold exactly their counts, read through the API (as the user and as the admin) and from
the ``analytics`` topic.

The expected figures are computed here, independently, from each task's terminal state
as the API shows it (a task counts in the windows holding its ``updated_at``). Every
function and rule is this module's own, so the shared platform's other modules' tasks
do not count in them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.private import PrivatePlatform
from fxstream.sdk import Client
from fxstream.service.trigger_processor import firing_task_id
from fxstream.topics import Event, WindowAggregate, decode, encode
from tests.e2e.stack import committed_records, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 90.0
N_OK = 12
N_BOOM = 5
TUMBLING = 60
HOPPING, HOP = 300, 60


def analytics_ok(x: int) -> int:
    """Succeeds."""
    return x


def analytics_boom(x: int) -> int:
    """Fails."""
    raise ValueError(f"analytics test failure {x}")


def analytics_event(event: dict[str, Any]) -> str:
    """A rule's function: fails for events whose key ends in 'bad'."""
    if event["event_key"].endswith("bad"):
        raise ValueError("a bad event")
    return str(event["event_key"])


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    return shared_platform


@pytest.fixture(scope="module")
def client(stack: PrivatePlatform) -> Iterator[Client]:
    made = stack.client()
    yield made
    made.close()


def expected_windows(updated: list[float]) -> dict[tuple[str, float], int]:
    """How many of the moments each tumbling and hopping window holds."""
    counts: dict[tuple[str, float], int] = {}
    for moment in updated:
        start = moment // TUMBLING * TUMBLING
        counts[("tumbling", start)] = counts.get(("tumbling", start), 0) + 1
        last = moment // HOP * HOP
        for s in range(int(last) - HOPPING + HOP, int(last) + 1, HOP):
            if s <= moment < s + HOPPING:
                counts[("hopping", float(s))] = counts.get(("hopping", float(s)), 0) + 1
    return counts


def finished(windows: list[dict[str, Any]]) -> dict[tuple[str, float], int]:
    return {(w["window"], w["start"]): w["finished"] for w in windows}


def wait_for_windows(read: Callable[[], list[dict[str, Any]]], total: int) -> list[dict[str, Any]]:
    """Read windows until the tumbling ones hold at least ``total`` tasks and two reads
    two seconds (two of the processor's flushes) apart agree: one flush's records are
    spread over the topic's partitions, and the API may have read some of them only."""
    deadline = time.monotonic() + WAIT_S
    windows = read()
    while time.monotonic() < deadline:
        if sum(w["finished"] for w in windows if w["window"] == "tumbling") >= total:
            time.sleep(2)
            again = read()
            if finished(again) == finished(windows):
                return again
            windows = again
        else:
            time.sleep(0.5)
            windows = read()
    return windows  # the caller's exact comparison says what is missing


def terminal_states(
    stack: PrivatePlatform, client: Client, task_ids: list[str], state: str
) -> list[dict[str, Any]]:
    """The tasks' terminal states as the API holds them (``GET /v1/tasks/{id}``, which
    has the ``updated_at`` the SDK's task view leaves out)."""
    states = []
    for task_id in task_ids:
        wait_for_state(client, task_id, state, timeout_s=WAIT_S)
        answer = httpx.get(
            f"{stack.settings.service_url}/v1/tasks/{task_id}",
            headers={"Authorization": f"Bearer {stack.settings.token}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        states.append(answer.json())
    return states


@pytest.fixture(scope="module")
def ran(stack: PrivatePlatform, client: Client) -> dict[str, Any]:
    """N_OK succeeding and N_BOOM failing tasks of two functions of this module's own."""
    tag = uuid.uuid4().hex[:8]
    ok_id = client.register_function(analytics_ok, description=f"analytics {tag}")
    boom_id = client.register_function(analytics_boom, description=f"analytics {tag}")
    ok = [client.run(i, endpoint_id=stack.endpoint_id, function_id=ok_id) for i in range(N_OK)]
    boom = [
        client.run(i, endpoint_id=stack.endpoint_id, function_id=boom_id) for i in range(N_BOOM)
    ]
    for task_id in ok:
        client.future(task_id).result(timeout=WAIT_S)
    for task_id in boom:
        with pytest.raises(ValueError):
            client.future(task_id).result(timeout=WAIT_S)
    client.forget(ok + boom)
    return {
        "ok_id": ok_id,
        "boom_id": boom_id,
        "ok": terminal_states(stack, client, ok, "succeeded"),
        "boom": terminal_states(stack, client, boom, "failed"),
    }


def test_windowed_counts_equal_the_tasks_run_through_the_api(
    client: Client, ran: dict[str, Any]
) -> None:
    ok = wait_for_windows(lambda: client.get_analytics("function", key=ran["ok_id"]), N_OK)
    assert finished(ok) == expected_windows([s["updated_at"] for s in ran["ok"]])
    boom = wait_for_windows(lambda: client.get_analytics("function", key=ran["boom_id"]), N_BOOM)
    assert finished(boom) == expected_windows([s["updated_at"] for s in ran["boom"]])
    for window in ok:
        assert window["succeeded"] == window["finished"] and window["errors"] == 0
        assert window["error_rate"] == 0
        assert window["states"]["succeeded"] == window["finished"]
    for window in boom:
        assert window["failed"] == window["errors"] == window["finished"]
        assert window["error_rate"] == 1.0
    # Each window's latency samples are its tasks, and its maximum is theirs, exactly.
    tumbling = [w for w in ok if w["window"] == "tumbling"]
    assert sum(w["latency_s"]["samples"] for w in tumbling) == N_OK
    latencies = [
        (s["timings"]["result_published_at"] or s["updated_at"]) - s["timings"]["submitted_at"]
        for s in ran["ok"]
    ]
    assert max(w["latency_s"]["max"] for w in tumbling) == pytest.approx(max(latencies))
    for w in tumbling:
        figures = w["latency_s"]
        assert figures["p50"] <= figures["p90"] <= figures["p99"] <= figures["max"]


def test_the_topic_holds_the_same_windows(
    stack: PrivatePlatform, client: Client, ran: dict[str, Any]
) -> None:
    api = wait_for_windows(lambda: client.get_analytics("function", key=ran["boom_id"]), N_BOOM)
    latest: dict[bytes, WindowAggregate] = {}
    for message in committed_records(stack.kafka, stack.catalogue.analytics):
        value = message.value()
        key = message.key()
        if value is not None and key is not None:
            latest[key] = decode(value, WindowAggregate)
    mine = [a for a in latest.values() if a.dimension == "function" and a.key == ran["boom_id"]]
    assert {(a.window, a.start): a.finished for a in mine} == finished(api)
    assert {(a.window, a.start): a.failed for a in mine} == {
        (w["window"], w["start"]): w["failed"] for w in api
    }
    assert sum(a.finished for a in mine if a.window == "tumbling") == N_BOOM


def test_a_user_sees_only_its_own_windows_and_the_admin_sees_all(
    stack: PrivatePlatform, client: Client, ran: dict[str, Any]
) -> None:
    mine = wait_for_windows(lambda: client.get_analytics("function", key=ran["ok_id"]), N_OK)
    assert sum(w["finished"] for w in mine if w["window"] == "tumbling") == N_OK
    other = other_user_client(stack, f"analytics-{uuid.uuid4().hex[:6]}")
    try:
        assert other.get_analytics("function", key=ran["ok_id"]) == []
        assert all(w["user_id"] == other.user_id for w in other.get_analytics("user"))
    finally:
        other.close()
    answer = httpx.get(
        f"{stack.settings.service_url}/v1/analytics",
        params={"dimension": "function", "key": ran["ok_id"]},
        headers={"Authorization": f"Bearer {stack.admin_token}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    admin = answer.json()["windows"]
    assert finished(admin) == finished(mine)
    assert all(w["user_id"] is None for w in admin)  # summed over users


def test_a_rule_s_windows_count_its_firings(stack: PrivatePlatform, client: Client) -> None:
    source = f"trig-an-{uuid.uuid4().hex[:8]}"
    ensure_event_topic(stack.kafka, stack.catalogue, source)
    function_id = client.register_function(analytics_event)
    rule_id = client.register_trigger(
        source=source, function_id=function_id, endpoint_id=stack.endpoint_id
    )
    producer = Producer({**stack.kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    keys = ["a", "b", "c-bad", "d"]
    coordinates: list[tuple[str, int, int]] = []
    for key in keys:
        delivered: list[Any] = []
        event = Event(
            source=source, event_key=key, event_type="file-complete", occurred_at=time.time()
        )
        producer.produce(
            stack.catalogue.events(source),
            key=key.encode(),
            value=encode(event),
            on_delivery=lambda err, msg: delivered.append((err, msg)),  # noqa: B023
        )
        producer.flush(10)
        error, message = delivered[0]
        assert error is None, error
        coordinates.append((message.topic(), message.partition(), message.offset()))
    fired = [firing_task_id(rule_id, *c) for c in coordinates]
    good_ids = [t for t, k in zip(fired, keys, strict=True) if "bad" not in k]
    good = terminal_states(stack, client, good_ids, "succeeded")
    bad = terminal_states(stack, client, [fired[2]], "failed")
    windows = wait_for_windows(lambda: client.get_analytics("rule", key=rule_id), len(keys))
    assert finished(windows) == expected_windows([s["updated_at"] for s in good + bad])
    tumbling = [w for w in windows if w["window"] == "tumbling"]
    assert sum(w["failed"] for w in tumbling) == 1
    assert sum(w["succeeded"] for w in tumbling) == len(keys) - 1
