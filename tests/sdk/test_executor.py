"""The Executor end to end through Kafka, with a responder thread in place of router and agent."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fxstream.sdk import (
    TIMING_KEYS,
    Client,
    Executor,
    ServiceUnavailable,
    ShellFunction,
    ShellResult,
    TaskExecutionFailed,
    TaskFuture,
)
from fxstream.topics import Serializer
from tests.conftest import write_kafka_credentials
from tests.sdk.conftest import SdkTopics
from tests.sdk.streams import Responder, ResultWriter, success

ENDPOINT = "ep-exec"
IDLE_ENDPOINT = "ep-idle"  # nobody answers here


def square(x: int) -> int:
    return x * x


def add(x: int, y: int, *, scale: int = 1) -> int:
    return (x + y) * scale


def fails(x: int) -> None:
    raise ValueError(f"bad value {x}")


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


SHELL = ShellFunction("echo hello {name}", name="greet")

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "f-square": square,
    "f-add": add,
    "f-fails": fails,
    "f-nap": nap,
    "f-shell": SHELL,
}


@pytest.fixture(scope="module")
def responder(sdk_topics: SdkTopics) -> Iterator[Responder]:
    """Answers every task for ENDPOINT through the broker."""
    code = {fid: Serializer().serialize_function(fn) for fid, fn in FUNCTIONS.items()}
    with Responder(sdk_topics.kafka, sdk_topics.catalogue, ENDPOINT, code) as running:
        yield running
    assert running.errors == []


@pytest.fixture
def executor(client: Client, responder: Responder) -> Iterator[Executor]:
    """An executor on the responder's endpoint with the test functions associated."""
    ex = Executor(endpoint_id=ENDPOINT, client=client)
    for function_id, fn in FUNCTIONS.items():
        ex.register_function(fn, function_id=function_id)
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


def test_map_returns_results_in_input_order(executor: Executor, responder: Responder) -> None:
    assert list(executor.map(square, range(40), timeout=60)) == [i * i for i in range(40)]
    assert list(executor.map(add, [1, 2, 3], [10, 20, 30], timeout=60)) == [11, 22, 33]


def test_submit_with_args_and_kwargs_and_full_timings(executor: Executor) -> None:
    future = executor.submit(add, 2, 3, scale=10)
    assert isinstance(future, concurrent.futures.Future)
    assert isinstance(future, TaskFuture)
    assert uuid.UUID(future.task_id).version == 4
    assert future.result(timeout=30) == 50
    timings = future.timings
    assert tuple(timings) == TIMING_KEYS
    hops = [timings[k] for k in TIMING_KEYS]
    assert all(t is not None for t in hops), timings
    assert hops == sorted(hops)  # type: ignore[type-var]


def test_a_remote_exception_is_raised_with_its_traceback(executor: Executor) -> None:
    future = executor.submit(fails, 3)
    with pytest.raises(ValueError, match="bad value 3") as caught:
        future.result(timeout=30)
    assert isinstance(caught.value, TaskExecutionFailed)
    assert "in fails" in caught.value.remote_traceback


def test_functions_are_registered_once_per_executor(client: Client) -> None:
    ex = Executor(endpoint_id=ENDPOINT, client=client)
    assert ex.register_function(square, function_id="f-square") == "f-square"
    assert ex.register_function(square) == "f-square"  # cached: the service is not asked
    # An unregistered function goes to the service, which is not running in these tests.
    with pytest.raises(ServiceUnavailable, match="FXSTREAM_SERVICE_URL"):
        ex.submit(fails, 1)
    ex.shutdown()
    nowhere = Executor(client=client)
    with pytest.raises(ValueError, match="no endpoint"):
        nowhere.submit(square, 1)
    nowhere.shutdown()


def test_as_completed_and_a_small_batch_size(client: Client, responder: Responder) -> None:
    with Executor(endpoint_id=ENDPOINT, client=client, batch_size=1) as ex:
        ex.register_function(square, function_id="f-square")
        futures: dict[concurrent.futures.Future[Any], int] = {
            ex.submit(square, i): i for i in range(20)
        }
        for future in concurrent.futures.as_completed(futures, timeout=60):
            assert future.result() == futures[future] ** 2


def test_shutdown_waits_for_results(client: Client, responder: Responder) -> None:
    ex = Executor(endpoint_id=ENDPOINT, client=client)
    ex.register_function(nap, function_id="f-nap")
    futures = [ex.submit(nap, 0.02) for _ in range(10)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [0.02] * 10
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(nap, 0)


def test_shutdown_with_cancel_futures_cancels_pending_futures(
    client: Client, sdk_topics: SdkTopics
) -> None:
    ex = Executor(endpoint_id=IDLE_ENDPOINT, client=client)
    futures = [ex.submit_to_registered_function("f-square", (i,)) for i in range(20)]
    started = time.monotonic()
    ex.shutdown(wait=True, cancel_futures=True)
    assert time.monotonic() - started < 10
    assert all(f.cancelled() for f in futures)
    assert ex.outstanding == 0
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit_to_registered_function("f-square", (1,))
    # A result that still comes for a cancelled task is dropped quietly.
    ResultWriter(sdk_topics.kafka).result(
        sdk_topics.results, success(futures[0].task_id, sdk_topics.user_id, 0)
    )
    assert futures[0].cancelled()


def test_map_timeout(client: Client) -> None:
    with Executor(endpoint_id=IDLE_ENDPOINT, client=client) as ex:
        ex.register_function(square, function_id="f-square")
        results = ex.map(square, [1, 2], timeout=0.5)
        with pytest.raises(concurrent.futures.TimeoutError):
            list(results)
        ex.shutdown(cancel_futures=True)


def test_a_shell_function_runs_through_the_executor(executor: Executor) -> None:
    result = executor.submit(SHELL, name="world").result(timeout=30)
    assert isinstance(result, ShellResult)
    assert result.returncode == 0
    assert result.stdout == "hello world\n"
    assert result.cmd == "echo hello world"


def test_an_executor_without_a_client_reads_the_environment(
    sdk_topics: SdkTopics, responder: Responder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The Kafka principal comes from the credentials file; the rest from the variables.
    credentials = write_kafka_credentials(sdk_topics.kafka, tmp_path / "credentials.json")
    monkeypatch.setenv("FXSTREAM_CREDENTIALS", str(credentials))
    monkeypatch.setenv("FXSTREAM_SERVICE_URL", sdk_topics.service_url)
    monkeypatch.setenv("FXSTREAM_TOPIC_PREFIX", sdk_topics.catalogue.prefix)
    monkeypatch.setenv("FXSTREAM_USER_ID", sdk_topics.user_id)
    monkeypatch.setenv("FXSTREAM_TOKEN", sdk_topics.token)
    with Executor(endpoint_id=ENDPOINT) as ex:
        ex.register_function(square, function_id="f-square")
        assert ex.submit(square, 9).result(timeout=30) == 81
    with pytest.raises(Exception, match="closed"):
        ex.client.run(endpoint_id=ENDPOINT, function_id="f-square")
