"""``GET /v1/task-groups/{id}/tasks`` against the real broker: listing, paging, access, errors.

The app runs in-process (TestClient drives the real ASGI stack); task states
are produced to the module's task-state topic as the processors would.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from fxstream.service import create_app
from fxstream.service.api import MAX_GROUP_PAGE
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    Serializer,
    TaskState,
    TaskStateName,
    TaskTimings,
)
from tests.service.conftest import Produce, eventually
from tests.service.test_api import User, assert_error, register


@pytest.fixture(scope="module")
def client(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[TestClient]:
    """The API on this module's topics, started and stopped around the module."""
    with TestClient(create_app(module_kafka, catalogue)) as client:
        yield client


def state(
    task_id: str,
    owner: User,
    group: str | None,
    name: TaskStateName,
    value: bytes | None = None,
) -> TaskState:
    """A task-state record of ``owner``'s task in ``group``."""
    now = time.time()
    return TaskState(
        task_id=task_id,
        user_id=owner.user_id,
        function_id="f-1",
        endpoint_id="ep-1",
        task_group_id=group,
        state=name,
        updated_at=now,
        timings=TaskTimings(submitted_at=now - 1),
        value=value,
    )


def listed(client: TestClient, owner: User, group: str, **query: int) -> list[str]:
    """Every task id of the group, following the pages."""
    task_ids: list[str] = []
    offset: int | None = query.pop("offset", 0)
    while offset is not None:
        answer = client.get(
            f"/v1/task-groups/{group}/tasks",
            params={"offset": offset, **query},
            headers=owner.auth,
        )
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert page["task_group_id"] == group
        assert page["offset"] == offset
        task_ids += [task["task_id"] for task in page["tasks"]]
        offset = page["next_offset"]
    return task_ids


def test_a_group_lists_the_callers_tasks_in_order_with_their_states_across_pages(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice = register(client, "alice")
    group, other_group = str(uuid.uuid4()), str(uuid.uuid4())
    task_ids = [str(uuid.uuid4()) for _ in range(7)]
    for task_id in task_ids:
        produce(catalogue.task_state, task_id, state(task_id, alice, group, TaskStateName.ROUTED))
    produce(
        catalogue.task_state,
        "elsewhere",
        state("elsewhere", alice, other_group, TaskStateName.ROUTED),
    )
    produce(catalogue.task_state, "loose", state("loose", alice, None, TaskStateName.ROUTED))
    # Later states keep a task's place, so paging neither skips nor repeats one.
    value = Serializer().serialize_value(42)
    produce(
        catalogue.task_state,
        task_ids[0],
        state(task_ids[0], alice, group, TaskStateName.SUCCEEDED, value),
    )

    def folded() -> bool:
        answer = client.get(f"/v1/tasks/{task_ids[0]}", headers=alice.auth)
        return answer.status_code == 200 and bool(answer.json()["state"] == "succeeded")

    eventually(folded, what="the last state is visible")
    # The order is the one the service read them in (across partitions): stable.
    in_order = listed(client, alice, group)
    assert sorted(in_order) == sorted(task_ids)
    assert listed(client, alice, group, limit=3) == in_order
    assert listed(client, alice, group, limit=1) == in_order
    assert listed(client, alice, other_group) == ["elsewhere"]

    page = client.get(f"/v1/task-groups/{group}/tasks?limit=3", headers=alice.auth).json()
    assert page["total"] == 7
    assert page["next_offset"] == 3
    everything = client.get(f"/v1/task-groups/{group}/tasks", headers=alice.auth).json()
    states = {task["task_id"]: task for task in everything["tasks"]}
    assert states[task_ids[0]]["state"] == "succeeded"
    assert base64.b64decode(states[task_ids[0]]["value"]) == value
    assert states[task_ids[1]]["state"] == "routed"
    assert states[task_ids[1]]["value"] is None
    beyond = client.get(f"/v1/task-groups/{group}/tasks?offset=99", headers=alice.auth).json()
    assert beyond["tasks"] == []
    assert beyond["next_offset"] is None


def test_another_users_group_is_403_and_an_unknown_group_is_404(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice, bob = register(client, "alice"), register(client, "bob")
    group, task_id = str(uuid.uuid4()), str(uuid.uuid4())
    produce(catalogue.task_state, task_id, state(task_id, alice, group, TaskStateName.ROUTED))
    eventually(lambda: client.get(f"/v1/tasks/{task_id}", headers=alice.auth).status_code == 200)

    detail = assert_error(
        client.get(f"/v1/task-groups/{group}/tasks", headers=bob.auth), 403, "forbidden"
    )
    assert "another user" in detail
    detail = assert_error(
        client.get(f"/v1/task-groups/{uuid.uuid4()}/tasks", headers=alice.auth),
        404,
        "not-found",
    )
    assert "router" in detail

    # A user who picked the same group id sees only their own tasks in it.
    bobs = str(uuid.uuid4())
    produce(catalogue.task_state, bobs, state(bobs, bob, group, TaskStateName.ROUTED))
    eventually(lambda: client.get(f"/v1/tasks/{bobs}", headers=bob.auth).status_code == 200)
    assert listed(client, bob, group) == [bobs]
    assert listed(client, alice, group) == [task_id]


def test_bad_ids_and_paging_values_are_422_and_a_token_is_needed(client: TestClient) -> None:
    alice = register(client, "alice")
    assert_error(
        client.get("/v1/task-groups/not_an_id!/tasks", headers=alice.auth),
        422,
        "invalid-request",
    )
    for query in ("offset=-1", f"limit={MAX_GROUP_PAGE + 1}", "limit=0", "limit=many"):
        assert_error(
            client.get(f"/v1/task-groups/{uuid.uuid4()}/tasks?{query}", headers=alice.auth),
            422,
            "invalid-request",
        )
    assert_error(client.get(f"/v1/task-groups/{uuid.uuid4()}/tasks"), 401, "unauthorized")


def test_a_page_ends_early_once_its_values_pass_the_byte_budget(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice = register(client, "alice")
    group = str(uuid.uuid4())
    big = b"x" * 900_000  # ten of these pass the 8 MiB page budget
    task_ids = [str(uuid.uuid4()) for _ in range(12)]
    for task_id in task_ids:
        produce(
            catalogue.task_state,
            task_id,
            state(task_id, alice, group, TaskStateName.SUCCEEDED, big),
        )
    eventually(
        lambda: client.get(f"/v1/tasks/{task_ids[-1]}", headers=alice.auth).status_code == 200
    )
    page = client.get(f"/v1/task-groups/{group}/tasks", headers=alice.auth).json()
    assert 1 <= len(page["tasks"]) < len(task_ids)
    assert page["next_offset"] == len(page["tasks"])
    assert sorted(listed(client, alice, group)) == sorted(task_ids)
