"""``GET /v1/analytics`` against the real broker: windows written to the ``analytics`` topic
(as the analytics processor writes them) read back through the API, with its auth (a user
its own, the admin every user's, an endpoint nothing), the latest record per key, merging
and the filters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fxstream.service import create_app
from fxstream.topics import (
    OTHER_KEY,
    Catalogue,
    KafkaConnection,
    TaskStateName,
    WindowAggregate,
    latency_bucket,
)
from tests.service.conftest import Produce, eventually
from tests.service.test_api import ACCOUNTS, ADMIN, User, register

START = float(int(time.time()) // 60 * 60 - 600)


@pytest.fixture(scope="module")
def client(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[TestClient]:
    with TestClient(create_app(module_kafka, catalogue, accounts=ACCOUNTS)) as client:
        yield client


def window(user: str, dimension: str, key: str, start: float, **figures: Any) -> WindowAggregate:
    fields: dict[str, Any] = {
        "window": "tumbling",
        "size_s": 60,
        "step_s": 60,
        "start": start,
        "end": start + 60,
        "dimension": dimension,
        "key": key,
        "user_id": user,
        "updated_at": time.time(),
        **figures,
    }
    return WindowAggregate(**fields)


def publish(produce: Produce, catalogue: Catalogue, aggregate: WindowAggregate) -> None:
    produce(catalogue.analytics, aggregate.topic_key(), aggregate)


def get(client: TestClient, headers: dict[str, str], **params: Any) -> list[dict[str, Any]]:
    answer = client.get("/v1/analytics", params=params, headers=headers)
    assert answer.status_code == 200, answer.text
    windows: list[dict[str, Any]] = answer.json()["windows"]
    return windows


@pytest.fixture(scope="module")
def users(client: TestClient, produce: Produce, catalogue: Catalogue) -> tuple[User, User]:
    """Two users, each with windows of one shared function id, written twice (the second
    record of a key is the figure)."""
    alice, bob = register(client, "alice"), register(client, "bob")
    one_second = latency_bucket(1.0)
    for n in range(3):
        start = START + 60 * n
        publish(produce, catalogue, window(alice.user_id, "function", "fn-x", start, finished=1))
        publish(
            produce,
            catalogue,
            window(
                alice.user_id,
                "function",
                "fn-x",
                start,
                finished=4,
                succeeded=3,
                failed=1,
                states={TaskStateName.SUCCEEDED: 3, TaskStateName.FAILED: 1},
                latency_histogram={one_second: 4},
                latency_sum_s=3.6,
                latency_max_s=0.95,
                final=n < 2,
            ),
        )
        publish(
            produce,
            catalogue,
            window(
                bob.user_id,
                "function",
                "fn-x",
                start,
                finished=2,
                failed=2,
                latency_histogram={0: 2},
                latency_max_s=0.0005,
            ),
        )
    publish(produce, catalogue, window(alice.user_id, "function", OTHER_KEY, START, finished=7))

    def read_all() -> bool:
        # Each key's records may sit on another partition: wait for every last one.
        summed = [w["finished"] for w in get(client, ADMIN, dimension="function", key="fn-x")]
        other = get(client, ADMIN, dimension="function", key=OTHER_KEY)
        return summed == [6, 6, 6] and len(other) == 1

    eventually(read_all, timeout_s=30, what="the API's view read every window")
    return alice, bob


def test_a_user_reads_only_its_own_windows(client: TestClient, users: tuple[User, User]) -> None:
    alice, bob = users
    mine = get(client, alice.auth, dimension="function", key="fn-x")
    assert [w["start"] for w in mine] == [START, START + 60, START + 120]
    for w in mine:
        assert w["user_id"] == alice.user_id
        assert (w["finished"], w["succeeded"], w["failed"], w["errors"]) == (4, 3, 1, 1)
        assert w["error_rate"] == 0.25
        assert w["finished_per_s"] == 4 / 60
        assert w["states"] == {"failed": 1, "succeeded": 3}
        # Bucket upper bounds, capped at the exact maximum.
        assert w["latency_s"]["p50"] == w["latency_s"]["max"] == 0.95
        assert w["latency_s"]["mean"] == pytest.approx(0.9)
    assert [w["final"] for w in mine] == [True, True, False]
    theirs = get(client, bob.auth, dimension="function", key="fn-x")
    assert {w["user_id"] for w in theirs} == {bob.user_id}
    assert [w["failed"] for w in theirs] == [2, 2, 2]
    # Naming another user finds nothing; the bound's key is the user's own.
    assert get(client, bob.auth, dimension="function", user_id=alice.user_id) == []
    assert [
        w["finished"] for w in get(client, alice.auth, key=OTHER_KEY, dimension="function")
    ] == [7]
    assert get(client, bob.auth, key=OTHER_KEY, dimension="function") == []


def test_the_admin_reads_every_user_s_windows_summed_or_one_user_s(
    client: TestClient, users: tuple[User, User]
) -> None:
    alice, _ = users
    summed = get(client, ADMIN, dimension="function", key="fn-x")
    for w in summed:
        assert w["user_id"] is None
        assert (w["finished"], w["failed"], w["succeeded"]) == (6, 3, 3)
        assert w["latency_s"]["samples"] == 6
        assert w["latency_s"]["max"] == 0.95
        # Two of six in bucket 0 (<= 1 ms), four in alice's: the median is hers.
        assert w["latency_s"]["histogram"][0] == [0.001, 2]
        assert w["latency_s"]["p50"] == 0.95
    assert [w["final"] for w in summed] == [False, False, False]  # bob's are not final
    one = get(client, ADMIN, dimension="function", key="fn-x", user_id=alice.user_id)
    assert [w["finished"] for w in one] == [4, 4, 4]


def test_filters_and_the_page_limit(client: TestClient, users: tuple[User, User]) -> None:
    alice, _ = users
    auth = alice.auth
    assert get(client, auth, dimension="function", key="fn-x", window="hopping") == []
    assert [
        w["start"] for w in get(client, auth, dimension="function", key="fn-x", since=START + 60)
    ] == [START + 60, START + 120]
    assert [
        w["start"] for w in get(client, auth, dimension="function", key="fn-x", until=START + 60)
    ] == [START, START + 60]
    answer = client.get(
        "/v1/analytics", params={"dimension": "function", "key": "fn-x", "limit": 2}, headers=auth
    )
    assert answer.json()["truncated"] is True
    assert [w["start"] for w in answer.json()["windows"]] == [START + 60, START + 120]
    assert get(client, auth, dimension="user") == []  # none written for that dimension
    bad = client.get("/v1/analytics", params={"dimension": "nope"}, headers=auth)
    assert bad.status_code == 422


def test_an_endpoint_s_token_and_no_token_are_refused(
    client: TestClient, users: tuple[User, User]
) -> None:
    alice, _ = users
    made = client.post("/v1/endpoints", json={"name": "laptop"}, headers=alice.auth)
    assert made.status_code == 201, made.text
    endpoint = {"Authorization": f"Bearer {made.json()['token']}"}
    refused = client.get("/v1/analytics", headers=endpoint)
    assert refused.status_code == 403
    assert refused.json()["error"] == "wrong-token-kind"
    assert client.get("/v1/analytics").status_code == 401
