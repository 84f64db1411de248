"""The Client's REST methods against the real service (fxstream.service.api), run in-process.

The service runs with uvicorn in a thread on a free port, on its own topic
prefix on the session broker. Task states are written to the task-state topic
by the test, as the task-state processor would.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import uvicorn

from fxstream.sdk import (
    AuthenticationError,
    Client,
    ConfigurationError,
    Executor,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RegisteredUser,
    TaskExecutionFailed,
    TaskPending,
    VersionMismatch,
)
from fxstream.sdk.versions import check_versions, version_tuple
from fxstream.service import AccountSettings, new_token, token_sha256
from fxstream.service.api import create_app
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    Serializer,
    TaskError,
    TaskState,
    TaskStateName,
    TaskTimings,
    encode,
    ensure_topics,
)
from tests.conftest import RunningPlatform
from tests.sdk.streams import Responder, ResultWriter

T = TypeVar("T")


def square(x: int) -> int:
    return x * x


@dataclass(frozen=True)
class Service:
    """The running service and its deployment."""

    url: str
    kafka: KafkaConnection
    catalogue: Catalogue
    admin_token: str = ""

    def client(self, user: RegisteredUser | None = None, *, token: str | None = None) -> Client:
        """A client for ``user`` (or anonymous); the user id is asked from the service."""
        return Client(
            self.url,
            kafka=self.kafka,
            topic_prefix=self.catalogue.prefix,
            token=token if token is not None else (user.token if user else None),
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def service(kafka_platform: RunningPlatform) -> Iterator[Service]:
    """The REST service on a prefix of this module's own."""
    kafka = kafka_platform.kafka
    catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    admin = kafka_platform.admin()
    ensure_topics(admin, catalogue)
    port = _free_port()
    admin_token = new_token()
    config = uvicorn.Config(
        create_app(
            kafka,
            catalogue,
            accounts=AccountSettings(admin_token_sha256=token_sha256(admin_token)),
        ),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "the service did not start (see its log above)"
        assert time.monotonic() < deadline, "the service did not start in 60 s"
        time.sleep(0.05)
    try:
        yield Service(f"http://127.0.0.1:{port}", kafka, catalogue, admin_token)
    finally:
        server.should_exit = True
        thread.join(30)
        ours = [t for t in admin.list_topics(timeout=10).topics if t.startswith(catalogue.prefix)]
        for future in admin.delete_topics(ours, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                continue


@pytest.fixture(scope="module")
def alice(service: Service) -> RegisteredUser:
    """A registered user."""
    return Client.register_user(service.url, "alice", admin_token=service.admin_token)


@pytest.fixture(scope="module")
def bob(service: Service) -> RegisteredUser:
    """Another registered user."""
    return Client.register_user(service.url, "bob", admin_token=service.admin_token)


def eventually(call: Callable[[], T], timeout: float = 20.0) -> T:
    """``call()`` once it stops raising NotFound (the service's view folds asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except NotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_register_user_and_who_am_i(service: Service, alice: RegisteredUser) -> None:
    user_id, token = alice
    assert uuid.UUID(user_id) and token
    with service.client(alice) as client:
        assert client.user_id == user_id  # asked from the service: not configured
        me = client.whoami()
        assert {k: me[k] for k in ("user_id", "name")} == {"user_id": user_id, "name": "alice"}
    with (
        service.client(token="not-a-token") as stranger,
        pytest.raises(AuthenticationError) as caught,
    ):
        stranger.whoami()
    assert caught.value.status_code == 401 and caught.value.detail


def test_functions_register_read_list_delete(service: Service, alice: RegisteredUser) -> None:
    with service.client(alice) as client:
        function_id = client.register_function(square, description="squares")
        record = client.get_function(function_id)
        assert record["name"] == "square" and record["owner_id"] == alice.user_id
        assert record["code"] == Serializer().serialize_function(square)
        assert Serializer().deserialize_function(record["code"])(7) == 49
        assert function_id in {f["function_id"] for f in client.list_functions()}
        client.delete_function(function_id)
        with pytest.raises(NotFound) as caught:
            client.get_function(function_id)
    assert caught.value.status_code == 404 and caught.value.detail


def cube(x: int) -> int:
    """Cubes x (this docstring becomes the function's description)."""
    return x**3


def test_register_function_takes_globus_computes_parameters(
    service: Service, alice: RegisteredUser
) -> None:
    with service.client(alice) as client:
        # Globus Compute's order: function, description, metadata, public, group.
        function_id = client.register_function(cube, None, {"stage": 2})
        record = client.get_function(function_id)
        assert (
            record["description"] == "Cubes x (this docstring becomes the function's description)."
        )
        meta = record["metadata"]
        assert meta["stage"] == "2" and meta["python_version"].startswith("3.")
        assert "sdk_version" in meta
        assert (
            client.get_function(client.register_function(square, "mine"))["description"] == "mine"
        )
        with pytest.raises(ValueError, match="allowed_users"):
            client.register_function(cube, group="5c8e7f0a-globus-group")
        with pytest.raises(ValueError, match="high-assurance"):
            client.register_function(cube, ha_endpoint_id="ep")
        # The Executor passes the same parameters on (a name of its own among them).
        with Executor("ep-unused", client) as executor:
            named = executor.register_function(cube, name="cube_again", metadata={"k": 1})
        record = client.get_function(named)
        assert record["name"] == "cube_again" and record["metadata"]["k"] == "1"
        assert record["description"].startswith("Cubes x")


def test_version_check_and_logout(service: Service, alice: RegisteredUser) -> None:
    with service.client(alice) as client:
        client.version_check()  # the SDK and the service come from one workspace
        with pytest.raises(VersionMismatch, match="older than the service's min_ep_version"):
            client.version_check(endpoint_version="0.0.1")
        client.logout()
        with pytest.raises(ConfigurationError, match="no API token"):
            client.run(endpoint_id="ep", function_id="fn")  # nothing sent without a token
        with pytest.raises(AuthenticationError) as refused:
            client.whoami()  # the service refuses a request without one
        assert refused.value.status_code == 401


def test_versions_compare_by_their_numbers() -> None:
    assert version_tuple("1.10.2rc1") == (1, 10, 2) > version_tuple("1.9")
    service = {"version": "2.0", "min_sdk_version": "99.0", "min_ep_version": "1.0"}
    with pytest.raises(VersionMismatch, match=r"older than the service's min_sdk_version 99\.0"):
        check_versions(service)
    with pytest.raises(VersionMismatch, match="cannot compare"):
        check_versions({**service, "min_sdk_version": "0"}, endpoint_version="unknown")


def test_endpoints_register_list_status_delete(
    service: Service, alice: RegisteredUser, bob: RegisteredUser
) -> None:
    with service.client(bob) as other:
        public = other.register_endpoint("bobs-public", public=True)
    with service.client(alice) as client:
        endpoint_id = client.register_endpoint(
            "laptop", description="my laptop", metadata={"site": "home"}
        )
        listed = {e["endpoint_id"]: e for e in client.list_endpoints()}
        assert listed[endpoint_id]["status"]["state"] == "never-seen"
        assert client.get_endpoint(endpoint_id)["metadata"] == {"site": "home"}
        status = client.get_endpoint_status(endpoint_id)
        assert status["state"] == "never-seen" and status["status"] == "offline"
        # Globus Compute's names for the same reads.
        assert client.get_endpoint_metadata(endpoint_id)["metadata"] == {"site": "home"}
        owned = {e["endpoint_id"] for e in client.get_endpoints()}
        usable = {e["endpoint_id"] for e in client.get_endpoints(role="any")}
        assert endpoint_id in owned and public not in owned
        assert {endpoint_id, public} <= usable
        with pytest.raises(ValueError, match="role must be"):
            client.get_endpoints(role="admin")
        client.delete_endpoint(endpoint_id)
        with pytest.raises(NotFound):
            client.get_endpoint(endpoint_id)


def test_errors_carry_the_service_detail(
    service: Service, alice: RegisteredUser, bob: RegisteredUser
) -> None:
    with service.client(alice) as owner, service.client(bob) as other:
        private = owner.register_function(square)
        with pytest.raises(NotFound) as hidden:
            other.delete_function(private)  # not visible to bob: as if it did not exist
        assert hidden.value.status_code == 404 and hidden.value.detail
        public = owner.register_function(square, public=True)
        with pytest.raises(PermissionDenied) as denied:
            other.delete_function(public)  # visible, but not bob's to delete
        assert denied.value.status_code == 403 and denied.value.detail
        with pytest.raises(InvalidRequest, match=r"allowed_users\[0\]"):
            owner.register_endpoint("ep", allowed_users=["not an id!"])


def _write_state(service: Service, state: TaskState) -> None:
    """Write a task state as the task-state processor would."""
    ResultWriter(service.kafka).write(service.catalogue.task_state, state.task_id, encode(state))


def _state(user: RegisteredUser, name: TaskStateName, **fields: Any) -> TaskState:
    return TaskState(
        task_id=str(uuid.uuid4()),
        user_id=user.user_id,
        function_id="f-1",
        endpoint_id="ep-1",
        state=name,
        updated_at=time.time(),
        timings=TaskTimings(submitted_at=time.time() - 1, routed_at=time.time()),
        **fields,
    )


def test_status_of_tasks_this_client_did_not_run_comes_from_the_service(
    service: Service, alice: RegisteredUser
) -> None:
    done = _state(alice, TaskStateName.SUCCEEDED, value=Serializer().serialize_value([1, 2]))
    failed = _state(
        alice,
        TaskStateName.FAILED,
        error=TaskError(type="ValueError", message="nope", traceback="Traceback ...\nValueError"),
    )
    running = _state(alice, TaskStateName.RUNNING)
    for state in (done, failed, running):
        _write_state(service, state)

    with service.client(alice) as client:
        task = eventually(lambda: client.get_task(done.task_id))
        assert task["state"] == "succeeded" and task["pending"] is False
        assert task["timings"]["submitted"] == done.timings.submitted_at
        assert client.get_result(done.task_id) == [1, 2]

        eventually(lambda: client.get_task(failed.task_id))
        with pytest.raises(ValueError, match="nope") as caught:
            client.get_result(failed.task_id)
        assert isinstance(caught.value, TaskExecutionFailed)

        eventually(lambda: client.get_task(running.task_id))
        with pytest.raises(TaskPending, match="running"):
            client.get_result(running.task_id)

        unknown = str(uuid.uuid4())
        with pytest.raises(NotFound):
            client.get_result(unknown)
        results = client.get_batch_result([done.task_id, failed.task_id, running.task_id, unknown])
        assert results[done.task_id]["result"] == [1, 2]
        assert isinstance(results[failed.task_id]["exception"], TaskExecutionFailed)
        assert results[running.task_id]["pending"] is True
        assert results[unknown] == {"task_id": unknown, "pending": True, "status": "unknown"}


def test_executor_registers_through_the_service_and_runs_end_to_end(
    service: Service, alice: RegisteredUser
) -> None:
    with service.client(alice) as client:
        endpoint_id = client.register_endpoint("responder")
        functions: dict[str, bytes] = {}
        with (
            Responder(
                service.kafka, service.catalogue, endpoint_id, functions, user_id=alice.user_id
            ),
            Executor(endpoint_id=endpoint_id, client=client) as ex,
        ):
            function_id = ex.register_function(square)  # POST /v1/functions
            functions[function_id] = client.get_function(function_id)["code"]
            before = len(client.list_functions())
            assert ex.submit(square, 4).result(timeout=30) == 16
            assert ex.submit(square, 5).result(timeout=30) == 25
            assert len(client.list_functions()) == before  # registered once
