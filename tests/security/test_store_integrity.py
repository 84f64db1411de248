"""The proxy store cannot run code in a worker, and the platform's Redis is locked down.

Against the real platform (real Redis, real directories, real agents and workers):

* A by-reference argument substituted in the store (``SET fxobj:<key>`` with a crafted
  pickle whose ``__reduce__`` writes a marker file; or the object's file overwritten in a
  file store) is detected before anything is deserialized: the marker file never appears,
  and the task fails with ``StoreIntegrityError`` naming the key and the store. Both ways
  an argument resolves are covered: a lazy proxy (resolved inside the function) and a
  bytes value (fetched while the arguments load).
* Redis refuses clients that do not authenticate; ``CONFIG``, ``FLUSHALL``, ``FLUSHDB``,
  ``MODULE`` and ``DEBUG`` are gone for every user; the ``fxstream`` user may touch only
  ``fxobj:*`` keys; the data directory is 0700 and the AOF files 0600; no password is on
  the server's command line or in any repr or error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis
from cryptography import x509

from fxstream.connectors import (
    ByReference,
    FileConnector,
    FileStreamReader,
    FileStreamWriter,
    RedisConnector,
    StoreIntegrityError,
    StoreSpec,
    open_store,
)
from fxstream.ops.pki import LocalCA
from fxstream.ops.private import private_config
from fxstream.ops.redis_server import ADMIN_USER, STORE_USER, RedisServer
from fxstream.sdk import Client, Executor, TaskExecutionFailed
from fxstream.sdk.results import unreadable_result
from fxstream.topics import Serializer
from tests.conftest import RunningPlatform
from tests.e2e.stack import Stack, added_endpoint, wait_for_state


class _WritesMarker:
    """Loading this object writes ``path``: what an attacker's pickle would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return Path.write_text, (self.path, "code from the store ran here")


def _crafted(marker: Path) -> bytes:
    """An fxstream payload (as the store holds them) that writes ``marker`` when loaded."""
    return Serializer().serialize_value(_WritesMarker(marker))


def test_the_crafted_object_would_run_code_if_it_were_loaded(tmp_path: Path) -> None:
    """The control: without the digest check, loading the substitute runs its code."""
    control = tmp_path / "control"
    Serializer().deserialize(_crafted(control))
    assert control.exists()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _server(platform: RunningPlatform) -> RedisServer:
    return platform.platform.redis()


# --- the connectors, directly --------------------------------------------------------------


def test_a_substituted_redis_object_is_refused_before_it_loads(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    url = kafka_platform.connection.redis_url
    store = open_store(url)
    by_reference = ByReference(store, threshold_bytes=1000)
    packed = by_reference.pack_arguments((os.urandom(5000),))
    [reference] = packed.references
    [stored] = packed.stored
    assert reference.sha256 == stored.key.sha256 and len(reference.sha256) == 64
    connector = store.connector
    assert isinstance(connector, RedisConnector)
    marker = tmp_path / "marker"
    connector._client.set(reference.object_key, _crafted(marker))
    with pytest.raises(StoreIntegrityError) as caught:
        Serializer().unpack_arguments(packed.payload)
    assert not marker.exists(), "the substituted object was deserialized"
    assert caught.value.key == reference.object_key
    assert f"127.0.0.1:{kafka_platform.config.redis_port}" in caught.value.store
    assert "nothing was deserialized" in str(caught.value)
    store.evict(stored.key)


def test_a_substituted_result_is_refused_as_itself(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    """A result by reference (what a worker writes): loading it raises the integrity error
    itself, not a DeserializationError, and the SDK hands that error to the caller."""
    store = open_store(kafka_platform.connection.redis_url)
    packed = ByReference(store, threshold_bytes=1000).pack_value(os.urandom(5000))
    [reference] = packed.references
    marker = tmp_path / "marker"
    store.connector._client.set(reference.object_key, _crafted(marker))
    with pytest.raises(StoreIntegrityError) as caught:
        Serializer().deserialize(packed.payload)
    assert not marker.exists()
    assert unreadable_result("task-1", caught.value, packed.payload) is caught.value
    store.evict(packed.stored[0].key)


def test_a_substituted_chunk_is_refused(kafka_platform: RunningPlatform) -> None:
    options = StoreSpec.parse(kafka_platform.connection.redis_url).options
    connector = RedisConnector(**{**options, "chunk_bytes": 1000})
    key = connector.put(os.urandom(3500))
    assert key.chunks == 4
    assert connector.get(key) is not None
    connector._client.set(f"{key.redis_key}:2", b"\0" * 1000)
    with pytest.raises(StoreIntegrityError, match=key.redis_key):
        connector.get(key)
    # A key without a digest (one not made by put) is refused too: nothing loads unverified.
    with pytest.raises(StoreIntegrityError, match="carries no sha256 digest"):
        connector.get(key._replace(sha256=""))
    connector.evict(key)
    connector.close()


def test_a_replaced_file_object_is_refused(tmp_path: Path) -> None:
    connector = FileConnector(tmp_path / "store")
    key = connector.put(os.urandom(2000))
    assert _mode(connector._path(key)) == 0o600
    marker = tmp_path / "marker"
    connector._path(key).write_bytes(_crafted(marker))
    with pytest.raises(StoreIntegrityError, match=key.filename):
        connector.get(key)
    assert not marker.exists()


def test_a_tampered_file_stream_fails_its_digest_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "frames.fxstream"
    chunks = [os.urandom(1000) for _ in range(3)]
    with FileStreamWriter(path) as writer:
        for chunk in chunks:
            writer.write(chunk)
    digest = writer.describe().sha256
    assert digest == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert writer.describe().reference("files").sha256 == digest
    with FileStreamReader(path, expected_sha256=digest) as reader:
        assert list(reader) == chunks
    data = path.read_bytes()
    start = data.index(chunks[1])
    path.write_bytes(data[:start] + bytes(1000) + data[start + 1000 :])
    with (
        FileStreamReader(path, expected_sha256=digest) as reader,
        pytest.raises(StoreIntegrityError, match="a file stream"),
    ):
        list(reader)


def test_a_tampered_adios2_stream_fails_its_digest_at_the_end(tmp_path: Path) -> None:
    from fxstream.connectors import Adios2Stream

    stream = Adios2Stream(str(tmp_path / "frames"), engine="bp5")
    arrays = [np.arange(100, dtype=np.float64) + 1000 * n for n in range(3)]
    with stream.writer() as writer:
        for array in arrays:
            writer.send(array, n=int(array[0]))
    digest = writer.describe().sha256
    assert len(digest) == 64
    with stream.reader(expected_sha256=digest) as reader:
        assert [int(step.attributes["n"]) for step in reader] == [0, 1000, 2000]
    [data_file] = Path(stream.path).glob("data.*")
    data = data_file.read_bytes()
    start = data.index(arrays[1].tobytes())
    data_file.write_bytes(data[:start] + bytes(800) + data[start + 800 :])
    with (
        stream.reader(expected_sha256=digest) as reader,
        pytest.raises(StoreIntegrityError, match="ADIOS2 BP5 stream"),
    ):
        list(reader)
    stream.remove()


# --- end to end: the task fails with the integrity error -----------------------------------


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def gated_length(gate: str, values: Any) -> int:
    """Wait for ``gate`` to exist, then use ``values`` (a lazy proxy resolves only now)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.05)
    return len(values)


def length(data: bytes) -> int:
    """A bytes argument by reference is fetched while the arguments load, before this runs."""
    return len(data)


def _redis_objects(url: str) -> Callable[[], set[str]]:
    client = redis.Redis.from_url(url)

    def objects() -> set[str]:
        return {name.decode() for name in client.scan_iter(match="fxobj:*", count=1000)}

    return objects


def _file_objects(directory: Path) -> Callable[[], set[str]]:
    def objects() -> set[str]:
        return {str(path) for path in directory.glob("*.fxobj")}

    return objects


@pytest.mark.parametrize("kind", ["redis", "file"])
def test_a_substituted_argument_fails_the_task_with_an_integrity_error(
    stack: Stack, tmp_path: Path, kind: str
) -> None:
    if kind == "redis":
        store_url = stack.settings.store_url
        assert store_url is not None, "./fx up writes the platform's Redis into the credentials"
        objects = _redis_objects(store_url)
        substitute_client = redis.Redis.from_url(store_url)

        def substitute(name: str, data: bytes) -> None:
            # With the fxstream user every SDK holds: the store itself is not trusted.
            assert substitute_client.set(name, data, keepttl=True)

    else:
        directory = tmp_path / "file-store"
        directory.mkdir()
        store_url = f"file://{directory}"
        objects = _file_objects(directory)

        def substitute(name: str, data: bytes) -> None:
            Path(name).write_bytes(data)

    # One worker and no prefetch: the second task's arguments load only once the first
    # (held at its gate) is done, so both substitutions happen before anything reads them.
    options = {"workers": 1, "prefetch": 0, "store_url": store_url}
    with added_endpoint(stack, f"integrity-{kind}", **options) as endpoint:
        client = Client.from_settings(dataclasses.replace(stack.settings, store_url=store_url))
        gate, marker = tmp_path / "gate", tmp_path / "marker"
        try:
            with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
                before = objects()
                lazy = executor.submit(gated_length, str(gate), list(range(60_000)))
                [lazy_key] = objects() - before
                before = objects()
                eager = executor.submit(length, os.urandom(200_000))
                [eager_key] = objects() - before
                substitute(lazy_key, _crafted(marker))
                substitute(eager_key, _crafted(marker))
                gate.touch()
                for future, key in ((lazy, lazy_key), (eager, eager_key)):
                    with pytest.raises(TaskExecutionFailed) as caught:
                        future.result(timeout=120)
                    failure = caught.value
                    assert failure.remote_type == "StoreIntegrityError", failure
                    assert isinstance(failure, StoreIntegrityError), type(failure).__mro__
                    assert key in failure.remote_message
                    assert "nothing was deserialized" in failure.remote_message
                    wait_for_state(client, future.task_id, "failed")
            assert not marker.exists(), "a substituted object was deserialized in the worker"
        finally:
            client.close()


# --- Redis: authentication, renamed commands, modes ----------------------------------------


def test_redis_refuses_clients_that_do_not_authenticate(kafka_platform: RunningPlatform) -> None:
    port = kafka_platform.config.redis_port
    anonymous = redis.Redis(port=port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get("fxobj:anything")
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.set("fxobj:anything", b"x")
    anonymous.close()
    default = redis.Redis(port=port, username="default", password="", socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        default.ping()
    default.close()
    wrong = "not-the-password-" + os.urandom(8).hex()
    # ("localhost": this process's table of store passwords is keyed by host and port, and
    # the platform's connectors here use 127.0.0.1.)
    guesser = RedisConnector("localhost", port, username=STORE_USER, password=wrong)
    with pytest.raises(PermissionError, match="requires a user and password") as caught:
        guesser.put(b"x")
    assert wrong not in str(caught.value) and wrong not in repr(guesser)
    guesser.close()


@pytest.mark.parametrize("user", [STORE_USER, ADMIN_USER])
@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "GET", "dir"),
        ("CONFIG", "SET", "dir", "/tmp"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("MODULE", "LIST"),
        ("DEBUG", "SLEEP", "0"),
    ],
)
def test_admin_commands_are_renamed_away_for_every_user(
    kafka_platform: RunningPlatform, user: str, command: tuple[str, ...]
) -> None:
    server = _server(kafka_platform)
    client = redis.Redis(
        port=kafka_platform.config.redis_port,
        username=user,
        password=server.passwords()[user],
        socket_timeout=5,
    )
    assert client.ping()
    with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
        client.execute_command(*command)  # type: ignore[no-untyped-call]
    client.close()


def test_the_store_user_may_only_touch_object_keys_with_the_connector_commands(
    kafka_platform: RunningPlatform,
) -> None:
    server = _server(kafka_platform)
    client = redis.Redis(
        port=kafka_platform.config.redis_port,
        username=STORE_USER,
        password=server.passwords()[STORE_USER],
        socket_timeout=5,
    )
    assert client.set("fxobj:acl-check", b"x", ex=60)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("other:key", b"x")
    for command in (
        ("KEYS", "*"),
        ("ACL", "LIST"),
        ("SHUTDOWN",),
        ("MONITOR",),
        ("EVAL", "1", "0"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)  # type: ignore[no-untyped-call]
    client.delete("fxobj:acl-check")
    client.close()
    admin = redis.Redis(
        port=kafka_platform.config.redis_port,
        username=ADMIN_USER,
        password=server.passwords()[ADMIN_USER],
        socket_timeout=5,
    )
    whoami = admin.execute_command("ACL", "WHOAMI")  # type: ignore[no-untyped-call]
    assert whoami in (ADMIN_USER, ADMIN_USER.encode())
    admin.close()


def test_redis_data_and_secrets_are_owner_only(kafka_platform: RunningPlatform) -> None:
    server = _server(kafka_platform)
    assert _mode(server.directory) == 0o700
    assert _mode(server.data_dir) == 0o700
    files = [path for path in server.data_dir.rglob("*") if path.is_file()]
    assert any(path.suffix == ".aof" for path in files), f"no AOF in {files}"
    for path in server.data_dir.rglob("*"):
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), path
    for path in (server.conf_file, server.acl_file, server.passwords_file):
        assert _mode(path) == 0o600, path
    passwords = server.passwords()
    acl_text = server.acl_file.read_text()
    assert "user default off" in acl_text
    pid = server.process.pid()
    assert pid is not None
    command_line = " ".join(psutil.Process(pid).cmdline())
    for password in passwords.values():
        assert password not in acl_text, "the ACL file holds hashes, not passwords"
        assert password not in command_line


def test_the_store_url_is_redacted_everywhere_it_is_shown(kafka_platform: RunningPlatform) -> None:
    url = kafka_platform.connection.redis_url
    spec = StoreSpec.parse(url)
    password = spec.options["password"]
    assert password and password not in spec.url and password not in repr(spec)
    assert password not in repr(kafka_platform.connection)
    store = open_store(url)
    assert password not in repr(store.connector)
    assert password not in str(store.config()), "a proxy's store config would carry it"
    assert "password" not in store.connector.config()


# --- Redis over TLS, when the operator asks --------------------------------------------------


def test_redis_serves_tls_only_when_asked(tmp_path: Path) -> None:
    config = private_config(tmp_path / "home")
    server = RedisServer(config, "redis-server", tls=True)
    server.start()
    try:
        server.wait_ready()
        # The platform CA issued the server's certificate; its key is private.
        ca = LocalCA(server.pki_dir)
        cert_file, key_file = ca.server_files("redis")
        served = x509.load_pem_x509_certificate(cert_file.read_bytes())
        served.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_file.read_bytes()))
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert server.ca_file == ca.cert_file
        url = server.client_url
        assert url.startswith("rediss://fxstream:") and "ca_file=" in url
        connector = open_store(url).connector
        assert isinstance(connector, RedisConnector) and connector.tls
        data = os.urandom(10_000)
        key = connector.put(data)
        assert connector.get(key) == data
        connector.evict(key)
        # No plaintext listener: a client without TLS gets no Redis answer.
        plain = redis.Redis(
            port=config.redis_port,
            username=STORE_USER,
            password=server.passwords()[STORE_USER],
            socket_timeout=3,
            socket_connect_timeout=3,
        )
        with pytest.raises(redis.exceptions.ConnectionError):
            plain.ping()
        plain.close()
    finally:
        assert server.process.stop(30)
