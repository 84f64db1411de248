"""Cancel in the SDK: what goes to the user's ``from.user.<user>``, and how a future ends.

Real broker, no router or agent: the tests read the cancel records the Client
produces and write the ``TaskCancelled`` results an agent would (the whole path
runs in tests/e2e/test_cancel.py).
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from fxstream.sdk import Client, Executor
from fxstream.topics import (
    TaskCancel,
    TaskError,
    TaskErrorType,
    decode,
    record_kind,
)
from tests.sdk.conftest import SdkTopics
from tests.sdk.streams import ResultWriter, end_offsets, failure, read_from, read_to_end, success

ENDPOINT = "ep-cancel"
FUNCTION = "f-cancel"


def cancels_after(sdk_topics: SdkTopics, start: dict[int, int]) -> list[TaskCancel]:
    """The cancel records among the records written after ``start`` (call it once the
    client's records are acknowledged: it reads to the end offsets of now, no further)."""
    topic = sdk_topics.submissions
    messages = read_to_end(sdk_topics.kafka, topic, start)
    found = []
    for message in messages:
        if record_kind(message.value()) == "cancel":
            cancel = decode(message.value(), TaskCancel)
            assert message.key() == cancel.task_id.encode()
            found.append(cancel)
    return found


def test_cancelling_a_sent_tasks_future_sends_one_remote_cancel(
    client: Client, sdk_topics: SdkTopics
) -> None:
    start = end_offsets(sdk_topics.kafka, sdk_topics.submissions)
    task_id = client.run(endpoint_id=ENDPOINT, function_id=FUNCTION)  # acknowledged
    future = client.future(task_id)
    before = time.time()
    assert future.cancel()
    assert future.cancel()  # twice: still one remote cancel
    assert future.cancelled() and not future.cancelled_remotely
    client.close()  # flushes what was produced
    [cancel] = cancels_after(sdk_topics, start)
    assert (cancel.task_id, cancel.user_id, cancel.endpoint_id) == (
        task_id,
        sdk_topics.user_id,
        ENDPOINT,
    )
    assert not hasattr(cancel, "auth_token")  # the topic says who asks
    assert cancel.requested_at >= before


def test_client_cancel_returns_once_acknowledged_and_cancels_the_future(
    client: Client, sdk_topics: SdkTopics
) -> None:
    start = end_offsets(sdk_topics.kafka, sdk_topics.submissions)
    task_id = client.run(endpoint_id=ENDPOINT, function_id=FUNCTION)
    client.cancel(task_id, reason="changed my mind")
    assert client.future(task_id).cancelled()
    # Acknowledged: readable at once, without closing (flushing) the client.
    [cancel] = cancels_after(sdk_topics, start)
    assert (cancel.task_id, cancel.reason) == (task_id, "changed my mind")


def test_client_cancel_of_another_sessions_task_needs_its_endpoint(
    client: Client, sdk_topics: SdkTopics
) -> None:
    start = end_offsets(sdk_topics.kafka, sdk_topics.submissions)
    elsewhere = "5d1e9a8c-0f4e-4bde-9c55-3f2a1b7c9d10"
    client.cancel(elsewhere, endpoint_id=ENDPOINT)
    [cancel] = cancels_after(sdk_topics, start)
    assert (cancel.task_id, cancel.endpoint_id) == (elsewhere, ENDPOINT)
    with pytest.raises(ValueError, match="endpoint_id"):
        client.cancel(elsewhere, endpoint_id="not an id")


def test_a_task_cancelled_elsewhere_ends_its_future_cancelled(
    client: Client, sdk_topics: SdkTopics
) -> None:
    start = end_offsets(sdk_topics.kafka, sdk_topics.submissions)
    executor = Executor(endpoint_id=ENDPOINT, client=client)
    future = executor.submit_to_registered_function(FUNCTION)
    other = executor.submit_to_registered_function(FUNCTION)
    error = TaskError(type=TaskErrorType.CANCELLED, message="task was cancelled: by a colleague")
    writer = ResultWriter(sdk_topics.kafka)
    writer.result(sdk_topics.results, failure(future.task_id, sdk_topics.user_id, error))
    writer.result(sdk_topics.results, success(other.task_id, sdk_topics.user_id, 7))
    done, _ = concurrent.futures.wait([future, other], timeout=20)
    assert done == {future, other}
    assert future.cancelled() and future.cancelled_remotely
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert other.result() == 7
    assert client.result_stats["delivered"] == 2
    assert future.cancel()  # already cancelled: True, and no remote cancel is sent
    executor.shutdown(wait=True)
    client.close()
    # Its task was cancelled already: this client sent no cancel of its own.
    assert cancels_after(sdk_topics, start) == []


def test_shutdown_with_cancel_futures_cancels_sent_tasks_remotely(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    executor = Executor(endpoint_id=ENDPOINT, client=client)
    futures = [executor.submit_to_registered_function(FUNCTION, (i,)) for i in range(5)]
    assert len(read_from(sdk_topics.kafka, topic, start, count=5)) == 5  # all sent
    executor.shutdown(wait=True, cancel_futures=True)
    assert all(f.cancelled() for f in futures)
    client.close()
    cancels = cancels_after(sdk_topics, start)
    assert sorted(c.task_id for c in cancels) == sorted(f.task_id for f in futures)
