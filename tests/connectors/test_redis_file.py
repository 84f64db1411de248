"""fxstream's Redis and file connectors against a real Redis server and real directories."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxystore.proxy import get_factory
from proxystore.store.base import Store

from fxstream.connectors import (
    DEFAULT_LEASE_S,
    FileConnector,
    FileObjectKey,
    ObjectOnOtherNode,
    RedisConnector,
    StoreSpec,
    StoreURLError,
    open_store,
)
from fxstream.topics import Catalogue, StorageTier
from tests.conftest import RunningPlatform


@pytest.fixture
def redis_connector(kafka_platform: RunningPlatform) -> Iterator[RedisConnector]:
    spec = StoreSpec.parse(kafka_platform.connection.redis_url)
    # Under fxobj:, the only keys the platform's fxstream Redis user may touch.
    prefix = f"fxobj:test-{os.urandom(4).hex()}:"
    connector = RedisConnector(**{**spec.options, "key_prefix": prefix, "chunk_bytes": 1_000_000})
    yield connector
    for name in connector._client.scan_iter(match=f"{prefix}*"):
        connector._client.delete(name)
    connector.close()


def test_redis_splits_large_objects_into_chunks_and_joins_them(
    redis_connector: RedisConnector,
) -> None:
    data = os.urandom(3_500_000)
    key = redis_connector.put(data)
    assert key.chunks == 4 and key.size_bytes == len(data)
    assert redis_connector.get(key) == data
    assert redis_connector.exists(key)
    assert redis_connector.count_objects() == 1
    redis_connector.evict(key)
    assert not redis_connector.exists(key)
    assert redis_connector.get(key) is None
    assert redis_connector.count_objects() == 0


def test_redis_object_with_a_missing_chunk_is_gone(redis_connector: RedisConnector) -> None:
    key = redis_connector.put(os.urandom(2_500_000))
    redis_connector._client.delete(f"{key.redis_key}:1")
    assert redis_connector.get(key) is None
    assert not redis_connector.exists(key)


def test_redis_keys_carry_the_lease(kafka_platform: RunningPlatform) -> None:
    spec = StoreSpec.parse(f"{kafka_platform.connection.redis_url}?lease_s=2&chunk_bytes=100")
    connector = spec.connector_type().from_config(spec.options)
    assert isinstance(connector, RedisConnector)
    key = connector.put(b"x" * 250)
    ttls = [connector._client.ttl(name) for name in connector._keys_of(key)]
    assert len(ttls) == 3 and all(0 < ttl <= 2 for ttl in ttls)
    assert connector.renew(key, 60)
    assert all(connector._client.ttl(name) > 2 for name in connector._keys_of(key))
    connector.renew(key, 1)
    time.sleep(2.2)
    assert connector.get(key) is None, "an object nobody evicted must expire with its lease"
    connector.close()


def test_redis_batch_and_config_round_trip(redis_connector: RedisConnector) -> None:
    keys = redis_connector.put_batch([b"a", b"", b"c" * 2_000_001])
    assert redis_connector.get_batch(keys) == [b"a", b"", b"c" * 2_000_001]
    again = RedisConnector.from_config(redis_connector.config())
    assert again.get(keys[2]) == b"c" * 2_000_001
    again.close()


def test_a_proxy_resolves_in_another_process(kafka_platform: RunningPlatform) -> None:
    """A proxy carries no password: the other process opens the store with its own URL
    (as a worker does with its endpoint's store_url), then the proxy resolves there."""
    url = kafka_platform.connection.redis_url
    password = StoreSpec.parse(url).options["password"]
    store = open_store(url)
    proxy = store.proxy(b"from the parent " * 1000)
    pickled = pickle.dumps(proxy)
    assert password.encode() not in pickled, "the proxy carries the store's password"
    script = (
        "import os, pickle, sys; from fxstream.connectors import open_store; "
        "open_store(os.environ['STORE_URL']); proxy = pickle.loads(sys.stdin.buffer.read()); "
        "sys.stdout.write(str(len(proxy)) + ' ' + bytes(proxy[:16]).decode())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=pickled,
        capture_output=True,
        timeout=60,
        check=True,
        env={**os.environ, "STORE_URL": url},
    )
    assert done.stdout.decode() == "16000 from the parent "
    # Without the URL, the other process is refused, with an error that says what to do.
    refused = subprocess.run(
        [sys.executable, "-c", script.replace("open_store(os.environ['STORE_URL']); ", "")],
        input=pickled,
        capture_output=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert b"requires a user and password" in refused.stderr
    assert password.encode() not in refused.stderr
    store.evict(get_factory(proxy).key)


def test_file_tiers_write_once_and_sweep(tmp_path: Path) -> None:
    durable = FileConnector(tmp_path / "shared", lease_s=100)
    key = durable.put(b"data")
    assert durable.tier is StorageTier.DURABLE
    assert durable.get(key) == b"data" and durable.exists(key)
    assert not list((tmp_path / "shared").glob(".*partial")), "no partial file is left behind"
    os.utime(durable._path(key), (time.time() - 200, time.time() - 200))
    fresh = durable.put(b"new")
    assert durable.sweep_expired() == 1
    assert not durable.exists(key) and durable.exists(fresh)
    assert durable.count_objects() == 1


def test_an_ephemeral_object_from_another_node_says_so(tmp_path: Path) -> None:
    local = FileConnector(tmp_path / "local", tier="ephemeral")
    key = local.put(b"node-local")
    assert key.node == socket.gethostname()
    assert local.get(key) == b"node-local"
    elsewhere = FileObjectKey(key.filename.replace(key.filename[:4], "0000"), "gpu-node-17", 10)
    with pytest.raises(ObjectOnOtherNode, match=r"gpu-node-17.*durable store"):
        local.get(elsewhere)
    with pytest.raises(ValueError, match="not a key"):
        local.get(FileObjectKey("../../etc/passwd"))


def test_file_store_through_proxystore(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/objects?tier=ephemeral")
    assert isinstance(store, Store)
    proxy = store.proxy([1, 2, 3])
    assert sum(proxy) == 6


def test_an_adios2_store_url_round_trips_through_proxystore(tmp_path: Path) -> None:
    store = open_store(f"adios2://{tmp_path}/bp5?lease_s=60")
    proxy = store.proxy(b"bp5 bytes" * 1000)
    assert len(proxy) == 9000
    assert store.connector.count_objects() == 1


def test_store_urls_parse_and_refuse_clearly() -> None:
    spec = StoreSpec.parse("redis://127.0.0.1:6379/2?lease_s=60")
    assert spec.options["db"] == 2 and spec.lease_s == 60 and spec.tier is StorageTier.DURABLE
    assert StoreSpec.parse("file:///scratch/objects").lease_s == DEFAULT_LEASE_S
    retention = Catalogue().spec("tasks.ep.{endpoint_id}").retention_ms / 1000
    assert retention <= DEFAULT_LEASE_S, "objects must outlive replays of their tasks"
    for url, message in [
        ("s3://bucket", "unknown scheme"),
        ("redis://localhost", "HOST:PORT"),
        ("redis://h:1/x", "database must be a number"),
        ("file:///d?tier=fast", "durable' or 'ephemeral"),
        ("file:///d?lease_s=-1", "positive"),
        ("file:///d?colour=red", "unknown parameters"),
        ("file://otherhost/d", "file:///ABSOLUTE"),
        ("adios2://otherhost/d", "adios2:///ABSOLUTE"),
    ]:
        with pytest.raises(StoreURLError, match=message):
            StoreSpec.parse(url)
