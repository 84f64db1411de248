"""Replay's building blocks on the real broker: the listener's capture and the read-back.

Results are produced to the module's results topic as an agent would; the
listener and :func:`read_back_results` read them. (The whole replay, through
the service and real agents, is tested in tests/e2e/test_replay.py.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Producer

from fxstream.sdk import FxstreamError, TaskFuture
from fxstream.sdk.history import CLOCK_SKEW_S, read_back_results
from fxstream.sdk.results import ResultListener
from fxstream.topics import KafkaConnection, Serializer, TaskResult, encode
from tests.sdk.conftest import SdkTopics
from tests.sdk.streams import end_offsets, success


class Writer:
    """Produces results (optionally stamped with a given time) and reports where they landed."""

    def __init__(self, kafka: KafkaConnection, topic: str) -> None:
        self._producer = Producer({**kafka.confluent(), "acks": "all", "log_level": 3})
        self._topic = topic

    def write(self, result: TaskResult, *, stamped_at: float | None = None) -> tuple[int, int]:
        """Produce ``result``; its (partition, offset) once acknowledged."""
        landed: list[tuple[int, int]] = []

        def report(error: object, message: object) -> None:
            assert error is None, error
            landed.append((message.partition(), message.offset()))  # type: ignore[attr-defined]

        self._producer.produce(
            self._topic,
            key=result.task_id,
            value=encode(result),
            on_delivery=report,
            timestamp=0 if stamped_at is None else int(stamped_at * 1000),
        )
        assert self._producer.flush(30) == 0
        return landed[0]


@pytest.fixture
def writer(sdk_topics: SdkTopics) -> Writer:
    """Writes to the module's results topic."""
    return Writer(sdk_topics.kafka, sdk_topics.results)


@pytest.fixture
def listener(sdk_topics: SdkTopics) -> Iterator[ResultListener]:
    """A started listener on the module's results topic."""
    the_listener = ResultListener(sdk_topics.kafka, sdk_topics.results, Serializer())
    the_listener.start()
    yield the_listener
    the_listener.close()


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (for counters the listener thread updates)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def grouped(task_id: str, user_id: str, value: object, group: str) -> TaskResult:
    """A success result of a task in ``group``."""
    plain = success(task_id, user_id, value)
    return TaskResult(
        task_id=plain.task_id,
        user_id=plain.user_id,
        function_id=plain.function_id,
        endpoint_id=plain.endpoint_id,
        task_group_id=group,
        outcome="success",
        value=plain.value,
        worker=plain.worker,
    )


def future_of(task_id: str) -> TaskFuture:
    """A fresh future, as replay makes one for a task it learns about."""
    return TaskFuture(task_id, function_id="f-1", endpoint_id="ep-1", submitted_at=time.time())


def new_id() -> str:
    """A fresh task or group id."""
    return str(uuid.uuid4())


def test_a_capture_splits_the_topic_at_its_boundary_with_no_gap_and_no_overlap(
    listener: ResultListener, writer: Writer, sdk_topics: SdkTopics
) -> None:
    user, group = sdk_topics.user_id, new_id()
    before, during, elsewhere = new_id(), new_id(), new_id()
    t0 = time.time()
    unknown = listener.unknown
    partition, offset = writer.write(grouped(before, user, "before", group))
    wait_for(lambda: listener.unknown == unknown + 1)  # ignored: nobody tracked it

    with listener.capture(group) as boundary:
        assert boundary[partition] > offset
        writer.write(grouped(during, user, "during", group))
        writer.write(grouped(elsewhere, user, "elsewhere", new_id()))
        wait_for(lambda: listener.unknown == unknown + 2)  # the other group's is not kept

        # What arrived during the capture resolves the task adopted afterwards.
        during_future = listener.adopt(future_of(during))
        assert during_future.result(timeout=0) == "during"

        # What came before the boundary is read back, and only that.
        found = read_back_results(
            sdk_topics.kafka, sdk_topics.results, {before: t0, during: t0}, boundary
        )
        assert set(found) == {before}
        before_future = listener.adopt(future_of(before))
        assert not before_future.done()
        listener.offer(found[before])
        assert before_future.result(timeout=0) == "before"

    # A second result of a delivered task is a counted duplicate, not a second delivery.
    duplicates = listener.duplicates
    writer.write(grouped(during, user, "again", group))
    wait_for(lambda: listener.duplicates == duplicates + 1)
    assert during_future.result(timeout=0) == "during"
    assert during_future.duplicates == 1

    # Once the capture is over the group's untracked results are ignored again.
    after = new_id()
    writer.write(grouped(after, user, "after", group))
    wait_for(lambda: listener.unknown == unknown + 3)
    assert not listener.adopt(future_of(after)).done()


def test_adopting_a_task_already_tracked_keeps_its_future(listener: ResultListener) -> None:
    task_id = new_id()
    first = listener.adopt(future_of(task_id))
    assert listener.adopt(future_of(task_id)) is first


def test_a_settled_future_is_claimed_once_and_its_later_result_is_a_duplicate(
    listener: ResultListener, writer: Writer, sdk_topics: SdkTopics
) -> None:
    task_id = new_id()
    future = listener.adopt(future_of(task_id))
    assert listener.settle(future)
    assert not listener.settle(future)
    future._resolve_result("from task-state")
    duplicates = listener.duplicates
    writer.write(success(task_id, sdk_topics.user_id, "from the topic"))
    wait_for(lambda: listener.duplicates == duplicates + 1)
    assert future.result(timeout=0) == "from task-state"
    assert listener.adopt(future_of(task_id)) is future


def test_a_capture_needs_a_started_listener(sdk_topics: SdkTopics) -> None:
    idle = ResultListener(sdk_topics.kafka, sdk_topics.results, Serializer())
    with pytest.raises(FxstreamError, match="start the results listener"), idle.capture("g"):
        raise AssertionError("a capture on a listener that never started must not begin")


def test_read_back_finds_the_first_result_of_each_task_stamped_since_its_submission(
    writer: Writer, sdk_topics: SdkTopics
) -> None:
    user, now = sdk_topics.user_id, time.time()
    skewed, first, duplicate = new_id(), new_id(), new_id()
    # An agent whose clock is behind the client's stamps results "before" the submission.
    writer.write(success(skewed, user, "skewed"), stamped_at=now - CLOCK_SKEW_S / 2)
    writer.write(success(first, user, 1))
    writer.write(success(duplicate, user, "first"))
    writer.write(success(duplicate, user, "second"))
    ends = end_offsets(sdk_topics.kafka, sdk_topics.results)
    wanted = {skewed: now, first: now, duplicate: now, new_id(): now}
    found = read_back_results(sdk_topics.kafka, sdk_topics.results, wanted, ends)
    assert set(found) == {skewed, first, duplicate}
    serializer = Serializer()
    value = found[duplicate].value
    assert value is not None
    assert serializer.deserialize(value) == "first"

    # An end beyond what the topic holds is waited for, up to the timeout.
    beyond = {partition: end + 1 for partition, end in ends.items()}
    with pytest.raises(FxstreamError, match="longer than"):
        read_back_results(sdk_topics.kafka, sdk_topics.results, {new_id(): now}, beyond, timeout=2)
