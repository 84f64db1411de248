"""The running platform an end-to-end module shares: started as `./fx up` starts it.

Broker, Redis, the service API, the stream processors and the local endpoint, each
its own process in a private home on free ports; stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

from fxstream.ops.private import PrivatePlatform, private_platform
from fxstream.sdk import Client, NotFound
from fxstream.topics import KafkaConnection

# The e2e modules' platform is the shared private platform (fxstream.ops.private).
Stack = PrivatePlatform


def running_stack(home: Path) -> Iterator[Stack]:
    """Start a platform with its services in ``home``, yield it, stop it (for a fixture)."""
    with private_platform(home) as stack:
        yield stack


def wait_for_state(client: Client, task_id: str, state: str, *, timeout_s: float = 30.0) -> None:
    """Wait until the service shows ``task_id`` in ``state``.

    ``NotFound`` is expected at first: a future can resolve (the SDK reads the results
    topic itself) before the task-state processor has folded the task at all.
    """
    deadline = time.monotonic() + timeout_s
    seen = "not yet known to the service"
    while True:
        with contextlib.suppress(NotFound):
            seen = client.get_task(task_id)["state"]
            if seen == state:
                return
        assert time.monotonic() < deadline, f"task {task_id} never showed {state}; last: {seen}"
        time.sleep(0.2)


def other_user_client(stack: PrivatePlatform, name: str) -> Client:
    """A client of a new user registered by the admin, as that user's own Kafka principal.

    ``POST /v1/users`` answers the new user's ``u.<user id>`` credential once; the
    client uses it (the local user's principal could not write the new user's topic).
    """
    settings = stack.settings
    response = httpx.post(
        f"{settings.service_url}/v1/users",
        json={"name": name},
        headers={"Authorization": f"Bearer {stack.admin_token}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    body = response.json()
    kafka = settings.kafka
    if body.get("kafka_password"):
        kafka = kafka.as_user(body["kafka_username"], body["kafka_password"])
    return Client(
        settings.service_url,
        kafka=kafka,
        topic_prefix=settings.topic_prefix,
        user_id=body["user_id"],
        token=body["token"],
    )


def committed_records(
    kafka: KafkaConnection, topic: str, key: str | None = None, *, timeout_s: float = 30.0
) -> list[Message]:
    """Every committed record of ``topic`` (with ``key``, if given), from the beginning to
    the end each partition had when it was reached (read_committed)."""
    consumer = Consumer(
        {
            **kafka.confluent(),
            "group.id": f"e2e-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "log_level": 2,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: list[Message] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(partitions) and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                at_end.add(message.partition() or 0)  # _PARTITION_EOF
            elif key is None or message.key() == key.encode():
                found.append(message)
        return found
    finally:
        consumer.close()
