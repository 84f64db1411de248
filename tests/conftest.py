"""Shared fixtures: one private Kafka broker + Redis per test session, on free ports in a temp dir.

The platform is started with the project's own launcher (fxstream.ops), so the
tests exercise exactly what `./fx up` runs, and stopped by PID at the end.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from fxstream.ops import ConnectionInfo, Platform, PlatformConfig
from fxstream.ops.private import private_config
from fxstream.ops.process import free_ports
from fxstream.topics import KafkaConnection, write_secret_file

pytest_plugins = ["tests.cpu_report"]

# What the fast lane (`./fx test --fast`) leaves out: anything that starts a platform or kills.
_SLOW_MARKS = ("platform", "faults", "cluster")
_PLATFORM_FIXTURE = "kafka_platform"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--fast``: the edit loop's lane, with no broker, no platform and no process kills."""
    parser.addoption(
        "--fast",
        action="store_true",
        help="run only tests that need no Kafka/Redis platform and kill nothing",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the fast lane, deselect tests marked slow or needing the session platform."""
    if not config.getoption("--fast"):
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        slow = any(item.get_closest_marker(mark) for mark in _SLOW_MARKS)
        needs_platform = _PLATFORM_FIXTURE in getattr(item, "fixturenames", ())
        (dropped if slow or needs_platform else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def free_port_block(size: int) -> int:
    """The first port of ``size`` consecutive free ports (for the cluster's port layout)."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + size > 65535:
            continue
        block = []
        try:
            for port in range(base, base + size):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                block.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in block:
                sock.close()
    raise RuntimeError(f"no block of {size} free ports found")


def write_kafka_credentials(kafka: KafkaConnection, path: Path) -> Path:
    """``kafka`` as a 0600 credentials file: what a service process or agent is started with."""
    write_secret_file(path, json.dumps(kafka.to_json()).encode())
    return path


@dataclass(frozen=True)
class RunningPlatform:
    """The session's platform: its config, launcher, connection and admin principal."""

    config: PlatformConfig
    platform: Platform
    connection: ConnectionInfo
    kafka: KafkaConnection

    def admin(self) -> AdminClient:
        """A fresh admin client on the session broker (as the admin principal)."""
        return AdminClient({**self.kafka.confluent(), "log_level": 2})


@pytest.fixture(scope="session")
def kafka_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPlatform]:
    """One private secure broker + Redis for the whole session (started once, ~10 s)."""
    config = private_config(tmp_path_factory.mktemp("platform"))
    platform = Platform(config)
    try:
        connection = platform.up()
        yield RunningPlatform(config, platform, connection, platform.kafka(cluster=False))
    finally:
        platform.down()


@pytest.fixture
def bootstrap(kafka_platform: RunningPlatform) -> str:
    """The session broker's bootstrap servers."""
    return kafka_platform.connection.bootstrap_servers


@pytest.fixture
def kafka(kafka_platform: RunningPlatform) -> KafkaConnection:
    """The session broker as its admin principal (SASL/SCRAM-SHA-512 over TLS)."""
    return kafka_platform.kafka


@pytest.fixture
def unique_prefix() -> str:
    """A topic prefix no other test (or earlier run) uses."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def topic_cleanup(kafka_platform: RunningPlatform) -> Iterator[list[str]]:
    """Append topic names to the yielded list; they are deleted after the test."""
    created: list[str] = []
    yield created
    if created:
        admin = kafka_platform.admin()
        for future in admin.delete_topics(created, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone: nothing to clean
                continue
