"""The SDK's contracts end to end, on a platform started as `./fx up` starts it.

Data: what a function returns comes back as its value (a mutated by-reference argument
included), classes of a script's ``__main__`` travel by default, the client's data
strategy governs results, and each refusal's advice, followed, works.
Exit: scripts that submit and exit without ``shutdown()``, after ``shutdown(wait=False)``,
after dropping the executor, or from an ``atexit`` hook: every task runs or the submit
raises. Side-effect files prove what ran.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer
from proxystore.proxy import Proxy

from fxstream.connectors import ByReference
from fxstream.sdk import Client, Executor, TaskExecutionFailed
from fxstream.topics import SerializationError, Serializer, TaskResult, encode
from tests.e2e.stack import Stack

pytestmark = pytest.mark.platform

WAIT_S = 60.0


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def scale(a: Any) -> Any:
    a *= 2
    return a


def echo(value: Any) -> Any:
    return value


def pair_of(a: Any) -> Any:
    return (a, {"again": a})


def as_set(values: list[int]) -> set[int]:
    return set(values)


def add_one(x: int) -> int:
    return x + 1


# --- data ------------------------------------------------------------------------------------


def test_a_by_reference_argument_returned_comes_back_as_its_value(stack: Stack) -> None:
    """800 kB arrays go by reference (store_url set, above proxy_threshold); whatever the
    function returns of them is the value, even after the SDK evicted the arguments."""
    assert stack.settings.store_url is not None
    array = np.arange(100_000, dtype=np.float64)  # 800 kB
    with stack.executor() as executor:
        doubled = executor.submit(scale, array).result(timeout=WAIT_S)
        same = executor.submit(echo, array).result(timeout=WAIT_S)
        both = executor.submit(pair_of, array).result(timeout=WAIT_S)
        small = executor.submit(scale, np.arange(10, dtype=np.float64)).result(timeout=WAIT_S)
    # type(), not isinstance: a proxy claims its target's class.
    assert type(doubled) is np.ndarray and not isinstance(doubled, Proxy)
    np.testing.assert_array_equal(doubled, array * 2)
    assert type(same) is np.ndarray
    np.testing.assert_array_equal(same, array)
    assert type(both[0]) is np.ndarray and both[1]["again"] is both[0]
    np.testing.assert_array_equal(both[0], array)
    np.testing.assert_array_equal(small, np.arange(10) * 2)
    # Long after the arguments were evicted, the values are still whole.
    time.sleep(1.0)
    assert float(np.sum(doubled)) == float(np.sum(array)) * 2


def _script(
    stack: Stack, body: str, tmp_path: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "FXSTREAM_CREDENTIALS": str(stack.credentials)}
    return subprocess.run(
        [sys.executable, str(script), stack.endpoint_id, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


def test_a_class_of_the_scripts_main_is_an_argument_and_a_result(
    stack: Stack, tmp_path: Path
) -> None:
    done = _script(
        stack,
        """
        import sys
        from fxstream.sdk import Executor

        class Point:
            def __init__(self, x):
                self.x = x

        def moved(p):
            return Point(p.x + 1)

        with Executor(endpoint_id=sys.argv[1]) as executor:
            result = executor.submit(moved, Point(41)).result(timeout=60)
        print(type(result).__name__, result.x)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Point", "42"]


def _advised(message: str) -> str:
    found = re.search(r"Serializer\(data='(\w\w)'\)", message)
    assert found is not None, f"no data strategy advised in: {message}"
    return found.group(1)


def test_the_clients_data_strategy_governs_results_and_its_advice_works(stack: Stack) -> None:
    settings = stack.settings
    with (
        Client.from_settings(settings, serializer=Serializer(data="js")) as client,
        Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
    ):
        assert executor.submit(echo, [1, {"a": 2}]).result(timeout=WAIT_S) == [1, {"a": 2}]
        refused = executor.submit(as_set, [1, 2, 2])
        with pytest.raises(TaskExecutionFailed, match="JSON cannot encode set") as caught:
            refused.result(timeout=WAIT_S)
    advised = Serializer(data=_advised(str(caught.value)))
    with (
        Client.from_settings(settings, serializer=advised) as client,
        Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
    ):
        assert executor.submit(as_set, [1, 2, 2]).result(timeout=WAIT_S) == {1, 2}


def test_a_pickle_clients_refusal_advises_a_strategy_that_works(stack: Stack) -> None:
    settings = stack.settings
    with (
        Client.from_settings(settings, serializer=Serializer(data="pk")) as client,
        Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
        pytest.raises(SerializationError) as caught,
    ):
        executor.submit(echo, lambda x: x * 3)
    advised = Serializer(data=_advised(str(caught.value)))
    with (
        Client.from_settings(settings, serializer=advised) as client,
        Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
    ):
        tripled = executor.submit(echo, lambda x: x * 3).result(timeout=WAIT_S)
    assert tripled(5) == 15


def total(values: list[int]) -> int:
    return sum(values)


def test_a_future_inside_an_argument_is_refused_and_its_advice_works(stack: Stack) -> None:
    """A future as a top-level argument is a dependency (tests/e2e/test_dags.py); inside a
    container nothing would replace it, so it is refused, saying what to do instead."""
    with stack.executor() as executor:
        first = executor.submit(add_one, 1)
        for nested in ([first, 1], {"x": first}):
            with pytest.raises(SerializationError, match=r"as a top-level argument"):
                executor.submit(total, nested)  # type: ignore[arg-type]
        # The advice, either way: the future itself as a top-level argument ...
        assert executor.submit(add_one, first).result(timeout=WAIT_S) == 3  # type: ignore[arg-type]
        assert executor.submit(add_one, x=first).result(timeout=WAIT_S) == 3  # type: ignore[arg-type]
        # ... or its value, inside the container.
        assert executor.submit(total, [first.result(timeout=WAIT_S), 1]).result(timeout=WAIT_S) == 3


# --- exit ------------------------------------------------------------------------------------

_MARK = """
import pathlib, sys
from fxstream.sdk import Executor

def mark(path):
    pathlib.Path(path).write_text("ran")
    return path

out = pathlib.Path(sys.argv[2])
"""


def _wait_for_files(paths: list[Path]) -> list[Path]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.2)
    return [p for p in paths if not p.exists()]


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("", id="no-shutdown"),
        pytest.param("executor.shutdown(wait=False)", id="shutdown-without-wait"),
        pytest.param("del executor; import gc; gc.collect()", id="dropped-executor"),
    ],
)
def test_a_script_that_exits_at_once_loses_no_task(
    stack: Stack, tmp_path: Path, ending: str
) -> None:
    body = (
        _MARK
        + """
executor = Executor(endpoint_id=sys.argv[1])
futures = [executor.submit(mark, str(out / f"task-{i}")) for i in range(5)]
print("submitted", len(futures))
"""
        + ending
        + "\n"
    )
    done = _script(stack, body, tmp_path, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["submitted", "5"]
    missing = _wait_for_files([tmp_path / f"task-{i}" for i in range(5)])
    assert missing == [], f"tasks lost at exit: {[p.name for p in missing]}"


def test_a_submit_from_an_atexit_hook_runs_or_raises(stack: Stack, tmp_path: Path) -> None:
    body = (
        _MARK
        + """
import atexit

executor = Executor(endpoint_id=sys.argv[1])
executor.submit(mark, str(out / "before")).result(timeout=60)

def late():
    try:
        executor.submit(mark, str(out / "at-exit"))
    except RuntimeError as exc:
        print("refused:", exc)
    else:
        print("accepted")

atexit.register(late)
"""
    )
    done = _script(stack, body, tmp_path, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "before").exists()
    outcome = done.stdout.strip()
    if outcome == "accepted":
        assert _wait_for_files([tmp_path / "at-exit"]) == [], "accepted at exit, never ran"
    else:
        assert outcome.startswith("refused: cannot schedule new futures after interpreter")
        time.sleep(5)
        assert not (tmp_path / "at-exit").exists(), "refused, yet it ran"


# --- remote exceptions -------------------------------------------------------------------------


def missing_key(key: str) -> None:
    table: dict[str, int] = {}
    table[key]


def fails_a_command() -> None:
    # An exception class of an installed module with attributes of its own.
    raise subprocess.CalledProcessError(7, ["make", "all"], output="seven")


def test_a_remote_exception_keeps_its_type_args_and_traceback(stack: Stack) -> None:
    with stack.executor() as executor:
        with pytest.raises(KeyError) as caught:
            executor.submit(missing_key, "the-key").result(timeout=WAIT_S)
        assert caught.value.args == ("the-key",)
        assert isinstance(caught.value, TaskExecutionFailed)
        assert "in missing_key" in caught.value.remote_traceback
        assert "in missing_key" in str(caught.value)
        with pytest.raises(subprocess.CalledProcessError) as odd:
            executor.submit(fails_a_command).result(timeout=WAIT_S)
    assert odd.value.args == (7, ["make", "all"])
    assert (odd.value.returncode, odd.value.output) == (7, "seven")
    assert isinstance(odd.value, TaskExecutionFailed)
    assert "in fails_a_command" in odd.value.remote_traceback


def test_an_exception_class_of_the_scripts_main_is_caught_by_its_name(
    stack: Stack, tmp_path: Path
) -> None:
    done = _script(
        stack,
        """
        import sys
        from fxstream.sdk import Executor

        class Refused(Exception):
            "Raised by the script's own function."

        def refuse(why):
            raise Refused(why, 42)

        with Executor(endpoint_id=sys.argv[1]) as executor:
            try:
                executor.submit(refuse, "no").result(timeout=60)
            except Refused as exc:
                print("caught", exc.args, "in refuse" in exc.remote_traceback)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "caught ('no', 42) True"


# --- what the executor keeps ------------------------------------------------------------------


def test_a_function_is_registered_once_and_nothing_is_kept_alive(stack: Stack) -> None:
    template = "hi {}"
    with stack.client() as client:
        before = len(client.list_functions())
        executor = Executor(endpoint_id=stack.endpoint_id, client=client)
        for i in range(3):
            # A fresh lambda and a fresh bound method each time: the same code.
            assert executor.submit(lambda x: x + 1, i).result(timeout=WAIT_S) == i + 1
            assert executor.submit(template.format, i).result(timeout=WAIT_S) == f"hi {i}"
        assert len(client.list_functions()) - before == 2
        # Neither the callable, nor a done future, nor its result is kept by the executor.
        fn = lambda: {1, 2, 3}  # noqa: E731
        future = executor.submit(fn)
        value = future.result(timeout=WAIT_S)
        watched = [weakref.ref(fn), weakref.ref(future), weakref.ref(value)]
        del fn, future, value
        gc.collect()
        assert [ref() for ref in watched] == [None, None, None]
        # An executor dropped without shutdown() is collected; its last task ran.
        last = executor.submit(add_one, 41)
        dropped = weakref.ref(executor)
        del executor
        gc.collect()
        assert dropped() is None
        assert last.result(timeout=WAIT_S) == 42


def test_a_duplicate_by_reference_result_is_evicted_without_loading_it(stack: Stack) -> None:
    """A second result of a settled task (as after a rebalance) names its stored objects in
    its envelope: they are evicted from that list, and the payload is never loaded."""
    with stack.client() as client:
        assert client.store is not None
        with Executor(endpoint_id=stack.endpoint_id, client=client) as executor:
            future = executor.submit(add_one, 1)
            assert future.result(timeout=WAIT_S) == 2
        packed = ByReference(client.store, threshold_bytes=0).pack_value(os.urandom(10_000))
        (stored,) = packed.stored
        assert client.store.exists(stored.key)
        duplicate = TaskResult(
            task_id=future.task_id,
            user_id=client.user_id,
            function_id=future.function_id,
            endpoint_id=stack.endpoint_id,
            outcome="success",
            value=packed.payload,
        )
        producer = Producer(stack.kafka.confluent())
        producer.produce(
            client.catalogue.results(client.user_id), key=future.task_id, value=encode(duplicate)
        )
        assert producer.flush(30) == 0
        deadline = time.monotonic() + WAIT_S
        while client.duplicate_results < 1:
            assert time.monotonic() < deadline, "the duplicate never arrived"
            time.sleep(0.1)
        while client.store.exists(stored.key):
            assert time.monotonic() < deadline, "the duplicate's object was not evicted"
            time.sleep(0.1)
        assert future.result() == 2 and future.duplicates == 1


def start_then_finish(started: str, finished: str, seconds: float) -> str:
    Path(started).touch()
    time.sleep(seconds)
    Path(finished).touch()
    return "finished"


def test_cancel_never_kills_a_call_that_started(stack: Stack, tmp_path: Path) -> None:
    """``future.cancel()`` right after the task started, before this client can know it
    runs (its running event lags by up to a heartbeat): whatever ``cancel()`` answers,
    the call is not killed. It finishes (its side effect shows), and the future either
    holds its result (``cancel()`` was False) or stays cancelled (True)."""
    started, finished = tmp_path / "started", tmp_path / "finished"
    with stack.executor() as executor:
        future = executor.submit(start_then_finish, str(started), str(finished), 3.0)
        deadline = time.monotonic() + WAIT_S
        while not started.exists():
            assert time.monotonic() < deadline, "the task never started"
            time.sleep(0.02)
        cancelled = future.cancel()
        deadline = time.monotonic() + WAIT_S
        while not finished.exists():
            assert time.monotonic() < deadline, "the started call was killed by cancel()"
            time.sleep(0.1)
        if cancelled:
            assert future.cancelled()
        else:
            assert future.result(timeout=WAIT_S) == "finished"
