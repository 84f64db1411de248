"""Poison on the task path: no task or record stops an endpoint or the service.

As a legitimate user through the SDK (and, for records no SDK would write, straight
to the topics), each case below is followed by an ordinary task on the same
endpoint that must complete within 30 s, with every platform process still the one
that started (none crashed or restarted) and ``status`` healthy.

Two endpoints: the platform's own (results above proxy_threshold go by reference
through Redis), and one started here without a store, so large results travel
inline and meet the topics' limits.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from fxstream.agent.cli import issued_credentials, register_endpoint
from fxstream.agent.config import EndpointConfig
from fxstream.sdk import (
    Client,
    Executor,
    NotFound,
    PayloadTooLarge,
    ShellFunction,
    TaskExecutionFailed,
    TaskRejected,
)
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    KafkaConnection,
    TaskDispatch,
    TaskSubmission,
    decode,
    encode,
    read_routing_keys,
    utf8_len,
)
from fxstream.topics.budget import ERROR_MESSAGE_MAX_BYTES
from tests.e2e.stack import Stack

pytestmark = pytest.mark.platform

ENDPOINT_BIN = Path(sys.executable).parent / "fxstream-endpoint"
ORDINARY_WITHIN_S = 30.0
EMOJI = "\U0001f600"


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def pids(stack: Stack) -> dict[str, int | None]:
    """Every platform process's PID when the module started."""
    return {c.name: c.pid for c in stack.platform.status().components}


@dataclasses.dataclass
class InlineEndpoint:
    """An endpoint agent without a store, its own process."""

    endpoint_id: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def inline(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InlineEndpoint]:
    home = tmp_path_factory.mktemp("inline-endpoint")
    settings = stack.settings
    # Registered by its owner; the agent gets what the service issues the endpoint: its own
    # API token and (secure platform) Kafka principal ep.<id>, never its owner's.
    issued = register_endpoint(settings.service_url, _token(stack), "inline")
    endpoint_id = str(issued["endpoint_id"])
    brokers = KafkaConnection(stack.bootstrap, ca_file=stack.kafka.ca_file)
    credentials = issued_credentials(
        endpoint_id, issued, kafka=brokers, owner_token=None, warn=pytest.fail
    )
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(home)}
    os.environ["FXSTREAM_ENDPOINTS_DIR"] = str(home)
    try:
        config = EndpointConfig(
            name="inline",
            endpoint_id=endpoint_id,
            service_url=settings.service_url,
            bootstrap_servers=stack.bootstrap,
            topic_prefix=stack.prefix,
            workers=2,
            heartbeat_period_s=2.0,
            lease_timeout_s=10.0,
        )
        credentials.save(config.credentials_path)
        config.save()
    finally:
        del os.environ["FXSTREAM_ENDPOINTS_DIR"]
    log = home / "agent.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [ENDPOINT_BIN, "start", "inline"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 90
        while b"endpoint ready" not in log.read_bytes():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield InlineEndpoint(endpoint_id, process, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _token(stack: Stack) -> str:
    token = stack.settings.token
    assert token is not None
    return token


def double(x: int) -> int:
    return 2 * x


def raise_emoji(count: int) -> None:
    raise ValueError(EMOJI * count)


def return_bytes(size: int) -> bytes:
    return b"x" * size


def nothing() -> int:
    return 7


def echo(value: bytes) -> bytes:
    return value


def _no_store(stack: Stack) -> Client:
    return Client.from_settings(dataclasses.replace(stack.settings, store_url=None))


def _ordinary_task_completes(
    stack: Stack, pids: dict[str, int | None], endpoint_id: str | None = None
) -> None:
    """An ordinary task on the endpoint completes within 30 s; nothing restarted."""
    client = _no_store(stack)
    try:
        with Executor(endpoint_id=endpoint_id or stack.endpoint_id, client=client) as executor:
            started = time.monotonic()
            assert executor.submit(double, 21).result(timeout=ORDINARY_WITHIN_S) == 42
            assert time.monotonic() - started < ORDINARY_WITHIN_S
    finally:
        client.close()
    status = stack.platform.status()
    assert status.healthy, status.to_json()
    assert {c.name: c.pid for c in status.components} == pids, "a platform process restarted"


def _dead_letter(stack: Stack, key: bytes, timeout_s: float = 60.0) -> DeadLetter:
    topic = Catalogue(prefix=stack.prefix).dead_letter
    reader = Consumer(
        {
            **stack.kafka.confluent(),
            "group.id": f"poison-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "log_level": 2,
        }
    )
    reader.assign([TopicPartition(topic, 0, 0)])
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = reader.poll(0.5)
            if message is not None and message.error() is None and message.key() == key:
                return decode(message.value(), DeadLetter)
    finally:
        reader.close()
    pytest.fail(f"no dead letter keyed {key!r} within {timeout_s:g} s")


def _produce(stack: Stack, topic: str, key: bytes, value: bytes) -> None:
    producer = Producer({**stack.kafka.confluent(), "message.max.bytes": 2_000_000, "log_level": 2})
    producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


# --- the cases -----------------------------------------------------------------------------


def test_an_emoji_error_of_300000_characters_fails_only_its_task(
    stack: Stack, pids: dict[str, int | None]
) -> None:
    with stack.executor() as executor:
        future = executor.submit(raise_emoji, 300_000)
        with pytest.raises(TaskExecutionFailed) as info:
            future.result(timeout=60)
    assert isinstance(info.value, ValueError)
    message = info.value.remote_message
    assert message.startswith(EMOJI * 100)
    assert utf8_len(message) <= ERROR_MESSAGE_MAX_BYTES
    assert "bytes cut" in message
    _ordinary_task_completes(stack, pids)


def test_a_large_error_with_retries_fits_and_task_state_folds_it(
    stack: Stack, pids: dict[str, int | None]
) -> None:
    client = stack.client()
    try:
        with Executor(
            endpoint_id=stack.endpoint_id, client=client, max_retries=3, retry_user_errors=True
        ) as executor:
            future = executor.submit(raise_emoji, 65_536)
            with pytest.raises(TaskExecutionFailed) as info:
                future.result(timeout=120)
            assert info.value.attempt == 4
            assert [a.attempt for a in info.value.earlier_attempts] == [1, 2, 3]
            deadline = time.monotonic() + 60
            state: dict[str, object] = {}
            while state.get("state") != "failed":
                assert time.monotonic() < deadline, f"task-state never folded it: {state}"
                try:
                    state = client.get_task(future.task_id)
                except NotFound:  # not folded yet
                    state = {}
                time.sleep(0.5)
    finally:
        client.close()
    _ordinary_task_completes(stack, pids)


def test_a_result_of_999530_bytes_comes_back_inline(
    stack: Stack, pids: dict[str, int | None], inline: InlineEndpoint
) -> None:
    client = _no_store(stack)
    try:
        with Executor(endpoint_id=inline.endpoint_id, client=client) as executor:
            assert executor.submit(return_bytes, 999_530).result(timeout=60) == b"x" * 999_530
    finally:
        client.close()
    _ordinary_task_completes(stack, pids, inline.endpoint_id)


def test_a_result_above_the_limits_is_an_error_naming_the_setting(
    stack: Stack, pids: dict[str, int | None], inline: InlineEndpoint
) -> None:
    client = _no_store(stack)
    try:
        with Executor(endpoint_id=inline.endpoint_id, client=client) as executor:
            future = executor.submit(return_bytes, 1_100_000)
            with pytest.raises(TaskExecutionFailed) as info:
                future.result(timeout=60)
    finally:
        client.close()
    assert info.value.remote_type == "ResultTooLarge"
    message = info.value.remote_message
    assert "store_url" in message and "max.message.bytes" in message
    letter = _dead_letter(stack, future.task_id.encode())
    assert letter.error_type == DeadLetterReason.RESULT_TOO_LARGE
    assert letter.original_value_digest is not None
    assert letter.original_value_digest.size > 1_100_000
    _ordinary_task_completes(stack, pids, inline.endpoint_id)


def test_a_dispatch_for_a_user_without_a_results_topic_is_settled(
    stack: Stack, pids: dict[str, int | None]
) -> None:
    """As the router would write it (its dispatch, with the routing stamp the platform's key
    makes), for a user whose results topic is gone: the ingress cannot forward the agent's
    result and dead-letters it, and the agent's queue record is settled (the next task
    runs)."""
    catalogue = Catalogue(prefix=stack.prefix)
    client = stack.client()
    try:
        function_id = client.register_function(nothing)
        prepared = client.prepare_task(stack.endpoint_id, function_id)
    finally:
        client.close()
    submission = decode(prepared.record, TaskSubmission)
    ghost = f"ghost-{uuid.uuid4().hex[:12]}"
    orphan = msgspec.structs.replace(submission, user_id=ghost)
    keys = read_routing_keys(stack.home / "credentials" / "routing-keys.json")
    dispatch = TaskDispatch(
        task_id=orphan.task_id,
        endpoint_id=stack.endpoint_id,
        user_id=ghost,
        function_sha256=orphan.function_sha256,
        routed_at=time.time(),
        submission=encode(orphan),
        routing_stamp=keys.stamp(
            task_id=orphan.task_id,
            endpoint_id=stack.endpoint_id,
            user_id=ghost,
            function_id=orphan.function_id,
        ),
    )
    key = orphan.task_id.encode()
    _produce(stack, catalogue.endpoint_queue(stack.endpoint_id), key, encode(dispatch))
    letter = _dead_letter(stack, key)
    assert letter.error_type == DeadLetterReason.TASK_UNDELIVERABLE
    assert catalogue.results(ghost) in letter.reason
    _ordinary_task_completes(stack, pids)


def test_a_megabyte_of_garbage_on_the_queue_is_dead_lettered(
    stack: Stack, pids: dict[str, int | None]
) -> None:
    catalogue = Catalogue(prefix=stack.prefix)
    key = f"garbage-{uuid.uuid4().hex[:8]}".encode()
    garbage = os.urandom(1_000_000)
    _produce(stack, catalogue.endpoint_queue(stack.endpoint_id), key, garbage)
    letter = _dead_letter(stack, key)
    assert letter.error_type == DeadLetterReason.DECODE_ERROR
    assert letter.original_value == garbage  # within the size a dead letter keeps whole
    _ordinary_task_completes(stack, pids)


def test_oversized_submissions_are_refused_and_routing_goes_on(
    stack: Stack, pids: dict[str, int | None]
) -> None:
    catalogue = Catalogue(prefix=stack.prefix)
    client = _no_store(stack)
    try:
        function_id = client.register_function(double)
        with (
            Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
            pytest.raises(PayloadTooLarge),
        ):
            executor.submit(echo, b"x" * 1_100_000)
        # Just under from.user's limit, written by hand: its dispatch would not fit
        # an endpoint queue, and the router refuses it rather than failing its write.
        prepared = client.prepare_task(stack.endpoint_id, function_id, (1,))
        submission = decode(prepared.record, TaskSubmission)
        filler = b"p" * (catalogue.spec("from.user.{user_id}").max_message_bytes - 1100)
        fat = msgspec.structs.replace(submission, payload=submission.payload + filler)
        record = encode(fat)
        future = client.track(dataclasses.replace(prepared, record=record))
        _produce(stack, catalogue.from_user(fat.user_id), fat.task_id.encode(), record)
        with pytest.raises(TaskRejected, match="too large for an endpoint queue"):
            future.result(timeout=60)
    finally:
        client.close()
    _ordinary_task_completes(stack, pids)


def test_sigterm_stops_an_agent_within_10_s(
    stack: Stack, inline: InlineEndpoint, pids: dict[str, int | None]
) -> None:
    """With a task running: it is handed back uncommitted, the agent gone within 10 s."""
    client = _no_store(stack)
    executor = Executor(endpoint_id=inline.endpoint_id, client=client)
    try:
        executor.submit(ShellFunction("sleep 60"))
        time.sleep(3)  # taken and running
        started = time.monotonic()
        inline.process.send_signal(signal.SIGTERM)
        inline.process.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        # The task went back to the queue of an endpoint no agent serves now.
        executor.shutdown(wait=False)
        client.close(timeout=5)
    assert took < 10.0, f"SIGTERM took {took:.1f} s:\n{inline.log.read_text()[-3000:]}"
