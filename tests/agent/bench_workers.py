"""Throughput of the warm worker pool on no-op tasks (a script, not a test).

Run from the repository root: ``.venv/bin/python -m tests.agent.bench_workers [tasks]``.
It prints tasks per second for a burst (submit everything, then wait) and for
an agent-like window (at most 64 tasks in flight, one submitted as each ends).
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from concurrent.futures import Future

from fxstream.agent import WorkerPool, WorkItem, WorkOutcome

CODE = b"echo"
SHA = hashlib.sha256(CODE).hexdigest()


def burst(pool: WorkerPool, count: int) -> float:
    """Tasks/s when ``count`` tasks are submitted at once."""
    started = time.perf_counter()
    futures = [pool.submit(WorkItem(f"t{i}", "fn-echo", SHA, CODE, b"")) for i in range(count)]
    assert all(f.result().ok for f in futures)
    return count / (time.perf_counter() - started)


def windowed(pool: WorkerPool, count: int, window: int = 64) -> float:
    """Tasks/s with at most ``window`` tasks in flight."""
    slots = threading.Semaphore(window)
    futures: list[Future[WorkOutcome]] = []
    started = time.perf_counter()
    for i in range(count):
        slots.acquire()
        future = pool.submit(WorkItem(f"t{i}", "fn-echo", SHA, None, b""))
        future.add_done_callback(lambda _: slots.release())
        futures.append(future)
    assert all(f.result().ok for f in futures)
    return count / (time.perf_counter() - started)


def round_trip(pool: WorkerPool, count: int = 1000) -> float:
    """Mean seconds from submit to outcome, one task at a time."""
    started = time.perf_counter()
    for i in range(count):
        pool.submit(WorkItem(f"s{i}", "fn-echo", SHA, None, b"")).result()
    return (time.perf_counter() - started) / count


def main() -> None:
    """Measure a 2-worker pool, with and without batching."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    for label, max_batch in (("batching", 16), ("no batching", 1)):
        with WorkerPool(2, "tests.agent.runners:load_behaviour", max_batch=max_batch) as pool:
            assert pool.wait_ready(30)
            burst(pool, 500)  # warm up: load the function, learn that it is short
            bursts = ", ".join(f"{burst(pool, count):,.0f}" for _ in range(3))
            windows = ", ".join(f"{windowed(pool, count):,.0f}" for _ in range(3))
            latency = round_trip(pool) * 1e6
            print(
                f"2 workers, {label}: burst of {count}: {bursts} tasks/s; "
                f"window of 64: {windows} tasks/s; one at a time: {latency:.0f} us per task"
            )


if __name__ == "__main__":
    main()
