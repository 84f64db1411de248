"""Accounts (issue 13, item 5) against the real broker: who may create users, token expiry,
rotation and revocation (and that each refusal's remedy works), endpoint-scoped tokens,
404 for what a caller may not see, registration rate limits, and the Globus Auth adapter.

The REST API runs in-process on the real Kafka runtime (TestClient drives the ASGI
stack), on a topic prefix of this module's own (tests/service/conftest.py); one test
starts the real ``fxstream-service api`` process. The Globus Auth tests run the real
globus-sdk client against a local stand-in introspection server
(``globus_introspect_stub``), because the Globus cloud cannot be reached from here.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from fxstream.ops.process import free_ports
from fxstream.service import (
    AccountSettings,
    RateLimit,
    RegistrationLimits,
    create_app,
    new_token,
    token_sha256,
)
from fxstream.service.globus_auth import GlobusAuthProvider
from fxstream.service.identity_provider import IdentityRejected
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    Serializer,
    TaskState,
    TaskStateName,
    TaskTimings,
    write_secret_file,
)
from tests.conftest import write_kafka_credentials
from tests.security.globus_introspect_stub import GlobusIntrospectionStub, Issued
from tests.service.conftest import (  # noqa: F401  (fixtures)
    Produce,
    catalogue,
    eventually,
    module_kafka,
    produce,
)

SERVICE = Path(sys.executable).parent / "fxstream-service"
ADMIN_TOKEN = new_token()
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
GLOBUS_CLIENT_ID = str(uuid.uuid4())
GLOBUS_SECRET = new_token()


def triple(x: int) -> int:
    """The function the tests register."""
    return 3 * x


CODE_B64 = base64.b64encode(Serializer().serialize_function(triple)).decode()


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for ``token``."""
    return {"Authorization": f"Bearer {token}"}


def accounts(**fields: Any) -> AccountSettings:
    """This module's account settings (the admin token), with ``fields`` changed."""
    return AccountSettings(admin_token_sha256=token_sha256(ADMIN_TOKEN), **fields)


@pytest.fixture(scope="module")
def globus() -> Iterator[GlobusIntrospectionStub]:
    """The stand-in for Globus Auth (the real one cannot be reached from here)."""
    stub = GlobusIntrospectionStub(GLOBUS_CLIENT_ID, GLOBUS_SECRET).start()
    try:
        yield stub
    finally:
        stub.stop()


def globus_provider(stub: GlobusIntrospectionStub, *domains: str) -> GlobusAuthProvider:
    """The real adapter (real globus-sdk) pointed at the stand-in."""
    return GlobusAuthProvider(
        GLOBUS_CLIENT_ID,
        GLOBUS_SECRET,
        allowed_domains=domains or ("example.org",),
        base_url=stub.url,
    )


@pytest.fixture(scope="module")
def client(
    module_kafka: KafkaConnection,  # noqa: F811
    catalogue: Catalogue,  # noqa: F811
    globus: GlobusIntrospectionStub,
) -> Iterator[TestClient]:
    """The API with this module's admin token and a Globus Auth login."""
    settings = accounts(identity_providers={"globus": globus_provider(globus)})
    with TestClient(create_app(module_kafka, catalogue, accounts=settings)) as client:
        yield client


def create_user(client: TestClient, name: str) -> tuple[str, str]:
    """A user made by the admin: (user_id, token)."""
    answer = client.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    return answer.json()["user_id"], answer.json()["token"]


def error_of(answer: httpx.Response, status: int, error: str) -> str:
    """The answer is ``status`` with error code ``error``; returns its detail."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["error"] == error, body
    detail: str = body["detail"]
    return detail


def routed(task_id: str, user_id: str, function_id: str, endpoint_id: str) -> TaskState:
    """The "routed" task state the router writes in the transaction of its dispatch."""
    now = time.time()
    return TaskState(
        task_id=task_id,
        user_id=user_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        state=TaskStateName.ROUTED,
        updated_at=now,
        timings=TaskTimings(submitted_at=now, routed_at=now),
    )


# --- who creates users -----------------------------------------------------------------------


def test_user_creation_without_the_admin_token_is_refused(client: TestClient) -> None:
    error_of(client.post("/v1/users", json={"name": "anon"}), 401, "unauthorized")
    error_of(
        client.post("/v1/users", json={"name": "x"}, headers=bearer("guess")), 401, "unauthorized"
    )
    _, token = create_user(client, "alice")
    detail = error_of(
        client.post("/v1/users", json={"name": "x"}, headers=bearer(token)), 403, "admin-only"
    )
    assert "platform admin" in detail
    endpoint = client.post("/v1/endpoints", json={"name": "e"}, headers=bearer(token)).json()
    error_of(
        client.post("/v1/users", json={"name": "x"}, headers=bearer(endpoint["token"])),
        403,
        "admin-only",
    )
    # The admin token is not a user: it cannot act as one.
    error_of(client.get("/v1/users/me", headers=ADMIN), 403, "wrong-token-kind")


def test_the_admin_creates_a_user_whose_token_works(
    client: TestClient,
    kafka_platform: Any,
    catalogue: Catalogue,  # noqa: F811
) -> None:
    answer = client.post("/v1/users", json={"name": "Grace"}, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["token_expires_at"] > time.time() + 29 * 86400
    me = client.get("/v1/users/me", headers=bearer(body["token"])).json()
    assert me["user_id"] == body["user_id"] and me["name"] == "Grace"
    results = catalogue.results(body["user_id"])
    assert results in kafka_platform.admin().list_topics(timeout=10).topics


# --- expiry, rotation, revocation, and the remedy each refusal names ---------------------------


def test_an_expired_token_is_refused_and_the_remedy_works(
    module_kafka: KafkaConnection,  # noqa: F811
    catalogue: Catalogue,  # noqa: F811
) -> None:
    short = accounts(token_lifetime_s=1.0)
    with TestClient(create_app(module_kafka, catalogue, accounts=short)) as api:
        user_id, token = create_user(api, "brief")
        assert api.get("/v1/users/me", headers=bearer(token)).status_code == 200
        time.sleep(1.2)
        detail = error_of(api.get("/v1/users/me", headers=bearer(token)), 401, "token-expired")
        assert f"POST /v1/users/{user_id}/token" in detail
        # An expired token cannot rotate itself back to life.
        error_of(api.post("/v1/users/me/token", headers=bearer(token)), 401, "token-expired")
        # The remedy the message names: the admin issues a new token.
        issued = api.post(f"/v1/users/{user_id}/token", headers=ADMIN)
        assert issued.status_code == 200, issued.text
        fresh = issued.json()["token"]
        assert issued.json()["previous_token_valid_until"] is None
        assert api.get("/v1/users/me", headers=bearer(fresh)).json()["user_id"] == user_id
        error_of(api.get("/v1/users/me", headers=bearer(token)), 401, "unauthorized")


def test_a_rotation_revokes_at_once_or_after_the_grace_it_says(client: TestClient) -> None:
    user_id, first = create_user(client, "rotator")
    answer = client.post("/v1/users/me/token", headers=bearer(first))  # no body: no grace
    assert answer.status_code == 200, answer.text
    second = answer.json()["token"]
    assert answer.json()["previous_token_valid_until"] is None
    detail = error_of(client.get("/v1/users/me", headers=bearer(first)), 401, "unauthorized")
    assert "platform admin" in detail
    assert client.get("/v1/users/me", headers=bearer(second)).json()["user_id"] == user_id

    answer = client.post("/v1/users/me/token", json={"grace_s": 1.5}, headers=bearer(second))
    third = answer.json()["token"]
    until = answer.json()["previous_token_valid_until"]
    assert until is not None and 0 < until - time.time() <= 1.5
    # Inside its grace the old token still works, and says until when; it cannot rotate.
    me = client.get("/v1/users/me", headers=bearer(second)).json()
    assert me["user_id"] == user_id and me["token_expires_at"] == until
    error_of(client.post("/v1/users/me/token", headers=bearer(second)), 401, "token-rotated-away")
    time.sleep(max(0.0, until - time.time()) + 0.2)
    detail = error_of(client.get("/v1/users/me", headers=bearer(second)), 401, "token-rotated-away")
    assert "use the token the rotation returned" in detail
    assert client.get("/v1/users/me", headers=bearer(third)).status_code == 200
    error_of(
        client.post("/v1/users/me/token", json={"grace_s": 86_401}, headers=bearer(third)),
        422,
        "invalid-request",
    )


def test_a_revoked_token_is_refused_and_the_remedy_works(client: TestClient) -> None:
    user_id, token = create_user(client, "revoker")
    rotated = client.post("/v1/users/me/token", json={"grace_s": 600}, headers=bearer(token))
    current = rotated.json()["token"]
    assert client.delete("/v1/users/me/token", headers=bearer(current)).status_code == 204
    detail = error_of(client.get("/v1/users/me", headers=bearer(current)), 401, "token-revoked")
    assert f"POST /v1/users/{user_id}/token" in detail
    # The token still in its grace is revoked with it.
    error_of(client.get("/v1/users/me", headers=bearer(token)), 401, "token-rotated-away")
    issued = client.post(f"/v1/users/{user_id}/token", headers=ADMIN)
    assert issued.status_code == 200, issued.text
    fresh = issued.json()["token"]
    assert client.get("/v1/users/me", headers=bearer(fresh)).json()["user_id"] == user_id
    error_of(client.post(f"/v1/users/{uuid.uuid4()}/token", headers=ADMIN), 404, "not-found")
    error_of(client.post(f"/v1/users/{user_id}/token", headers=bearer(fresh)), 403, "admin-only")


# --- endpoint-scoped tokens and 404 for what a caller may not see ------------------------------


def test_an_endpoint_token_sees_only_its_endpoint_and_the_code_of_tasks_routed_to_it(
    client: TestClient,
    catalogue: Catalogue,  # noqa: F811
    produce: Produce,  # noqa: F811
) -> None:
    alice_id, alice = create_user(client, "alice")
    bob_id, bob = create_user(client, "bob")
    mine = client.post("/v1/endpoints", json={"name": "mine"}, headers=bearer(alice)).json()
    theirs = client.post("/v1/endpoints", json={"name": "x"}, headers=bearer(bob)).json()
    endpoint_id, endpoint_token = mine["endpoint_id"], mine["token"]
    assert endpoint_token not in (alice, bob)
    function_id = client.post(
        "/v1/functions", json={"name": "f", "code": CODE_B64}, headers=bearer(bob)
    ).json()["function_id"]
    other_function = client.post(
        "/v1/functions", json={"name": "g", "code": CODE_B64}, headers=bearer(bob)
    ).json()["function_id"]
    ep = bearer(endpoint_token)

    # Its own endpoint only: listing shows it alone, another endpoint is 404.
    assert [e["endpoint_id"] for e in client.get("/v1/endpoints", headers=ep).json()] == [
        endpoint_id
    ]
    assert client.get(f"/v1/endpoints/{endpoint_id}", headers=ep).status_code == 200
    missing = error_of(
        client.get(f"/v1/endpoints/{theirs['endpoint_id']}", headers=ep), 404, "not-found"
    )
    unknown = error_of(client.get(f"/v1/endpoints/{uuid.uuid4()}", headers=ep), 404, "not-found")
    assert "does not exist" in missing and "does not exist" in unknown
    # No code of a function with no task routed to this endpoint: 404, as if it did not exist.
    error_of(client.get(f"/v1/functions/{function_id}", headers=ep), 404, "not-found")
    # A refused task (no routed state) and a state an agent's result made do not count.
    refused = routed(str(uuid.uuid4()), bob_id, function_id, endpoint_id)
    produce(
        catalogue.task_state,
        refused.task_id,
        TaskState(
            task_id=refused.task_id,
            user_id=bob_id,
            function_id=function_id,
            endpoint_id=endpoint_id,
            state=TaskStateName.REJECTED,
            updated_at=time.time(),
        ),
    )
    finished = routed(str(uuid.uuid4()), bob_id, function_id, endpoint_id)
    produce(
        catalogue.task_state,
        finished.task_id,
        TaskState(**{**_fields(finished), "state": TaskStateName.SUCCEEDED}),
    )
    error_of(client.get(f"/v1/functions/{function_id}", headers=ep), 404, "not-found")
    # Nothing a user may do: no user routes.
    error_of(client.get("/v1/users/me", headers=ep), 403, "wrong-token-kind")
    error_of(
        client.post("/v1/functions", json={"name": "f", "code": CODE_B64}, headers=ep),
        403,
        "wrong-token-kind",
    )
    error_of(client.get(f"/v1/tasks/{uuid.uuid4()}", headers=ep), 403, "wrong-token-kind")

    # Once the router routes a task of the function here, the agent may fetch its code.
    task = routed(str(uuid.uuid4()), bob_id, function_id, endpoint_id)
    produce(catalogue.task_state, task.task_id, task)
    answer = client.get(f"/v1/functions/{function_id}", headers=ep)
    assert answer.status_code == 200, answer.text
    assert base64.b64decode(answer.json()["code"]) == base64.b64decode(CODE_B64)
    # ...and no other function, and no other endpoint's token that one.
    error_of(client.get(f"/v1/functions/{other_function}", headers=ep), 404, "not-found")
    error_of(
        client.get(f"/v1/functions/{function_id}", headers=bearer(theirs["token"])),
        404,
        "not-found",
    )
    # The owner of the endpoint, as a user, still may not read bob's private code.
    error_of(client.get(f"/v1/functions/{function_id}", headers=bearer(alice)), 404, "not-found")
    assert alice_id != bob_id

    # The owner replaces the endpoint's token: the old one stops at once.
    replaced = client.post(f"/v1/endpoints/{endpoint_id}/token", headers=bearer(alice))
    assert replaced.status_code == 200, replaced.text
    error_of(client.get(f"/v1/endpoints/{endpoint_id}", headers=ep), 401, "unauthorized")
    fresh = bearer(replaced.json()["token"])
    assert client.get(f"/v1/functions/{function_id}", headers=fresh).status_code == 200
    # Not another user's to replace, and invisible to them: 404.
    error_of(
        client.post(f"/v1/endpoints/{endpoint_id}/token", headers=bearer(bob)), 404, "not-found"
    )


def _fields(state: TaskState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in state.__struct_fields__}


def test_another_users_private_objects_are_404_not_403(
    client: TestClient,
    catalogue: Catalogue,  # noqa: F811
    produce: Produce,  # noqa: F811
) -> None:
    alice_id, alice = create_user(client, "alice")
    _, mallory = create_user(client, "mallory")
    function_id = client.post(
        "/v1/functions", json={"name": "f", "code": CODE_B64}, headers=bearer(alice)
    ).json()["function_id"]
    endpoint_id = client.post("/v1/endpoints", json={"name": "e"}, headers=bearer(alice)).json()[
        "endpoint_id"
    ]
    task = routed(str(uuid.uuid4()), alice_id, function_id, endpoint_id)
    produce(catalogue.task_state, task.task_id, task)
    eventually(
        lambda: client.get(f"/v1/tasks/{task.task_id}", headers=bearer(alice)).status_code == 200
    )
    group = str(uuid.uuid4())
    grouped = TaskState(**{**_fields(task), "task_id": str(uuid.uuid4()), "task_group_id": group})
    produce(catalogue.task_state, grouped.task_id, grouped)
    eventually(
        lambda: (
            client.get(f"/v1/task-groups/{group}/tasks", headers=bearer(alice)).status_code == 200
        )
    )

    # Mallory registers an endpoint of her own: that gives her no code (it did before).
    client.post("/v1/endpoints", json={"name": "trap"}, headers=bearer(mallory))
    m = bearer(mallory)
    for path, unknown in (
        (f"/v1/functions/{function_id}", f"/v1/functions/{uuid.uuid4()}"),
        (f"/v1/endpoints/{endpoint_id}", f"/v1/endpoints/{uuid.uuid4()}"),
        (f"/v1/tasks/{task.task_id}", f"/v1/tasks/{uuid.uuid4()}"),
        (f"/v1/task-groups/{group}/tasks", f"/v1/task-groups/{uuid.uuid4()}/tasks"),
    ):
        seen = error_of(client.get(path, headers=m), 404, "not-found")
        never = error_of(client.get(unknown, headers=m), 404, "not-found")
        # The same words as for an id nobody has: nothing tells that it exists.
        assert seen.replace(path.split("/")[3], "?") == never.replace(unknown.split("/")[3], "?")
    error_of(client.delete(f"/v1/functions/{function_id}", headers=m), 404, "not-found")
    error_of(client.delete(f"/v1/endpoints/{endpoint_id}", headers=m), 404, "not-found")
    status = client.post("/v1/tasks/status", json={"task_ids": [task.task_id]}, headers=m)
    assert status.json() == {task.task_id: None}
    assert client.get(f"/v1/functions/{function_id}", headers=bearer(alice)).status_code == 200


# --- rate limits on registration ---------------------------------------------------------------


def test_registration_is_rate_limited_per_caller_with_retry_after(
    module_kafka: KafkaConnection,  # noqa: F811
    catalogue: Catalogue,  # noqa: F811
) -> None:
    two = RateLimit(burst=2, per_hour=60)  # then one a minute
    limited = accounts(limits=RegistrationLimits(users=two, endpoints=two, functions=two))
    with TestClient(create_app(module_kafka, catalogue, accounts=limited)) as api:
        _, alice = create_user(api, "a")
        _, bob = create_user(api, "b")
        refused = api.post("/v1/users", json={"name": "c"}, headers=ADMIN)
        detail = error_of(refused, 429, "rate-limited")
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert "retry after" in detail
        for path, body in (
            ("/v1/endpoints", {"name": "e"}),
            ("/v1/functions", {"name": "f", "code": CODE_B64}),
        ):
            for _ in range(2):
                assert api.post(path, json=body, headers=bearer(alice)).status_code == 201
            refused = api.post(path, json=body, headers=bearer(alice))
            error_of(refused, 429, "rate-limited")
            assert int(refused.headers["Retry-After"]) >= 1
            # Per caller: bob still has his own.
            assert api.post(path, json=body, headers=bearer(bob)).status_code == 201
        # Reads are not limited.
        assert api.get("/v1/endpoints", headers=bearer(alice)).status_code == 200


# --- the real command: the admin token comes from a 0600 file ----------------------------------


def test_the_real_service_takes_the_admin_token_from_a_0600_file(
    tmp_path: Path,
    module_kafka: KafkaConnection,  # noqa: F811
    catalogue: Catalogue,  # noqa: F811
) -> None:
    connection = tmp_path / "platform.json"
    connection.write_text(
        json.dumps(
            {
                "mode": "single",
                "bootstrap_servers": module_kafka.bootstrap,
                "redis_url": "redis://127.0.0.1:1/0",
                "topic_prefix": catalogue.prefix,
                "replication_factor": catalogue.replication_factor,
                "min_insync_replicas": catalogue.min_insync_replicas,
            }
        )
    )
    token_file = tmp_path / "credentials" / "api-admin.json"
    write_secret_file(token_file, json.dumps({"token": ADMIN_TOKEN}).encode())
    (port,) = free_ports(1)
    kafka_file = write_kafka_credentials(module_kafka, tmp_path / "kafka.json")
    argv = [
        str(SERVICE),
        "api",
        "--connection",
        str(connection),
        "--kafka-credentials",
        str(kafka_file),
        "--port",
        str(port),
    ]

    os.chmod(token_file, 0o644)
    loose = subprocess.run(
        [*argv, "--admin-token-file", str(token_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loose.returncode == 1 and f"chmod 600 {token_file}" in loose.stderr, loose.stderr
    os.chmod(token_file, 0o600)

    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FXSTREAM_ADMIN_TOKEN_FILE": str(token_file)},
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{base}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.post(f"{base}/v1/users", json={"name": "n"}, timeout=30).status_code == 401
        made = httpx.post(f"{base}/v1/users", json={"name": "n"}, headers=ADMIN, timeout=30)
        assert made.status_code == 201, made.text
        assert ADMIN_TOKEN not in log.read_text()
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- Globus Auth: the adapter on globus-sdk, against the local stand-in ------------------------


def test_the_globus_adapter_accepts_an_active_token_and_refuses_the_rest(
    globus: GlobusIntrospectionStub,
) -> None:
    """Real globus-sdk introspection against the stand-in (the Globus cloud is unreachable)."""
    adapter = globus_provider(globus)
    subject = str(uuid.uuid4())
    globus.tokens["active"] = Issued(subject, "ada@example.org", "Ada", [GLOBUS_CLIENT_ID])
    globus.tokens["inactive"] = Issued(
        subject, "ada@example.org", "Ada", [GLOBUS_CLIENT_ID], active=False
    )
    globus.tokens["for-another-app"] = Issued(subject, "ada@example.org", "Ada", ["other"])
    globus.tokens["other-domain"] = Issued(
        str(uuid.uuid4()), "eve@elsewhere.net", "Eve", [GLOBUS_CLIENT_ID]
    )

    identity = adapter.identify("active")
    assert (identity.provider, identity.subject, identity.username) == (
        "globus",
        subject,
        "ada@example.org",
    )
    path, form = globus.requests[-1]
    assert path.startswith("/v2/oauth2/token/introspect") and form["token"] == ["active"]
    with pytest.raises(IdentityRejected, match="not active"):
        adapter.identify("inactive")
    with pytest.raises(IdentityRejected, match="not active"):
        adapter.identify("never-issued")
    with pytest.raises(IdentityRejected, match="not issued for this fxstream service"):
        adapter.identify("for-another-app")
    with pytest.raises(IdentityRejected, match=r"elsewhere\.net"):
        adapter.identify("other-domain")
    assert globus_provider(globus, "*").identify("other-domain").username == "eve@elsewhere.net"


def test_a_globus_login_maps_the_identity_to_one_fxstream_user(
    client: TestClient, globus: GlobusIntrospectionStub
) -> None:
    """Through the API, against the stand-in introspection server (Globus is unreachable)."""
    subject = str(uuid.uuid4())
    globus.tokens["login-1"] = Issued(subject, "kim@example.org", "Kim", [GLOBUS_CLIENT_ID])
    globus.tokens["login-2"] = Issued(subject, "kim@example.org", "Kim", [GLOBUS_CLIENT_ID])
    globus.tokens["login-dead"] = Issued(
        subject, "kim@example.org", "Kim", [GLOBUS_CLIENT_ID], active=False
    )

    first = client.post("/v1/login/globus", json={"token": "login-1"})
    assert first.status_code == 200, first.text
    assert first.json()["created"] is True
    user_id, token = first.json()["user_id"], first.json()["token"]
    me = client.get("/v1/users/me", headers=bearer(token)).json()
    assert me == {**me, "user_id": user_id, "name": "Kim"}

    # The same Globus identity again: the same user, a new token, the old one stopped.
    again = client.post("/v1/login/globus", json={"token": "login-2"})
    assert again.status_code == 200, again.text
    assert again.json()["created"] is False and again.json()["user_id"] == user_id
    error_of(client.get("/v1/users/me", headers=bearer(token)), 401, "unauthorized")
    renewed = bearer(again.json()["token"])
    assert client.get("/v1/users/me", headers=renewed).status_code == 200

    # A revoked fxstream token of a Globus user names the login as a remedy, and it works.
    assert client.delete("/v1/users/me/token", headers=renewed).status_code == 204
    detail = error_of(client.get("/v1/users/me", headers=renewed), 401, "token-revoked")
    assert "POST /v1/login/globus" in detail
    relogin = client.post("/v1/login/globus", json={"token": "login-1"})
    assert relogin.json()["user_id"] == user_id
    assert client.get("/v1/users/me", headers=bearer(relogin.json()["token"])).status_code == 200

    detail = error_of(
        client.post("/v1/login/globus", json={"token": "login-dead"}), 401, "identity-rejected"
    )
    assert "not active" in detail
    error_of(client.post("/v1/login/orcid", json={"token": "x"}), 404, "not-found")
