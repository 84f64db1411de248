"""Error mapping: service answers to typed exceptions, task errors to TaskExecutionFailed."""

from __future__ import annotations

import pickle
import socket

import httpx
import pytest

from fxstream.sdk import (
    AuthenticationError,
    BlockLost,
    Client,
    FxstreamError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RateLimited,
    ServiceError,
    ServiceUnavailable,
    TaskExecutionFailed,
    TaskRejected,
    WorkerLost,
)
from fxstream.sdk.errors import task_failure
from fxstream.sdk.rest import raise_for_error
from fxstream.topics import KafkaConnection, TaskError


def answer(status: int, body: object) -> httpx.Response:
    """An HTTP answer as httpx hands it to the SDK."""
    request = httpx.Request("POST", "http://svc/v1/functions")
    return httpx.Response(status, json=body, request=request)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, InvalidRequest),
        (401, AuthenticationError),
        (403, PermissionDenied),
        (404, NotFound),
        (409, InvalidRequest),
        (413, InvalidRequest),
        (422, InvalidRequest),
        (429, RateLimited),
        (418, ServiceError),
    ],
)
def test_error_answers_map_to_typed_exceptions_with_the_detail(
    status: int, expected: type[ServiceError]
) -> None:
    detail = "what is wrong and what to do"
    with pytest.raises(ServiceError) as caught:
        raise_for_error(answer(status, {"error": "some-code", "detail": detail}))
    error = caught.value
    assert type(error) is expected
    assert isinstance(error, FxstreamError)
    assert (error.status_code, error.error, error.detail) == (status, "some-code", detail)
    assert detail in str(error) and "POST http://svc/v1/functions" in str(error)


def test_a_429_carries_its_retry_after() -> None:
    request = httpx.Request("POST", "http://svc/v1/endpoints")
    response = httpx.Response(
        429,
        json={"error": "rate-limited", "detail": "retry after 7 s"},
        headers={"Retry-After": "7"},
        request=request,
    )
    with pytest.raises(RateLimited) as caught:
        raise_for_error(response)
    assert caught.value.retry_after == 7.0


def test_validation_lists_are_flattened_naming_the_field() -> None:
    body = {"detail": [{"loc": ["body", "name"], "msg": "field required", "type": "missing"}]}
    with pytest.raises(InvalidRequest, match=r"body\.name: field required"):
        raise_for_error(answer(422, body))


def test_server_errors_and_non_json_bodies() -> None:
    with pytest.raises(ServiceUnavailable, match="service's log"):
        raise_for_error(answer(500, {"error": "internal", "detail": "boom"}))
    request = httpx.Request("GET", "http://svc/v1/users/me")
    with pytest.raises(NotFound, match="no such page"):
        raise_for_error(httpx.Response(404, text="no such page", request=request))
    raise_for_error(answer(201, {"ok": True}))  # success: nothing raised


def test_an_unreachable_service_names_the_setting() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with (
        Client(url, kafka=KafkaConnection("127.0.0.1:1"), token="t") as client,
        pytest.raises(ServiceUnavailable, match="FXSTREAM_SERVICE_URL"),
    ):
        client.list_endpoints()


def test_task_failures_pick_their_class_and_survive_pickling() -> None:
    error = TaskError(type="KeyError", message="'k'", traceback="Traceback ...\nKeyError: 'k'")
    failure = task_failure("t-1", error, endpoint_id="ep-1", attempt=2)
    assert isinstance(failure, KeyError) and isinstance(failure, TaskExecutionFailed)
    assert str(failure).startswith("task t-1 failed on endpoint ep-1: KeyError: 'k'")
    copy = pickle.loads(pickle.dumps(failure))
    assert type(copy) is type(failure)
    assert (copy.task_id, copy.endpoint_id, copy.attempt) == ("t-1", "ep-1", 2)
    assert copy.remote_traceback == error.traceback

    assert type(task_failure("t", TaskError(type="TaskRejected", message="no"))) is TaskRejected
    lost = task_failure("t", TaskError(type="fxstream.agent.WorkerLost", message="pid 9 died"))
    assert type(lost) is WorkerLost
    block = task_failure("t", TaskError(type="BlockLost", message="the task's block ended"))
    assert type(block) is BlockLost and isinstance(block, WorkerLost)
    plain = task_failure("t", TaskError(type="SystemExit", message="1"))
    assert type(plain) is TaskExecutionFailed  # not an Exception subclass: never mixed in
