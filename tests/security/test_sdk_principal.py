"""The SDK of the local user connects as its own ``u.<user id>`` principal, never the admin.

``./fx up`` (here: a private secure platform with its services) writes the local user's
``<home>/credentials.json`` with the Kafka principal made at registration. With only that
file, ``Executor.map`` runs tasks end to end on the real secure broker; and the same
principal is refused by the broker when it reads another user's results topic.
"""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from fxstream.ops.private import PrivatePlatform
from fxstream.ops.services import Credentials
from fxstream.sdk import Client, ClientSettings, Executor
from fxstream.service.accounts import AccountManager
from fxstream.topics import Catalogue
from fxstream.topics.acls import ADMIN_USERNAME, user_group_prefix

pytestmark = pytest.mark.timeout(300)


def square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def _own(stack: PrivatePlatform) -> Credentials:
    assert stack.credentials is not None
    credentials = Credentials.load(stack.credentials)
    assert credentials is not None
    return credentials


def test_the_local_users_credentials_name_its_own_principal(stack: PrivatePlatform) -> None:
    credentials = _own(stack)
    assert stack.connection.secure
    assert credentials.kafka.username == f"u.{credentials.user_id}"
    assert credentials.kafka.username != ADMIN_USERNAME
    assert credentials.kafka.password and credentials.kafka.password != stack.kafka.password
    assert stack.credentials is not None and stack.credentials.stat().st_mode & 0o777 == 0o600


def test_executor_map_works_end_to_end_as_the_users_principal(stack: PrivatePlatform) -> None:
    assert stack.credentials is not None
    settings = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(stack.credentials)})
    assert settings.kafka.username == f"u.{settings.user_id}"
    with Client.from_settings(settings) as client, Executor(stack.endpoint_id, client) as ex:
        assert list(ex.map(square, range(8), timeout=120)) == [x * x for x in range(8)]


def test_the_users_principal_cannot_read_another_users_results(stack: PrivatePlatform) -> None:
    credentials = _own(stack)
    catalogue = Catalogue(prefix=stack.prefix)
    other = f"other-{uuid.uuid4().hex[:12]}"
    manager = AccountManager.connect(stack.kafka, catalogue)
    manager.create_user_principal(other)
    try:
        topic = catalogue.results(other)
        consumer = Consumer(
            {
                **credentials.kafka.confluent(),
                # Its own group prefix: only the topic can be what the broker refuses.
                "group.id": user_group_prefix(credentials.user_id) + "test",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "log_level": 0,
            }
        )
        try:
            # Subscribed (as the ACL matrix test does): the client reports the refusal.
            consumer.subscribe([topic])
            error = None
            for _ in range(100):
                message = consumer.poll(0.2)
                if message is not None and message.error() is not None:
                    error = message.error()
                    break
            assert error is not None, "the broker let u.<U> read another user's results"
            assert error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, error
        finally:
            consumer.close()
        # Its own results topic is readable with the same settings (the refusal is the ACL's).
        own = Consumer(
            {
                **credentials.kafka.confluent(),
                "group.id": user_group_prefix(credentials.user_id) + "test",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )
        try:
            own_topic = catalogue.results(credentials.user_id)
            _low, high = own.get_watermark_offsets(TopicPartition(own_topic, 0), timeout=20)
            assert high >= 0
        finally:
            own.close()
    finally:
        manager.delete_user_principal(other)
