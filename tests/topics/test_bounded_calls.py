"""BoundedCaller: a call that does not return by its deadline is left behind, and the
calls after it run on a fresh thread."""

from __future__ import annotations

import threading
import time

import pytest

from fxstream.topics.bounded_calls import BoundedCaller, CallHung


def test_a_call_returns_its_value_and_raises_its_exception() -> None:
    caller = BoundedCaller("t")
    try:
        assert caller.call("add", lambda: 1 + 1, 5.0) == 2
        with pytest.raises(ZeroDivisionError):
            caller.call("divide", lambda: 1 / 0, 5.0)
        assert caller.abandoned == 0
    finally:
        caller.close()


def test_a_hung_call_is_left_behind_at_its_deadline_and_the_next_call_runs() -> None:
    caller = BoundedCaller("t")
    release = threading.Event()
    began = time.monotonic()
    try:
        with pytest.raises(CallHung, match="stuck did not return within 0 s") as hung:
            caller.call("stuck", lambda: release.wait(60), 0.3)
        assert time.monotonic() - began < 5
        assert hung.value.what == "stuck"
        assert caller.abandoned == 1
        # The stuck thread is still inside its call; the next call does not queue behind it.
        assert caller.call("next", lambda: threading.current_thread().name, 5.0) == "t-calls"
        stuck = [t for t in threading.enumerate() if t.name == "t-calls"]
        assert len(stuck) == 2, "the abandoned thread and the fresh one"
    finally:
        release.set()
        caller.close()
    # Once its call returns, the abandoned thread ends instead of serving more calls.
    deadline = time.monotonic() + 5
    while len([t for t in threading.enumerate() if t.name == "t-calls"]) > 0:
        assert time.monotonic() < deadline, "the callers' threads did not end"
        time.sleep(0.05)
