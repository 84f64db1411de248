"""Task tags, filtered task queries and the per-task event log end to end, on the session's
shared platform (started as `./fx up` starts it): the SDK tags tasks (``Client.run``,
batches, the Executor), the router and the task-state processor keep the tags, and
``Client.get_tasks`` / ``iter_tasks`` filter on them through the API."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fxstream.sdk import Client, Executor, NotFound
from tests.e2e.stack import Stack, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 60.0


def add_one(x: int) -> int:
    return x + 1


def triple(x: int) -> int:
    return 3 * x


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[Client]:
    """A client of the platform's local user."""
    made = stack.client()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def tagged(stack: Stack, client: Client) -> dict[str, Any]:
    """Tasks of one run, tagged by ``run``, ``batch`` and the Executor, all finished and
    folded into task-state."""
    run = f"r-{uuid.uuid4().hex[:12]}"
    since = time.time()
    function_id = client.register_function(add_one)
    by_run = [
        client.run(i, endpoint_id=stack.endpoint_id, function_id=function_id, tags={"run": run})
        for i in range(3)
    ]
    batch = client.create_batch()
    for i in range(4):
        batch.add(function_id, (i,), tags={"part": "odd" if i % 2 else "even"})
    sent = client.batch_run(stack.endpoint_id, batch, tags={"run": run, "how": "batch"})
    by_batch = sent["tasks"][function_id]
    with Executor(endpoint_id=stack.endpoint_id, client=client, tags={"run": run}) as executor:
        futures = [executor.submit(triple, i) for i in range(2)]
        executor.tags = {"run": run, "late": "yes"}
        futures.append(executor.submit(triple, 9))
        assert [f.result(timeout=WAIT_S) for f in futures] == [0, 3, 27]
        group = executor.task_group_id
    by_executor = [f.task_id for f in futures]
    for task_id in by_run + by_batch:
        client.future(task_id).result(timeout=WAIT_S)
    every = by_run + by_batch + by_executor
    client.forget(every)  # from here on, get_task asks the service
    for task_id in every:
        wait_for_state(client, task_id, "succeeded", timeout_s=WAIT_S)
    return {
        "run": run,
        "since": since,
        "until": time.time(),
        "function_id": function_id,
        "group": group,
        "by_run": by_run,
        "by_batch": by_batch,
        "by_executor": by_executor,
        "every": every,
    }


def test_tags_round_trip_to_the_service(client: Client, tagged: dict[str, Any]) -> None:
    run = tagged["run"]
    assert client.get_task(tagged["by_run"][0])["tags"] == {"run": run}
    assert client.get_task(tagged["by_batch"][1])["tags"] == {
        "run": run,
        "how": "batch",
        "part": "odd",
    }
    assert client.get_task(tagged["by_executor"][0])["tags"] == {"run": run}
    assert client.get_task(tagged["by_executor"][2])["tags"] == {"run": run, "late": "yes"}


def test_tag_queries_return_exactly_the_tagged_tasks(
    client: Client, tagged: dict[str, Any]
) -> None:
    run = tagged["run"]
    found = [t["task_id"] for t in client.iter_tasks(tags={"run": run})]
    assert sorted(found) == sorted(tagged["every"])
    assert len(found) == len(set(found))
    # Pages of 2 (cursors) reach the same tasks in the same order.
    assert [t["task_id"] for t in client.iter_tasks(tags={"run": run}, page_size=2)] == found
    newest_first = client.iter_tasks(tags={"run": run}, newest_first=True)
    assert [t["task_id"] for t in newest_first] == found[::-1]
    page = client.get_tasks(tags={"run": run}, limit=4)
    assert len(page.tasks) == 4 and page.next_cursor is not None
    batch_odd = client.iter_tasks(tags={"run": run, "how": "batch", "part": "odd"})
    assert [t["task_id"] for t in batch_odd] == tagged["by_batch"][1::2]
    assert [t["task_id"] for t in client.iter_tasks(tags={"run": run + "-none"})] == []


def test_state_function_endpoint_group_and_time_filters(
    stack: Stack, client: Client, tagged: dict[str, Any]
) -> None:
    run = tagged["run"]

    def ids(**filters: Any) -> set[str]:
        return {t["task_id"] for t in client.iter_tasks(tags={"run": run}, **filters)}

    every = set(tagged["every"])
    assert ids(state="succeeded") == every
    assert ids(state=["failed", "running"]) == set()
    assert ids(function_id=tagged["function_id"]) == set(tagged["by_run"] + tagged["by_batch"])
    assert ids(endpoint_id=stack.endpoint_id) == every
    assert ids(endpoint_id=str(uuid.uuid4())) == set()
    assert ids(task_group_id=tagged["group"]) == set(tagged["by_executor"])
    assert ids(since=tagged["since"], until=tagged["until"]) == every
    assert ids(until=tagged["since"] - 1) == set()
    succeeded = {t["task_id"] for t in client.iter_tasks(state="succeeded", since=tagged["since"])}
    assert every <= succeeded


def test_another_user_never_sees_the_tasks(stack: Stack, tagged: dict[str, Any]) -> None:
    bob = other_user_client(stack, f"bob-{uuid.uuid4().hex[:6]}")
    try:
        assert list(bob.iter_tasks(tags={"run": tagged["run"]})) == []
        assert list(bob.iter_tasks(since=tagged["since"])) == []
        with pytest.raises(NotFound):
            bob.get_task(tagged["by_run"][0])
    finally:
        bob.close()


def test_bad_tags_are_refused_before_anything_is_sent(stack: Stack, client: Client) -> None:
    function_id = client.register_function(add_one)
    with pytest.raises(ValueError, match="no ':' or spaces"):
        client.run(1, endpoint_id=stack.endpoint_id, function_id=function_id, tags={"a:b": "c"})
    number: Any = {"n": 1}
    with pytest.raises(ValueError, match=r"pass str\(1\)"):
        Executor(endpoint_id=stack.endpoint_id, client=client, tags=number)
    with pytest.raises(ValueError, match="at most 8 tags"):
        client.create_batch().add(function_id, (1,), tags={f"k{i}": "v" for i in range(9)})
    with pytest.raises(ValueError, match="1-64 characters"):
        client.get_tasks(tags={"run": "x" * 65})


def test_a_finished_tasks_event_log_is_ordered_and_complete(
    client: Client, tagged: dict[str, Any]
) -> None:
    task_id = tagged["by_run"][1]  # forgotten by the client: the service answers
    events = client.get_task(task_id)["events"]
    assert [e["state"] for e in events] == [
        "submitted",
        "routed",
        "dequeued",
        "started",
        "finished",
        "result-published",
        "succeeded",
    ]
    endpoint = f"endpoint:{client.get_task(task_id)['endpoint_id']}"
    assert [e["where"] for e in events][:3] == ["client", "router", endpoint]
    assert events[3]["where"].startswith("worker:") and events[3]["attempt"] == 1
    assert events[5]["where"] == endpoint and events[6]["where"] == "task-state"
    # One host, one clock: lifecycle order is time order too.
    moments = [e["at"] for e in events]
    assert moments == sorted(moments), events


def test_a_locally_answered_task_ends_its_event_log_with_delivery(
    stack: Stack, client: Client
) -> None:
    function_id = client.register_function(add_one)
    task_id = client.run(1, endpoint_id=stack.endpoint_id, function_id=function_id)
    assert client.future(task_id).result(timeout=WAIT_S) == 2
    events = client.get_task(task_id)["events"]
    assert [e["state"] for e in events] == [
        "submitted",
        "routed",
        "dequeued",
        "started",
        "finished",
        "result-published",
        "delivered",
    ]
    assert events[-1]["where"] == "client"
    assert [e["at"] for e in events] == sorted(e["at"] for e in events)
