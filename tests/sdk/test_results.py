"""The results listener resolves futures from real TaskResult records on the results topic.

The tests submit real tasks (they land on the user's from.user topic) and then produce
the result records themselves, as an agent would.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fxstream.sdk import (
    TIMING_KEYS,
    Client,
    Executor,
    ResultsTopicMissing,
    TaskExecutionFailed,
    TaskPending,
    TaskRejected,
    WalltimeExceeded,
    WorkerLost,
)
from fxstream.topics import (
    ObjectReference,
    Serializer,
    StorageTier,
    TaskError,
    TaskTimings,
    describe_exception,
    wrap_references,
)
from tests.sdk.conftest import OfflineClient, SdkTopics
from tests.sdk.streams import ResultWriter, failure, success

ENDPOINT = "ep-results"
FUNCTION = "f-results"


@pytest.fixture
def writer(sdk_topics: SdkTopics) -> ResultWriter:
    """Produces result records to the module's broker."""
    return ResultWriter(sdk_topics.kafka)


@pytest.fixture
def executor(client: Client) -> Iterator[Executor]:
    """An executor on an endpoint nobody serves: the tests write the results."""
    ex = Executor(endpoint_id=ENDPOINT, client=client)
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (for counters the listener thread updates)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def divide_by_zero(x: int) -> float:
    return x / 0


def test_success_value_resolves_the_future(
    executor: Executor, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    future = executor.submit_to_registered_function(FUNCTION, (1,))
    assert not future.done()
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, {"answer": 42}))
    assert future.result(timeout=20) == {"answer": 42}
    assert future.worker == "testhost:1"
    assert future.attempt == 1


def test_remote_error_raises_with_type_message_and_traceback(
    executor: Executor, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    future = executor.submit_to_registered_function(FUNCTION, (7,))
    try:
        divide_by_zero(7)
    except ZeroDivisionError as exc:
        error = describe_exception(exc)
    writer.result(sdk_topics.results, failure(future.task_id, sdk_topics.user_id, error))

    with pytest.raises(TaskExecutionFailed) as caught:
        future.result(timeout=20)
    failed = caught.value
    assert isinstance(failed, ZeroDivisionError)  # `except ZeroDivisionError` works too
    assert failed.task_id == future.task_id
    assert failed.remote_type == "ZeroDivisionError"
    assert failed.remote_message == "division by zero"
    assert "divide_by_zero" in failed.remote_traceback
    text = str(failed)
    assert "ZeroDivisionError: division by zero" in text
    assert "Remote traceback:" in text
    assert "in divide_by_zero" in text
    assert "return x / 0" in text


@pytest.mark.parametrize(
    ("error_type", "expected"),
    [
        ("TaskRejected", TaskRejected),
        ("WorkerLost", WorkerLost),
        ("WalltimeExceeded", WalltimeExceeded),
        ("mypackage.CustomError", TaskExecutionFailed),
    ],
)
def test_platform_errors_get_their_own_classes(
    executor: Executor,
    writer: ResultWriter,
    sdk_topics: SdkTopics,
    error_type: str,
    expected: type[TaskExecutionFailed],
) -> None:
    future = executor.submit_to_registered_function(FUNCTION)
    detail = f"the platform says no ({error_type})"
    error = TaskError(type=error_type, message=detail, retryable=error_type == "WorkerLost")
    writer.result(sdk_topics.results, failure(future.task_id, sdk_topics.user_id, error))
    exc = future.exception(timeout=20)
    assert type(exc) is expected
    assert isinstance(exc, TaskExecutionFailed)
    assert detail in str(exc)
    assert exc.retryable is (error_type == "WorkerLost")


def test_a_duplicate_result_is_ignored_and_counted(
    executor: Executor, client: Client, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    future = executor.submit_to_registered_function(FUNCTION)
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "first"))
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "second"))
    assert future.result(timeout=20) == "first"
    wait_for(lambda: client.duplicate_results == 1)
    assert future.duplicates == 1
    assert future.result() == "first"
    assert client.result_stats["delivered"] == 1


def test_timings_are_attached_to_the_future(
    executor: Executor, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    future = executor.submit_to_registered_function(FUNCTION)
    submitted = future.timings["submitted"]
    assert submitted is not None and abs(submitted - time.time()) < 10
    t0 = time.time()
    reported = TaskTimings(
        submitted_at=submitted,
        routed_at=t0 + 0.1,
        dequeued_at=t0 + 0.2,
        started_at=t0 + 0.3,
        finished_at=t0 + 0.4,
        result_published_at=t0 + 0.5,
    )
    writer.result(
        sdk_topics.results,
        success(future.task_id, sdk_topics.user_id, None, timings=reported),
    )
    assert future.result(timeout=20) is None
    timings = future.timings
    assert tuple(timings) == TIMING_KEYS
    assert timings["submitted"] == submitted
    assert timings["routed"] == t0 + 0.1
    assert timings["dequeued"] == t0 + 0.2
    assert timings["started"] == t0 + 0.3
    assert timings["finished"] == t0 + 0.4
    assert timings["result_published"] == t0 + 0.5
    delivered = timings["delivered"]
    assert delivered is not None and t0 <= delivered <= time.time()


def test_a_result_produced_right_after_submit_is_not_missed(
    sdk_topics: SdkTopics, writer: ResultWriter
) -> None:
    # A fresh client each time: the first submission is the one a late consumer would miss.
    for _ in range(5):
        with sdk_topics.client() as fresh:
            ex = Executor(endpoint_id=ENDPOINT, client=fresh)
            future = ex.submit_to_registered_function(FUNCTION, (1,))
            writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "fast"))
            assert future.result(timeout=20) == "fast"
            ex.shutdown()


def test_results_racing_submissions_all_resolve(executor: Executor, sdk_topics: SdkTopics) -> None:
    futures = [executor.submit_to_registered_function(FUNCTION, (i,)) for i in range(50)]

    def answer() -> None:
        w = ResultWriter(sdk_topics.kafka)
        for i, f in enumerate(futures):
            w.result(sdk_topics.results, success(f.task_id, sdk_topics.user_id, i))

    thread = threading.Thread(target=answer)
    thread.start()
    assert [f.result(timeout=30) for f in futures] == list(range(50))
    thread.join()


def test_unknown_and_malformed_records_are_counted_and_skipped(
    executor: Executor, client: Client, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    future = executor.submit_to_registered_function(FUNCTION)
    writer.result(sdk_topics.results, success(str(uuid.uuid4()), sdk_topics.user_id, "not ours"))
    writer.write(sdk_topics.results, str(uuid.uuid4()), b"\x00garbage for nobody")
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "ours"))
    assert future.result(timeout=20) == "ours"
    wait_for(lambda: client.result_stats["unknown"] >= 1 and client.result_stats["malformed"] >= 1)


def test_an_unreadable_record_keyed_by_a_waiting_task_is_ignored(
    executor: Executor, client: Client, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    """A record that is not a result says nothing about its task: counted, ignored, and
    the task's real result still resolves the future."""
    future = executor.submit_to_registered_function(FUNCTION)
    before = client.result_stats["malformed"]
    writer.write(sdk_topics.results, future.task_id, b"\x00garbage")
    wait_for(lambda: client.result_stats["malformed"] == before + 1)
    assert not future.done()
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "real"))
    assert future.result(timeout=20) == "real"


class _LoadedMarker:
    """Pickles as "create this file": shows whether a payload was ever unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (self.path,)


def test_a_second_result_is_never_loaded_nor_resolves_again(
    executor: Executor,
    client: Client,
    writer: ResultWriter,
    sdk_topics: SdkTopics,
    tmp_path: Path,
) -> None:
    future = executor.submit_to_registered_function(FUNCTION)
    writer.result(sdk_topics.results, success(future.task_id, sdk_topics.user_id, "first"))
    assert future.result(timeout=20) == "first"
    marker = tmp_path / "loaded"
    inline = Serializer(data="pk").serialize_value(_LoadedMarker(marker))
    reference = ObjectReference(
        object_key="fx:gone", store="no-such-store", size_bytes=10, tier=StorageTier.DURABLE
    )
    duplicates = [
        msgspec.structs.replace(success(future.task_id, sdk_topics.user_id, None), value=value)
        for value in (inline, wrap_references(inline, [reference]))
    ]
    failed = failure(future.task_id, sdk_topics.user_id, TaskError(type="E", message="late"))
    for duplicate in [*duplicates, failed]:
        writer.result(sdk_topics.results, duplicate)
    wait_for(lambda: client.duplicate_results == 3)
    assert not marker.exists(), "a duplicate result was unpickled"
    assert future.result() == "first"
    assert future.duplicates == 3


def test_a_cancelled_future_discards_its_late_result(
    client: Client, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    task_id = client.run(endpoint_id=ENDPOINT, function_id=FUNCTION)  # sent and acknowledged
    future = client.future(task_id)
    assert future.cancel()  # stops waiting; the task itself cannot be recalled
    writer.result(sdk_topics.results, success(task_id, sdk_topics.user_id, "late"))
    wait_for(lambda: client.result_stats["discarded"] == 1)
    assert future.cancelled()
    assert future.timings["delivered"] is not None


def test_run_then_get_result_get_task_and_batch_results(
    client: Client, writer: ResultWriter, sdk_topics: SdkTopics
) -> None:
    ok = client.run(2, 3, endpoint_id=ENDPOINT, function_id=FUNCTION)
    bad = client.run(endpoint_id=ENDPOINT, function_id=FUNCTION)
    waiting = client.run(endpoint_id=ENDPOINT, function_id=FUNCTION)

    with pytest.raises(TaskPending, match="not finished"):
        client.get_result(ok)

    writer.result(sdk_topics.results, success(ok, sdk_topics.user_id, 5))
    error = TaskError(type="ValueError", message="bad input", traceback="Traceback: ...")
    writer.result(sdk_topics.results, failure(bad, sdk_topics.user_id, error))
    client.future(ok).result(timeout=20)
    client.future(bad).exception(timeout=20)

    assert client.get_result(ok) == 5
    with pytest.raises(ValueError, match="bad input"):
        client.get_result(bad)

    task = client.get_task(ok)
    assert task["state"] == "succeeded" and task["pending"] is False
    assert task["timings"]["delivered"] is not None
    # Globus Compute's words and fields beside fxstream's.
    assert task["status"] == "success" and task["result"] == 5
    assert float(task["completion_t"]) > 0
    failed = client.get_task(bad)
    assert failed["state"] == "failed" and failed["status"] == "failed"
    assert failed["error"]["message"] == "bad input"
    assert isinstance(failed["exception"], TaskExecutionFailed) and "result" not in failed
    assert client.get_task(waiting)["status"] == "waiting-for-ep"

    results = client.get_batch_result([ok, bad, waiting])
    assert results[ok]["result"] == 5 and results[ok]["pending"] is False
    assert results[ok]["status"] == "success"
    assert isinstance(results[bad]["exception"], TaskExecutionFailed)
    assert results[waiting]["pending"] is True
    assert results[waiting]["status"] == "waiting-for-ep"


def test_a_missing_results_topic_is_a_clear_error(sdk_topics: SdkTopics) -> None:
    with OfflineClient(
        sdk_topics.service_url,
        kafka=sdk_topics.kafka,
        topic_prefix=sdk_topics.catalogue.prefix,
        user_id=str(uuid.uuid4()),
        token="t",
    ) as stranger:
        with pytest.raises(ResultsTopicMissing, match="does not exist") as caught:
            stranger.run(endpoint_id=ENDPOINT, function_id=FUNCTION)
        assert stranger.catalogue.results(stranger.user_id) in str(caught.value)
