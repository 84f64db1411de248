"""Fixtures of the trigger tests: a private topic prefix, event topics, credential files."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.topics import Catalogue, KafkaConnection
from tests.conftest import write_kafka_credentials


@pytest.fixture
def catalogue(unique_prefix: str) -> Catalogue:
    """A catalogue under a prefix no other test uses."""
    return Catalogue(prefix=unique_prefix)


@pytest.fixture
def event_topic(
    kafka: KafkaConnection, catalogue: Catalogue, topic_cleanup: list[str]
) -> Callable[[str], str]:
    """Creates ``events.<source>`` (as the admin) and returns its name; deleted afterwards."""

    def create(source: str) -> str:
        topic = ensure_event_topic(kafka, catalogue, source)
        topic_cleanup.append(topic)
        return topic

    return create


@pytest.fixture
def source_name() -> str:
    """A fresh source id."""
    return f"src-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def credentials(kafka: KafkaConnection, tmp_path: Path) -> Path:
    """The admin's Kafka connection as a 0600 credentials file (for a source process)."""
    return write_kafka_credentials(kafka, tmp_path / "kafka.json")
