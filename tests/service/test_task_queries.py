"""``GET /v1/tasks`` (filtered queries) and the event log of ``GET /v1/tasks/{id}``, against
the real broker.

The app runs in-process (TestClient drives the real ASGI stack); task states are produced
to the module's task-state topic as the router and the task-state processor would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fxstream.service import create_app
from fxstream.topics import (
    Attempt,
    Catalogue,
    KafkaConnection,
    TaskState,
    TaskStateName,
    TaskTimings,
)
from tests.service.conftest import Produce, eventually
from tests.service.test_api import ACCOUNTS, User, assert_error, register

S = TaskStateName


@pytest.fixture(scope="module")
def client(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[TestClient]:
    """The API on this module's topics, started and stopped around the module."""
    with TestClient(create_app(module_kafka, catalogue, accounts=ACCOUNTS)) as client:
        yield client


def state(
    task_id: str,
    owner: User,
    submitted_at: float,
    name: TaskStateName = S.ROUTED,
    *,
    tags: dict[str, str] | None = None,
    function_id: str = "fn-1",
    endpoint_id: str = "ep-1",
    group: str | None = None,
) -> TaskState:
    """A task-state record of ``owner``'s task."""
    return TaskState(
        task_id=task_id,
        user_id=owner.user_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        task_group_id=group,
        state=name,
        updated_at=submitted_at + 1,
        timings=TaskTimings(submitted_at=submitted_at, routed_at=submitted_at + 0.5),
        tags=tags or {},
    )


def query(client: TestClient, owner: User, **params: Any) -> list[str]:
    """Every task id ``GET /v1/tasks`` answers for ``params``, following the cursors."""
    found: list[str] = []
    cursor: str | None = None
    while True:
        sent = {**params, **({"cursor": cursor} if cursor else {})}
        answer = client.get("/v1/tasks", params=sent, headers=owner.auth)
        assert answer.status_code == 200, answer.text
        page = answer.json()
        limit = int(params.get("limit", 100))
        assert len(page["tasks"]) <= limit
        for task in page["tasks"]:
            assert task["user_id"] == owner.user_id
        found += [task["task_id"] for task in page["tasks"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return found


@pytest.fixture(scope="module")
def tasks(client: TestClient, catalogue: Catalogue, produce: Produce) -> dict[str, Any]:
    """Alice's and Bob's tasks, with the same tags, read by the API's view."""
    alice, bob = register(client, "alice"), register(client, "bob")
    base = time.time() - 1_000
    run = f"r-{uuid.uuid4().hex[:8]}"
    group = str(uuid.uuid4())
    mine: list[str] = []
    for i in range(12):
        task_id = str(uuid.uuid4())
        mine.append(task_id)
        record = state(
            task_id,
            alice,
            base + i,
            S.SUCCEEDED if i % 4 == 0 else S.ROUTED,
            tags={"run": run, "part": str(i % 2)},
            function_id="fn-a" if i < 6 else "fn-b",
            endpoint_id="ep-1" if i % 3 else "ep-2",
            group=group if i >= 8 else None,
        )
        produce(catalogue.task_state, task_id, record)
    theirs = [str(uuid.uuid4()) for _ in range(5)]
    for i, task_id in enumerate(theirs):
        produce(catalogue.task_state, task_id, state(task_id, bob, base + i, tags={"run": run}))
    last = theirs[-1]
    eventually(
        lambda: client.get(f"/v1/tasks/{last}", headers=bob.auth).status_code == 200,
        what="the view read the states",
    )
    eventually(lambda: client.get(f"/v1/tasks/{mine[-1]}", headers=alice.auth).status_code == 200)
    return {"alice": alice, "bob": bob, "mine": mine, "theirs": theirs, "run": run, "base": base}


def test_a_tag_query_returns_exactly_the_callers_tasks_with_the_tag(
    client: TestClient, tasks: dict[str, Any]
) -> None:
    alice, bob, run = tasks["alice"], tasks["bob"], tasks["run"]
    assert query(client, alice, tag=f"run:{run}") == tasks["mine"]
    assert query(client, bob, tag=f"run:{run}") == tasks["theirs"]
    assert query(client, alice, tag=[f"run:{run}", "part:1"]) == tasks["mine"][1::2]
    assert query(client, alice, tag=f"run:{run}-other") == []
    # Every page size reaches the same tasks once, in order; newest first reverses it.
    for limit in (1, 5, 1_000):
        assert query(client, alice, tag=f"run:{run}", limit=limit) == tasks["mine"]
    assert query(client, alice, tag=f"run:{run}", order="desc") == tasks["mine"][::-1]
    # Alice's cursor, passed by Bob, walks Bob's tasks only.
    page = client.get("/v1/tasks", params={"tag": f"run:{run}", "limit": 1}, headers=alice.auth)
    cursor = page.json()["next_cursor"]
    assert cursor is not None
    theirs = client.get(
        "/v1/tasks", params={"tag": f"run:{run}", "cursor": cursor}, headers=bob.auth
    ).json()
    assert {t["user_id"] for t in theirs["tasks"]} <= {bob.user_id}


def test_state_function_endpoint_group_and_time_filters(
    client: TestClient, tasks: dict[str, Any]
) -> None:
    alice, mine, run, base = tasks["alice"], tasks["mine"], tasks["run"], tasks["base"]
    tagged = {"tag": f"run:{run}"}
    assert query(client, alice, state="succeeded", **tagged) == mine[0::4]
    assert query(client, alice, state=["succeeded", "routed"], **tagged) == mine
    assert query(client, alice, function_id="fn-b", **tagged) == mine[6:]
    assert query(client, alice, endpoint_id="ep-2", **tagged) == mine[0::3]
    group_of_8_to_11 = client.get(f"/v1/tasks/{mine[8]}", headers=alice.auth).json()
    group = group_of_8_to_11["task_group_id"]
    assert query(client, alice, group=group) == mine[8:]
    assert query(client, alice, since=base + 3, until=base + 5, **tagged) == mine[3:6]
    assert query(client, alice, since=base + 3, until=base + 5) == mine[3:6]
    assert query(client, alice, since=base + 11.5, **tagged) == []
    combined = query(
        client, alice, state="routed", function_id="fn-a", endpoint_id="ep-1", **tagged
    )
    assert combined == [mine[i] for i in (1, 2, 5)]


def test_get_task_holds_the_tags_and_an_ordered_event_log(
    client: TestClient, catalogue: Catalogue, produce: Produce, tasks: dict[str, Any]
) -> None:
    alice = tasks["alice"]
    task_id = str(uuid.uuid4())
    now = time.time()
    finished = TaskState(
        task_id=task_id,
        user_id=alice.user_id,
        function_id="fn-1",
        endpoint_id="ep-1",
        state=S.SUCCEEDED,
        updated_at=now + 6,
        timings=TaskTimings(
            submitted_at=now,
            routed_at=now + 1,
            dequeued_at=now + 2,
            started_at=now + 3,
            finished_at=now + 4,
            result_published_at=now + 5,
        ),
        attempts=[Attempt(attempt=1, worker="node:7", started_at=now + 3, finished_at=now + 4)],
        tags={"run": "events"},
    )
    produce(catalogue.task_state, task_id, finished)
    eventually(lambda: client.get(f"/v1/tasks/{task_id}", headers=alice.auth).status_code == 200)
    body = client.get(f"/v1/tasks/{task_id}", headers=alice.auth).json()
    assert body["tags"] == {"run": "events"}
    assert [(e["state"], e["where"], e["at"]) for e in body["events"]] == [
        ("submitted", "client", now),
        ("routed", "router", now + 1),
        ("dequeued", "endpoint:ep-1", now + 2),
        ("started", "worker:node:7", now + 3),
        ("finished", "worker:node:7", now + 4),
        ("result-published", "endpoint:ep-1", now + 5),
        ("succeeded", "task-state", now + 6),
    ]
    listed = client.get("/v1/tasks", params={"tag": "run:events"}, headers=alice.auth).json()
    assert [t["task_id"] for t in listed["tasks"]] == [task_id]
    assert listed["tasks"][0]["events"] == body["events"]
    # Bob sees neither the task nor its tag.
    bob = tasks["bob"]
    assert client.get(f"/v1/tasks/{task_id}", headers=bob.auth).status_code == 404
    assert query(client, bob, tag="run:events") == []


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"tag": "run"}, "tag=KEY:VALUE"),
        ({"tag": "a b:c"}, "tag=KEY:VALUE"),
        ({"cursor": "not-a-cursor"}, "next_cursor of the previous page"),
        ({"since": 10, "until": 5}, "swap them"),
        ({"limit": 0}, "limit"),
        ({"limit": 1_001}, "limit"),
        ({"state": "sleeping"}, "state"),
        ({"function_id": "no/such"}, "function_id"),
        ({"tag": [f"k{i}:v" for i in range(9)]}, "tag"),
    ],
)
def test_a_bad_query_is_refused_saying_what_to_change(
    client: TestClient, tasks: dict[str, Any], params: dict[str, Any], says: str
) -> None:
    detail = assert_error(
        client.get("/v1/tasks", params=params, headers=tasks["alice"].auth), 422, "invalid-request"
    )
    assert says in detail


def test_a_query_needs_a_user_token(client: TestClient, tasks: dict[str, Any]) -> None:
    assert_error(client.get("/v1/tasks"), 401, "unauthorized")
