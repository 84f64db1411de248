"""TaskExpiry on the session broker: finished tasks leave task-state after the retention
period, unfinished ones never do, and a restarted expiry goes on where it stopped."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from fxstream.ops.bench.chaos import read_topic
from fxstream.service.registry import RegistryView
from fxstream.service.task_expiry import (
    DEFAULT_RETENTION_S,
    EXIT_EXPIRY_FAILED,
    RETENTION_ENV,
    TaskExpiry,
    exit_when_failed,
    retention_from_env,
    retention_s,
)
from fxstream.topics import Catalogue, KafkaConnection, TaskState, TaskStateName
from tests.service.conftest import Produce, eventually

pytestmark = pytest.mark.platform

RETENTION_S = 3.0


@pytest.fixture
def view(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[RegistryView]:
    view = RegistryView(module_kafka, catalogue, follow=("task-state",))
    view.start()
    assert view.wait_until_current(timeout_s=30)
    yield view
    view.close()


def _state(task_id: str, state: TaskStateName) -> TaskState:
    return TaskState(
        task_id=task_id,
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=state,
        updated_at=time.time(),
    )


def _tombstone_partitions(kafka: KafkaConnection, topic: str, key: str) -> list[int]:
    """The partitions holding a tombstone of ``key`` in ``topic`` (read to its end)."""
    return [
        message.partition() or 0
        for message in read_topic(kafka, topic, isolation="read_uncommitted", timeout_s=30)
        if message.key() == key.encode() and message.value() is None
    ]


def _expiry(
    kafka: KafkaConnection, catalogue: Catalogue, view: RegistryView, group: str
) -> TaskExpiry:
    expiry = TaskExpiry(
        kafka,
        catalogue,
        lookup=view.task,
        group_id=group,
        retention_s=RETENTION_S,
        ready=view.wait_until_current,
    )
    expiry.start()
    return expiry


def test_finished_tasks_leave_task_state_after_the_retention_period_and_no_sooner(
    module_kafka: KafkaConnection, catalogue: Catalogue, produce: Produce, view: RegistryView
) -> None:
    topic = catalogue.task_state
    done, running, later = (f"task-{uuid.uuid4().hex[:8]}" for _ in range(3))
    done_at, _offset = produce(topic, done, _state(done, TaskStateName.SUCCEEDED))
    produce(topic, running, _state(running, TaskStateName.RUNNING))
    produce(topic, later, _state(later, TaskStateName.ROUTED))
    eventually(
        lambda: all(view.task(t) is not None for t in (done, running, later)),
        what="the view read the tasks",
    )
    group = f"fxstream-processors-expiry-{uuid.uuid4().hex[:8]}"
    expiry = _expiry(module_kafka, catalogue, view, group)
    try:
        time.sleep(1.0)
        finished = _state(later, TaskStateName.FAILED)
        produce(topic, later, finished)
        eventually(lambda: view.task(done) is None, timeout_s=30, what="the finished task expired")
        eventually(lambda: view.task(later) is None, timeout_s=30, what="the later one too")
        gone_at = time.time()
        assert gone_at - finished.updated_at >= RETENTION_S, (
            f"the task was expired {gone_at - finished.updated_at:.2f} s after it finished, "
            f"before its {RETENTION_S} s retention"
        )
        # The running task's record is as old, and stays: only finished tasks expire.
        time.sleep(1.0)
        assert view.task(running) is not None, "an unfinished task was expired"
        assert expiry.alive, f"the expiry thread stopped: {expiry.failure}"
        assert expiry.stats.expired == 2
    finally:
        expiry.close()
    assert not expiry.alive
    # The tombstone is on the task's own partition (as the processors, which write with
    # aiokafka, place its states), or compaction would never delete the task's state.
    assert _tombstone_partitions(module_kafka, topic, done) == [done_at]

    # A restarted expiry (same group) goes on after what the first one looked at.
    again = _expiry(module_kafka, catalogue, view, group)
    try:
        fresh = f"task-{uuid.uuid4().hex[:8]}"
        produce(topic, fresh, _state(fresh, TaskStateName.CANCELLED))
        eventually(lambda: view.task(fresh) is not None, what="the view read the new task")
        eventually(lambda: view.task(fresh) is None, timeout_s=30, what="the new task expired")
        assert again.stats.expired == 1
        assert again.stats.gone == 0, "records already looked at were looked at again"
        assert view.task(running) is not None
    finally:
        again.close()


def test_the_retention_period_is_read_from_the_environment() -> None:
    assert retention_from_env({}) == DEFAULT_RETENTION_S
    assert retention_from_env({RETENTION_ENV: " 3600 "}) == 3600.0
    for bad in ("0", "-5", "a week", "inf", "nan"):
        with pytest.raises(ValueError, match="a positive number") as raised:
            retention_from_env({RETENTION_ENV: bad})
        assert RETENTION_ENV in str(raised.value)


def test_a_command_line_retention_wins_and_is_checked() -> None:
    assert retention_s(60.0, {RETENTION_ENV: "3600"}) == 60.0
    assert retention_s(None, {RETENTION_ENV: "3600"}) == 3600.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--task-retention-s"):
            retention_s(bad, {})


def test_an_expiry_that_fails_stops_and_its_process_exits_to_be_restarted(
    module_kafka: KafkaConnection, catalogue: Catalogue, view: RegistryView, produce: Produce
) -> None:
    # A lookup that fails (as a broken on-disk table would) stops the thread with the error,
    # and exit_when_failed then exits with EXIT_EXPIRY_FAILED (here recorded, not exited).
    def broken(task_id: str) -> TaskState | None:
        raise OSError(f"cannot read {task_id}")

    task_id = f"t-broken-{uuid.uuid4().hex[:8]}"
    produce(catalogue.task_state, task_id, _state(task_id, TaskStateName.SUCCEEDED))
    expiry = TaskExpiry(
        module_kafka,
        catalogue,
        lookup=broken,
        group_id=f"expiry-broken-{uuid.uuid4().hex[:8]}",
        retention_s=0.5,
        ready=view.wait_until_current,
    )
    exits: list[int] = []

    async def watch() -> None:
        await asyncio.wait_for(
            exit_when_failed(expiry, every_s=0.1, exit_process=exits.append), timeout=60
        )

    expiry.start()
    try:
        asyncio.run(watch())
    finally:
        expiry.close()
    assert exits == [EXIT_EXPIRY_FAILED]
    assert isinstance(expiry.failure, OSError)
    assert not expiry.alive
