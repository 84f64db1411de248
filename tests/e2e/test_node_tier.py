"""The node-local tier end to end: a client and an endpoint on one node pass large
arguments and results through shared memory, not Redis (real broker, service, agent,
workers and Redis of the shared platform; the tier's directory is a fresh one in /dev/shm).

The suite turns the tier off for every other test (tests/conftest.py); these turn it on
for the endpoint they add and the clients they make, as a user's environment has it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from fxstream.connectors import RedisConnector, StoreSpec, find_node_local
from fxstream.connectors.node_local import NODE_STORE_DIR_ENV, NODE_STORE_ENV
from fxstream.sdk import Client, Executor
from fxstream.topics import StorageTier, TaskResult, decode, payload_references
from fxstream.topics.acls import user_group_prefix
from tests.e2e.stack import Stack, added_endpoint

MB = 1024 * 1024

pytestmark = pytest.mark.platform


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform: this module adds an endpoint of its own."""
    return shared_platform


@pytest.fixture
def node_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh tier directory (0700, in /dev/shm), the tier on for what starts now."""
    directory = Path(tempfile.mkdtemp(prefix="fx-node-test-", dir="/dev/shm"))
    monkeypatch.setenv(NODE_STORE_ENV, "on")
    monkeypatch.setenv(NODE_STORE_DIR_ENV, str(directory))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _redis(stack: Stack) -> RedisConnector:
    url = stack.settings.store_url
    assert url is not None
    spec = StoreSpec.parse(url)
    connector = spec.connector_type().from_config(spec.options)
    assert isinstance(connector, RedisConnector)
    return connector


def _objects(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.fxobj"))


def _wait_for_node_key(client: Client, endpoint_id: str, key: str) -> None:
    deadline = time.monotonic() + 30
    while client.get_endpoint_status(endpoint_id).get("node_key") != key:
        assert time.monotonic() < deadline, "the endpoint never advertised this node's key"
        time.sleep(0.2)


def _result_references(client: Client, task_id: str) -> list[tuple[str, StorageTier, str]]:
    """(store, tier, object key) of each object the task's committed result refers to."""
    topic = client.catalogue.results(client.user_id)
    consumer = Consumer(
        {
            **client.kafka.confluent(),
            "group.id": f"{user_group_prefix(client.user_id)}test-node-tier",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = [TopicPartition(topic, p, 0) for p in metadata.topics[topic].partitions]
        consumer.assign(partitions)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=1.0):
                if message.error() is None and message.key() == task_id.encode():
                    result = decode(message.value(), TaskResult)
                    assert result.value is not None
                    references, _ = payload_references(result.value)
                    return [(r.store, r.tier, r.object_key) for r in references]
        raise AssertionError(f"no committed result of {task_id} on {topic}")
    finally:
        consumer.close()


def hold_and_echo(data: bytes, directory: str) -> tuple[int, bytes]:
    """The argument's objects in the tier while the task runs, and the argument back."""
    return len([n for n in os.listdir(directory) if n.endswith(".fxobj")]), data


def test_a_client_on_the_endpoints_node_passes_data_through_shared_memory(
    stack: Stack, node_dir: Path
) -> None:
    node = find_node_local()
    assert node is not None and node.directory == node_dir
    redis = _redis(stack)
    with added_endpoint(stack, "node-tier", workers=1) as endpoint:
        client = stack.client()
        try:
            _wait_for_node_key(client, endpoint.endpoint_id, node.key)
            assert client.local_node(endpoint.endpoint_id) == node
            data = os.urandom(3 * MB)
            before = redis.count_objects()
            with Executor(endpoint.endpoint_id, client) as executor:
                future = executor.submit(hold_and_echo, data, str(node_dir))
                seen, echoed = future.result(timeout=120)
            assert echoed == data
            assert seen == 1, "the argument must be in the node-local store while it runs"
            references = _result_references(client, future.task_id)
            assert [(tier, key.startswith(f"{node_dir}/")) for _, tier, key in references] == [
                (StorageTier.EPHEMERAL, True)
            ], f"the result must come back through {node_dir}: {references}"
            assert redis.count_objects() == before, "nothing of this task may go to Redis"
            deadline = time.monotonic() + 30
            while _objects(node_dir):  # evicted once the result is consumed
                assert time.monotonic() < deadline, f"left in the tier: {_objects(node_dir)}"
                time.sleep(0.1)
        finally:
            client.close()


def test_a_client_of_another_node_key_uses_the_store(
    stack: Stack, node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with added_endpoint(stack, "node-tier-other", workers=1) as endpoint:
        # The client's tier is another directory: another node key, as on another node.
        other = Path(tempfile.mkdtemp(prefix="fx-node-client-", dir="/dev/shm"))
        monkeypatch.setenv(NODE_STORE_DIR_ENV, str(other))
        client = stack.client()
        try:
            node = find_node_local()
            assert node is not None and node.directory == other
            deadline = time.monotonic() + 30
            while not client.get_endpoint_status(endpoint.endpoint_id).get("node_key"):
                assert time.monotonic() < deadline, "the endpoint never advertised a node key"
                time.sleep(0.2)
            assert client.local_node(endpoint.endpoint_id) is None
            data = os.urandom(2 * MB)
            with Executor(endpoint.endpoint_id, client) as executor:
                future = executor.submit(hold_and_echo, data, str(node_dir))
                seen, echoed = future.result(timeout=120)
            assert (seen, echoed == data) == (0, True)
            references = _result_references(client, future.task_id)
            assert [tier for _, tier, _ in references] == [StorageTier.DURABLE]
            assert _objects(other) == [] and _objects(node_dir) == []
        finally:
            client.close()
            shutil.rmtree(other, ignore_errors=True)
