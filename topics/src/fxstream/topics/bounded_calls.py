"""Blocking client calls whose caller stops waiting at a deadline the client may not keep.

librdkafka's transactional calls take a timeout, but not every path honours it:
``send_offsets_to_transaction`` waits forever when the consumer group's
coordinator broker dies or leaves the cluster mid-transaction (its coordinator
requests never check their timeout: confluentinc/librdkafka#5456, and a
decommissioned coordinator is never looked up again: #5511), and
``abort_transaction`` has been seen to outlast its timeout during a cluster roll
(#3779). A publisher stuck there commits nothing again, and as it holds the
agent's ``rebalancing`` lock, the agent cannot even hand its partitions back.

:class:`BoundedCaller` runs such calls on a thread of its own and waits for each
at most a deadline; past it, it raises :exc:`CallHung` and abandons that thread
(a call cannot be interrupted; the thread stays blocked, or returns later to
nobody), and the next call runs on a fresh thread. The caller must then stop
using the client the hung call was made on (the agent's publisher replaces its
producer; an event source's writer refuses further writes, and the source restarts),
and keep a reference to it: destroying a client while a thread is inside one of its
calls crashes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["BoundedCaller", "CallHung"]

T = TypeVar("T")


class CallHung(Exception):
    """A call did not return by its deadline; its thread was abandoned."""

    def __init__(self, what: str, waited_s: float) -> None:
        super().__init__(f"{what} did not return within {waited_s:.0f} s")
        self.what = what
        self.waited_s = waited_s


class _Outcome:
    """What one call returned or raised, and when it did."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


_Job = tuple[Callable[[], object], _Outcome]


class BoundedCaller:
    """Runs one call at a time on a daemon thread, waiting for each at most a deadline.

    The handoff costs two thread switches per call; it is meant for calls made a
    few times per transaction, not per record.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self.abandoned = 0
        """Threads left behind in a call that did not return by its deadline."""

    def call(self, what: str, fn: Callable[[], T], deadline_s: float) -> T:
        """``fn()``'s result (or its exception); :exc:`CallHung` if it has not returned
        within ``deadline_s``."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = self._start()
        outcome = _Outcome()
        jobs.put((fn, outcome))
        if not outcome.done.wait(deadline_s):
            # The thread is inside fn for good (or until the client wakes it): leave it.
            self._jobs = None
            jobs.put(None)  # it stops after fn returns, if ever
            self.abandoned += 1
            raise CallHung(what, deadline_s)
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread once it is idle."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    def _start(self) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=_serve, args=(jobs,), name=f"{self._name}-calls", daemon=True
        )
        thread.start()
        return jobs


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, outcome = job
        try:
            outcome.value = fn()
        except BaseException as exc:  # handed to the waiting caller, who raises it
            outcome.error = exc
        outcome.done.set()
