"""A platform of its own: up twice is harmless, down stops every PID, data survives down/up.

These tests start and stop their own platform (not the session one), because
stopping the shared broker would disturb every other test.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from confluent_kafka import Consumer, Producer

from fxstream.ops import Platform, ProcessStartError
from fxstream.ops.private import private_config

pytestmark = pytest.mark.platform


@pytest.fixture(scope="module")
def own_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    platform = Platform(private_config(tmp_path_factory.mktemp("own-platform")))
    try:
        yield platform
    finally:
        platform.down()


def _pids(platform: Platform) -> list[int]:
    procs = [platform.redis().process] + [n.process for n in platform.nodes(cluster=False)]
    return [pid for pid in (p.pid() for p in procs) if pid is not None]


def test_up_twice_is_harmless_and_status_is_healthy(own_platform: Platform) -> None:
    first = own_platform.up()
    pids = _pids(own_platform)
    assert len(pids) == 2
    second = own_platform.up()
    assert second == first
    assert _pids(own_platform) == pids
    status = own_platform.status()
    assert status.healthy, status.to_json()
    assert status.topics is not None
    assert sorted(status.topics.unchanged) == sorted(first.catalogue().static_topics())


def test_data_survives_down_and_up(own_platform: Platform) -> None:
    connection = own_platform.up()
    topic = connection.catalogue().dead_letter
    marker = uuid.uuid4().bytes
    kafka = own_platform.kafka(cluster=False)
    producer = Producer({**kafka.confluent(), "acks": "all"})
    producer.produce(topic, key=b"durability", value=marker)
    assert producer.flush(30) == 0
    store = redis.Redis.from_url(connection.redis_url)
    store.set("fxobj:durability", marker)
    store.close()

    pids = _pids(own_platform)
    stopped = own_platform.down()
    assert len(stopped) == 2
    assert not any(psutil.pid_exists(pid) for pid in pids), "down left a process behind"
    assert own_platform.status().mode is None

    connection = own_platform.up()
    consumer = Consumer(
        {
            **own_platform.kafka(cluster=False).confluent(),
            "group.id": f"durability-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    values: list[bytes | None] = []
    try:
        for _ in range(60):
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                values.append(message.value())
            if marker in values:
                break
    finally:
        consumer.close()
    assert marker in values
    store = redis.Redis.from_url(connection.redis_url)
    assert store.get("fxobj:durability") == marker
    store.close()


def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    config = private_config(tmp_path / "busy")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", config.redis_port))
        squatter.listen()
        platform = Platform(config)
        try:
            with pytest.raises(ProcessStartError, match="FXSTREAM_REDIS_PORT"):
                platform.up()
        finally:
            platform.down()
    assert _pids(platform) == []


def test_down_when_nothing_runs_stops_nothing(tmp_path: Path) -> None:
    assert Platform(private_config(tmp_path / "idle")).down() == []
