"""The REST API against the real broker: every route, auth, sharing, errors, restarts, the CLI.

The app runs in-process (TestClient drives the real ASGI stack), except in the
CLI tests, which start the real ``fxstream-service`` command.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from fxstream.ops.process import free_ports
from fxstream.service import AccountSettings, create_app, new_token, token_sha256
from fxstream.topics import (
    Attempt,
    Catalogue,
    Heartbeat,
    KafkaConnection,
    Serializer,
    TaskState,
    TaskStateName,
    TaskTimings,
    write_secret_file,
)
from tests.conftest import RunningPlatform, write_kafka_credentials
from tests.service.conftest import Produce, eventually

SERVICE = Path(sys.executable).parent / "fxstream-service"


def double(x: int) -> int:
    """The function the tests register."""
    return 2 * x


CODE = Serializer().serialize_function(double)
CODE_B64 = base64.b64encode(CODE).decode()
# The platform admin's token of this module's services: the only one that creates users.
ADMIN_TOKEN = new_token()
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ACCOUNTS = AccountSettings(admin_token_sha256=token_sha256(ADMIN_TOKEN))


@dataclass(frozen=True)
class User:
    """A registered user and the headers that authenticate it."""

    user_id: str
    token: str

    @property
    def auth(self) -> dict[str, str]:
        """The Authorization header."""
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def client(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[TestClient]:
    """The API on this module's topics, started (lifespan) and stopped around the module."""
    with TestClient(create_app(module_kafka, catalogue, accounts=ACCOUNTS)) as client:
        yield client


def register(client: TestClient | httpx.Client, name: str = "alice") -> User:
    """A new user, created by the platform admin."""
    answer = client.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    body = answer.json()
    return User(body["user_id"], body["token"])


def new_function(client: TestClient, owner: User, **fields: Any) -> str:
    """A new function of ``owner``; ``fields`` override the defaults."""
    body = {"name": "double", "code": CODE_B64, **fields}
    answer = client.post("/v1/functions", json=body, headers=owner.auth)
    assert answer.status_code == 201, answer.text
    function_id: str = answer.json()["function_id"]
    return function_id


def new_endpoint(client: TestClient, owner: User, **fields: Any) -> str:
    """A new endpoint of ``owner``; ``fields`` override the defaults."""
    answer = client.post("/v1/endpoints", json={"name": "laptop", **fields}, headers=owner.auth)
    assert answer.status_code == 201, answer.text
    endpoint_id: str = answer.json()["endpoint_id"]
    return endpoint_id


def ids(answer: httpx.Response, field: str) -> set[str]:
    """The ``field`` of each item of a list answer."""
    assert answer.status_code == 200, answer.text
    return {item[field] for item in answer.json()}


def assert_error(answer: httpx.Response, status: int, error: str) -> str:
    """The answer is ``status`` with the error body shape; returns its detail."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error", "detail"}, body
    assert body["error"] == error
    assert body["detail"]
    detail: str = body["detail"]
    return detail


def is_uuid4(value: str) -> bool:
    """True for a canonical uuid4 string."""
    return str(uuid.UUID(value)) == value and uuid.UUID(value).version == 4


def topic_partitions(platform: RunningPlatform, topic: str) -> int:
    """How many partitions ``topic`` has (0 if it does not exist)."""
    described = platform.admin().list_topics(timeout=10).topics.get(topic)
    return 0 if described is None else len(described.partitions)


# --- health, users, auth -------------------------------------------------------------------


def test_health_needs_no_token(client: TestClient) -> None:
    answer = client.get("/v1/health")
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "kafka": True}


def test_register_creates_the_results_topic_and_me_answers(
    client: TestClient, kafka_platform: RunningPlatform, catalogue: Catalogue
) -> None:
    user = register(client, "Ada Lovelace")
    assert is_uuid4(user.user_id)
    assert len(user.token) >= 32
    expected = catalogue.spec("results.{user_id}").partitions
    assert topic_partitions(kafka_platform, catalogue.results(user.user_id)) == expected
    # The one topic the user writes (its identity at the broker).
    expected = catalogue.spec("from.user.{user_id}").partitions
    assert topic_partitions(kafka_platform, catalogue.from_user(user.user_id)) == expected

    answer = client.get("/v1/users/me", headers=user.auth)
    assert answer.status_code == 200
    body = answer.json()
    assert body.pop("token_expires_at") > time.time() + 29 * 86400  # the default: 30 days
    assert body == {"user_id": user.user_id, "name": "Ada Lovelace"}


_UNKNOWN_ID = "0f0f0f0f-0000-4000-8000-0000000000aa"
"""An id nothing has (fixed: pytest-xdist workers must collect the same test ids)."""


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/users", {"name": "u"}),
        ("GET", "/v1/users/me", None),
        ("POST", "/v1/users/me/token", None),
        ("DELETE", "/v1/users/me/token", None),
        ("POST", f"/v1/users/{_UNKNOWN_ID}/token", None),
        ("POST", "/v1/functions", {"name": "f", "code": CODE_B64}),
        ("GET", "/v1/functions", None),
        ("GET", f"/v1/functions/{_UNKNOWN_ID}", None),
        ("DELETE", f"/v1/functions/{_UNKNOWN_ID}", None),
        ("POST", "/v1/endpoints", {"name": "e"}),
        ("GET", "/v1/endpoints", None),
        ("GET", f"/v1/endpoints/{_UNKNOWN_ID}", None),
        ("DELETE", f"/v1/endpoints/{_UNKNOWN_ID}", None),
        ("GET", f"/v1/tasks/{_UNKNOWN_ID}", None),
        ("POST", "/v1/tasks/status", {"task_ids": []}),
    ],
)
def test_every_route_but_health_needs_a_known_token(
    client: TestClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer not-a-token-anyone-has"},
        {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    ):
        answer = client.request(method, path, json=body, headers=headers)
        assert_error(answer, 401, "unauthorized")
        assert answer.headers["www-authenticate"] == "Bearer"


# --- functions -----------------------------------------------------------------------------


def test_function_lifecycle(client: TestClient) -> None:
    alice = register(client)
    created = client.post(
        "/v1/functions",
        json={
            "name": "double",
            "code": CODE_B64,
            "container": "docker://python:3.11",
            "public": False,
            "allowed_users": [],
            "description": "doubles x",
        },
        headers=alice.auth,
    )
    assert created.status_code == 201, created.text
    function_id = created.json()["function_id"]
    assert is_uuid4(function_id)
    assert created.json()["code_sha256"] == hashlib.sha256(CODE).hexdigest()

    # Read-your-writes: the GET right after the POST sees the function.
    record = client.get(f"/v1/functions/{function_id}", headers=alice.auth).json()
    assert base64.b64decode(record["code"]) == CODE
    assert record["function_id"] == function_id
    assert record["owner_id"] == alice.user_id
    assert record["container"] == "docker://python:3.11"
    assert record["description"] == "doubles x"
    assert record["code_sha256"] == hashlib.sha256(CODE).hexdigest()
    assert Serializer().deserialize_function(base64.b64decode(record["code"]))(21) == 42

    listed = client.get("/v1/functions", headers=alice.auth).json()
    mine = [f for f in listed if f["function_id"] == function_id]
    assert len(mine) == 1
    assert "code" not in mine[0]
    assert mine[0]["name"] == "double"

    deleted = client.delete(f"/v1/functions/{function_id}", headers=alice.auth)
    assert deleted.status_code == 204
    assert deleted.content == b""
    assert_error(client.get(f"/v1/functions/{function_id}", headers=alice.auth), 404, "not-found")
    assert function_id not in ids(client.get("/v1/functions", headers=alice.auth), "function_id")
    assert_error(
        client.delete(f"/v1/functions/{function_id}", headers=alice.auth), 404, "not-found"
    )


def test_another_users_private_function_is_404(client: TestClient) -> None:
    alice, bob = register(client, "alice"), register(client, "bob")
    function_id = new_function(client, alice)

    # Exactly as a function that does not exist: its existence is not revealed.
    assert_error(client.get(f"/v1/functions/{function_id}", headers=bob.auth), 404, "not-found")
    assert_error(client.delete(f"/v1/functions/{function_id}", headers=bob.auth), 404, "not-found")
    assert function_id not in ids(client.get("/v1/functions", headers=bob.auth), "function_id")
    # Bob's failed delete changed nothing.
    assert client.get(f"/v1/functions/{function_id}", headers=alice.auth).status_code == 200


def test_functions_are_shared_publicly_or_with_named_users(client: TestClient) -> None:
    alice, bob, carol = register(client, "alice"), register(client, "bob"), register(client, "c")
    private = new_function(client, alice)
    public = new_function(client, alice, public=True)
    shared = new_function(client, alice, allowed_users=[bob.user_id, bob.user_id])

    seen_by_bob = ids(client.get("/v1/functions", headers=bob.auth), "function_id")
    assert {public, shared} <= seen_by_bob
    assert private not in seen_by_bob
    seen_by_carol = ids(client.get("/v1/functions", headers=carol.auth), "function_id")
    assert public in seen_by_carol
    assert not {private, shared} & seen_by_carol

    shared_record = client.get(f"/v1/functions/{shared}", headers=bob.auth)
    assert shared_record.status_code == 200
    assert shared_record.json()["allowed_users"] == [bob.user_id]  # repeats dropped
    assert client.get(f"/v1/functions/{public}", headers=carol.auth).status_code == 200
    assert_error(client.get(f"/v1/functions/{shared}", headers=carol.auth), 404, "not-found")
    # Sharing lets others run a function, not delete it (they see it: 403, not 404).
    assert_error(client.delete(f"/v1/functions/{shared}", headers=bob.auth), 403, "forbidden")
    assert_error(client.delete(f"/v1/functions/{public}", headers=carol.auth), 403, "forbidden")


def test_owning_an_endpoint_gives_no_access_to_other_users_code(client: TestClient) -> None:
    alice, site_admin = register(client, "alice"), register(client, "site admin")
    function_id = new_function(client, alice)
    new_endpoint(client, site_admin)
    # Before issue 13 any endpoint owner could read any code; now only the endpoint's own
    # token may, and only for a task routed to it (tests/security/test_accounts.py).
    assert_error(
        client.get(f"/v1/functions/{function_id}", headers=site_admin.auth), 404, "not-found"
    )
    listed = ids(client.get("/v1/functions", headers=site_admin.auth), "function_id")
    assert function_id not in listed


# --- endpoints -----------------------------------------------------------------------------

NEVER_SEEN = {
    "state": "never-seen",
    "last_seen": None,
    "workers_total": 0,
    "workers_idle": 0,
    "workers_busy": 0,
    "queue_depth": 0,
    "agent_id": None,
    "pool_slots": 0,
    "blocks_pending": 0,
    "blocks_running": 0,
    "blocks_idle": 0,
    "node_key": "",
}


def test_endpoint_lifecycle(
    client: TestClient, kafka_platform: RunningPlatform, catalogue: Catalogue
) -> None:
    alice, bob = register(client, "alice"), register(client, "bob")
    created = client.post(
        "/v1/endpoints",
        json={
            "name": "polaris",
            "public": False,
            "allowed_users": [],
            "description": "login node",
            "metadata": {"site": "alcf", "scheduler": "pbs"},
        },
        headers=alice.auth,
    )
    assert created.status_code == 201, created.text
    endpoint_id = created.json()["endpoint_id"]
    assert is_uuid4(endpoint_id)
    queue = catalogue.endpoint_queue(endpoint_id)
    assert (
        topic_partitions(kafka_platform, queue)
        == catalogue.spec("tasks.ep.{endpoint_id}").partitions
    )
    assert (
        topic_partitions(kafka_platform, catalogue.from_endpoint(endpoint_id))
        == catalogue.spec("from.ep.{endpoint_id}").partitions
    )

    record = client.get(f"/v1/endpoints/{endpoint_id}", headers=alice.auth).json()
    assert record["endpoint_id"] == endpoint_id
    assert record["owner_id"] == alice.user_id
    assert record["name"] == "polaris"
    assert record["metadata"] == {"site": "alcf", "scheduler": "pbs"}
    assert record["status"] == NEVER_SEEN
    listed = client.get("/v1/endpoints", headers=alice.auth).json()
    assert [e["status"] for e in listed if e["endpoint_id"] == endpoint_id] == [NEVER_SEEN]

    assert_error(client.get(f"/v1/endpoints/{endpoint_id}", headers=bob.auth), 404, "not-found")
    assert_error(client.delete(f"/v1/endpoints/{endpoint_id}", headers=bob.auth), 404, "not-found")
    assert endpoint_id not in ids(client.get("/v1/endpoints", headers=bob.auth), "endpoint_id")

    assert client.delete(f"/v1/endpoints/{endpoint_id}", headers=alice.auth).status_code == 204
    assert_error(client.get(f"/v1/endpoints/{endpoint_id}", headers=alice.auth), 404, "not-found")
    assert endpoint_id not in ids(client.get("/v1/endpoints", headers=alice.auth), "endpoint_id")


def test_endpoints_are_shared_publicly_or_with_named_users(client: TestClient) -> None:
    alice, bob, carol = register(client, "alice"), register(client, "bob"), register(client, "c")
    private = new_endpoint(client, alice)
    public = new_endpoint(client, alice, public=True)
    shared = new_endpoint(client, alice, allowed_users=[bob.user_id])

    seen_by_bob = ids(client.get("/v1/endpoints", headers=bob.auth), "endpoint_id")
    assert {public, shared} <= seen_by_bob
    assert private not in seen_by_bob
    seen_by_carol = ids(client.get("/v1/endpoints", headers=carol.auth), "endpoint_id")
    assert public in seen_by_carol
    assert not {private, shared} & seen_by_carol
    assert client.get(f"/v1/endpoints/{shared}", headers=bob.auth).status_code == 200
    assert_error(client.get(f"/v1/endpoints/{shared}", headers=carol.auth), 404, "not-found")
    assert_error(client.delete(f"/v1/endpoints/{public}", headers=bob.auth), 403, "forbidden")


def heartbeat(endpoint_id: str, *, sent_at: float, period_s: float) -> Heartbeat:
    """A heartbeat as an agent sends it."""
    return Heartbeat(
        endpoint_id=endpoint_id,
        agent_id="agent-7",
        sent_at=sent_at,
        sequence=1,
        period_s=period_s,
        hostname="node1",
        pid=4242,
        workers_total=4,
        workers_idle=3,
        workers_busy=1,
        queue_depth=2,
    )


def status_of(client: TestClient, user: User, endpoint_id: str) -> dict[str, Any]:
    """The ``status`` of an endpoint as the API shows it."""
    answer = client.get(f"/v1/endpoints/{endpoint_id}", headers=user.auth)
    assert answer.status_code == 200, answer.text
    status: dict[str, Any] = answer.json()["status"]
    return status


def test_endpoint_status_goes_never_seen_online_lost(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice = register(client)
    endpoint_id = new_endpoint(client, alice)
    assert status_of(client, alice, endpoint_id)["state"] == "never-seen"

    period = 1.0
    sent_at = time.time()
    produce(
        catalogue.heartbeats, endpoint_id, heartbeat(endpoint_id, sent_at=sent_at, period_s=period)
    )
    eventually(lambda: status_of(client, alice, endpoint_id)["state"] == "online", what="online")
    assert status_of(client, alice, endpoint_id) == {
        "state": "online",
        "last_seen": sent_at,
        "workers_total": 4,
        "workers_idle": 3,
        "workers_busy": 1,
        "queue_depth": 2,
        "agent_id": "agent-7",
        "pool_slots": 0,
        "blocks_pending": 0,
        "blocks_running": 0,
        "blocks_idle": 0,
        "node_key": "",
    }
    listed = client.get("/v1/endpoints", headers=alice.auth).json()
    assert [e["status"]["state"] for e in listed if e["endpoint_id"] == endpoint_id] == ["online"]

    # No heartbeat for more than 3 periods: lost, still showing when it was last seen.
    time.sleep(max(0.0, sent_at + 3 * period + 0.2 - time.time()))
    status = status_of(client, alice, endpoint_id)
    assert status["state"] == "lost"
    assert status["last_seen"] == sent_at


def test_an_endpoint_whose_last_heartbeat_is_old_is_lost(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice = register(client)
    endpoint_id = new_endpoint(client, alice)
    old = time.time() - 60
    produce(catalogue.heartbeats, endpoint_id, heartbeat(endpoint_id, sent_at=old, period_s=5.0))
    eventually(lambda: status_of(client, alice, endpoint_id)["state"] == "lost", what="lost")
    assert status_of(client, alice, endpoint_id)["last_seen"] == old


# --- tasks ---------------------------------------------------------------------------------


def task_state(task_id: str, user_id: str, state: TaskStateName, value: bytes | None) -> TaskState:
    """A task-state record as the processors write it."""
    now = time.time()
    return TaskState(
        task_id=task_id,
        user_id=user_id,
        function_id=str(uuid.uuid4()),
        endpoint_id=str(uuid.uuid4()),
        state=state,
        updated_at=now,
        timings=TaskTimings(submitted_at=now - 2, routed_at=now - 1, finished_at=now),
        attempts=[Attempt(attempt=1, worker="node1:4242", started_at=now - 1, finished_at=now)],
        value=value,
    )


def test_task_status_comes_from_the_task_state_topic(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice, bob = register(client, "alice"), register(client, "bob")
    task_id, unknown = str(uuid.uuid4()), str(uuid.uuid4())
    assert_error(client.get(f"/v1/tasks/{task_id}", headers=alice.auth), 404, "not-found")

    produce(
        catalogue.task_state,
        task_id,
        task_state(task_id, alice.user_id, TaskStateName.RUNNING, None),
    )
    value = Serializer().serialize_value(42)
    produce(
        catalogue.task_state,
        task_id,
        task_state(task_id, alice.user_id, TaskStateName.SUCCEEDED, value),
    )

    def succeeded() -> bool:
        answer = client.get(f"/v1/tasks/{task_id}", headers=alice.auth)
        return answer.status_code == 200 and bool(answer.json()["state"] == "succeeded")

    eventually(succeeded, what="the task reads as succeeded")
    body = client.get(f"/v1/tasks/{task_id}", headers=alice.auth).json()
    assert body["task_id"] == task_id
    assert body["user_id"] == alice.user_id
    assert base64.b64decode(body["value"]) == value
    assert body["attempts"][0]["worker"] == "node1:4242"
    assert body["timings"]["routed_at"] is not None
    assert_error(client.get(f"/v1/tasks/{task_id}", headers=bob.auth), 404, "not-found")

    answer = client.post(
        "/v1/tasks/status", json={"task_ids": [task_id, unknown]}, headers=alice.auth
    )
    assert answer.status_code == 200
    assert answer.json() == {task_id: body, unknown: None}
    # Another user's task reads as unknown: its existence is not revealed.
    answer = client.post("/v1/tasks/status", json={"task_ids": [task_id]}, headers=bob.auth)
    assert answer.json() == {task_id: None}


def test_a_running_task_has_a_null_value(
    client: TestClient, catalogue: Catalogue, produce: Produce
) -> None:
    alice = register(client)
    task_id = str(uuid.uuid4())
    produce(
        catalogue.task_state,
        task_id,
        task_state(task_id, alice.user_id, TaskStateName.RUNNING, None),
    )
    eventually(lambda: client.get(f"/v1/tasks/{task_id}", headers=alice.auth).status_code == 200)
    body = client.get(f"/v1/tasks/{task_id}", headers=alice.auth).json()
    assert body["state"] == "running"
    assert body["value"] is None


# --- errors --------------------------------------------------------------------------------


def test_unknown_ids_and_routes_are_404(client: TestClient) -> None:
    alice = register(client)
    missing = str(uuid.uuid4())
    for method, path in [
        ("GET", f"/v1/functions/{missing}"),
        ("DELETE", f"/v1/functions/{missing}"),
        ("GET", f"/v1/endpoints/{missing}"),
        ("DELETE", f"/v1/endpoints/{missing}"),
        ("GET", f"/v1/tasks/{missing}"),
        ("GET", "/v1/functions/not an id at all"),
    ]:
        detail = assert_error(client.request(method, path, headers=alice.auth), 404, "not-found")
        assert "does not exist" in detail or "no state" in detail

    for path in ("/v1/nothing-here", "/", "/v2/users"):
        detail = assert_error(client.get(path), 404, "not-found")
        assert path in detail
    assert_error(client.put("/v1/users/me", headers=alice.auth), 405, "method-not-allowed")


B64_NOT_A_PAYLOAD = base64.b64encode(b"print('hello')").decode()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/users", {}, "name"),
        ("/v1/users", {"name": ""}, "name"),
        ("/v1/users", {"name": "x" * 257}, "name"),
        ("/v1/users", {"name": "ok", "nmae": "typo"}, "nmae"),
        ("/v1/users", [], "body"),
        ("/v1/functions", {"code": CODE_B64}, "name"),
        ("/v1/functions", {"name": "f"}, "code"),
        ("/v1/functions", {"name": "f", "code": "%%% not base64"}, "code"),
        ("/v1/functions", {"name": "f", "code": B64_NOT_A_PAYLOAD}, "code"),
        ("/v1/functions", {"name": "f", "code": CODE_B64, "public": "maybe"}, "public"),
        (
            "/v1/functions",
            {"name": "f", "code": CODE_B64, "allowed_users": ["ok-id", "not an id!"]},
            "allowed_users[1]",
        ),
        ("/v1/functions", {"name": "f", "code": CODE_B64, "container": "x" * 1025}, "container"),
        ("/v1/endpoints", {"name": "e", "metadata": {"cores": 64}}, "metadata.cores"),
        ("/v1/endpoints", {"name": "e", "allowed_users": "bob"}, "allowed_users"),
        ("/v1/tasks/status", {"task_ids": ["t"] * 1001}, "task_ids"),
        ("/v1/tasks/status", {"task_ids": ["../etc"]}, "task_ids[0]"),
    ],
)
def test_invalid_bodies_are_422_naming_the_field(
    client: TestClient, path: str, body: Any, field: str
) -> None:
    headers = ADMIN if path == "/v1/users" else register(client).auth
    detail = assert_error(client.post(path, json=body, headers=headers), 422, "invalid-request")
    assert detail.startswith(f"{field}:") or f"; {field}:" in detail, detail


def test_malformed_json_is_422(client: TestClient) -> None:
    user = register(client)
    answer = client.post(
        "/v1/functions",
        content=b'{"name": "f", "code":',
        headers={**user.auth, "Content-Type": "application/json"},
    )
    assert "not valid JSON" in assert_error(answer, 422, "invalid-request")


def test_code_larger_than_the_functions_topic_allows_is_413(
    client: TestClient, catalogue: Catalogue
) -> None:
    user = register(client)
    limit = catalogue.spec("functions").max_message_bytes
    code = b"fxdc\n" + bytes(limit)
    answer = client.post(
        "/v1/functions",
        json={"name": "huge", "code": base64.b64encode(code).decode()},
        headers=user.auth,
    )
    assert str(limit) in assert_error(answer, 413, "too-large")


def test_openapi_and_docs_are_served(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/v1/users", "/v1/functions/{function_id}", "/v1/tasks/status"} <= set(schema["paths"])
    assert client.get("/docs").status_code == 200


# --- durability: the topics are the only state ---------------------------------------------


def test_everything_survives_a_restart_of_the_service(
    module_kafka: KafkaConnection, catalogue: Catalogue
) -> None:
    with TestClient(create_app(module_kafka, catalogue, accounts=ACCOUNTS)) as first:
        alice = register(first, "alice")
        kept = new_function(first, alice, description="kept")
        dropped = new_function(first, alice)
        assert first.delete(f"/v1/functions/{dropped}", headers=alice.auth).status_code == 204
        endpoint_id = new_endpoint(first, alice, metadata={"site": "home"})

    with TestClient(create_app(module_kafka, catalogue, accounts=ACCOUNTS)) as second:
        me = second.get("/v1/users/me", headers=alice.auth).json()
        assert {k: me[k] for k in ("user_id", "name")} == {
            "user_id": alice.user_id,
            "name": "alice",
        }
        function = second.get(f"/v1/functions/{kept}", headers=alice.auth).json()
        assert function["description"] == "kept"
        assert base64.b64decode(function["code"]) == CODE
        assert_error(second.get(f"/v1/functions/{dropped}", headers=alice.auth), 404, "not-found")
        endpoint = second.get(f"/v1/endpoints/{endpoint_id}", headers=alice.auth).json()
        assert endpoint["metadata"] == {"site": "home"}
        assert kept in ids(second.get("/v1/functions", headers=alice.auth), "function_id")


# --- the real command ----------------------------------------------------------------------


def write_connection(path: Path, kafka: KafkaConnection, catalogue: Catalogue) -> Path:
    """A platform.json as ``./fx up`` writes it, pointing at this module's topics."""
    path.write_text(
        json.dumps(
            {
                "mode": "single",
                "bootstrap_servers": kafka.bootstrap,
                "redis_url": "redis://127.0.0.1:1/0",
                "topic_prefix": catalogue.prefix,
                "replication_factor": catalogue.replication_factor,
                "min_insync_replicas": catalogue.min_insync_replicas,
            }
        )
    )
    return path


def admin_token_file(path: Path) -> Path:
    """The admin token file as the platform writes it (0600 JSON)."""
    write_secret_file(path, json.dumps({"token": ADMIN_TOKEN}).encode())
    return path


def wait_until_serving(process: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
    """Wait for /v1/health to answer, failing with the log if the process exits first."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the service exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/v1/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"the service did not answer within 60 s:\n{log.read_text()}")


def test_the_real_service_serves_and_stops_on_sigterm(
    tmp_path: Path, module_kafka: KafkaConnection, catalogue: Catalogue, client: TestClient
) -> None:
    connection = write_connection(tmp_path / "platform.json", module_kafka, catalogue)
    credentials = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    (port,) = free_ports(1)
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                SERVICE,
                "api",
                "--connection",
                str(connection),
                "--kafka-credentials",
                str(credentials),
                "--port",
                str(port),
                "--admin-token-file",
                str(admin_token_file(tmp_path / "api-admin.json")),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, base_url, log)
        with httpx.Client(base_url=base_url, timeout=30) as http:
            assert http.get("/v1/health").json() == {"status": "ok", "kafka": True}
            user = register(http, "remote")
            assert http.get("/v1/users/me", headers=user.auth).json()["name"] == "remote"
            created = http.post(
                "/v1/functions", json={"name": "f", "code": CODE_B64}, headers=user.auth
            )
            assert created.status_code == 201
            function_id = created.json()["function_id"]
            assert http.get(f"/v1/functions/{function_id}", headers=user.auth).status_code == 200
            assert_error(http.get("/v1/nowhere"), 404, "not-found")

        # The state is in Kafka: the in-process service on the same topics sees it too.
        eventually(
            lambda: (
                client.get(f"/v1/functions/{function_id}", headers=user.auth).status_code == 200
            ),
            what="the other service instance sees the function",
        )

        os.kill(process.pid, signal.SIGTERM)
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # uvicorn shuts down cleanly, then re-raises the signal it caught.
    assert returncode in (0, -signal.SIGTERM), log.read_text()
    assert "Application shutdown complete" in log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2)


def test_the_real_service_refuses_bodies_above_its_cap_unread(
    tmp_path: Path, module_kafka: KafkaConnection, catalogue: Catalogue
) -> None:
    """413 naming the setting: at once for a declared length, and mid-stream for chunks."""
    connection = write_connection(tmp_path / "platform.json", module_kafka, catalogue)
    credentials = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    (port,) = free_ports(1)
    log = tmp_path / "service.log"
    # The credentials file named by the environment, as the platform's supervisor does.
    env = {
        **os.environ,
        "FXSTREAM_API_MAX_BODY_BYTES": "65536",
        "FXSTREAM_KAFKA_CREDENTIALS": str(credentials),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                SERVICE,
                "api",
                "--connection",
                str(connection),
                "--port",
                str(port),
                "--admin-token-file",
                str(admin_token_file(tmp_path / "api-admin.json")),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, base_url, log)
        # A declared 100 MiB body, none of it sent: the answer comes without reading it.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(
                b"POST /v1/users HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 104857600\r\n\r\n"
            )
            received = b""
            while chunk := raw.recv(65536):  # the server closes after its answer
                received += chunk
            head = received.decode()
        assert head.startswith("HTTP/1.1 413"), head
        assert "--max-body-bytes" in head and "FXSTREAM_API_MAX_BODY_BYTES" in head
        with httpx.Client(base_url=base_url, timeout=30) as http:
            # No length declared (chunked): counted as it streams, refused past the cap.
            chunks = (b"x" * 16_384 for _ in range(64))
            answer = http.post("/v1/users", content=chunks)
            detail = assert_error(answer, 413, "body-too-large")
            assert "--max-body-bytes" in detail and "65,536" in detail
            # Under the cap, the API works as before.
            assert register(http, "small").user_id
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_service(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``fxstream-service`` to completion."""
    return subprocess.run(
        [SERVICE, *args], capture_output=True, text=True, timeout=120, check=False
    )


def assert_one_line_failure(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """Exit status 1 and a single line on stderr containing each of ``phrases``."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_start_fails_in_one_line_when_kafka_does_not_answer() -> None:
    (nobody,) = free_ports(1)
    for command in ("api", "worker"):
        result = run_service(command, "--bootstrap", f"127.0.0.1:{nobody}", "--kafka-timeout", "1")
        assert_one_line_failure(result, "does not answer", "./fx up")


def test_start_fails_in_one_line_when_the_port_is_in_use(
    tmp_path: Path, module_kafka: KafkaConnection, catalogue: Catalogue
) -> None:
    credentials = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_service(
            "api",
            "--kafka-credentials",
            str(credentials),
            "--prefix",
            catalogue.prefix,
            "--port",
            str(port),
        )
    assert_one_line_failure(result, f"127.0.0.1:{port}", "--port")


def test_start_fails_in_one_line_when_topics_are_missing(
    tmp_path: Path, module_kafka: KafkaConnection
) -> None:
    credentials = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    unprovisioned = f"t{uuid.uuid4().hex[:10]}."
    result = run_service("api", "--kafka-credentials", str(credentials), "--prefix", unprovisioned)
    assert_one_line_failure(result, "topics missing", f"{unprovisioned}users", "./fx up")


def test_start_fails_in_one_line_on_a_credentials_file_others_can_read(
    tmp_path: Path, module_kafka: KafkaConnection, catalogue: Catalogue
) -> None:
    credentials = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    credentials.chmod(0o644)
    for command in ("api", "worker"):
        result = run_service(
            command, "--kafka-credentials", str(credentials), "--prefix", catalogue.prefix
        )
        assert_one_line_failure(result, str(credentials), f"chmod 600 {credentials}")
    missing = tmp_path / "nowhere.json"
    result = run_service("api", "--kafka-credentials", str(missing))
    assert_one_line_failure(result, f"no credentials file at {missing}")


def test_start_fails_in_one_line_without_a_usable_connection(tmp_path: Path) -> None:
    assert_one_line_failure(
        run_service("api"), "--bootstrap", "--kafka-credentials", "--connection"
    )
    missing = tmp_path / "platform.json"
    assert_one_line_failure(run_service("api", "--connection", str(missing)), str(missing))
    missing.write_text('{"bootstrap_servers": "127.0.0.1:1"}')
    assert_one_line_failure(
        run_service("api", "--connection", str(missing)), "topic_prefix", "./fx up"
    )
