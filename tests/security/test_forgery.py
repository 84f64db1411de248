"""Record-level identity checks (issue 13, item 3 and the code half of item 4).

A real broker and the real processes (router, ingress, task-state, liveness, the local
endpoint's agent) of a private platform. Each test writes what an attacker would write,
straight to Kafka, and checks that it is dead-lettered and has no other effect. The
broker's own refusals (ACLs: who may write which topic) are tests/security/
test_acl_matrix.py's; these checks must hold even where the broker lets the record in
(the insecure development platform), because they do not trust what a record says
about who wrote it: the router believes the ``from.user.<U>`` topic a submission is on,
the ingress the ``from.ep.<E>`` topic a result is on and the router's routing stamp it
carries, and the agent the router's stamps.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Message, Producer
from confluent_kafka.admin import AdminClient

from fxstream.ops.private import PrivatePlatform
from fxstream.sdk import Client, TaskRejected
from fxstream.topics import (
    DataLocation,
    DeadLetter,
    EndpointLogs,
    FunctionRecord,
    Heartbeat,
    LogLine,
    Serializer,
    TaskDispatch,
    TaskEvent,
    TaskResult,
    TaskStateName,
    TaskSubmission,
    WarmAdvert,
    client_info,
    code_sha256,
    decode,
    encode,
    ensure_topics,
    read_routing_keys,
)
from tests.e2e.stack import committed_records

pytestmark = pytest.mark.platform

WAIT_S = 60.0


class Touch:
    """Unpickling this touches ``path``: the proof that something was deserialized."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))

    def __call__(self) -> None:
        """Callable, so it passes for a function's code (it is never called)."""


def sleep_then(seconds: float, value: str) -> str:
    """A slow function: its task stays pending while a forged result is sent."""
    time.sleep(seconds)
    return value


def touch(path: str) -> str:
    """Running this touches ``path``: the proof that the function ran."""
    pathlib.Path(path).touch()
    return path


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    """The session's shared platform (tests/conftest.py), with its services and local
    endpoint: this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def client(stack: PrivatePlatform) -> Iterator[Client]:
    """The platform user's client (the victim)."""
    with stack.client() as victim:
        yield victim


@pytest.fixture(scope="module")
def other_endpoint(client: Client) -> str:
    """A second endpoint (no agent needed: the attacker writes its from.ep topic by hand)."""
    return client.register_endpoint(f"other-{uuid.uuid4().hex[:6]}")


def produce(stack: PrivatePlatform, topic: str, key: str, value: bytes) -> None:
    """Write one record, as whoever the broker lets write ``topic``."""
    producer = Producer({**stack.kafka.confluent(), "log_level": 2})
    errors: list[object] = []
    producer.produce(topic, key=key, value=value, on_delivery=lambda e, _: errors.append(e))
    assert producer.flush(10) == 0
    assert errors == [None], errors


def records(stack: PrivatePlatform, topic: str) -> list[Message]:
    """Every committed record of ``topic``, from the beginning to its current end."""
    return committed_records(stack.kafka, topic)


def dead_letter_of(
    stack: PrivatePlatform, original: bytes, *, error_type: str, component: str
) -> DeadLetter:
    """The dead letter holding ``original``, waiting up to a minute for it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        for message in records(stack, stack.catalogue.dead_letter):
            letter = decode(message.value(), DeadLetter)
            if letter.original_value == original:
                assert (letter.error_type, letter.component) == (error_type, component), letter
                return letter
        assert time.monotonic() < deadline, f"no {error_type} dead letter from {component}"
        time.sleep(0.5)


def keys_of(stack: PrivatePlatform, topic: str) -> set[bytes]:
    """The keys of every committed record of ``topic``."""
    return {m.key() or b"" for m in records(stack, topic)}


def new_topic(stack: PrivatePlatform, topic: str, template: str) -> None:
    """Create one per-user or per-endpoint topic, as the service would for a new principal."""
    catalogue = stack.catalogue
    ensure_topics(
        AdminClient({**stack.kafka.confluent(), "log_level": 0}),
        catalogue,
        {topic: catalogue.spec(template)},
    )


def a_submission(
    client: Client, endpoint_id: str, function_id: str, *, user_id: str, payload: bytes
) -> TaskSubmission:
    """A submission as an attacker would build it by hand."""
    return TaskSubmission(
        task_id=str(uuid.uuid4()),
        function_id=function_id,
        endpoint_id=endpoint_id,
        user_id=user_id,
        function_sha256=client.function_sha256(function_id),
        payload=payload,
        client=client_info(),
        submitted_at=time.time(),
    )


# --- tests ---------------------------------------------------------------------------------


def test_a_submission_naming_another_user_than_its_topic_is_dead_lettered_and_never_runs(
    stack: PrivatePlatform, client: Client, tmp_path: Path
) -> None:
    # Mallory may write only her own from.user topic; she puts the victim's id in it.
    mallory = f"mallory-{uuid.uuid4().hex[:8]}"
    new_topic(stack, stack.catalogue.from_user(mallory), "from.user.{user_id}")
    function_id = client.register_function(touch)
    marker = tmp_path / "ran"
    forged = a_submission(
        client,
        stack.endpoint_id,
        function_id,
        user_id=client.user_id,
        payload=client.serializer.pack_arguments((str(marker),), {}),
    )
    value = encode(forged)
    produce(stack, stack.catalogue.from_user(mallory), forged.task_id, value)

    letter = dead_letter_of(stack, value, error_type="IdentityMismatch", component="router")
    assert f"names user {client.user_id!r}" in letter.reason
    # The router carried on: the victim's own task runs; the forged one was never routed.
    genuine = client.run(
        str(tmp_path / "genuine"), endpoint_id=stack.endpoint_id, function_id=function_id
    )
    assert client.future(genuine).result(timeout=WAIT_S) == str(tmp_path / "genuine")
    queue = stack.catalogue.endpoint_queue(stack.endpoint_id)
    assert forged.task_id.encode() not in keys_of(stack, queue)
    assert forged.task_id.encode() not in keys_of(stack, stack.catalogue.task_state)
    assert not marker.exists()


def test_a_forged_result_from_another_endpoint_is_dead_lettered_and_never_reaches_the_sdk(
    stack: PrivatePlatform, client: Client, other_endpoint: str
) -> None:
    function_id = client.register_function(sleep_then)
    task_id = client.run(4.0, "genuine", endpoint_id=stack.endpoint_id, function_id=function_id)
    # While it runs, the other endpoint (whose topic is the only one it may write) answers
    # it with a value of its choosing.
    forged = TaskResult(
        task_id=task_id,
        user_id=client.user_id,
        function_id=function_id,
        endpoint_id=stack.endpoint_id,
        outcome="success",
        value=client.serializer.serialize_value("forged"),
    )
    value = encode(forged)
    produce(stack, stack.catalogue.from_endpoint(other_endpoint), task_id, value)
    letter = dead_letter_of(stack, value, error_type="NotRoutedHere", component="ingress")
    assert f"endpoint {other_endpoint!r}" in letter.reason

    assert client.future(task_id).result(timeout=WAIT_S) == "genuine"
    results = records(stack, stack.catalogue.results(client.user_id))
    mine = [decode(m.value(), TaskResult) for m in results if m.key() == task_id.encode()]
    assert [r.value for r in mine] == [client.serializer.serialize_value("genuine")]
    assert client.get_result(task_id) == "genuine"


def test_a_genuine_stamp_replayed_elsewhere_or_for_another_user_is_dead_lettered(
    stack: PrivatePlatform, client: Client, other_endpoint: str
) -> None:
    # The task's genuine routing stamp, as its dispatch (and later its result) carries it:
    # not a secret, so the attacker is assumed to hold it.
    function_id = client.register_function(sleep_then)
    task_id = client.run(4.0, "genuine", endpoint_id=stack.endpoint_id, function_id=function_id)
    queue = stack.catalogue.endpoint_queue(stack.endpoint_id)
    deadline = time.monotonic() + WAIT_S
    while not (dispatches := committed_records(stack.kafka, queue, task_id)):
        assert time.monotonic() < deadline, "the task was never dispatched"
        time.sleep(0.2)
    stamp = decode(dispatches[0].value(), TaskDispatch).routing_stamp
    assert stamp.startswith("v1.")
    victim = f"victim-{uuid.uuid4().hex[:8]}"

    def forged(**fields: str) -> bytes:
        result = TaskResult(
            task_id=task_id,
            user_id=client.user_id,
            function_id=function_id,
            endpoint_id=stack.endpoint_id,
            outcome="success",
            value=client.serializer.serialize_value("forged"),
            routing_stamp=stamp,
        )
        return encode(msgspec.structs.replace(result, **fields))

    # From the other endpoint (its own topic, naming itself), and from the task's own
    # endpoint redirecting the result to another user's results topic.
    replayed = forged(endpoint_id=other_endpoint)
    redirected = forged(user_id=victim)
    produce(stack, stack.catalogue.from_endpoint(other_endpoint), task_id, replayed)
    produce(stack, stack.catalogue.from_endpoint(stack.endpoint_id), task_id, redirected)
    for value in (replayed, redirected):
        letter = dead_letter_of(stack, value, error_type="NotRoutedHere", component="ingress")
        assert "its routing stamp does not match" in letter.reason

    assert client.future(task_id).result(timeout=WAIT_S) == "genuine"
    mine = [
        decode(m.value(), TaskResult)
        for m in records(stack, stack.catalogue.results(client.user_id))
        if m.key() == task_id.encode()
    ]
    assert [r.value for r in mine] == [client.serializer.serialize_value("genuine")]
    assert [r.routing_stamp for r in mine] == [stamp]


def test_a_result_for_a_task_nobody_routed_is_dead_lettered(
    stack: PrivatePlatform, client: Client
) -> None:
    task_id = str(uuid.uuid4())
    forged = TaskResult(
        task_id=task_id,
        user_id=client.user_id,
        function_id=str(uuid.uuid4()),
        endpoint_id=stack.endpoint_id,
        outcome="success",
        value=client.serializer.serialize_value("forged"),
    )
    value = encode(forged)
    # Even on the endpoint's own topic: it was never routed there.
    produce(stack, stack.catalogue.from_endpoint(stack.endpoint_id), task_id, value)
    dead_letter_of(stack, value, error_type="NotRoutedHere", component="ingress")
    assert task_id.encode() not in keys_of(stack, stack.catalogue.results(client.user_id))


def test_a_heartbeat_for_another_endpoint_is_dead_lettered(
    stack: PrivatePlatform, other_endpoint: str
) -> None:
    agent_id = str(uuid.uuid4())
    beat = Heartbeat(
        endpoint_id=stack.endpoint_id,
        agent_id=agent_id,
        sent_at=time.time(),
        sequence=1,
        period_s=1e6,  # "online" for ever
        hostname="forged",
        pid=1,
        workers_total=4096,
        workers_idle=4096,
        workers_busy=0,
        queue_depth=0,
    )
    value = encode(beat)
    produce(stack, stack.catalogue.from_endpoint(other_endpoint), stack.endpoint_id, value)
    letter = dead_letter_of(stack, value, error_type="IdentityMismatch", component="ingress")
    assert "reports only for itself" in letter.reason
    beats = [decode(m.value(), Heartbeat) for m in records(stack, stack.catalogue.heartbeats)]
    assert agent_id not in {b.agent_id for b in beats}
    # The endpoint's own heartbeats do arrive (through the same ingress).
    assert stack.endpoint_id in {b.endpoint_id for b in beats}


def test_a_log_batch_for_another_endpoint_is_dead_lettered(
    stack: PrivatePlatform, other_endpoint: str
) -> None:
    # Lines slipped into the victim's log (which its owner reads as its agents' own).
    forged = EndpointLogs(
        endpoint_id=stack.endpoint_id,
        agent_id=str(uuid.uuid4()),
        hostname="forged",
        sent_at=time.time(),
        lines=[LogLine(at=time.time(), level="ERROR", logger="x", message="send your token")],
    )
    value = encode(forged)
    produce(stack, stack.catalogue.from_endpoint(other_endpoint), stack.endpoint_id, value)
    letter = dead_letter_of(stack, value, error_type="IdentityMismatch", component="ingress")
    assert "reports only for itself" in letter.reason
    batches = [
        decode(m.value(), EndpointLogs) for m in records(stack, stack.catalogue.endpoint_logs)
    ]
    assert forged.agent_id not in {b.agent_id for b in batches}


def test_adverts_events_and_locations_speak_only_for_their_own_endpoint(
    stack: PrivatePlatform, client: Client, other_endpoint: str
) -> None:
    # A warm advert naming itself but keyed as the victim's (compacted: it would replace
    # the victim's advert), a task event for the victim's task, a location at its site.
    advert = WarmAdvert(endpoint_id=other_endpoint, manager_id="node", advertised_at=time.time())
    function_id = client.register_function(sleep_then)
    task_id = client.run(0.0, "x", endpoint_id=stack.endpoint_id, function_id=function_id)
    assert client.future(task_id).result(timeout=WAIT_S) == "x"
    event = TaskEvent(
        task_id=task_id,
        user_id=client.user_id,
        function_id=function_id,
        endpoint_id=stack.endpoint_id,
        state=TaskStateName.RUNNING,
        at=time.time(),
        source="forged",
    )
    location = DataLocation(
        object_key=f"forged-{uuid.uuid4()}",
        store="redis",
        site=stack.endpoint_id,
        size_bytes=1,
        updated_at=time.time(),
    )
    own = stack.catalogue.from_endpoint(other_endpoint)
    cases = [
        (f"{stack.endpoint_id}/node", encode(advert), "IdentityMismatch"),
        (task_id, encode(event), "NotRoutedHere"),
        (location.object_key, encode(location), "IdentityMismatch"),
    ]
    for key, value, _ in cases:
        produce(stack, own, key, value)
    for _, value, error_type in cases:
        dead_letter_of(stack, value, error_type=error_type, component="ingress")
    assert f"{stack.endpoint_id}/node".encode() not in keys_of(stack, stack.catalogue.warm)
    assert location.object_key.encode() not in keys_of(stack, stack.catalogue.data_locations)
    forwarded = [
        decode(m.value(), TaskEvent)
        for m in records(stack, stack.catalogue.task_events)
        if m.key() == task_id.encode()
    ]
    assert "forged" not in {e.source for e in forwarded}


def test_a_dispatch_naming_another_endpoint_is_refused_by_the_agent_unread(
    stack: PrivatePlatform, client: Client, other_endpoint: str, tmp_path: Path
) -> None:
    # Written straight to this endpoint's queue (which only the service may write on the
    # secure platform), with an argument that would run code when deserialized.
    function_id = client.register_function(touch)
    marker = tmp_path / "deserialized"
    submission = a_submission(
        client,
        other_endpoint,
        function_id,
        user_id=client.user_id,
        payload=client.serializer.pack_arguments((Touch(marker),), {}),
    )
    dispatch = TaskDispatch(
        task_id=submission.task_id,
        endpoint_id=other_endpoint,
        user_id=client.user_id,
        function_sha256=submission.function_sha256,
        routed_at=time.time(),
        submission=encode(submission),
    )
    value = encode(dispatch)
    produce(stack, stack.catalogue.endpoint_queue(stack.endpoint_id), dispatch.task_id, value)
    letter = dead_letter_of(
        stack, value, error_type="IdentityMismatch", component=f"agent {stack.endpoint_id}"
    )
    assert "nothing deserialized" in letter.reason
    assert not marker.exists()
    assert dispatch.task_id.encode() not in keys_of(stack, stack.catalogue.results(client.user_id))


def test_a_task_pinned_to_code_that_changed_since_is_refused(
    stack: PrivatePlatform, client: Client, tmp_path: Path
) -> None:
    function_id = client.register_function(touch)
    old = client.function_sha256(function_id)
    # The function's code changes in the registry (as the service would write it).
    record = decode(
        [m for m in records(stack, stack.catalogue.functions) if m.key() == function_id.encode()][
            -1
        ].value(),
        FunctionRecord,
    )
    code = client.serializer.serialize_function(sleep_then)
    changed = FunctionRecord(
        function_id=function_id,
        name=record.name,
        owner_id=record.owner_id,
        code=code,
        code_sha256=code_sha256(code),
        created_at=time.time(),
    )
    produce(stack, stack.catalogue.functions, function_id, encode(changed))
    # Once the service shows the new code (the router follows the same registry topic):
    # a submission a moment before the change would rightly run the code it pinned.
    deadline = time.monotonic() + WAIT_S
    while client.get_function(function_id)["code_sha256"] != changed.code_sha256:
        assert time.monotonic() < deadline, "the service never showed the changed code"
        time.sleep(0.2)
    time.sleep(1.0)
    marker = tmp_path / "ran"
    task = client.prepare_task(stack.endpoint_id, function_id, (str(marker),), function_sha256=old)
    future = client.track(task)
    client.send([(task, future)])
    with pytest.raises(TaskRejected, match="has changed since this task was prepared"):
        future.result(timeout=WAIT_S)
    assert not marker.exists()


def test_code_whose_digest_is_not_the_dispatchs_is_refused_before_it_is_loaded(
    stack: PrivatePlatform, client: Client, tmp_path: Path
) -> None:
    # Registered code that runs something the moment it is deserialized.
    marker = tmp_path / "loaded"
    serializer = Serializer()
    code = serializer.serialize_function(Touch(marker))
    function_id = client.register_code(code, name="booby-trapped")
    # One genuine, routed task of the function first: an endpoint may fetch only the code of
    # functions routed to it (docs/security.md), so without it the fetch below would be
    # refused before the digest is even compared. Its run loads the code (the marker
    # appears); the marker is then removed, so what follows proves the forged one loads none.
    client.run(endpoint_id=stack.endpoint_id, function_id=function_id)
    deadline = time.monotonic() + WAIT_S
    while not marker.exists():
        assert time.monotonic() < deadline, "the genuine task never loaded its code"
        time.sleep(0.2)
    marker.unlink()
    submission = a_submission(
        client,
        stack.endpoint_id,
        function_id,
        user_id=client.user_id,
        payload=client.serializer.pack_arguments((), {}),
    )
    # A dispatch that pins other code than the registered one (as if the code had been
    # swapped between routing and fetching).
    pinned = hashlib.sha256(b"the code the router checked").hexdigest()
    submission = msgspec.structs.replace(submission, function_sha256=pinned)
    dispatch = TaskDispatch(
        task_id=submission.task_id,
        endpoint_id=stack.endpoint_id,
        user_id=client.user_id,
        function_sha256=pinned,
        routed_at=time.time(),
        submission=encode(submission),
    )
    produce(
        stack, stack.catalogue.endpoint_queue(stack.endpoint_id), dispatch.task_id, encode(dispatch)
    )
    # The agent answers with an integrity error (its result then stops at the ingress:
    # this dispatch was never routed by the router).
    deadline = time.monotonic() + WAIT_S
    answer: TaskResult | None = None
    while answer is None:
        for message in records(stack, stack.catalogue.dead_letter):
            letter = decode(message.value(), DeadLetter)
            if letter.task_id == submission.task_id and letter.component == "ingress":
                answer = decode(letter.original_value, TaskResult)
        assert time.monotonic() < deadline, "the agent never answered the dispatch"
        time.sleep(0.5)
    assert answer.error is not None and answer.error.type == "CodeIntegrityError"
    assert pinned in answer.error.message
    assert not marker.exists()


def test_no_token_is_in_any_kafka_segment_after_a_workload(
    stack: PrivatePlatform, client: Client
) -> None:
    function_id = client.register_function(sleep_then)
    task_ids = [
        client.run(0.0, f"v{i}", endpoint_id=stack.endpoint_id, function_id=function_id)
        for i in range(5)
    ]
    assert [client.future(t).result(timeout=WAIT_S) for t in task_ids] == [
        f"v{i}" for i in range(5)
    ]
    slow = client.run(30.0, "slow", endpoint_id=stack.endpoint_id, function_id=function_id)
    client.cancel(slow)
    token = stack.settings.token
    assert token
    data_dirs = [p for p in (stack.home / "kafka", stack.home / "cluster") if p.exists()]
    assert data_dirs, f"no Kafka data directory under {stack.home}"
    files = [p for d in data_dirs for p in d.rglob("*") if p.is_file()]
    assert any(p.suffix == ".log" for p in files)
    holding = [p for p in files if token.encode() in p.read_bytes()]
    assert holding == [], f"the API token is on disk in {holding}"
    # Nor the routing keys (the stamps are in the records; the keys only in their file),
    # in any Kafka segment or any platform log.
    keys_file = stack.home / "credentials" / "routing-keys.json"
    secrets = [
        form
        for encoded in json.loads(keys_file.read_text())["keys"].values()
        for form in (encoded.encode(), read_routing_keys(keys_file).signing.secret)
    ]
    logs = [p for p in (stack.home / "logs").rglob("*") if p.is_file()]
    assert logs, f"no platform log under {stack.home}"
    leaked = [p for p in [*files, *logs] if any(k in p.read_bytes() for k in secrets)]
    assert leaked == [], f"a routing key is on disk in {leaked}"
