"""Pass-by-reference end to end: the platform's Redis as proxy store, real agent and workers.

Each test checks values and the store: every object the platform created for a
task is evicted once its result is consumed (no leaked keys), and what a retry
needs is still there when it runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from proxystore.proxy import get_factory

from fxstream.connectors import RedisConnector, StoreSpec, open_store
from fxstream.sdk import Client, Executor, FxstreamError, PayloadTooLarge
from fxstream.topics import DataLocation, decode
from tests.e2e.stack import Stack, wait_for_state

MB = 1024 * 1024


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def _objects(stack: Stack) -> RedisConnector:
    url = stack.settings.store_url
    assert url is not None, "./fx up must write the platform's Redis into the credentials"
    connector = StoreSpec.parse(url).connector_type().from_config(StoreSpec.parse(url).options)
    assert isinstance(connector, RedisConnector)
    return connector


def _wait_for_count(connector: RedisConnector, expected: int, timeout: float = 30.0) -> int:
    # Eviction runs just after a future resolves (on the listener's threads).
    deadline = time.monotonic() + timeout
    count = connector.count_objects()
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        count = connector.count_objects()
    return count


def echo(value: Any) -> Any:
    return value


def digest(data: bytes) -> tuple[str, int, str]:
    return type(data).__name__, len(data), hashlib.sha256(data).hexdigest()


def array_facts(array: Any) -> tuple[str, float, tuple[int, ...]]:
    return type(array).__name__, float(np.sum(array)), tuple(array.shape)


def test_a_consumed_result_is_evicted_and_asking_again_says_so(stack: Stack) -> None:
    data = os.urandom(300_000)
    client = stack.client()
    try:
        with Executor(stack.endpoint_id, client) as executor:
            future = executor.submit(echo, data)
            assert future.result(timeout=60) == data
        wait_for_state(client, future.task_id, "succeeded")
        with pytest.raises(FxstreamError, match="evicted from the store once its client consumed"):
            client.get_result(future.task_id)
    finally:
        client.close()


@pytest.mark.parametrize("size", [10_000, 100_000, MB, 10 * MB])
def test_round_trip_at_each_size_class(stack: Stack, size: int) -> None:
    connector = _objects(stack)
    before = connector.count_objects()
    data = os.urandom(size)
    with stack.executor() as executor:
        assert executor.submit(echo, data).result(timeout=120) == data
    assert _wait_for_count(connector, before) == before


def test_a_200_mb_argument_reaches_the_function_as_bytes(stack: Stack) -> None:
    connector = _objects(stack)
    before = connector.count_objects()
    data = np.random.default_rng(7).integers(0, 255, 200 * MB, dtype=np.uint8).tobytes()
    with stack.executor() as executor:
        kind, length, sha = executor.submit(digest, data).result(timeout=300)
    assert (kind, length, sha) == ("bytes", len(data), hashlib.sha256(data).hexdigest())
    assert _wait_for_count(connector, before) == before


def test_large_arrays_arrive_as_lazy_proxies(stack: Stack) -> None:
    array = np.arange(1_000_000, dtype=np.float64)  # 8 MB
    with stack.executor() as executor:
        kind, total, shape = executor.submit(array_facts, array).result(timeout=120)
    assert kind == "Proxy", "an array above the threshold must travel as a ProxyStore proxy"
    assert total == float(array.sum()) and shape == array.shape


def test_explicit_proxies_pass_through_and_stay_the_owners(stack: Stack) -> None:
    url = stack.settings.store_url
    assert url is not None
    store = open_store(url)
    array = np.ones(300_000)
    proxy = store.proxy(array)
    key = get_factory(proxy).key
    with stack.executor() as executor:
        kind, total, _ = executor.submit(array_facts, proxy).result(timeout=120)
    assert (kind, total) == ("Proxy", 300_000.0)
    assert store.exists(key), "fxstream must not evict a proxy the user created"
    store.evict(key)


def test_no_store_and_oversized_arguments_name_the_setting(stack: Stack) -> None:
    settings = dataclasses.replace(stack.settings, store_url=None)
    with (
        Client.from_settings(settings) as client,
        Executor(stack.endpoint_id, client) as ex,
        pytest.raises(PayloadTooLarge) as caught,
    ):
        ex.submit(echo, b"x" * (settings.max_inline_bytes + 1))
    message = str(caught.value)
    assert "store_url" in message and "FXSTREAM_STORE_URL" in message
    assert f"{settings.max_inline_bytes:,}" in message


def test_many_medium_arguments_name_the_threshold(stack: Stack) -> None:
    settings = dataclasses.replace(stack.settings, max_inline_bytes=200_000)
    medium = [bytes([i]) * 60_000 for i in range(5)]  # each under the threshold, 300 kB in all
    with (
        Client.from_settings(settings) as client,
        Executor(stack.endpoint_id, client) as ex,
        pytest.raises(PayloadTooLarge) as caught,
    ):
        ex.submit(echo, *medium)
    assert "proxy_threshold" in str(caught.value)


def crash_once(data: bytes, marker: str) -> int:
    path = Path(marker)
    if not path.exists():
        path.write_text("crashed")
        os._exit(3)
    return len(data)


def test_a_retry_after_a_worker_crash_still_finds_its_input(stack: Stack, tmp_path: Path) -> None:
    connector = _objects(stack)
    before = connector.count_objects()
    data = os.urandom(2 * MB)
    marker = tmp_path / f"crashed-{uuid.uuid4().hex}"
    client = stack.client()
    try:
        with Executor(stack.endpoint_id, client, max_retries=2) as executor:
            future = executor.submit(crash_once, data, str(marker))
            assert future.result(timeout=120) == len(data)
            assert future.attempt == 2, "the first attempt must have crashed"
    finally:
        client.close()
    assert marker.exists()
    assert _wait_for_count(connector, before) == before


def test_data_locations_record_creation_and_eviction(stack: Stack) -> None:
    connector = _objects(stack)
    before = connector.count_objects()
    topic = f"{stack.prefix}data-locations"
    consumer = Consumer(
        {
            **stack.kafka.confluent(),
            "group.id": f"test-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = []
        for partition in partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            ends.append(TopicPartition(topic, partition, high))
        with stack.executor() as executor:
            assert executor.submit(echo, b"z" * 300_000).result(timeout=60) == b"z" * 300_000
        assert _wait_for_count(connector, before) == before
        consumer.assign(ends)
        created: dict[str, DataLocation] = {}
        removed: set[str] = set()
        deadline = time.monotonic() + 30
        settled_at = deadline
        while time.monotonic() < deadline:
            if created:  # then a few seconds more: a tombstone would follow the eviction
                deadline = min(deadline, settled_at + 3.0)
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            key = message.key().decode()
            if message.value() is None:
                removed.add(key)
            else:
                created[key] = decode(message.value(), DataLocation)
                settled_at = time.monotonic()
    finally:
        consumer.close()
    # Only the agent publishes (through from.ep.<E>, forwarded by ingress after checking):
    # the SDK's principal may not write data-locations, and a user's claim about an object
    # key could not be checked, so the SDK publishes neither its arguments nor evictions.
    sites = sorted(location.site for location in created.values())
    assert sites == [stack.endpoint_id], "the agent publishes its result's location"
    assert all(location.size_bytes > 300_000 for location in created.values())
    assert not removed, "the SDK writes no tombstones to data-locations"


def small_or_large(index: int, data: bytes) -> bytes:
    # Every 10th result is above the endpoint's 64 KiB threshold: it goes by reference too.
    return data * 40 if index % 10 == 0 else data[:16]


def test_no_key_leaks_after_ten_thousand_tasks(stack: Stack) -> None:
    connector = _objects(stack)
    before = connector.count_objects()
    settings = dataclasses.replace(stack.settings, proxy_threshold=1_024)
    tasks = 10_000
    payloads = [i.to_bytes(4, "big") * 512 for i in range(tasks)]  # 2 KiB: by reference
    with Client.from_settings(settings) as client, Executor(stack.endpoint_id, client) as ex:
        results = list(ex.map(small_or_large, range(tasks), payloads, timeout=600))
    assert results == [small_or_large(i, payloads[i]) for i in range(tasks)]
    leaked = _wait_for_count(connector, before, timeout=60)
    assert leaked - before == 0, f"{leaked - before} objects leaked after {tasks} tasks"
