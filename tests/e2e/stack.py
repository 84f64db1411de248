"""The running platform of the end-to-end and security modules: started as `./fx up` starts it.

Broker, Redis, the service API, the stream processors and the local endpoint, each
its own process in a private home on free ports; stopped by PID at the end. Most
modules use the session's shared one (``shared_platform`` in tests/conftest.py) and add
endpoints with :func:`added_endpoint`; a module that stops, kills or reconfigures a
platform process starts its own with :func:`running_stack`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from fxstream.ops.private import ExtraEndpoint, PrivatePlatform, private_platform
from fxstream.sdk import Client, NotFound
from fxstream.topics import KafkaConnection

# A private platform with its services (fxstream.ops.private): the shared one or its own.
Stack = PrivatePlatform


def running_stack(home: Path) -> Iterator[Stack]:
    """Start a platform of the module's own with its services in ``home``, yield it, stop
    it (for a fixture of a module that may not share the session's platform)."""
    with private_platform(home) as stack:
        yield stack


@contextlib.contextmanager
def added_endpoint(stack: Stack, name: str, **options: Any) -> Iterator[ExtraEndpoint]:
    """An endpoint agent added to ``stack`` (:meth:`PrivatePlatform.add_endpoint` with
    ``options``) for the block, then stopped by PID.

    Its name is ``name`` and a suffix of its own (``ExtraEndpoint.name``): the agent's
    directory, PID and log files are named for it, and on the shared platform no other
    module's endpoint may have them. Endpoints of other modules are left running.
    """
    already = len(stack.extra_endpoints)
    try:
        extra = stack.add_endpoint(f"{name}-{uuid.uuid4().hex[:8]}", **options)
    except BaseException:
        _stop_endpoints(stack, stack.extra_endpoints[already:])  # started, never online
        raise
    try:
        yield extra
    finally:
        _stop_endpoints(stack, [extra])


def _stop_endpoints(stack: Stack, endpoints: list[ExtraEndpoint]) -> None:
    for endpoint in endpoints:
        endpoint.process.stop(timeout_s=60)  # by PID; False if the platform stopped it
        if endpoint in stack.extra_endpoints:
            stack.extra_endpoints.remove(endpoint)


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
    return new_user(stack, name)[0]


def new_user(stack: PrivatePlatform, name: str) -> tuple[Client, str]:
    """:func:`other_user_client` and the new user's API token (a test that logs in with it)."""
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
    client = Client(
        settings.service_url,
        kafka=kafka,
        topic_prefix=settings.topic_prefix,
        user_id=body["user_id"],
        token=body["token"],
    )
    return client, str(body["token"])


def committed_records(
    kafka: KafkaConnection, topic: str, key: str | None = None, *, timeout_s: float = 30.0
) -> list[Message]:
    """Every committed record of ``topic`` (with ``key``, if given), from the beginning to
    the end each partition had when it was reached (read_committed).

    Fails if a partition's end is not reached within ``timeout_s``: a partial read would
    let a test that looks for a record's absence pass without having read it.
    """
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
        last_error: KafkaError | None = None
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(partitions) and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            error = message.error()
            if error is None:
                if key is None or message.key() == key.encode():
                    found.append(message)
            elif error.code() == KafkaError._PARTITION_EOF:
                at_end.add(message.partition() or 0)
            else:
                last_error = error  # the client retries; the deadline below ends it
        assert len(at_end) == len(partitions), (
            f"{topic} not read to its end within {timeout_s:g} s "
            f"({len(at_end)} of {len(partitions)} partitions; last error: {last_error})"
        )
        return found
    finally:
        consumer.close()
