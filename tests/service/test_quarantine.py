"""An input whose output Kafka refuses is dead-lettered, and the processor goes on (real broker).

The router and the task-state processor run each in its own process
(``--only``), as ``./fx up`` runs them. Each test feeds one input whose output
cannot be written, then an ordinary one, and checks that the ordinary one is
processed, the bad one is set aside with its reason, and the process never
exited (before this, it exited, and re-read the same input on restart: a
crash loop).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import Message, Producer

from fxstream.topics import (
    DeadLetter,
    TaskDispatch,
    TaskError,
    TaskErrorType,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    client_info,
    encode,
)
from tests.conftest import RunningPlatform
from tests.service.test_router import (
    ALICE,
    BOB,
    CODE_DIGEST,
    PUBLIC_EP,
    PUBLIC_FN,
    TOKENS,
    Deployment,
    Processors,
    decoded,
    key_is,
    new_task_id,
    submission,
    submit,
)

# The batch header and one record's framing around key, value and one header (Kafka's v2
# record format: 61 bytes of batch header, then varints), rounded up.
_FRAMING = 120


@dataclass
class Stack:
    dep: Deployment
    router: Processors
    task_state: Processors


@pytest.fixture(scope="module")
def stack(
    kafka_platform: RunningPlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    dep = Deployment.provision(kafka_platform, users=[ALICE, BOB], endpoints=[PUBLIC_EP])
    for user, token in TOKENS.items():
        dep.add_user(user, token)
    dep.add_function(PUBLIC_FN, ALICE, public=True)
    dep.add_endpoint(PUBLIC_EP, ALICE, public=True)
    router = Processors(
        dep.kafka, dep.catalogue, tmp_path_factory.mktemp("router"), roles=("router",)
    )
    task_state = Processors(
        dep.kafka, dep.catalogue, tmp_path_factory.mktemp("task-state"), roles=("task-state",)
    )
    try:
        yield Stack(dep, router, task_state)
    finally:
        codes = {"router": router.stop(), "task-state": task_state.stop()}
        dep.close(kafka_platform)
    assert codes == {"router": 0, "task-state": 0}, (router.log()[-3000:], task_state.log()[-3000:])


def _alive(process: Processors) -> None:
    assert process.process.poll() is None, f"the processor exited:\n{process.log()[-3000:]}"
    assert "exiting" not in process.log(), process.log()[-3000:]


def _letters(dep: Deployment, task_id: str) -> list[DeadLetter]:
    return [decoded(m, DeadLetter) for m in dep.reader(dep.catalogue.dead_letter).keyed(task_id)]


def test_a_result_whose_folded_state_is_over_the_limit_is_dead_lettered_and_the_next_folds(
    stack: Stack,
) -> None:
    dep = stack.dep
    # The issue's ValueError("\U0001F600" * 65_536): a 525 kB result (under results.<user>'s
    # limit) whose error the folded state holds twice (as its error and in its attempt).
    emoji = "\U0001f600" * 65_536
    big_id, next_id = new_task_id(), new_task_id()
    big = TaskResult(
        task_id=big_id,
        user_id=BOB,
        function_id=PUBLIC_FN,
        endpoint_id=PUBLIC_EP,
        outcome="error",
        error=TaskError(type="ValueError", message=emoji, traceback=emoji),
        timings=TaskTimings(submitted_at=time.time() - 1, finished_at=time.time()),
    )
    value = encode(big)
    limit = dep.catalogue.spec("results.{user_id}").max_message_bytes
    assert 500_000 < len(value) < limit - _FRAMING
    dep.produce(dep.catalogue.results(BOB), big_id, value)
    ordinary = TaskResult(
        task_id=next_id,
        user_id=BOB,
        function_id=PUBLIC_FN,
        endpoint_id=PUBLIC_EP,
        outcome="success",
        value=b"fxpk\nfine",
        timings=TaskTimings(submitted_at=time.time() - 1, finished_at=time.time()),
    )
    dep.produce(dep.catalogue.results(BOB), next_id, encode(ordinary))

    states = dep.reader(dep.catalogue.task_state)
    state = decoded(states.wait_for(key_is(next_id)), TaskState)
    assert state.state is TaskStateName.SUCCEEDED
    # The big one's outcome: its state, or its dead letter. Either may sit in a partition
    # the reader has not reached yet when the next task's state shows, so wait for one.
    stored: list[Message] = []
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 60
    while not stored and not letters:
        assert time.monotonic() < deadline, "the big result got neither a state nor a letter"
        try:
            stored = [states.wait_for(key_is(big_id), timeout_s=1)]
        except AssertionError:
            try:
                dep.reader(dep.catalogue.dead_letter).wait_for(key_is(big_id), timeout_s=1)
            except AssertionError:
                continue
            letters = _letters(dep, big_id)
    if stored:
        # A bounded fold (topics/ budgets) may make the state fit: then it must fit.
        record: Message = stored[-1]
        assert len(record.value() or b"") <= dep.catalogue.spec("task-state").max_message_bytes
    else:
        (letter,) = letters
        assert letter.error_type == "OutputUnwritable"
        assert letter.component == "task-state"
        assert letter.original_value == value
        assert "max.message.bytes 1048576" in letter.reason, letter.reason
    _alive(stack.task_state)


def _wait_letters(dep: Deployment, task_id: str, *, want: bool) -> list[DeadLetter]:
    reader = dep.reader(dep.catalogue.dead_letter)
    if want:
        reader.wait_for(key_is(task_id), timeout_s=10)
    else:
        try:
            reader.wait_for(key_is(task_id), timeout_s=2)
        except AssertionError:
            return []
    return _letters(dep, task_id)


def _oversized_dispatch(task_id: str, limit: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A submission (value, headers) that from.user.<U> takes, whose dispatch (the
    submission plus ~280 bytes of routing fields, same headers) is over ``limit``."""
    base = TaskSubmission(
        task_id=task_id,
        function_id=PUBLIC_FN,
        endpoint_id=PUBLIC_EP,
        user_id=BOB,
        function_sha256=CODE_DIGEST,
        payload=b"",
        client=client_info(),
        submitted_at=time.time(),
    )
    target = limit - 1_300  # under the router's own size check (it ignores headers)
    payload = b"x" * (target - len(encode(base)) - 5)
    value = encode(TaskSubmission(**{**_fields(base), "payload": payload}))
    dispatch = encode(
        TaskDispatch(
            task_id=task_id,
            endpoint_id=PUBLIC_EP,
            user_id=BOB,
            function_sha256=CODE_DIGEST,
            routed_at=time.time(),
            attempt=1,
            submission=value,
        )
    )
    grows = len(dispatch) - len(value)
    assert grows > 100, grows
    # The submission's record lands midway between the limit and the limit minus growth.
    header = b"h" * (limit - _FRAMING - len(task_id) - len(value) - grows // 2)
    return value, [("pad", header)]


def _fields(task: TaskSubmission) -> dict[str, object]:
    return {name: getattr(task, name) for name in task.__struct_fields__}


def test_a_submission_whose_dispatch_is_over_the_queue_limit_is_refused_and_routing_goes_on(
    stack: Stack,
) -> None:
    dep = stack.dep
    big_id = new_task_id()
    limit = dep.catalogue.spec("tasks.ep.{endpoint_id}").max_message_bytes
    value, headers = _oversized_dispatch(big_id, limit)
    # librdkafka's own default cap (message.max.bytes 1,000,000) is below the topic's.
    producer = Producer({**dep.kafka.confluent(), "message.max.bytes": 2 * limit, "log_level": 2})
    errors: list[object] = []
    ordinary = submission(user=BOB)
    # Both in one flush, so the router most likely reads them in one batch: the refused
    # transaction then holds an ordinary task too, which bisection must keep.
    for key, value_, headers_ in (
        (big_id, value, headers),
        (ordinary.task_id, encode(ordinary), None),
    ):
        producer.produce(
            dep.catalogue.from_user(BOB),
            key=key,
            value=value_,
            headers=headers_,
            on_delivery=lambda err, _: errors.append(err),
        )
    assert producer.flush(10) == 0
    assert errors == [None, None], f"from.user refused a submission (shrink it): {errors}"

    queue = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP))
    dispatch = decoded(queue.wait_for(key_is(ordinary.task_id)), TaskDispatch)
    assert dispatch.task_id == ordinary.task_id
    # The big task is refused (whoever caught it: the router's plan or the broker), never
    # dispatched: its user's future fails with the reason.
    result = decoded(dep.reader(dep.catalogue.results(BOB)).wait_for(key_is(big_id)), TaskResult)
    assert result.error is not None and result.error.type == TaskErrorType.REJECTED
    assert "max.message.bytes" in result.error.message, result.error.message
    dep.reader(dep.catalogue.task_state).wait_for(
        lambda m: key_is(big_id)(m) and decoded(m, TaskState).state is TaskStateName.REJECTED
    )
    letters = _wait_letters(dep, big_id, want=True)
    assert letters and letters[-1].original_value == value
    # Probe transactions are always aborted: a read_committed reader sees the ordinary
    # task dispatched once, and the big one never.
    with contextlib.suppress(AssertionError):
        queue.wait_for(lambda _: False, timeout_s=2.0)
    assert len(queue.keyed(ordinary.task_id)) == 1
    assert not queue.keyed(big_id)
    _alive(stack.router)


def test_after_setting_aside_the_router_still_routes_a_plain_batch(stack: Stack) -> None:
    dep = stack.dep
    tasks = [submission(user=BOB) for _ in range(20)]
    for task in tasks:
        submit(dep, task)
    queue = dep.reader(dep.catalogue.endpoint_queue(PUBLIC_EP))
    for task in tasks:
        queue.wait_for(key_is(task.task_id))
    _alive(stack.router)
