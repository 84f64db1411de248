"""SDK test fixtures: one topic prefix and one user per test module, on the session broker.

Each module gets ``tasks.submitted`` and the user's ``results.<user_id>`` under
its own prefix (deleted at the end of the module), and a Client pointed at
them. These fixtures run no REST service: the Client's service URL is a closed
port, and the tests using them avoid REST calls (user id and token are given,
functions are associated with ids without registering them). test_rest.py
starts the real service in-process for the REST methods.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fxstream.sdk import DEFAULT_MAX_INLINE_BYTES, Client
from fxstream.topics import Catalogue, KafkaConnection, ensure_topics
from tests.conftest import RunningPlatform


@dataclass(frozen=True)
class SdkTopics:
    """The module's topics, user and credentials."""

    kafka: KafkaConnection
    catalogue: Catalogue
    user_id: str
    token: str
    service_url: str

    @property
    def results(self) -> str:
        """The user's results topic."""
        return self.catalogue.results(self.user_id)

    def client(self, *, max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES) -> Client:
        """A Client for this module's user (the caller closes it)."""
        return Client(
            self.service_url,
            kafka=self.kafka,
            topic_prefix=self.catalogue.prefix,
            user_id=self.user_id,
            token=self.token,
            max_inline_bytes=max_inline_bytes,
        )


def closed_port_url() -> str:
    """An http URL on a port nothing listens on (no REST service in these tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def sdk_topics(kafka_platform: RunningPlatform) -> Iterator[SdkTopics]:
    """``tasks.submitted`` and ``results.<user>`` under a prefix of this module's own."""
    catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    user_id = str(uuid.uuid4())
    topics = {
        catalogue.tasks_submitted: catalogue.spec("tasks.submitted"),
        catalogue.results(user_id): catalogue.spec("results.{user_id}"),
    }
    admin = kafka_platform.admin()
    ensure_topics(admin, catalogue, topics)
    try:
        yield SdkTopics(
            kafka=kafka_platform.kafka,
            catalogue=catalogue,
            user_id=user_id,
            token=f"token-{uuid.uuid4().hex}",
            service_url=closed_port_url(),
        )
    finally:
        for future in admin.delete_topics(list(topics), operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                continue


@pytest.fixture
def client(sdk_topics: SdkTopics) -> Iterator[Client]:
    """A Client for the module's user, closed after the test."""
    with sdk_topics.client() as the_client:
        yield the_client
