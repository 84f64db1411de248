"""Trigger rules on a running platform: registered through the SDK, fired by the platform's
trigger processor, each firing authorised by the router as the rule owner's submission.

Events are written to ``events.<source>`` as a source would (the admin's producer); the
functions run on the platform's endpoints. Every module-level name that starts with
``trig-`` is this module's own (the shared platform is used by other modules too).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from confluent_kafka import Producer

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.private import PrivatePlatform
from fxstream.sdk import Client, InvalidRequest, NotFound
from fxstream.service.trigger_processor import firing_task_id
from fxstream.topics import Event, TaskSubmission, TriggerRule, decode, encode
from tests.e2e.stack import added_endpoint, committed_records, other_user_client

pytestmark = pytest.mark.platform


def report(event: dict[str, Any]) -> dict[str, Any]:
    """The trigger tests' function: says which event it ran for."""
    return {"key": event["event_key"], "size": event["attributes"].get("size")}


def slow_report(event: dict[str, Any]) -> dict[str, Any]:
    """Like report, taking 0.4 s, with when it ran."""
    import time as clock

    began = clock.time()
    clock.sleep(0.4)
    return {"key": event["event_key"], "began": began, "ended": clock.time()}


def keywords(**kwargs: Any) -> dict[str, Any]:
    """Returns its keyword arguments."""
    return kwargs


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    return shared_platform


@pytest.fixture(scope="module")
def client(stack: PrivatePlatform) -> Iterator[Client]:
    client = stack.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def producer(stack: PrivatePlatform) -> Iterator[Producer]:
    producer = Producer({**stack.kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    yield producer
    producer.flush(10)


@pytest.fixture
def source(stack: PrivatePlatform) -> str:
    """A fresh source with its events topic."""
    name = f"trig-{uuid.uuid4().hex[:10]}"
    ensure_event_topic(stack.kafka, stack.catalogue, name)
    return name


Emit = Callable[..., tuple[str, int, int]]


@pytest.fixture
def emit(stack: PrivatePlatform, producer: Producer, source: str) -> Emit:
    """Writes an event of ``source``; returns its topic, partition and offset."""

    def write(key: str, **attributes: Any) -> tuple[str, int, int]:
        event = Event(
            source=source,
            event_key=key,
            event_type="file-complete",
            occurred_at=time.time(),
            attributes=attributes,
        )
        delivered: list[Any] = []
        producer.produce(
            stack.catalogue.events(source),
            key=key.encode(),
            value=encode(event),
            on_delivery=lambda err, msg: delivered.append((err, msg)),
        )
        producer.flush(10)
        error, message = delivered[0]
        assert error is None, error
        return message.topic(), message.partition(), message.offset()

    return write


def wait_status(
    client: Client, rule_id: str, done: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = client.get_trigger(rule_id)["status"]
        if done(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"rule {rule_id} never reached the expected status; last: {status}")


def caught_up(status: dict[str, Any]) -> bool:
    return status["waiting"] == 0 and status["in_flight"] == 0


def result_of(client: Client, task_id: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        # NotFound: the processors have not folded the fired task yet; ask again.
        with contextlib.suppress(NotFound):
            state = client.get_task(task_id)
            if state["state"] in ("succeeded", "failed", "rejected", "cancelled"):
                assert state["state"] == "succeeded", state
                return client.get_result(task_id)
        assert time.monotonic() < deadline, f"task {task_id} did not finish"
        time.sleep(0.2)


def submission_of(stack: PrivatePlatform, user_id: str, task_id: str) -> list[TaskSubmission]:
    records = committed_records(stack.kafka, stack.catalogue.from_user(user_id), task_id)
    return [decode(r.value(), TaskSubmission) for r in records]


def test_an_event_fires_one_task_whose_result_names_the_event_and_the_rule(
    stack: PrivatePlatform, client: Client, source: str, emit: Emit
) -> None:
    function_id = client.register_function(report)
    rule_id = client.register_trigger(
        source=source,
        function_id=function_id,
        endpoint_id=stack.endpoint_id,
        key_pattern="*.h5",
        predicates=[("size", "gt", 1024)],
    )
    assert [r["rule_id"] for r in client.list_triggers()].count(rule_id) == 1
    topic, partition, offset = emit("run1/a.h5", size=4096)
    emit("run1/b.txt", size=4096)  # the key pattern does not match
    emit("run1/c.h5", size=10)  # the predicate does not hold
    status = wait_status(client, rule_id, lambda s: caught_up(s) and s["fired"] >= 1)
    assert status["fired"] == 1 and status["states"] == {"succeeded": 1}
    task_id = firing_task_id(rule_id, topic, partition, offset)
    assert result_of(client, task_id) == {"key": "run1/a.h5", "size": 4096}
    state = client.get_task(task_id)
    assert state["task_group_id"] == rule_id
    (submission,) = submission_of(stack, client.user_id, task_id)
    assert submission.trigger is not None
    assert (submission.trigger.rule_id, submission.trigger.event_key) == (rule_id, "run1/a.h5")
    assert (submission.trigger.event_topic, submission.trigger.event_offset) == (topic, offset)
    assert [t["task_id"] for t in client.get_taskgroup_tasks(rule_id)] == [task_id]
    client.delete_trigger(rule_id)


def test_template_arguments_and_constants(
    stack: PrivatePlatform, client: Client, source: str, emit: Emit
) -> None:
    function_id = client.register_function(keywords)
    rule_id = client.register_trigger(
        source=source,
        function_id=function_id,
        endpoint_id=stack.endpoint_id,
        arguments="template",
        template={"path": "attributes.path", "key": "event_key"},
        constants={"threshold": 0.5},
    )
    coordinates = emit("k1", path="/data/k1", size=1)
    assert result_of(client, firing_task_id(rule_id, *coordinates)) == {
        "path": "/data/k1",
        "key": "k1",
        "threshold": 0.5,
    }
    client.delete_trigger(rule_id)


def test_a_paused_rule_fires_nothing_and_fires_again_once_resumed(
    stack: PrivatePlatform, client: Client, source: str, emit: Emit
) -> None:
    function_id = client.register_function(report)
    rule_id = client.register_trigger(
        source=source, function_id=function_id, endpoint_id=stack.endpoint_id
    )
    assert client.pause_trigger(rule_id)["paused"] is True
    emit("while-paused")
    # The processor has gone past the event (no lag) and fired nothing for it.
    status = wait_status(client, rule_id, caught_up)
    assert status["fired"] == 0
    assert client.resume_trigger(rule_id)["paused"] is False
    coordinates = emit("after-resume")
    assert result_of(client, firing_task_id(rule_id, *coordinates))["key"] == "after-resume"
    status = wait_status(client, rule_id, caught_up)
    assert status["fired"] == 1
    client.delete_trigger(rule_id)
    with pytest.raises(NotFound):
        client.get_trigger(rule_id)
    emit("after-delete")
    time.sleep(2)  # a deleted rule fires nothing: the group stays at one task
    assert len(client.get_taskgroup_tasks(rule_id)) == 1


def test_a_rule_at_its_limits_holds_events_and_drains_them_all(
    stack: PrivatePlatform, client: Client, source: str, emit: Emit
) -> None:
    with added_endpoint(stack, "trig-limits", workers=3) as endpoint:
        function_id = client.register_function(slow_report)
        rule_id = client.register_trigger(
            source=source,
            function_id=function_id,
            endpoint_id=endpoint.endpoint_id,
            max_in_flight=1,
        )
        events = [emit(f"burst-{i}") for i in range(5)]
        # Held: one in flight, the others waiting on their topic (the processor's lag).
        wait_status(client, rule_id, lambda s: s["waiting"] > 0 and s["in_flight"] == 1)
        status = wait_status(client, rule_id, lambda s: caught_up(s) and s["fired"] == 5)
        assert status["states"] == {"succeeded": 5}
        runs = [result_of(client, firing_task_id(rule_id, *e)) for e in events]
        assert [r["key"] for r in runs] == [f"burst-{i}" for i in range(5)]
        # Never two at once, although the endpoint has three workers.
        by_start = sorted(runs, key=lambda r: float(r["began"]))
        for earlier, later in itertools.pairwise(by_start):
            assert earlier["ended"] <= later["began"], by_start
        client.delete_trigger(rule_id)

    rate_rule = client.register_trigger(
        source=source,
        function_id=client.register_function(report),
        endpoint_id=stack.endpoint_id,
        max_per_second=2.0,
    )
    for i in range(6):
        emit(f"rate-{i}")
    status = wait_status(client, rate_rule, lambda s: caught_up(s) and s["fired"] == 6)
    assert status["states"] == {"succeeded": 6}
    submitted = sorted(t["timings"]["submitted_at"] for t in client.get_taskgroup_tasks(rate_rule))
    # Two at once (the bucket's second), then one every half second: at least 1.5 s.
    assert submitted[-1] - submitted[0] >= 1.5, submitted
    client.delete_trigger(rate_rule)


def test_registration_errors_say_what_to_do(
    stack: PrivatePlatform, client: Client, source: str
) -> None:
    function_id = client.register_function(report)
    with pytest.raises(InvalidRequest, match="needs a number"):
        client.register_trigger(
            source=source,
            function_id=function_id,
            endpoint_id=stack.endpoint_id,
            predicates=[("size", "gt", "big")],
        )
    with pytest.raises(InvalidRequest, match="needs a template"):
        client.register_trigger(
            source=source,
            function_id=function_id,
            endpoint_id=stack.endpoint_id,
            arguments="template",
        )
    with pytest.raises(NotFound, match="GET /v1/endpoints lists"):
        client.register_trigger(
            source=source, function_id=function_id, endpoint_id=str(uuid.uuid4())
        )


def test_a_user_sees_and_triggers_only_with_what_is_theirs(
    stack: PrivatePlatform, client: Client, source: str, emit: Emit
) -> None:
    private = client.register_function(report)
    rule_id = client.register_trigger(
        source=source, function_id=private, endpoint_id=stack.endpoint_id, paused=True
    )
    other = other_user_client(stack, "trig-other")
    try:
        assert rule_id not in [r["rule_id"] for r in other.list_triggers()]
        for call in (
            other.get_trigger,
            other.pause_trigger,
            other.resume_trigger,
            other.delete_trigger,
        ):
            with pytest.raises(NotFound):
                call(rule_id)
        with pytest.raises(NotFound, match="GET /v1/functions lists"):
            other.register_trigger(
                source=source, function_id=private, endpoint_id=stack.endpoint_id
            )
        # A rule naming another user's private function, written straight to the topic (as
        # only the service could): the processor submits it as its owner, and the router
        # refuses it as it refuses any submission of that user.
        now = time.time()
        forged = msgspec.convert(
            {
                "kind": "trigger-rule",
                "rule_id": str(uuid.uuid4()),
                "owner_id": other.user_id,
                "name": "trig-forged",
                "source": source,
                "function_id": private,
                "function_sha256": client.function_sha256(private),
                "endpoint_id": stack.endpoint_id,
                "created_at": now,
                "updated_at": now,
            },
            TriggerRule,
        )
        writer = Producer({**stack.kafka.confluent(), "log_level": 2})
        writer.produce(stack.catalogue.triggers, key=forged.rule_id.encode(), value=encode(forged))
        assert writer.flush(10) == 0
        time.sleep(1)  # the rule is older than the event (its created_at is now)
        coordinates = emit("forged")
        task_id = firing_task_id(forged.rule_id, *coordinates)
        deadline = time.monotonic() + 60
        while True:
            try:
                state = other.get_task(task_id)
                break
            except NotFound:
                assert time.monotonic() < deadline, "the forged rule's task never appeared"
                time.sleep(0.2)
        assert state["state"] == "rejected"
        assert "function" in state["error"]["message"]
        # The owner's paused rule fired nothing for the same event.
        assert client.get_trigger(rule_id)["status"]["fired"] == 0
        writer.produce(stack.catalogue.triggers, key=forged.rule_id.encode(), value=None)
        writer.flush(10)
    finally:
        other.close()
        client.delete_trigger(rule_id)


def test_the_api_refuses_triggers_without_a_user_token(stack: PrivatePlatform) -> None:
    url = f"{stack.settings.service_url}/v1/triggers"
    assert httpx.get(url, timeout=10).status_code == 401
    admin = httpx.get(url, headers={"Authorization": f"Bearer {stack.admin_token}"}, timeout=10)
    assert admin.status_code == 403
