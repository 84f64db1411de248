"""Task DAGs in the service (real broker, the processors in a subprocess): the router holds a
task with parents (``held-tasks``, ``waiting-for-parents``), the dependencies processor
releases it with its parents' results once they succeeded (the router then dispatches it)
or fails it naming the parent, and a processor SIGKILLed while a task is held decides it
exactly once after its restart.

Parents here are tasks whose results are produced to ``results.<user>`` as an agent would;
the task-state processor folds them, and the dependencies processor reads task-state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Message

from fxstream.topics import (
    HeldTask,
    TaskCancel,
    TaskDispatch,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    client_info,
    decode,
    encode,
)
from tests.conftest import RunningPlatform
from tests.service.test_router import (
    CODE_DIGEST,
    Deployment,
    Processors,
    Reader,
    decoded,
    key_is,
    new_task_id,
)

WAIT_S = 60.0
USER, OTHER = "dora", "olaf"
FUNCTION, ENDPOINT = "fn-dags", "ep-dags"


@dataclass
class Running:
    """The module's deployment and its processors (replaced by the restart test)."""

    dep: Deployment
    processors: Processors
    workdir: Path


@pytest.fixture(scope="module")
def running(
    kafka_platform: RunningPlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Running]:
    """Topics, registry records, then every processor; all torn down at the end."""
    dep = Deployment.provision(kafka_platform, users=[USER, OTHER], endpoints=[ENDPOINT])
    dep.add_user(USER, "dora-token")
    dep.add_user(OTHER, "olaf-token")
    dep.add_function(FUNCTION, USER, public=True)
    dep.add_endpoint(ENDPOINT, USER, public=True)
    workdir = tmp_path_factory.mktemp("dependencies")
    state = Running(dep, Processors(dep.kafka, dep.catalogue, workdir), workdir)
    try:
        yield state
    finally:
        code = state.processors.stop()
        dep.close(kafka_platform)
    assert code == 0, state.processors.log()[-3000:]


def child(*parents: str, task_id: str | None = None) -> TaskSubmission:
    """A task of USER depending on ``parents`` (its payload is never loaded here)."""
    return TaskSubmission(
        task_id=task_id or new_task_id(),
        function_id=FUNCTION,
        endpoint_id=ENDPOINT,
        user_id=USER,
        function_sha256=CODE_DIGEST,
        payload=b"fxpk\n\x00not pickle at all",
        client=client_info(),
        submitted_at=time.time(),
        depends_on=list(parents),
        tags={"dag": "yes"},
    )


def submit(dep: Deployment, task: TaskSubmission) -> None:
    dep.produce(dep.catalogue.from_user(task.user_id), task.task_id, encode(task))


def finish(dep: Deployment, task_id: str, *, value: bytes | None = None, user: str = USER) -> None:
    """A parent's result, as an agent publishes it: success with ``value``, else an error."""
    error = None if value is not None else TaskError(type="ValueError", message="it broke")
    result = TaskResult(
        task_id=task_id,
        user_id=user,
        function_id=FUNCTION,
        endpoint_id=ENDPOINT,
        outcome="success" if value is not None else "error",
        value=value,
        error=error,
        timings=TaskTimings(submitted_at=time.time() - 1, finished_at=time.time()),
    )
    dep.producer.produce(dep.catalogue.results(user), key=task_id, value=encode(result))
    assert dep.producer.flush(10) == 0


def in_state(task_id: str, state: TaskStateName) -> Callable[[Message], bool]:
    return lambda m: m.key() == task_id.encode() and decoded(m, TaskState).state is state


def tombstone_of(task_id: str) -> Callable[[Message], bool]:
    return lambda m: m.key() == task_id.encode() and m.value() is None


def error_result_of(reader: Reader, task_id: str) -> TaskResult:
    result = decoded(reader.wait_for(key_is(task_id), WAIT_S), TaskResult)
    assert result.outcome == "error" and result.error is not None
    return result


def decoded_submission(dispatch: TaskDispatch) -> TaskSubmission:
    """The submission a dispatch carries."""
    return decode(dispatch.submission, TaskSubmission)


def quiet(reader: Reader, quiet_s: float = 2.0) -> None:
    """Read until nothing new arrives for ``quiet_s``."""
    seen = len(reader.messages)
    while True:
        try:
            reader.wait_for(lambda _: False, timeout_s=quiet_s)
        except AssertionError:
            if len(reader.messages) == seen:
                return
            seen = len(reader.messages)


def test_a_held_task_is_released_with_its_parents_results_and_dispatched(
    running: Running,
) -> None:
    dep = running.dep
    first, second = new_task_id(), new_task_id()
    task = child(first, second)
    submit(dep, task)
    held = decoded(dep.reader(dep.catalogue.held_tasks).wait_for(key_is(task.task_id)), HeldTask)
    assert held.depends_on == [first, second] and held.user_id == USER
    assert held.submission == encode(task)
    states = dep.reader(dep.catalogue.task_state)
    waiting = decoded(
        states.wait_for(in_state(task.task_id, TaskStateName.WAITING_FOR_PARENTS)), TaskState
    )
    assert waiting.tags == {"dag": "yes"} and waiting.timings.routed_at is None
    finish(dep, first, value=b"fxpk\nfirst")
    time.sleep(1.5)  # one parent is not enough
    queue = dep.reader(dep.catalogue.endpoint_queue(ENDPOINT))
    quiet(queue, 0.5)
    assert queue.keyed(task.task_id) == []
    finish(dep, second, value=b"fxrf\nsecond-by-reference")
    dispatch = decoded(queue.wait_for(key_is(task.task_id), WAIT_S), TaskDispatch)
    released = decoded_submission(dispatch)
    assert released.parent_results == {first: b"fxpk\nfirst", second: b"fxrf\nsecond-by-reference"}
    assert released.payload == task.payload and released.depends_on == task.depends_on
    states.wait_for(in_state(task.task_id, TaskStateName.ROUTED))
    dep.reader(dep.catalogue.held_tasks).wait_for(tombstone_of(task.task_id), WAIT_S)


def test_a_failed_parent_fails_its_child_and_grandchild_naming_each_parent(
    running: Running,
) -> None:
    dep = running.dep
    root = new_task_id()
    middle = child(root)
    last = child(middle.task_id)
    submit(dep, middle)
    submit(dep, last)
    states = dep.reader(dep.catalogue.task_state)
    states.wait_for(in_state(last.task_id, TaskStateName.WAITING_FOR_PARENTS))
    finish(dep, root)  # an error
    results = dep.reader(dep.catalogue.results(USER))
    first = error_result_of(results, middle.task_id)
    assert first.error is not None and first.error.type == "ParentFailed"
    assert first.error.message == f"parent task {root} failed: ValueError: it broke"
    assert first.tags == {"dag": "yes"} and first.function_id == FUNCTION
    second = error_result_of(results, last.task_id)
    assert second.error is not None and second.error.type == "ParentFailed"
    assert second.error.message.startswith(
        f"parent task {middle.task_id} failed: ParentFailed: parent task {root} failed"
    )
    for task in (middle, last):
        states.wait_for(in_state(task.task_id, TaskStateName.FAILED))
    queue = dep.reader(dep.catalogue.endpoint_queue(ENDPOINT))
    quiet(queue, 0.5)
    assert queue.keyed(middle.task_id) == [] and queue.keyed(last.task_id) == []


def test_parents_already_ended_or_not_the_users_are_decided_at_once(running: Running) -> None:
    dep = running.dep
    done, theirs = new_task_id(), new_task_id()
    finish(dep, done, value=b"fxpk\ndone")
    finish(dep, theirs, value=b"fxpk\ntheirs", user=OTHER)
    states = dep.reader(dep.catalogue.task_state)
    states.wait_for(in_state(done, TaskStateName.SUCCEEDED))
    states.wait_for(in_state(theirs, TaskStateName.SUCCEEDED))
    ready, foreign = child(done), child(done, theirs)
    submit(dep, ready)
    submit(dep, foreign)
    queue = dep.reader(dep.catalogue.endpoint_queue(ENDPOINT))
    dispatch = decoded(queue.wait_for(key_is(ready.task_id), WAIT_S), TaskDispatch)
    assert decoded_submission(dispatch).parent_results == {done: b"fxpk\ndone"}
    unknown = error_result_of(dep.reader(dep.catalogue.results(USER)), foreign.task_id)
    assert unknown.error is not None and unknown.error.type == "ParentUnknown"
    assert f"parent task {theirs} is not a task of user {USER}" in unknown.error.message


def test_a_held_task_is_cancelled_by_its_submitters_cancel(running: Running) -> None:
    dep = running.dep
    parent = new_task_id()
    task = child(parent)
    submit(dep, task)
    states = dep.reader(dep.catalogue.task_state)
    states.wait_for(in_state(task.task_id, TaskStateName.WAITING_FOR_PARENTS))
    cancel = TaskCancel(
        task_id=task.task_id,
        user_id=USER,
        endpoint_id=ENDPOINT,
        requested_at=time.time(),
        reason="not needed",
        kill=False,
    )
    dep.produce(dep.catalogue.from_user(USER), task.task_id, encode(cancel))
    result = error_result_of(dep.reader(dep.catalogue.results(USER)), task.task_id)
    assert result.error is not None and result.error.type == "TaskCancelled"
    assert result.error.message == "cancelled while waiting for its parents: not needed"
    states.wait_for(in_state(task.task_id, TaskStateName.CANCELLED))
    held = dep.reader(dep.catalogue.held_tasks)
    held.wait_for(tombstone_of(task.task_id), WAIT_S)
    # Its parent succeeding later releases nothing: it is no longer held.
    finish(dep, parent, value=b"fxpk\nlate")
    states.wait_for(in_state(parent, TaskStateName.SUCCEEDED))
    queue = dep.reader(dep.catalogue.endpoint_queue(ENDPOINT))
    quiet(queue)
    assert [decode(m.value(), TaskCancel).task_id for m in queue.keyed(task.task_id)] == [
        task.task_id
    ]  # only the forwarded cancel, never a dispatch
    quiet(held)
    # The held record, the cancel's copy, and tombstones: nothing is left held.
    assert held.keyed(task.task_id)[-1].value() is None


def test_a_held_task_is_decided_exactly_once_across_a_sigkill(running: Running) -> None:
    dep = running.dep
    parent = new_task_id()
    task = child(parent)
    submit(dep, task)
    dep.reader(dep.catalogue.held_tasks).wait_for(key_is(task.task_id))
    states = dep.reader(dep.catalogue.task_state)
    states.wait_for(in_state(task.task_id, TaskStateName.WAITING_FOR_PARENTS))
    # Killed while the task is held; its parent ends while no processor runs.
    os.kill(running.processors.process.pid, signal.SIGKILL)
    running.processors.process.wait(timeout=30)
    finish(dep, parent, value=b"fxpk\nwhile-down")
    again = running.workdir / "again"
    again.mkdir()
    running.processors = Processors(dep.kafka, dep.catalogue, again)
    queue = dep.reader(dep.catalogue.endpoint_queue(ENDPOINT))
    dispatch = decoded(queue.wait_for(key_is(task.task_id), WAIT_S * 2), TaskDispatch)
    assert decoded_submission(dispatch).parent_results == {parent: b"fxpk\nwhile-down"}
    held = dep.reader(dep.catalogue.held_tasks)
    held.wait_for(tombstone_of(task.task_id), WAIT_S)
    quiet(queue)
    quiet(held)
    assert len(queue.keyed(task.task_id)) == 1
    assert [m.value() is None for m in held.keyed(task.task_id)] == [False, True]
    submissions = dep.reader(dep.catalogue.from_user(USER))
    submissions.wait_for(key_is(task.task_id))
    quiet(submissions)
    assert len(submissions.keyed(task.task_id)) == 2  # as sent, and released once
