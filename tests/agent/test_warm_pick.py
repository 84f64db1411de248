"""The agent's warm-first pick (:mod:`fxstream.agent.pick`): with fewer image pools than
images, the local queue hands the engine tasks of images whose pools run first, so
interleaved images do not make every task a cold start; an image passed over still runs
within ``max_image_wait_s``; with one pool (or room for every image's) the order is
arrival order, as before.

Real worker processes (``process`` images in :class:`ImagePools`, as the image-pool tests
use). The tasks are held and picked by :class:`HeldTasks` as
:meth:`fxstream.agent.feed.EngineFeed.feed` does (``engine.room(held.queued_images())``,
then ``next_for_engine``), without Kafka: nothing is published, the engine's outcome is
the answer here.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import uuid
from concurrent.futures import Future

import pytest

from fxstream.agent.config import ConfigError
from fxstream.agent.containers import Image
from fxstream.agent.engine import Engine, WorkItem, WorkOutcome
from fxstream.agent.held import Held, HeldTasks
from fxstream.agent.image_pools import ImagePools
from fxstream.agent.process_engine import ProcessEngine
from fxstream.topics import TaskDispatch, TaskSubmission, client_info
from tests.containers import tasks
from tests.containers.test_container_config import config
from tests.containers.test_runtimes import item

RUNNER = "fxstream.agent.worker_process:load_pickled"
TIMEOUT = 120.0
PREFETCH = 16  # the endpoint config's default
IMAGES = [Image(f"img{n}", "process", "") for n in range(6)]
_offsets = itertools.count()


def held(image: str | None) -> Held:
    """A held task of ``image`` (its records as the agent decodes them; never run as such:
    :class:`Feeder` gives the engine its own work item)."""
    task_id = uuid.uuid4().hex
    submission = TaskSubmission(
        task_id=task_id,
        function_id="tests.containers.tasks.sleep",
        endpoint_id="ep",
        user_id="alice",
        function_sha256="0" * 64,
        payload=b"",
        client=client_info(),
        submitted_at=time.time(),
    )
    dispatch = TaskDispatch(
        task_id=task_id,
        endpoint_id="ep",
        user_id="alice",
        function_sha256="0" * 64,
        routed_at=time.time(),
        attempt=1,
        submission=b"",
    )
    return Held(0, next(_offsets), dispatch, submission, time.time(), 100, image=image)


class Feeder:
    """Feeds ``engine`` from ``queue`` as the agent's feed does: at most workers +
    prefetch tasks in the engine, the next one warm-first (or, ``warm_first`` false, the
    oldest: the order before the pick, as a negative control)."""

    def __init__(
        self, engine: Engine, queue: HeldTasks, capacity: int, *, warm_first: bool = True
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.capacity = capacity
        self.warm_first = warm_first
        self.items: dict[str, WorkItem] = {}
        self.handed: list[str] = []  # task ids, in the order the engine got them
        self.outcomes: dict[str, WorkOutcome] = {}
        self.lock = threading.Lock()

    def hold(self, task: Held, seconds: float) -> None:
        self.items[task.task_id] = item(
            tasks.sleep, seconds, task_id=task.task_id, image=task.image
        )
        assert self.queue.hold(task) is None
        self.queue.enqueue(task)

    def feed(self) -> None:
        while True:
            room = self.engine.room(self.queue.queued_images()) if self.warm_first else None
            task = self.queue.next_for_engine(self.capacity, room)
            if task is None:
                return
            with self.lock:
                self.handed.append(task.task_id)
            future = self.engine.submit(self.items[task.task_id])
            future.add_done_callback(functools.partial(self._finished, task))

    def _finished(self, task: Held, future: Future[WorkOutcome]) -> None:
        outcome = future.result()
        with self.lock:
            self.outcomes[task.task_id] = outcome
        self.queue.left_engine(task)
        self.queue.release(task)
        self.feed()

    def run(self) -> None:
        """Feed until every task is answered (the poll loop feeds too, as the agent's does)."""
        deadline = time.monotonic() + TIMEOUT
        while len(self.outcomes) < len(self.items):
            assert time.monotonic() < deadline, f"{len(self.outcomes)} of {len(self.items)}"
            self.feed()
            time.sleep(0.05)
        failed = [o for o in self.outcomes.values() if not o.ok]
        assert not failed, failed[0]


def pools(max_workers: int | None, images: list[Image] = IMAGES) -> ImagePools:
    engine = ImagePools(1, RUNNER, default=None, images=images, max_workers=max_workers)
    assert engine.wait_ready(TIMEOUT)
    return engine


def cold_starts(engine: ImagePools) -> int:
    """Pools started for an image (the default pool's start with the engine aside)."""
    return sum(count for name, count in engine.starts().items() if name is not None)


def interleaved(feeder: Feeder, rounds: int, seconds: float) -> list[Held]:
    held_tasks = [held(image.name) for _ in range(rounds) for image in IMAGES]
    for task in held_tasks:
        feeder.hold(task, seconds)
    return held_tasks


@pytest.mark.parametrize("warm_first", [True, False], ids=["warm-first", "arrival-order"])
def test_interleaved_images_start_each_pool_about_once(warm_first: bool) -> None:
    # 3 pool slots (one worker each) for 6 images, 6 tasks of each, interleaved; a
    # prefetch of 4, so that arrival order thrashes with 6 images (with the default 16 it
    # does with 10, as in `./fx bench routing`).
    engine = pools(max_workers=3)
    try:
        feeder = Feeder(engine, HeldTasks(), 1 + 4, warm_first=warm_first)
        interleaved(feeder, rounds=6, seconds=0.05)
        feeder.run()
        starts = cold_starts(engine)
        if warm_first:
            # Each image's pool starts once, give or take a pool released while another
            # image's task was handed over at once (at most a few).
            assert starts <= 6 + 3, engine.starts()
        else:
            # The negative control: in arrival order nearly every task is a cold start.
            assert starts >= 15, engine.starts()  # 19 measured (36 tasks)
    finally:
        engine.close()


@pytest.mark.parametrize("bound", [1.0, 1000.0], ids=["bounded", "unbounded"])
def test_an_image_passed_over_runs_within_the_wait_bound(bound: float) -> None:
    # 2 pool slots, a steady stream of two images' tasks that keeps both busy, and one
    # task of a third image behind the stream's first few.
    three = IMAGES[:3]
    engine = pools(max_workers=2, images=three)
    try:
        feeder = Feeder(engine, HeldTasks(max_image_wait_s=bound), 1 + PREFETCH)
        stream = [held(three[n % 2].name) for n in range(120)]
        other = held(three[2].name)
        for task in stream[:4]:
            feeder.hold(task, 0.1)
        feeder.hold(other, 0.0)
        for task in stream[4:]:
            feeder.hold(task, 0.1)
        began = time.time()
        feeder.run()
        ran = feeder.outcomes[other.task_id]
        assert ran.started_at is not None
        last_of_stream = max(feeder.outcomes[t.task_id].started_at or 0.0 for t in stream)
        if bound < 10:
            # Within the bound plus a pool's drain and cold start, and long before the
            # stream ended (the run takes 120 x 0.1 s / 2 pools = 6 s at least).
            assert ran.started_at - began <= bound + 4.0, ran.started_at - began
            assert ran.started_at < last_of_stream - 1.0
        else:
            # The negative control: without the bound, the stream keeps both pools warm
            # and the other image runs only once the stream is done.
            assert ran.started_at >= last_of_stream - 0.5
    finally:
        engine.close()


def test_one_pool_or_room_for_every_image_keeps_arrival_order() -> None:
    # One image (the default endpoint): the engine gives no room, the order is FIFO.
    single = ProcessEngine(1, RUNNER)
    try:
        assert single.room(["img0"]) is None
        feeder = Feeder(single, HeldTasks(), 1 + PREFETCH)
        arrived = [held(None) for _ in range(30)]
        for task in arrived:
            feeder.hold(task, 0.0)
        feeder.run()
        assert feeder.handed == [t.task_id for t in arrived]
    finally:
        single.close()
    # Images with a pool each (no max_workers): nothing is ever evicted, no room either.
    every = pools(max_workers=None)
    try:
        assert every.room(["img0"]) is None
        feeder = Feeder(every, HeldTasks(), 1 + PREFETCH)
        arrived = interleaved(feeder, rounds=2, seconds=0.0)
        feeder.run()
        assert feeder.handed == [t.task_id for t in arrived]
        assert cold_starts(every) == 6
    finally:
        every.close()


def test_cancel_and_hand_back_find_tasks_in_the_per_image_queue() -> None:
    queue = HeldTasks()
    arrived = [held(image.name) for _ in range(2) for image in IMAGES[:3]]
    for task in arrived:
        assert queue.hold(task) is None
        queue.enqueue(task)
    claim = queue.claim_cancel(arrived[1].task_id, "not wanted", "alice")
    assert claim.waiting is arrived[1]
    assert queue.queue_size() == (5, 500)
    assert sorted(map(str, queue.queued_images())) == ["img0", "img1", "img2"]
    # Arrival order, without the cancelled task, when the engine gives no room.
    first = queue.next_for_engine(10)
    assert first is arrived[0]
    queue.hand_back_waiting()
    assert queue.queue_size() == (0, 0) and queue.queued_images() == []
    assert queue.next_for_engine(10) is None


def test_the_wait_bound_is_checked_saying_what_to_set() -> None:
    with pytest.raises(ConfigError, match="max_image_wait_s must be a positive number"):
        config(max_image_wait_s=0).validate()
    fine = config(max_image_wait_s=2.5, images={"a": "process"}, max_workers=2)
    fine.validate()
    with pytest.raises(ValueError, match="max_image_wait_s must be a positive number"):
        HeldTasks(max_image_wait_s=-1)
