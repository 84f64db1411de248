"""TaskFuture: cancelling and resolving a future no executor worker watches."""

from __future__ import annotations

import concurrent.futures

from fxstream.sdk import TaskFuture


def _future() -> TaskFuture:
    return TaskFuture("t-1", function_id="f-1", endpoint_id="e-1", submitted_at=1.0)


def test_a_cancelled_future_counts_as_done_for_wait() -> None:
    future = _future()
    assert future.cancel()
    done, not_done = concurrent.futures.wait([future], timeout=0)
    assert done == {future} and not not_done


def test_cancelling_twice_is_harmless() -> None:
    # Executor.map cancels the futures it did not consume, even ones a shutdown
    # already cancelled: the second cancel must not raise.
    future = _future()
    assert future.cancel()
    assert future.cancel()
    assert future.cancelled()


def test_a_done_future_cannot_be_cancelled_and_keeps_its_result() -> None:
    future = _future()
    assert future._resolve_result(42)
    assert not future.cancel()
    assert future.result() == 42


def test_a_late_result_for_a_cancelled_future_is_ignored() -> None:
    future = _future()
    future.cancel()
    assert not future._resolve_result(1)
    assert not future._resolve_exception(RuntimeError("late"))
    assert future.cancelled()


def test_a_running_future_refuses_cancel_and_resolves_normally() -> None:
    future = _future()
    assert future._mark_running()
    assert future.running()
    assert not future.cancel()  # concurrent.futures: an executing call cannot be cancelled
    assert future.running() and not future.cancelled()
    assert not future._mark_running()
    assert future._resolve_result(7)
    assert future.result() == 7


def test_a_killed_running_future_ends_cancelled_for_waiters_and_callbacks() -> None:
    future = _future()
    future._mark_running()
    seen: list[bool] = []
    future.add_done_callback(lambda f: seen.append(f.cancelled()))
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(concurrent.futures.wait, [future], 10)
    assert future._resolve_cancelled_remotely()
    done, not_done = waiting.result(timeout=10)
    assert done == {future} and not not_done
    assert future.cancelled() and future.cancelled_remotely
    assert seen == [True]
    assert future._force_cancel()  # already cancelled: still reported so
    assert not future._resolve_result(1)
