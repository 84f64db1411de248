"""Image pools sized to the task mix (funcX section 6.1): with ``max_workers`` each image's
pool gets workers in proportion to its share of the latest tasks, capped by its demand,
the leftover by largest remainder; pools grow and shrink as the mix shifts, within the
budget, and a shrink never kills a running task. Real worker processes in ``process``
images (no sandbox needed)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import psutil
import pytest

from fxstream.agent.containers import Image
from fxstream.agent.engine import WorkOutcome
from fxstream.agent.image_pools import ImagePools
from tests.agent.test_workers import pid_of
from tests.agent.test_workers import until as wait_for
from tests.containers import tasks
from tests.containers.test_runtimes import item

pytestmark = pytest.mark.usefixtures("leaves_no_process")

RUNNER = "fxstream.agent.worker_process:load_pickled"
TIMEOUT = 60.0
A, B, C = (Image(name, "process", "") for name in "abc")
# Worker starts under load take longer than the worker tests' own default wait.
until = functools.partial(wait_for, timeout=TIMEOUT)


def sizes(pools: ImagePools) -> dict[str | None, int]:
    """Each running pool's size (the workers it keeps)."""
    return {name: engine.size for name, engine in pools.pools().items()}


def submit(pools: ImagePools, image: str, seconds: float) -> Future[WorkOutcome]:
    return pools.submit(item(tasks.sleep, seconds, image=image))


def answered(futures: list[Future[WorkOutcome]]) -> list[WorkOutcome]:
    """The outcomes, every one a success (a task killed by a resize would not be)."""
    outcomes = [future.result(TIMEOUT) for future in futures]
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{failed[0].error_type}: {failed[0].error_message}"
    return outcomes


@contextmanager
def budget(pools: ImagePools) -> Iterator[list[int]]:
    """Sample, until the block ends, the most workers the pools hold (``workers_total``,
    retired ones still ending included, read in one snapshot with the keeper's
    decisions): ``[most]``."""
    most = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            most[0] = max(most[0], pools.counts().workers_total)
            done.wait(0.005)

    sampler = threading.Thread(target=sample, name="budget-sampler")
    sampler.start()
    try:
        yield most
    finally:
        done.set()
        sampler.join()


def test_pools_settle_in_proportion_to_the_mix_and_follow_a_shift() -> None:
    # Room for 4 workers, pools of 3 by default: a 3:1 mix gets 3 and 1 (whole pools
    # would fit one pool at a time, and b would wait for a to go idle).
    pools = ImagePools(3, RUNNER, default=A, images=[A, B], max_workers=4, mix_window=16)
    try:
        assert pools.wait_ready(TIMEOUT)
        assert pools.room(["a", "b"]) is None  # both fit, with a worker each: no eviction
        with budget(pools) as most:
            first = [submit(pools, image, 1.0) for _ in range(4) for image in "aaab"]
            until(lambda: pools.targets() == {"a": 3, "b": 1})
            until(lambda: sizes(pools) == {"a": 3, "b": 1})
            answered(first)
            assert pools.mix() == {"a": 12, "b": 4}
            # The mix shifts to 1:3: b's pool grows to 3 as a's shrinks to 1.
            second = [submit(pools, image, 1.0) for _ in range(4) for image in "bbba"]
            until(lambda: sizes(pools) == {"a": 1, "b": 3})
            answered(second)
            assert pools.mix() == {"a": 4, "b": 12}
            until(lambda: len(pools.pools()["a"].worker_pids()) == 1)
            assert pools.counts().workers_total == 4
        assert most == [4], most  # the budget used, never overrun
        assert pools.starts() == {"a": 1, "b": 1}  # resized, never restarted
    finally:
        pools.close()


def test_a_shrink_lets_running_tasks_finish_and_the_new_pool_starts_at_once() -> None:
    pools = ImagePools(3, RUNNER, default=A, images=[A, B], max_workers=4, mix_window=8)
    try:
        assert pools.wait_ready(TIMEOUT)
        engine = pools.pools()["a"]
        pids = set(engine.worker_pids())
        with budget(pools) as most:
            running = [submit(pools, "a", 4.0) for _ in range(3)]
            until(lambda: engine.busy_count == 3)
            later = [submit(pools, "b", 1.0) for _ in range(8)]
            # The window is all b's now: a's target is 1, b's 3 (4 minus a's one).
            until(lambda: pools.targets() == {"a": 1, "b": 3})
            # a's pool shrinks to 1, but its three workers are busy: they answer first.
            until(lambda: engine.size == 1)
            a_done = answered(running)
            assert {pid_of(o) for o in a_done} == pids  # each ran on, and kept, its worker
            until(lambda: sizes(pools) == {"a": 1, "b": 3})
            b_done = answered(later)
            until(lambda: len(engine.worker_pids()) == 1)
        assert most == [4], most
        # b's pool started with the worker left free, while a's tasks still ran.
        assert min(o.started_at or 0.0 for o in b_done) < min(o.finished_at for o in a_done)
        retired = pids - set(engine.worker_pids())
        assert len(retired) == 2
        until(lambda: not any(psutil.pid_exists(pid) for pid in retired))
        assert pools.starts() == {"a": 1, "b": 1}
    finally:
        pools.close()


def test_leftover_workers_go_to_the_largest_remainder() -> None:
    # 5 workers; the last 7 tasks are 4 a, 2 b, 1 c: floors 20/7 = 2, 10/7 = 1, 5/7 = 0
    # (1 at least), one left over: a's remainder (6/7) beats c's (5/7, and c has one task)
    # and b's (3/7), though b's tasks came first (the oldest waiter only breaks ties).
    pools = ImagePools(3, RUNNER, default=A, images=[A, B, C], max_workers=5, mix_window=7)
    try:
        assert pools.wait_ready(TIMEOUT)
        with budget(pools) as most:
            futures = [submit(pools, image, 3.0) for image in "bbcaaaa"]
            until(lambda: pools.targets() == {"a": 3, "b": 1, "c": 1})
            answered(futures)
        assert most[0] <= 5, most
    finally:
        pools.close()


def test_a_pool_is_capped_by_its_demand() -> None:
    # b has every task of the window but only two: two workers, not the four of the budget.
    pools = ImagePools(1, RUNNER, default=A, images=[A, B], max_workers=4, mix_window=8)
    try:
        assert pools.wait_ready(TIMEOUT)
        futures = [submit(pools, "b", 2.0) for _ in range(2)]
        until(lambda: sizes(pools) == {"a": 1, "b": 2})
        assert pools.targets() == {"a": 1, "b": 2}
        outcomes = answered(futures)
        assert len({pid_of(o) for o in outcomes}) == 2  # side by side
        assert pools.counts().workers_total == 3
    finally:
        pools.close()


def test_without_a_budget_every_pool_has_its_full_size() -> None:
    pools = ImagePools(2, RUNNER, default=A, images=[A, B])
    try:
        assert pools.wait_ready(TIMEOUT)
        answered([submit(pools, image, 0.0) for _ in range(2) for image in "aaab"])
        assert sizes(pools) == {"a": 2, "b": 2}
        assert pools.targets() == {"a": 2, "b": 2}
        assert pools.room(["a", "b"]) is None
        assert pools.counts().workers_total == 4
    finally:
        pools.close()
