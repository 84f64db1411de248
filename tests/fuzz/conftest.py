"""Fuzz fixtures: a private set of topics per module on the session broker, and a registry.

The registry (one user, one function, one endpoint, with their results and queue
topics) is written as the API writes it, so the router finds a task it may route.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import Producer

from fxstream.service.auth import new_token, token_sha256
from fxstream.topics import (
    Catalogue,
    EndpointRecord,
    FunctionRecord,
    Record,
    UserRecord,
    encode,
    ensure_topics,
)
from tests.conftest import RunningPlatform
from tests.service.conftest import delete_topics_under


@dataclass(frozen=True)
class Registry:
    """The ids (and the token) of the registered user, function and endpoint."""

    user_id: str
    token: str
    function_id: str
    endpoint_id: str


@pytest.fixture(scope="module")
def fuzz_catalogue(kafka_platform: RunningPlatform) -> Iterator[Catalogue]:
    """A catalogue with a prefix of this module's own, its static topics provisioned."""
    catalogue = Catalogue(prefix=f"fz{uuid.uuid4().hex[:10]}.")
    admin = kafka_platform.admin()
    report = ensure_topics(admin, catalogue)
    assert report.ok, report
    try:
        yield catalogue
    finally:
        delete_topics_under(admin, catalogue.prefix)


@pytest.fixture(scope="module")
def registry(kafka_platform: RunningPlatform, fuzz_catalogue: Catalogue) -> Registry:
    """One user, a function it owns and an endpoint it owns, with their topics."""
    catalogue = fuzz_catalogue
    registry = Registry(
        user_id=str(uuid.uuid4()),
        token=new_token(),
        function_id=str(uuid.uuid4()),
        endpoint_id=str(uuid.uuid4()),
    )
    ensure_topics(
        kafka_platform.admin(),
        catalogue,
        {
            catalogue.results(registry.user_id): catalogue.spec("results.{user_id}"),
            catalogue.endpoint_queue(registry.endpoint_id): catalogue.spec(
                "tasks.ep.{endpoint_id}"
            ),
        },
    )
    now = time.time()
    records: list[tuple[str, str, Record]] = [
        (
            catalogue.users,
            registry.user_id,
            UserRecord(
                user_id=registry.user_id,
                name="fuzzer",
                token_sha256=token_sha256(registry.token),
                created_at=now,
            ),
        ),
        (
            catalogue.functions,
            registry.function_id,
            FunctionRecord(
                function_id=registry.function_id,
                name="f",
                owner_id=registry.user_id,
                code=b"fxdc\nnot-loaded",
                code_sha256="0" * 64,
                created_at=now,
            ),
        ),
        (
            catalogue.endpoints,
            registry.endpoint_id,
            EndpointRecord(
                endpoint_id=registry.endpoint_id,
                name="e",
                owner_id=registry.user_id,
                created_at=now,
            ),
        ),
    ]
    producer = Producer(
        {
            **kafka_platform.kafka.confluent(),
            "acks": "all",
            "log_level": 2,
        }
    )
    for topic, key, record in records:
        producer.produce(topic, key=key.encode(), value=encode(record))
    assert producer.flush(30) == 0
    return registry
