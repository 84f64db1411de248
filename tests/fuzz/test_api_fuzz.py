"""Fuzz every REST route in-process (TestClient on the real Kafka runtime): never a 5xx.

Also the regressions the fuzzing found: a heartbeat or task state holding an
infinite time used to be accepted by every reader. The API rendered the time
as null, and one heartbeat with ``sent_at`` infinite pinned its endpoint
"online" forever (no later heartbeat is newer). Such records are now refused
at decoding (and so dead-lettered by the processors, skipped by the view).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
from confluent_kafka import Producer
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from fxstream.service import create_app
from fxstream.topics import (
    Catalogue,
    Heartbeat,
    KafkaConnection,
    Serializer,
    TaskState,
    TaskStateName,
    encode,
)
from tests.conftest import RunningPlatform
from tests.fuzz.api_fuzz import (
    ApiRequest,
    KnownIds,
    assert_answer_is_sane,
    requests,
    send,
)
from tests.fuzz.conftest import Registry

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(scope="module")
def client(
    kafka_platform: RunningPlatform, fuzz_catalogue: Catalogue, registry: Registry
) -> Iterator[TestClient]:
    """The API on the fuzz deployment, started (lifespan) and stopped around the module."""
    app = create_app(kafka_platform.kafka, fuzz_catalogue, timeout_s=10)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def known(registry: Registry) -> KnownIds:
    """The registered ids (the regression tests read them; the fuzz may delete its own)."""
    return KnownIds(registry.token, registry.user_id, registry.function_id, registry.endpoint_id)


@pytest.fixture(scope="module")
def fuzzed(client: TestClient) -> KnownIds:
    """A user with a function and an endpoint, made through the API, for the fuzz to hit."""
    user = client.post("/v1/users", json={"name": "fuzz"})
    assert user.status_code == 201, user.text
    token, user_id = user.json()["token"], user.json()["user_id"]
    auth = {"Authorization": f"Bearer {token}"}
    code = base64.b64encode(Serializer().serialize_function(len)).decode()
    function = client.post("/v1/functions", json={"name": "f", "code": code}, headers=auth)
    assert function.status_code == 201, function.text
    endpoint = client.post("/v1/endpoints", json={"name": "e"}, headers=auth)
    assert endpoint.status_code == 201, endpoint.text
    return KnownIds(token, user_id, function.json()["function_id"], endpoint.json()["endpoint_id"])


def test_fuzz_every_route(client: TestClient, fuzzed: KnownIds) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(request=requests(fuzzed))
    def check(request: ApiRequest) -> None:
        answer = send(client, request)
        seen[answer.status_code] += 1
        assert_answer_is_sane(request, answer)

    check()
    print(f"statuses: {dict(sorted(seen.items()))}")
    # The requests reach past authentication and validation, not only into the first refusal.
    assert {200, 401, 404, 422} <= set(seen), seen
    assert client.get("/v1/health").json() == {"status": "ok", "kafka": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/users", {"name": "n" * 10_000_000}),
        ("/v1/functions", {"name": "f", "code": base64.b64encode(b"x" * 6_000_000).decode()}),
        ("/v1/endpoints", {"name": "e", "metadata": {str(i): "v" for i in range(100_000)}}),
        ("/v1/tasks/status", {"task_ids": [str(uuid.uuid4()) for _ in range(50_000)]}),
    ],
    ids=["huge-name", "huge-code", "huge-metadata", "huge-status-query"],
)
def test_huge_bodies_are_4xx_with_a_reason(
    client: TestClient, known: KnownIds, path: str, body: object
) -> None:
    answer = client.post(path, json=body, headers={"Authorization": f"Bearer {known.token}"})
    request = ApiRequest("POST", path, {}, b"<huge>")
    assert 400 <= answer.status_code < 500
    assert_answer_is_sane(request, answer)


def _produce(kafka: KafkaConnection, topic: str, key: str, value: bytes) -> None:
    producer = Producer({**kafka.confluent(), "acks": "all", "log_level": 2})
    producer.produce(topic, key=key.encode(), value=value)
    assert producer.flush(30) == 0


def _with_infinity(record: msgspec.Struct, field: str) -> bytes:
    # Built by hand: encode() would write it, but no reader may accept it.
    fields = msgspec.msgpack.decode(encode(record))  # type: ignore[arg-type]
    fields[field] = float("inf")
    return msgspec.msgpack.encode(fields)


def test_regression_an_infinite_heartbeat_time_does_not_pin_the_endpoint(
    client: TestClient,
    kafka_platform: RunningPlatform,
    fuzz_catalogue: Catalogue,
    known: KnownIds,
) -> None:
    beat = Heartbeat(
        endpoint_id=known.endpoint_id,
        agent_id=str(uuid.uuid4()),
        sent_at=time.time(),
        sequence=1,
        period_s=5.0,
        hostname="h",
        pid=1,
        workers_total=1,
        workers_idle=1,
        workers_busy=0,
        queue_depth=0,
    )
    for field in ("sent_at", "period_s"):
        _produce(
            kafka_platform.kafka,
            fuzz_catalogue.heartbeats,
            known.endpoint_id,
            _with_infinity(beat, field),
        )
    # A later good record shows the view has read past the bad ones.
    _produce(
        kafka_platform.kafka,
        fuzz_catalogue.heartbeats,
        known.endpoint_id,
        encode(beat),
    )
    auth = {"Authorization": f"Bearer {known.token}"}
    deadline = time.monotonic() + 20
    while True:
        answer = client.get(f"/v1/endpoints/{known.endpoint_id}", headers=auth)
        assert answer.status_code == 200, answer.text
        if answer.json()["status"]["state"] == "online" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.json()["status"]["last_seen"] == beat.sent_at
    assert client.get("/v1/endpoints", headers=auth).status_code == 200


def test_regression_an_infinite_task_state_time_is_not_shown(
    client: TestClient,
    kafka_platform: RunningPlatform,
    fuzz_catalogue: Catalogue,
    known: KnownIds,
) -> None:
    task_id = str(uuid.uuid4())
    state = TaskState(
        task_id=task_id,
        user_id=known.user_id,
        function_id=known.function_id,
        endpoint_id=known.endpoint_id,
        state=TaskStateName.ROUTED,
        updated_at=time.time(),
    )
    _produce(
        kafka_platform.kafka,
        fuzz_catalogue.task_state,
        task_id,
        _with_infinity(state, "updated_at"),
    )
    auth = {"Authorization": f"Bearer {known.token}"}
    time.sleep(1.0)  # time for the view to read it, were it to fold it
    answer = client.get(f"/v1/tasks/{task_id}", headers=auth)
    assert answer.status_code == 404, answer.text
    status = client.post("/v1/tasks/status", json={"task_ids": [task_id]}, headers=auth)
    assert status.status_code == 200 and status.json() == {task_id: None}
