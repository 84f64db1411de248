"""The task-state processor (real broker, processors in a subprocess) and the shared helpers.

Results are produced to ``results.<user>`` as an agent would; the processor
folds them into ``task-state``. Records that must be read in order are
produced to one partition, since the processor reads each partition in order.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from confluent_kafka import Message

from fxstream.service.task_state import TaskStatePlanner, fold_result, results_pattern
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    RecordDecodeError,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    dead_letter,
    decode,
    encode,
    ensure_topics,
    normalise_headers,
    record_bytes,
)
from tests.conftest import RunningPlatform
from tests.service.test_router import (
    Deployment,
    Processors,
    Reader,
    decoded,
    key_is,
    new_task_id,
)

USER = "dana"
PARTITION = 0  # every result here goes to one partition, so the processor reads them in order

# --- units (no broker) -----------------------------------------------------------------------


def test_results_pattern_matches_only_this_deployments_results_topics() -> None:
    pattern = re.compile(results_pattern(Catalogue(prefix="fx.")))
    assert pattern.match("fx.results.user-1")
    assert pattern.match("fx.results.3f2a9c1e-0000-4000-8000-000000000000")
    assert not pattern.match("fxxresults.user-1")  # '.' is literal
    assert not pattern.match("other.fx.results.user-1")
    assert not pattern.match("fx.results.")
    assert not pattern.match("fx.task-state")
    assert re.compile(results_pattern(Catalogue(prefix=""))).match("results.u")


def test_dead_letter_accepts_any_header_shape_and_keeps_its_limits() -> None:
    assert normalise_headers({"a": b"1"}) == [("a", b"1")]
    assert normalise_headers([("a", b"1"), ("b", None)]) == [("a", b"1"), ("b", None)]
    assert normalise_headers(None) == []
    letter = dead_letter(
        topic="fx.tasks.submitted",
        partition=3,
        offset=7,
        key=b"not a task id!",
        value=b"\xff",
        reason="x" * 100_000,
        error_type=DeadLetterReason.DECODE_ERROR,
        component="router",
    )
    again = decode(encode(letter), DeadLetter)  # within the schema's limits, so it decodes
    assert len(again.reason.encode()) <= 16_384
    assert again.task_id is None  # the key is not an id


def test_fold_keeps_the_value_on_success_and_the_error_on_failure() -> None:
    timings = TaskTimings(submitted_at=1.0, routed_at=2.0, started_at=3.0, finished_at=4.0)
    ok = result("t-1", value=b"fxpk\n42", timings=timings, worker="host:1")
    state = fold_result(ok, now=5.0)
    assert (state.state, state.value, state.error, state.updated_at) == (
        TaskStateName.SUCCEEDED,
        b"fxpk\n42",
        None,
        5.0,
    )
    assert state.timings == timings
    assert [(a.attempt, a.worker, a.started_at, a.finished_at) for a in state.attempts] == [
        (1, "host:1", 3.0, 4.0)
    ]
    error = TaskError(type="ZeroDivisionError", message="division by zero")
    failed = fold_result(result("t-2", error=error, attempt=2), now=5.0)
    assert (failed.state, failed.value, failed.error) == (TaskStateName.FAILED, None, error)
    assert failed.attempts[0].error == error


def test_a_large_error_is_stored_once_and_the_state_fits_its_topic() -> None:
    """A ValueError of 65,536 emoji (a 525 kB result) once made a 1,049,868-byte state."""
    emoji = "\U0001f600" * 65_536
    error = TaskError(type="ValueError", message=emoji, traceback=emoji)
    planner = TaskStatePlanner(Catalogue())
    raw = SimpleNamespace(
        topic=Catalogue().results(USER),
        partition=0,
        offset=0,
        key=b"t-3",
        value=encode(result("t-3", error=error)),
        headers=[],
    )
    (out,) = planner.plan([raw])
    state = decode(out.value, TaskState)
    limit = Catalogue().spec("task-state").max_message_bytes
    assert record_bytes(out.key, out.value) <= limit
    assert state.error is not None and state.error.message.startswith("\U0001f600" * 1000)
    # The full error once, in the state; the attempt keeps its type and a short message.
    assert state.attempts[-1].error is not None
    assert state.attempts[-1].error.traceback == ""
    assert len(state.attempts[-1].error.message.encode()) <= 4096


# --- helpers -----------------------------------------------------------------------------------


def result(
    task_id: str,
    *,
    value: bytes | None = None,
    error: TaskError | None = None,
    attempt: int = 1,
    timings: TaskTimings | None = None,
    worker: str = "node-1:4242",
    user: str = USER,
) -> TaskResult:
    """A result as an agent publishes it: success with ``value``, or error with ``error``."""
    return TaskResult(
        task_id=task_id,
        user_id=user,
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="error" if error else "success",
        value=value,
        error=error,
        attempt=attempt,
        worker=worker,
        timings=timings or TaskTimings(submitted_at=time.time() - 1, finished_at=time.time()),
    )


def publish(dep: Deployment, record: TaskResult | bytes, key: str, user: str = USER) -> None:
    """Produce a result (or raw bytes) to the user's results topic, on one partition."""
    value = record if isinstance(record, bytes) else encode(record)
    dep.producer.produce(dep.catalogue.results(user), key=key, value=value, partition=PARTITION)
    assert dep.producer.flush(10) == 0


def drain(reader: Reader, quiet_s: float = 0.5) -> None:
    """Read until nothing new arrives for ``quiet_s`` (the processor writes a batch at once)."""
    seen = len(reader.messages)
    while True:
        try:
            reader.wait_for(lambda _: False, timeout_s=quiet_s)
        except AssertionError:
            if len(reader.messages) == seen:
                return
            seen = len(reader.messages)


def state_of(message: Message) -> TaskState:
    """The task state a task-state record holds."""
    return decoded(message, TaskState)


def terminal(message: Message) -> bool:
    """True for a succeeded or failed state."""
    return state_of(message).state in (TaskStateName.SUCCEEDED, TaskStateName.FAILED)


# --- the deployment ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(
    kafka_platform: RunningPlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, Processors]]:
    """Topics and the processors; the processors must stop cleanly on SIGTERM."""
    dep = Deployment.provision(kafka_platform, users=[USER], endpoints=[])
    processors = Processors(dep.kafka, dep.catalogue, tmp_path_factory.mktemp("task-state"))
    try:
        yield dep, processors
    finally:
        code = processors.stop()
        dep.close(kafka_platform)
    assert code == 0, processors.log()[-3000:]
    assert "Closing event loop" in processors.log()


# --- tests -------------------------------------------------------------------------------------


def test_success_result_becomes_succeeded_with_its_value(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    task_id = new_task_id()
    timings = TaskTimings(submitted_at=10.0, routed_at=11.0, started_at=12.0, finished_at=13.0)
    publish(dep, result(task_id, value=b"fxpk\nthe answer", timings=timings), task_id)

    state = state_of(dep.reader(dep.catalogue.task_state).wait_for(key_is(task_id)))
    assert state.state is TaskStateName.SUCCEEDED
    assert state.value == b"fxpk\nthe answer"
    assert state.timings == timings
    assert [(a.attempt, a.worker) for a in state.attempts] == [(1, "node-1:4242")]
    assert (state.user_id, state.function_id, state.endpoint_id) == (USER, "fn-1", "ep-1")


def test_error_result_becomes_failed_with_its_error(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    task_id = new_task_id()
    error = TaskError(type="ValueError", message="bad input", traceback="Traceback ...")
    publish(dep, result(task_id, error=error), task_id)

    state = state_of(dep.reader(dep.catalogue.task_state).wait_for(key_is(task_id)))
    assert (state.state, state.error, state.value) == (TaskStateName.FAILED, error, None)


def test_a_duplicate_result_does_not_overwrite_the_first(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, processors = deployment
    states = dep.reader(dep.catalogue.task_state)
    task_id = new_task_id()
    publish(dep, result(task_id, value=b"fxpk\nfirst", worker="node-1:1"), task_id)
    states.wait_for(key_is(task_id))
    # The task ran again after its agent crashed: a second result, another value.
    publish(dep, result(task_id, value=b"fxpk\nsecond", attempt=2, worker="node-2:2"), task_id)
    processors.wait_for_log(f"duplicate result for task {task_id} (attempt 2) ignored")
    drain(states)

    folded = [state_of(m) for m in states.keyed(task_id)]
    assert [(s.state, s.value) for s in folded] == [(TaskStateName.SUCCEEDED, b"fxpk\nfirst")]


def test_the_routers_rejections_are_left_to_the_router(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    states = dep.reader(dep.catalogue.task_state)
    rejected, after = new_task_id(), new_task_id()
    refusal = TaskError(type="TaskRejected", message="function 'x' does not exist")
    publish(dep, result(rejected, error=refusal), rejected)
    publish(dep, result(after, value=b"fxpk\n1"), after)

    states.wait_for(key_is(after))
    drain(states)
    assert states.keyed(rejected) == []  # no "failed" over the router's "rejected"


def test_a_bad_result_is_dead_lettered_and_the_next_one_folded(
    deployment: tuple[Deployment, Processors],
) -> None:
    dep, _ = deployment
    bad_key, good = new_task_id(), new_task_id()
    garbage = b"\xc1 not msgpack"
    with pytest.raises(RecordDecodeError) as expected:
        decode(garbage, TaskResult)
    publish(dep, garbage, bad_key)
    publish(dep, result(good, value=b"fxpk\nok"), good)

    letter = decoded(dep.reader(dep.catalogue.dead_letter).wait_for(key_is(bad_key)), DeadLetter)
    assert (letter.component, letter.error_type) == ("task-state", "RecordDecodeError")
    assert letter.reason == str(expected.value)
    assert letter.original_topic == dep.catalogue.results(USER)
    assert (letter.original_partition, letter.original_value) == (PARTITION, garbage)
    assert state_of(dep.reader(dep.catalogue.task_state).wait_for(key_is(good))).value == (
        b"fxpk\nok"
    )


def test_a_users_results_topic_created_after_start_is_followed(
    kafka_platform: RunningPlatform, deployment: tuple[Deployment, Processors]
) -> None:
    dep, _ = deployment
    dep.reader(dep.catalogue.task_state)  # (the processors are up: this module ran tests)
    newcomer = "erin"
    topic = dep.catalogue.results(newcomer)
    ensure_topics(
        kafka_platform.admin(), dep.catalogue, {topic: dep.catalogue.spec("results.{user_id}")}
    )
    dep.topics.append(topic)
    task_id = new_task_id()
    publish(dep, result(task_id, value=b"fxpk\nhi", user=newcomer), task_id, user=newcomer)

    # The pattern subscription notices new topics at its metadata refresh (5 s), then rebalances.
    state = state_of(dep.reader(dep.catalogue.task_state).wait_for(key_is(task_id), 30))
    assert (state.user_id, state.state) == (newcomer, TaskStateName.SUCCEEDED)
