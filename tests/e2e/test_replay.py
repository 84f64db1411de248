"""Replay with every real part: a new process rebuilds a task group's futures.

The session's shared platform, started as `./fx up` starts it (broker, Redis,
the service API, the stream processors and a local endpoint with 2 workers).
Tasks that block until a gate file appears let the tests decide which tasks
end before the first client goes away, which end while no client runs, and
which end after the new client has reloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from fxstream.sdk import (
    Client,
    Executor,
    NotFound,
    TaskExecutionFailed,
    TaskFuture,
)
from fxstream.topics import Catalogue, TaskState, TaskStateName, TaskTimings, encode
from tests.e2e.stack import Stack, other_user_client

pytestmark = pytest.mark.platform

CHILD = Path(__file__).with_name("replay_child.py")


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def double(x: int) -> int:
    return 2 * x


def divide(a: float, b: float) -> float:
    return a / b


def wait_for_gate(path: str, answer: str) -> str:
    """Block until the file ``path`` exists (at most two minutes), then return ``answer``."""
    import os
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {path} never opened")
        time.sleep(0.05)
    return answer


def eventually(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait until ``check()`` holds (a task or group the service does not list yet is not)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(NotFound):  # the service does not list it yet
            if check():
                return
        assert time.monotonic() < deadline, f"not true within {timeout:g} s: {what}"
        time.sleep(0.1)


def states_of(client: Client, group: str) -> dict[str, dict[str, Any]]:
    """Task id -> its state, as the service lists the group."""
    return {task["task_id"]: task for task in client.get_taskgroup_tasks(group)}


def ended(client: Client, task_id: str) -> bool:
    """True once the service shows the task succeeded or failed."""
    try:
        return client.get_task(task_id)["state"] in ("succeeded", "failed")
    except NotFound:  # the task-state processor has not folded it yet
        return False


def assert_delivered_once(client: Client, futures: list[TaskFuture]) -> None:
    """Every future was resolved by this client exactly once, and no result came twice."""
    stats = client.result_stats
    assert stats["delivered"] == len(futures), stats
    assert stats["duplicates"] == 0, stats
    assert all(f.duplicates == 0 for f in futures)


def test_reload_after_the_client_closed_gets_every_result_once(
    stack: Stack, tmp_path: Path
) -> None:
    group = str(uuid.uuid4())
    gate_a, gate_b = str(tmp_path / "a"), str(tmp_path / "b")
    first = stack.client()
    try:
        executor = Executor(endpoint_id=stack.endpoint_id, client=first, task_group_id=group)
        quick = [executor.submit(double, i) for i in range(20)]
        failing = executor.submit(divide, 1, 0)
        assert [f.result(timeout=120) for f in quick] == [2 * i for i in range(20)]
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=120)
        # One task that ends while no client runs, one that ends after the reload.
        ends_unwatched = executor.submit(wait_for_gate, gate_a, "A")
        ends_later = executor.submit(wait_for_gate, gate_b, "B")
        eventually(lambda: len(states_of(first, group)) == 23, "the service lists 23 tasks")
        executor.shutdown(wait=False)
    finally:
        first.close()  # the first "process" is gone; its futures never resolve

    second = stack.client()
    try:
        Path(gate_a).touch()
        eventually(lambda: ended(second, ends_unwatched.task_id), "task A ends unwatched")
        replay = Executor(client=second, task_group_id=group)
        futures = replay.reload_tasks()
        by_id = {f.task_id: f for f in futures}
        assert len(futures) == len(by_id) == 23
        assert set(by_id) == {f.task_id for f in [*quick, failing, ends_unwatched, ends_later]}
        # Ended before the reload (also while nobody listened): resolved at once.
        assert all(by_id[f.task_id].done() for f in [*quick, failing, ends_unwatched])
        assert [by_id[f.task_id].result(timeout=0) for f in quick] == [2 * i for i in range(20)]
        assert by_id[ends_unwatched.task_id].result(timeout=0) == "A"
        error = by_id[failing.task_id].exception(timeout=0)
        assert isinstance(error, TaskExecutionFailed)
        assert isinstance(error, ZeroDivisionError)
        assert "return a / b" in str(error)
        # Still running: resolved by the listener when its result arrives.
        pending = by_id[ends_later.task_id]
        assert not pending.done()
        assert replay.outstanding == 1
        Path(gate_b).touch()
        assert pending.result(timeout=120) == "B"
        assert pending.timings["delivered"] is not None
        # Reloading again hands back the same futures: nothing is delivered twice.
        assert {id(f) for f in replay.reload_tasks()} == {id(f) for f in futures}
        assert_delivered_once(second, futures)
        replay.shutdown()
    finally:
        Path(gate_a).touch()
        Path(gate_b).touch()
        second.close()


def test_a_killed_client_process_is_replayed_by_a_fresh_one(stack: Stack, tmp_path: Path) -> None:
    group = str(uuid.uuid4())
    env = {**os.environ, "FXSTREAM_CREDENTIALS": str(stack.credentials)}
    log = tmp_path / "child.log"
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), stack.endpoint_id, group, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 180)
        line = child.stdout.readline() if ready else b""
        assert line, f"the child reported nothing; its log:\n{log.read_text()[-3000:]}"
        report = json.loads(line)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    client = stack.client()
    try:
        (tmp_path / "a").touch()
        eventually(lambda: ended(client, report["a"]), "task A ends after the kill")
        with Executor(client=client, task_group_id=group) as replay:
            futures = replay.reload_tasks()
            by_id = {f.task_id: f for f in futures}
            assert set(by_id) == {*report["quick"], report["a"], report["b"]}
            assert [by_id[t].result(timeout=0) for t in report["quick"]] == [
                2 * i for i in range(len(report["quick"]))
            ]
            assert by_id[report["a"]].result(timeout=0) == "A"
            assert not by_id[report["b"]].done()
            (tmp_path / "b").touch()
            assert by_id[report["b"]].result(timeout=120) == "B"
        assert_delivered_once(client, futures)
    finally:
        (tmp_path / "a").touch()
        (tmp_path / "b").touch()
        client.close()


def override_state(stack: Stack, client: Client, task_id: str, **changes: Any) -> None:
    """Write a task-state record as the processor would, and wait until the service shows it."""
    current = client.get_task(task_id)
    timings = current["timings"]
    state = TaskState(
        task_id=task_id,
        user_id=client.user_id,
        function_id=current["function_id"],
        endpoint_id=current["endpoint_id"],
        task_group_id=current["task_group_id"],
        state=changes.get("state", TaskStateName.SUCCEEDED),
        updated_at=time.time(),
        timings=TaskTimings(submitted_at=timings["submitted"], routed_at=timings["routed"]),
        value=None,
    )
    producer = Producer({**stack.kafka.confluent(), "acks": "all", "log_level": 2})
    producer.produce(Catalogue(prefix=stack.prefix).task_state, key=task_id, value=encode(state))
    assert producer.flush(30) == 0

    def shown() -> bool:
        task = states_of(client, current["task_group_id"])[task_id]
        return bool(task["state"] == state.state and task["value"] is None)

    eventually(shown, f"the service shows {task_id} as {state.state} without a value")


def test_results_task_state_lacks_are_read_back_from_the_results_topic(stack: Stack) -> None:
    group = str(uuid.uuid4())
    first = stack.client()
    try:
        with Executor(endpoint_id=stack.endpoint_id, client=first, task_group_id=group) as ex:
            too_large, lagging = ex.submit(double, 21), ex.submit(double, 50)
            assert too_large.result(timeout=120) == 42
            assert lagging.result(timeout=120) == 100
        eventually(
            lambda: ended(first, too_large.task_id) and ended(first, lagging.task_id),
            "task-state shows both tasks ended",
        )
        # As if the value had been too large for task-state (it keeps the outcome only) ...
        override_state(stack, first, too_large.task_id, state=TaskStateName.SUCCEEDED)
        # ... and as if the processor had not folded the result yet.
        override_state(stack, first, lagging.task_id, state=TaskStateName.ROUTED)
    finally:
        first.close()

    second = stack.client()
    try:
        futures = second.reload_task_group(group)
        by_id = {f.task_id: f for f in futures}
        assert by_id[too_large.task_id].result(timeout=0) == 42
        assert by_id[lagging.task_id].result(timeout=0) == 100
        assert_delivered_once(second, futures)
    finally:
        second.close()


def test_another_users_group_and_an_unknown_group_are_empty(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    group = str(uuid.uuid4())
    owner = stack.client()
    intruder = other_user_client(stack, "mallory")
    try:
        with Executor(endpoint_id=stack.endpoint_id, client=owner, task_group_id=group) as ex:
            assert ex.submit(double, 1).result(timeout=120) == 2
        eventually(lambda: bool(states_of(owner, group)), "the service lists the task")
        # Another user's group reads as unknown: nothing to reload, nothing revealed.
        with pytest.raises(NotFound):
            intruder.get_taskgroup_tasks(group)
        assert Executor(client=intruder, task_group_id=group).reload_tasks() == []
        with caplog.at_level("WARNING", logger="fxstream.sdk.executor"):
            assert Executor(client=owner).reload_tasks(str(uuid.uuid4())) == []
        assert "nothing to reload" in caplog.text
        with pytest.raises(ValueError, match="not an id"):
            owner.reload_task_group("../tasks")
    finally:
        owner.close()
        intruder.close()
