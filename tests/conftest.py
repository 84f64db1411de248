"""Shared fixtures: one private Kafka broker + Redis per test session, on free ports in a temp dir,
and one shared private platform with its services for the modules that only use one.

Both are started with the project's own launcher (fxstream.ops), so the tests
exercise exactly what `./fx up` runs, and stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from fxstream.connectors.node_local import NODE_STORE_ENV
from fxstream.ops import ConnectionInfo, Platform, PlatformConfig
from fxstream.ops.private import PrivatePlatform, private_config, private_platform
from fxstream.ops.process import free_ports
from fxstream.topics import KafkaConnection, write_secret_file

pytest_plugins = ["tests.cpu_report", "tests.log_report"]

# The node-local tier (fxstream.connectors.node_local) is on by default wherever a client and
# an endpoint's workers share a node, as every platform of this suite does: it would take
# the by-reference path of every test written for the store (Redis, files). It is off for
# the session (every platform, agent and client inherits this), and on in the tests of the
# tier itself (tests/e2e/test_node_tier.py, tests/connectors/test_node_local.py) and in the
# commands a few tests run as a user would, without the suite's FXSTREAM_* settings
# (`fxstream up` in tests/ops/test_cli.py, the Globus Compute examples, the beamline demo).
os.environ[NODE_STORE_ENV] = "off"

# What the fast lane (`./fx test --fast`) leaves out: anything that starts a platform or kills.
_SLOW_MARKS = ("platform", "faults", "cluster", "hpc")
_SHARED_PLATFORM_FIXTURE = "shared_platform"
_PLATFORM_FIXTURES = ("kafka_platform", _SHARED_PLATFORM_FIXTURE)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--fast``: the edit loop's lane, with no broker, no platform and no process kills."""
    parser.addoption(
        "--fast",
        action="store_true",
        help="run only tests that need no Kafka/Redis platform and kill nothing",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the fast lane, deselect tests marked slow or needing a session platform; then run
    the modules that use the shared platform one after another."""
    if config.getoption("--fast"):
        keep: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            slow = any(item.get_closest_marker(mark) for mark in _SLOW_MARKS)
            needs_platform = any(name in _fixture_names(item) for name in _PLATFORM_FIXTURES)
            (dropped if slow or needs_platform else keep).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    _group_shared_platform_modules(items)


def _fixture_names(item: pytest.Item) -> tuple[str, ...]:
    """Every fixture ``item`` uses, also through other fixtures."""
    return tuple(getattr(item, "fixturenames", ()))


def _uses_shared_platform(item: pytest.Item) -> bool:
    return _SHARED_PLATFORM_FIXTURE in _fixture_names(item)


def _group_shared_platform_modules(items: list[pytest.Item]) -> None:
    """Move every module with a test on the shared platform (whole, in its order) to where
    the first such module runs, so the platform is up only while they run (it stops after
    the last of them: :func:`pytest_runtest_teardown`). The other tests keep their order."""
    modules = {item.path for item in items if _uses_shared_platform(item)}
    if not modules:
        return
    first = next(i for i, item in enumerate(items) if item.path in modules)
    grouped = [item for item in items if item.path in modules]
    rest = [item for item in items if item.path not in modules]
    items[:] = rest[:first] + grouped + rest[first:]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note the last test that uses the shared platform (the order is final now)."""
    users = [item.nodeid for item in session.items if _uses_shared_platform(item)]
    _SHARED.last_user = users[-1] if users else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test on the shared platform (and its module's fixtures), stop it."""
    yield
    if item.nodeid == _SHARED.last_user:
        _SHARED.stop()


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


class SharedPlatform:
    """The lifetime of the session's shared platform: started at first use, stopped by PID
    after the last test that uses it (or at the session's end, whichever comes first)."""

    def __init__(self) -> None:
        self.last_user: str | None = None
        self._running: PrivatePlatform | None = None
        self._failed: str | None = None
        self._context = contextlib.ExitStack()

    def get(self, factory: pytest.TempPathFactory) -> PrivatePlatform:
        """The running platform, started now in a new temp home if it is not running.

        A start that failed is not tried again by every later module: they fail at once
        with its error.
        """
        if self._failed is not None:
            raise RuntimeError(f"the shared platform failed to start earlier: {self._failed}")
        if self._running is None:
            # A directory the platform makes (not pytest's 0700 one): whether it makes its
            # home private is then the platform's doing (tests/security/test_transport.py).
            home = factory.mktemp("shared-platform") / "home"
            try:
                self._running = self._context.enter_context(private_platform(home))
            except Exception as exc:
                self._failed = f"{type(exc).__name__}: {exc} (its home: {home})"
                raise
        return self._running

    def stop(self) -> None:
        """Stop every process of the platform (its added endpoints too), by PID."""
        self._running = None
        self._context.close()


_SHARED = SharedPlatform()


@pytest.fixture(scope="session")
def _shared_platform_lifetime() -> Iterator[SharedPlatform]:
    """Stops the shared platform at the session's end if it still runs."""
    try:
        yield _SHARED
    finally:
        _SHARED.stop()


@pytest.fixture(scope="module")
def shared_platform(
    _shared_platform_lifetime: SharedPlatform, tmp_path_factory: pytest.TempPathFactory
) -> PrivatePlatform:
    """The session's one private platform with its services (broker, Redis, service API,
    stream processors, local endpoint), as `./fx up` starts it: for modules that only use
    a platform. Such a module registers users, functions and endpoints under names of its
    own, reads only its own records, stops what it starts (``added_endpoint`` in
    tests/e2e/stack.py) and stops, kills or reconfigures no platform process; a module
    that does starts its own platform (``running_stack``)."""
    return _SHARED.get(tmp_path_factory)
