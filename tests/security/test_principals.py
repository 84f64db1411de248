"""Principals made and removed through the Admin API, on the secure session broker.

Registering makes a SCRAM credential, the table's ACLs and the principal's topics; deleting
removes all three, so the principal can neither log in nor act; ``fxstream user add`` writes a
0600 credentials file the SDK's principal works from.
"""

from __future__ import annotations

import stat
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from fxstream.ops.users import add_user
from fxstream.service.accounts import AccountManager
from fxstream.topics import Catalogue, KafkaConnection, UserRecord, decode, read_secret_json

from ..conftest import RunningPlatform

TIMEOUT_S = 20.0


def _produce(kafka: KafkaConnection, topic: str) -> KafkaError | None:
    """Produce one record as ``kafka``'s principal; the delivery error, if any."""
    producer = Producer(
        {
            **kafka.confluent(),
            "acks": "all",
            "message.timeout.ms": 10_000,
            "log_level": 0,
            "error_cb": lambda _: None,
        }
    )
    errors: list[KafkaError | None] = []
    producer.produce(topic, key=b"k", value=b"v", on_delivery=lambda e, _: errors.append(e))
    producer.flush(TIMEOUT_S)
    assert errors, f"no delivery report for {topic}"
    return errors[0]


def _ignore(_: KafkaError) -> None:
    """Errors the test reads from results instead."""


def _topics(kafka: KafkaConnection) -> set[str]:
    admin = AdminClient({**kafka.confluent(), "log_level": 0})
    return set(admin.list_topics(timeout=TIMEOUT_S).topics)


def _logs_in(kafka: KafkaConnection) -> bool:
    settings: dict[str, object] = {**kafka.confluent(), "log_level": 0, "error_cb": _ignore}
    admin = AdminClient(settings)  # type: ignore[arg-type]
    try:
        admin.list_topics(timeout=5)
    except KafkaException:
        return False
    return True


def test_an_endpoint_principal_is_made_usable_and_removed_entirely(
    kafka_platform: RunningPlatform, unique_prefix: str
) -> None:
    kafka = kafka_platform.kafka
    catalogue = Catalogue(prefix=unique_prefix)
    manager = AccountManager.connect(kafka, catalogue)
    endpoint_id = f"e{uuid.uuid4().hex[:8]}"
    principal = manager.create_endpoint_principal(endpoint_id)
    assert principal.username == f"ep.{endpoint_id}"
    assert principal.password and principal.password not in repr(principal)
    own = principal.connection(kafka)
    queue, outbox = catalogue.endpoint_queue(endpoint_id), catalogue.from_endpoint(endpoint_id)
    assert {queue, outbox} <= _topics(kafka)
    assert _produce(own, outbox) is None
    refused = _produce(own, queue)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED

    manager.delete_endpoint_principal(endpoint_id)
    deadline = time.monotonic() + TIMEOUT_S
    while {queue, outbox} & _topics(kafka) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not {queue, outbox} & _topics(kafka)
    assert not _logs_in(own), "a deleted principal still authenticates"
    # Deleting again is a no-op (a half-finished deletion is completed by a retry).
    manager.delete_endpoint_principal(endpoint_id)


def test_registering_again_sets_a_new_password_and_keeps_the_rights(
    kafka_platform: RunningPlatform, unique_prefix: str
) -> None:
    kafka = kafka_platform.kafka
    catalogue = Catalogue(prefix=unique_prefix)
    manager = AccountManager.connect(kafka, catalogue)
    user_id = f"u{uuid.uuid4().hex[:8]}"
    first = manager.create_user_principal(user_id)
    second = manager.create_user_principal(user_id)
    try:
        assert first.password != second.password
        assert not _logs_in(first.connection(kafka))
        assert _produce(second.connection(kafka), catalogue.from_user(user_id)) is None
    finally:
        manager.delete_user_principal(user_id)


def test_ids_that_could_widen_a_prefix_are_refused_before_anything_is_made(
    kafka_platform: RunningPlatform, unique_prefix: str
) -> None:
    manager = AccountManager.connect(kafka_platform.kafka, Catalogue(prefix=unique_prefix))
    with pytest.raises(ValueError, match="letters, digits and '-'"):
        manager.create_user_principal("a.b")
    assert not [t for t in _topics(kafka_platform.kafka) if t.startswith(unique_prefix)]


def test_user_add_writes_a_private_credentials_file_the_principal_works_from(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    out = tmp_path / "alice.json"
    added = add_user(kafka_platform.platform, "alice", out)
    assert added.credentials_file == out
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    fields = read_secret_json(out)
    assert fields["user_id"] == added.user_id and fields["name"] == "alice"
    assert fields["token"] and fields["service_url"].startswith("http://")
    catalogue = kafka_platform.connection.catalogue()
    assert fields["topic_prefix"] == catalogue.prefix
    user = KafkaConnection.from_json(fields)
    assert user.username == added.kafka_username == f"u.{added.user_id}"
    assert _produce(user, catalogue.from_user(added.user_id)) is None
    refused = _produce(user, catalogue.users)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # The registry holds the user, with the token's hash only.
    view = AdminClient({**kafka_platform.kafka.confluent(), "log_level": 0})
    assert catalogue.users in view.list_topics(timeout=TIMEOUT_S).topics
    consumer = Consumer(
        {**kafka_platform.kafka.confluent(), "group.id": "acl-user-add-check", "log_level": 0}
    )
    partitions = view.list_topics(catalogue.users, timeout=TIMEOUT_S).topics[catalogue.users]
    consumer.assign(
        [TopicPartition(catalogue.users, p, OFFSET_BEGINNING) for p in partitions.partitions]
    )
    found: UserRecord | None = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while found is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            if message.key() == added.user_id.encode():
                found = decode(message.value() or b"", UserRecord)
    finally:
        consumer.close()
    assert found is not None and found.name == "alice"
    assert fields["token"] not in repr(found)
    AccountManager.connect(kafka_platform.kafka, catalogue).delete_user_principal(added.user_id)
