"""The router, end to end: real broker, registry records, and the processors in a subprocess.

One processors process serves the whole module (starting one costs ~3 s); each
test submits its own tasks with their own ids and reads what the router wrote.
The helpers here (``Deployment``, ``Processors``, ``Reader``) are reused by
``test_processors.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition

from fxstream.service.auth import token_sha256
from fxstream.service.routing_keys import CHECK_INTERVAL_S
from fxstream.topics import (
    ROUTING_KEYS_ENV,
    Catalogue,
    DeadLetter,
    EndpointRecord,
    FunctionRecord,
    KafkaConnection,
    Record,
    RecordDecodeError,
    TaskCancel,
    TaskDispatch,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    UserRecord,
    client_info,
    decode,
    encode,
    ensure_routing_keys,
    ensure_topics,
    read_routing_keys,
    record_kind,
)
from tests.conftest import RunningPlatform, write_kafka_credentials

WAIT_S = 30.0  # generous: the first record also waits for the processors to start
CODE_DIGEST = "0" * 64  # what add_function registers (the router never hashes the code)

# --- helpers shared with test_processors.py ------------------------------------------------


class Reader:
    """Reads one topic from the beginning (no consumer group) and remembers every record."""

    def __init__(self, kafka: KafkaConnection, topic: str) -> None:
        self.topic = topic
        self.messages: list[Message] = []
        self._consumer = Consumer(
            {
                **kafka.confluent(),
                "group.id": "unused",
                "enable.auto.commit": False,
                "log_level": 2,
            }
        )
        partitions = self._consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])

    def wait_for(self, predicate: Callable[[Message], bool], timeout_s: float = WAIT_S) -> Message:
        """The first record matching ``predicate``, seen before or within ``timeout_s``."""
        for message in self.messages:
            if predicate(message):
                return message
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            polled = self._consumer.poll(0.1)
            if polled is None or polled.error() is not None:
                continue
            self.messages.append(polled)
            if predicate(polled):
                return polled
        raise AssertionError(f"no matching record on {self.topic} within {timeout_s} s")

    def keyed(self, key: str) -> list[Message]:
        """Every record seen so far with this key."""
        return [m for m in self.messages if m.key() == key.encode()]

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()


def key_is(key: str) -> Callable[[Message], bool]:
    """A predicate for ``Reader.wait_for``: the record's key is ``key``."""
    return lambda message: message.key() == key.encode()


class Processors:
    """``python -m fxstream.service.processors`` in a subprocess, stopped by PID.

    Its routing keys are ``routing_keys`` (made there, 0600, if missing; by default a file
    of the workdir's own), named by ``FXSTREAM_ROUTING_KEYS`` as the platform does.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        workdir: Path,
        roles: tuple[str, ...] = (),
        routing_keys: Path | None = None,
    ) -> None:
        self.log_path = workdir / f"processors{'-'.join(('', *roles))}.log"
        app_id = "test-processors-" + catalogue.prefix.strip(".")
        credentials = write_kafka_credentials(kafka, workdir / "kafka-credentials.json")
        self.routing_keys_file = routing_keys or workdir / "routing-keys.json"
        self.routing_keys = ensure_routing_keys(self.routing_keys_file)
        env = {**os.environ, ROUTING_KEYS_ENV: str(self.routing_keys_file)}
        command = [
            sys.executable,
            "-m",
            "fxstream.service.processors",
            "--kafka-credentials",
            str(credentials),
            "--prefix",
            catalogue.prefix,
            "--app-id",
            app_id,
            "--data-dir",
            str(workdir / "faust"),
            *(arg for role in roles for arg in ("--only", role)),
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        """Everything the processors wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = WAIT_S) -> None:
        """Wait until ``text`` appears in the log."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.process.poll() is None, f"processors exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.log()[-3000:]}"
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL and fail if it hangs)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
            raise AssertionError(f"processors ignored SIGTERM:\n{self.log()[-3000:]}") from None


@dataclass
class Deployment:
    """A unique-prefix catalogue with its topics, a producer, and readers on the outputs."""

    kafka: KafkaConnection
    catalogue: Catalogue
    topics: list[str]
    producer: Producer
    readers: dict[str, Reader] = field(default_factory=dict)

    @classmethod
    def provision(
        cls,
        platform: RunningPlatform,
        *,
        users: list[str],
        endpoints: list[str],
        senders: Sequence[str] = (),
    ) -> Deployment:
        """Create the static topics plus each user's ``results.<user>`` and
        ``from.user.<user>`` (and ``from.user.<sender>`` for the ``senders``, users the
        broker lets write but the registry may not know) and each endpoint's
        ``tasks.ep.<endpoint>`` and ``from.ep.<endpoint>``."""
        catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
        topics = dict(catalogue.static_topics())
        for user in users:
            topics[catalogue.results(user)] = catalogue.spec("results.{user_id}")
        for user in [*users, *senders]:
            topics[catalogue.from_user(user)] = catalogue.spec("from.user.{user_id}")
        for endpoint in endpoints:
            topics[catalogue.endpoint_queue(endpoint)] = catalogue.spec("tasks.ep.{endpoint_id}")
            topics[catalogue.from_endpoint(endpoint)] = catalogue.spec("from.ep.{endpoint_id}")
        ensure_topics(platform.admin(), catalogue, topics)
        kafka = platform.kafka
        producer = Producer({**kafka.confluent(), "log_level": 2})
        return cls(kafka, catalogue, list(topics), producer)

    def reader(self, topic: str) -> Reader:
        """The (one, shared) reader of ``topic``."""
        if topic not in self.readers:
            self.readers[topic] = Reader(self.kafka, topic)
        return self.readers[topic]

    def produce(
        self,
        topic: str,
        key: str | None,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        """Produce one record and wait for the broker's acknowledgement."""
        self.producer.produce(topic, key=key, value=value, headers=headers)
        assert self.producer.flush(10) == 0

    def add_user(self, user_id: str, token: str) -> None:
        """Register a user (the record the API writes)."""
        record = UserRecord(
            user_id=user_id, name=user_id, token_sha256=token_sha256(token), created_at=time.time()
        )
        self.produce(self.catalogue.users, user_id, encode(record))

    def add_function(
        self, function_id: str, owner: str, *, public: bool = False, digest: str = CODE_DIGEST
    ) -> None:
        """Register a function (its code is never loaded by the router)."""
        record = FunctionRecord(
            function_id=function_id,
            name=function_id,
            owner_id=owner,
            code=b"fxdc\nnot-loaded",
            code_sha256=digest,
            created_at=time.time(),
            public=public,
        )
        self.produce(self.catalogue.functions, function_id, encode(record))

    def add_endpoint(self, endpoint_id: str, owner: str, *, public: bool = False) -> None:
        """Register an endpoint."""
        record = EndpointRecord(
            endpoint_id=endpoint_id,
            name=endpoint_id,
            owner_id=owner,
            created_at=time.time(),
            public=public,
        )
        self.produce(self.catalogue.endpoints, endpoint_id, encode(record))

    def close(self, platform: RunningPlatform) -> None:
        """Close the readers and delete every topic of this deployment."""
        for reader in self.readers.values():
            reader.close()
        admin = platform.admin()  # held: its futures fail if the client is collected first
        for future in admin.delete_topics(self.topics, operation_timeout=30).values():
            future.result(timeout=30)


def new_task_id() -> str:
    """A fresh task id."""
    return str(uuid.uuid4())


R = TypeVar("R", bound=Record)


def decoded(message: Message, kind: type[R]) -> R:
    """The record a message holds."""
    return decode(message.value(), kind)


# --- this module's deployment --------------------------------------------------------------

ALICE, BOB, CAROL = "alice", "bob", "carol"  # carol is never registered
TOKENS = {ALICE: "alice-token", BOB: "bob-token"}
PUBLIC_FN, PRIVATE_FN = "fn-public", "fn-alice-only"
PUBLIC_EP, PRIVATE_EP, NO_QUEUE_EP = "ep-public", "ep-alice-only", "ep-without-queue"


@pytest.fixture(scope="module")
def deployment(
    kafka_platform: RunningPlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, Processors]]:
    """Topics, registry records, then the processors; all torn down at the end."""
    deployment = Deployment.provision(
        kafka_platform, users=[ALICE, BOB], endpoints=[PUBLIC_EP, PRIVATE_EP], senders=[CAROL]
    )
    for user, token in TOKENS.items():
        deployment.add_user(user, token)
    deployment.add_function(PUBLIC_FN, ALICE, public=True)
    deployment.add_function(PRIVATE_FN, ALICE)
    deployment.add_endpoint(PUBLIC_EP, ALICE, public=True)
    deployment.add_endpoint(PRIVATE_EP, ALICE)
    deployment.add_endpoint(NO_QUEUE_EP, BOB, public=True)
    processors = Processors(
        deployment.kafka, deployment.catalogue, tmp_path_factory.mktemp("router")
    )
    try:
        yield deployment, processors
    finally:
        code = processors.stop()
        deployment.close(kafka_platform)
    assert code == 0, processors.log()[-3000:]


def submission(
    *,
    user: str = BOB,
    function: str = PUBLIC_FN,
    endpoint: str = PUBLIC_EP,
    task_id: str | None = None,
    digest: str = CODE_DIGEST,
) -> TaskSubmission:
    """A submission with an opaque payload the router must not read."""
    return TaskSubmission(
        task_id=task_id or new_task_id(),
        function_id=function,
        endpoint_id=endpoint,
        user_id=user,
        function_sha256=digest,
        # Not a loadable payload: the router would fail if it tried to deserialize it.
        payload=b"fxpk\n\x00not pickle at all",
        client=client_info(),
        submitted_at=time.time(),
    )


def submit(deployment: Deployment, task: TaskSubmission, *, sender: str | None = None) -> bytes:
    """Produce ``task`` to its user's ``from.user`` topic (or ``sender``'s); returns the
    exact bytes sent."""
    value = encode(task)
    topic = deployment.catalogue.from_user(sender or task.user_id)
    deployment.produce(topic, task.task_id, value)
    return value


# --- tests -----------------------------------------------------------------------------------


def test_valid_submission_is_dispatched_with_its_bytes_untouched(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, processors = deployment
    task = submission()
    value = encode(task)
    dep.produce(
        dep.catalogue.from_user(BOB), task.task_id, value, [("traceparent", b"00-abc-def-01")]
    )

    message = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP)).wait_for(key_is(task.task_id))
    dispatch = decoded(message, TaskDispatch)
    assert dispatch.submission == value
    assert (dispatch.task_id, dispatch.endpoint_id, dispatch.attempt) == (
        task.task_id,
        PUBLIC_EP,
        1,
    )
    # Stamped by the router: the topic's user and the registered code's digest, and the
    # routing stamp (under the processors' key) of this task, endpoint, user and function.
    assert (dispatch.user_id, dispatch.function_sha256) == (BOB, CODE_DIGEST)
    processors.routing_keys.verify(
        dispatch.routing_stamp,
        task_id=task.task_id,
        endpoint_id=PUBLIC_EP,
        user_id=BOB,
        function_id=PUBLIC_FN,
    )
    assert dispatch.routed_at >= task.submitted_at
    assert ("traceparent", b"00-abc-def-01") in (message.headers() or [])

    state_message = dep.reader(dep.catalogue.task_state).wait_for(key_is(task.task_id))
    state = decoded(state_message, TaskState)
    assert state.state is TaskStateName.ROUTED
    assert (state.user_id, state.function_id, state.endpoint_id) == (BOB, PUBLIC_FN, PUBLIC_EP)
    assert state.timings.submitted_at == task.submitted_at
    assert state.timings.routed_at == dispatch.routed_at


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown function", "function 'fn-missing' does not exist or is not shared with you"),
        ("function changed", f"function {PUBLIC_FN!r} has changed since this task was prepared"),
        ("private function", f"function {PRIVATE_FN!r} does not exist or is not shared with you"),
        ("private endpoint", f"endpoint {PRIVATE_EP!r} does not exist or is not shared with you"),
        ("endpoint without queue", f"endpoint {NO_QUEUE_EP!r} has no queue topic"),
    ],
)
def test_refused_task_gets_an_error_result_a_dead_letter_and_a_rejected_state(
    deployment: tuple[Deployment, Processors], case: str, expected: str
) -> None:
    dep, _ = deployment
    task = {
        "unknown function": submission(function="fn-missing"),
        "function changed": submission(digest="1" * 64),
        "private function": submission(function=PRIVATE_FN),
        "private endpoint": submission(endpoint=PRIVATE_EP),
        "endpoint without queue": submission(endpoint=NO_QUEUE_EP),
    }[case]
    value = submit(dep, task)

    result = decoded(
        dep.reader(dep.catalogue.results(BOB)).wait_for(key_is(task.task_id)), TaskResult
    )
    assert result.outcome == "error"
    assert result.error is not None
    assert result.error.type == "TaskRejected"
    assert result.error.message.startswith(expected), result.error.message
    assert (result.task_id, result.user_id, result.function_id) == (
        task.task_id,
        BOB,
        task.function_id,
    )

    letter = decoded(
        dep.reader(dep.catalogue.dead_letter).wait_for(key_is(task.task_id)), DeadLetter
    )
    assert letter.reason == result.error.message
    assert (letter.component, letter.error_type, letter.task_id) == (
        "router",
        "FunctionChanged" if case == "function changed" else "TaskRejected",
        task.task_id,
    )
    assert letter.original_topic == dep.catalogue.from_user(BOB)
    assert letter.original_value == value

    state = decoded(dep.reader(dep.catalogue.task_state).wait_for(key_is(task.task_id)), TaskState)
    assert state.state is TaskStateName.REJECTED
    assert state.error == result.error
    # Nothing reached any endpoint queue.
    assert not dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP)).keyed(task.task_id)


def test_unknown_user_without_results_topic_is_dead_lettered_and_rejected(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    task = submission(user=CAROL)
    submit(dep, task)
    letter = decoded(
        dep.reader(dep.catalogue.dead_letter).wait_for(key_is(task.task_id)), DeadLetter
    )
    assert letter.reason.startswith("user 'carol' is not registered")
    state = decoded(dep.reader(dep.catalogue.task_state).wait_for(key_is(task.task_id)), TaskState)
    assert state.state is TaskStateName.REJECTED


def test_garbage_is_dead_lettered_and_the_router_carries_on(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    garbage_key = new_task_id()
    garbage = b"\x93\x01\x02 definitely not a submission"
    with pytest.raises(RecordDecodeError) as expected:
        decode(garbage, TaskSubmission)
    dep.produce(dep.catalogue.from_user(BOB), garbage_key, garbage, [("origin", b"fuzzer")])
    # A valid record of the wrong kind is bad input too.
    wrong_kind_key = new_task_id()
    wrong_kind = encode(
        TaskState(
            task_id=wrong_kind_key,
            user_id=BOB,
            function_id=PUBLIC_FN,
            endpoint_id=PUBLIC_EP,
            state=TaskStateName.ROUTED,
            updated_at=time.time(),
        )
    )
    dep.produce(dep.catalogue.from_user(BOB), wrong_kind_key, wrong_kind)
    task = submission()
    value = submit(dep, task)

    letters = dep.reader(dep.catalogue.dead_letter)
    letter = decoded(letters.wait_for(key_is(garbage_key)), DeadLetter)
    assert letter.reason == str(expected.value)
    assert (letter.component, letter.error_type) == ("router", "RecordDecodeError")
    assert letter.original_value == garbage
    assert letter.original_headers == [("origin", b"fuzzer")]
    assert letter.task_id == garbage_key
    assert "submission" in decoded(letters.wait_for(key_is(wrong_kind_key)), DeadLetter).reason

    dispatch = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP)).wait_for(key_is(task.task_id))
    assert decoded(dispatch, TaskDispatch).submission == value


def test_function_registered_just_before_its_first_task_is_routed(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    function_id = f"fn-new-{uuid.uuid4().hex[:8]}"
    dep.add_function(function_id, BOB)
    task = submission(function=function_id)
    submit(dep, task)  # no pause: the router must catch up with the registry first
    dispatch = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP)).wait_for(key_is(task.task_id))
    assert decoded(dispatch, TaskDispatch).task_id == task.task_id


def cancel_of(task: TaskSubmission, *, user: str | None = None) -> TaskCancel:
    """A cancel of ``task``, by its submitter unless ``user`` says otherwise."""
    return TaskCancel(
        task_id=task.task_id,
        user_id=user or task.user_id,
        endpoint_id=task.endpoint_id,
        requested_at=time.time(),
        reason="test",
    )


def test_a_cancel_is_forwarded_to_the_endpoint_queue_after_its_task(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    task = submission()
    submit(dep, task)
    cancel = encode(cancel_of(task))
    # Sent before the submission is routed: same key, same partition, so it follows it.
    dep.produce(dep.catalogue.from_user(BOB), task.task_id, cancel, [("origin", b"sdk")])
    queue = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP))
    queue.wait_for(lambda m: m.key() == task.task_id.encode() and m.value() == cancel)
    records = queue.keyed(task.task_id)
    assert [record_kind(m.value()) for m in records] == ["dispatch", "cancel"]
    assert records[0].partition() == records[1].partition()
    assert records[0].offset() < records[1].offset()
    assert ("origin", b"sdk") in (records[1].headers() or [])


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown user", "user 'carol' is not registered"),
        ("private endpoint", f"endpoint {PRIVATE_EP!r} does not exist or is not shared"),
        ("endpoint without queue", f"endpoint {NO_QUEUE_EP!r} has no queue topic"),
    ],
)
def test_a_refused_cancel_is_dead_lettered_and_not_forwarded(
    deployment: tuple[Deployment, Processors], case: str, expected: str
) -> None:
    dep, _ = deployment
    task = submission(user=ALICE)
    submit(dep, task)
    cancel = {
        "unknown user": cancel_of(task, user=CAROL),
        "private endpoint": msgspec.structs.replace(
            cancel_of(task, user=BOB), endpoint_id=PRIVATE_EP
        ),
        "endpoint without queue": msgspec.structs.replace(
            cancel_of(task, user=BOB), endpoint_id=NO_QUEUE_EP
        ),
    }[case]
    value = encode(cancel)
    dep.produce(dep.catalogue.from_user(cancel.user_id), task.task_id, value)
    letter = decoded(
        dep.reader(dep.catalogue.dead_letter).wait_for(
            lambda m: (
                m.key() == task.task_id.encode() and decoded(m, DeadLetter).original_value == value
            )
        ),
        DeadLetter,
    )
    assert (letter.component, letter.error_type, letter.task_id) == (
        "router",
        "CancelRefused",
        task.task_id,
    )
    assert expected in letter.reason, letter.reason
    queue = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP))
    queue.wait_for(key_is(task.task_id))  # the task itself was routed
    later = submission()
    submit(dep, later)  # on another key: once it is routed, the refused cancel had its turn
    queue.wait_for(key_is(later.task_id))
    assert all(record_kind(m.value()) == "dispatch" for m in queue.keyed(task.task_id))


def test_a_malformed_cancel_is_dead_lettered_with_the_cancels_reason(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    key = new_task_id()
    raw = msgspec.msgpack.decode(encode(cancel_of(submission(task_id=key))))
    del raw["endpoint_id"]
    value = msgspec.msgpack.encode(raw)
    dep.produce(dep.catalogue.from_user(BOB), key, value)
    letter = decoded(dep.reader(dep.catalogue.dead_letter).wait_for(key_is(key)), DeadLetter)
    assert letter.error_type == "RecordDecodeError"
    assert "not a valid cancel record" in letter.reason
    assert "endpoint_id" in letter.reason


@pytest.mark.parametrize("kind", ["submission", "cancel"])
def test_a_record_naming_another_user_than_its_topics_is_dead_lettered(
    deployment: tuple[Deployment, Processors], kind: str
) -> None:
    # Bob writes his own topic (the only one the broker lets him write) claiming to be
    # Alice: the router believes the topic, not the record.
    dep, _ = deployment
    victim_task = submission(user=ALICE)
    submit(dep, victim_task)
    forged = submission(user=ALICE) if kind == "submission" else cancel_of(victim_task)
    value = encode(forged)
    dep.produce(dep.catalogue.from_user(BOB), forged.task_id, value)
    letter = decoded(
        dep.reader(dep.catalogue.dead_letter).wait_for(
            lambda m: decoded(m, DeadLetter).original_value == value
        ),
        DeadLetter,
    )
    assert (letter.component, letter.error_type) == ("router", "IdentityMismatch")
    assert "names user 'alice'" in letter.reason
    assert letter.original_topic == dep.catalogue.from_user(BOB)
    # Nothing else: no dispatch, no cancel forwarded, no state for a forged submission.
    queue = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP))
    queue.wait_for(key_is(victim_task.task_id))
    later = submission()
    submit(dep, later)
    queue.wait_for(key_is(later.task_id))
    assert [record_kind(m.value()) for m in queue.keyed(forged.task_id)] == (
        ["dispatch"] if kind == "cancel" else []
    )
    if kind == "submission":
        assert not dep.reader(dep.catalogue.task_state).keyed(forged.task_id)


def test_a_running_router_stamps_with_a_rotated_key_without_a_restart(
    deployment: tuple[Deployment, Processors],
) -> None:
    """`fxstream-service routing-keys FILE --rotate` while the processors run: within about
    a second the router stamps with the new key (the file is looked at once a second)."""
    dep, processors = deployment
    old = read_routing_keys(processors.routing_keys_file)
    rotate = subprocess.run(
        [
            str(Path(sys.executable).parent / "fxstream-service"),
            "routing-keys",
            str(processors.routing_keys_file),
            "--rotate",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rotate.returncode == 0, rotate.stderr
    rotated = read_routing_keys(processors.routing_keys_file)
    assert rotated.signing != old.signing and old.signing in rotated.retired
    # Later tests of this module verify with these (the old key is still accepted).
    processors.routing_keys = rotated
    # The file is looked at when a key is needed, at most once a second: a second after
    # the rotation, the next dispatch is stamped with the new key.
    time.sleep(CHECK_INTERVAL_S + 0.05)
    task = submission()
    submit(dep, task)
    message = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP)).wait_for(key_is(task.task_id))
    stamp = decoded(message, TaskDispatch).routing_stamp
    assert stamp.split(".")[1] == rotated.signing.key_id, stamp
    rotated.verify(
        stamp, task_id=task.task_id, endpoint_id=PUBLIC_EP, user_id=BOB, function_id=PUBLIC_FN
    )
    processors.wait_for_log(
        f"routing keys re-read from {processors.routing_keys_file}: signing key "
        f"{rotated.signing.key_id}; also accepted: {old.signing.key_id}"
    )
    log = processors.log()
    for key in (old.signing, rotated.signing):
        assert key.secret.hex() not in log
