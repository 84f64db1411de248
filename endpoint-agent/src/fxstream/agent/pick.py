"""The warm-first pick: which task of the local queue the engine gets next.

The agent hands its engine a few tasks at a time (``workers + prefetch``) from its
local queue (:class:`~fxstream.agent.held.HeldTasks`). An engine with a pool per image
and a budget of pools (:class:`~fxstream.agent.image_pools.ImagePools` with
``max_workers``) releases an idle pool to start a cold one for a task of another
image, so handing it tasks in arrival order, with many images interleaved, makes
nearly every task a cold start. The pick follows funcX's managers, which take tasks for
the containers they have warm: the engine says which images' pools run and want tasks
(:meth:`~fxstream.agent.engine.Engine.room`), and the pick takes

* the oldest task whose image's pool runs (or starts) and wants tasks, or of an image
  whose pool may start without costing a warm pool its slot: the budget has a spare
  slot, or a running pool is of an image with no task queued (it goes idle and is
  released first; the agent says which images it has queued);
* else nothing, until a pool wants more (its tasks are answered).

No image starves: an image is *passed over* from the first time a younger task of
another image is taken ahead of its oldest task, and once that has lasted
``max_image_wait_s`` its oldest task is taken like a warm one (one such image at a time
waits for a pool; the engine then stops feeding one pool so it goes idle and makes way).
An engine with one pool, or room for every image's, gives no room (``None``): the
queue is then first in, first out, as it always was.

Taking tasks out of order costs the offsets nothing: the commit position is the
contiguous prefix of answered offsets per partition, and answers past it ride in the
commit's metadata (:mod:`fxstream.agent.offsets`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final, Generic, Protocol, TypeVar

from fxstream.agent.engine import PoolRoom

__all__ = ["DEFAULT_MAX_IMAGE_WAIT_S", "LocalQueue", "Queued"]

DEFAULT_MAX_IMAGE_WAIT_S: Final = 30.0
"""How long an image's oldest task may be passed over for warm pools' tasks, by default."""


class Queued(Protocol):
    """What the pick reads of a queued task: its id and the image it runs in."""

    @property
    def task_id(self) -> str:
        """The task's id."""
        ...

    @property
    def image(self) -> str | None:
        """Its image (or interpreter pool; None: the endpoint's default)."""
        ...


T = TypeVar("T", bound=Queued)


class LocalQueue(Generic[T]):
    """Tasks waiting for the engine, in arrival order, kept per image for the pick.

    Not thread-safe: its owner (:class:`~fxstream.agent.held.HeldTasks`) holds a lock.
    """

    def __init__(self, max_image_wait_s: float = DEFAULT_MAX_IMAGE_WAIT_S) -> None:
        if not max_image_wait_s > 0:
            raise ValueError(
                f"max_image_wait_s must be a positive number of seconds, not {max_image_wait_s}"
            )
        self.max_image_wait_s = max_image_wait_s
        # Per image, its tasks oldest first, each with its place in the queue's order.
        self._by_image: dict[str | None, deque[tuple[int, T]]] = {}
        self._back = itertools.count()  # places at the back: 0, 1, ...
        self._front = itertools.count(-1, -1)  # places at the front: -1, -2, ...
        self._len = 0
        # Since when (monotonic) each image's oldest task has been passed over.
        self._passed_over: dict[str | None, float] = {}

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        """The tasks in queue order (oldest first)."""
        merged = heapq.merge(*self._by_image.values(), key=lambda entry: entry[0])
        return (task for _, task in merged)

    def append(self, task: T) -> None:
        """Queue ``task`` behind every other."""
        self._by_image.setdefault(task.image, deque()).append((next(self._back), task))
        self._len += 1

    def appendleft(self, task: T) -> None:
        """Queue ``task`` ahead of every other (a retry: it has waited its turn)."""
        self._by_image.setdefault(task.image, deque()).appendleft((next(self._front), task))
        self._len += 1

    def remove(self, task_id: str) -> T | None:
        """Take the task of ``task_id`` out of the queue, or None when it is not queued."""
        for image, tasks in self._by_image.items():
            for entry in tasks:
                if entry[1].task_id == task_id:
                    tasks.remove(entry)
                    self._len -= 1
                    if not tasks:
                        self._drop(image)
                    return entry[1]
        return None

    def retain(self, keep: Callable[[T], bool]) -> None:
        """Keep only the tasks ``keep`` says to keep (in their order)."""
        for image in list(self._by_image):
            tasks = deque(entry for entry in self._by_image[image] if keep(entry[1]))
            self._len -= len(self._by_image[image]) - len(tasks)
            if tasks:
                self._by_image[image] = tasks
            else:
                self._drop(image)

    def images(self) -> list[str | None]:
        """The images of the queued tasks."""
        return list(self._by_image)

    def _drop(self, image: str | None) -> None:
        del self._by_image[image]
        self._passed_over.pop(image, None)

    def take(self, room: PoolRoom | None, now: float) -> T | None:
        """Take the next task for the engine (see the module notes), or None: the queue
        is empty, or every queued task waits for a pool that is full. ``now`` is the
        monotonic clock."""
        if not self._by_image:
            return None
        heads = {image: tasks[0][0] for image, tasks in self._by_image.items()}
        if room is None:
            image = min(heads, key=heads.__getitem__)
        else:
            eligible: list[str | None] = []
            cold: list[str | None] = []
            for name in heads:
                free = room.free.get(name)
                if free is None:
                    cold.append(name)
                elif free > 0:
                    eligible.append(name)
            # A pool may start for a cold image without costing a warm one its slot.
            spare = room.spare > 0 or room.unwanted > room.blocked
            eligible += [
                name for name in cold if spare or (room.blocked == 0 and self._overdue(name, now))
            ]
            if not eligible:
                return None
            image = min(eligible, key=heads.__getitem__)
            chosen = heads[image]
            for name, place in heads.items():
                if place < chosen:
                    self._passed_over.setdefault(name, now)
        tasks = self._by_image[image]
        task = tasks.popleft()[1]
        self._len -= 1
        self._passed_over.pop(image, None)
        if not tasks:
            self._drop(image)
        return task

    def _overdue(self, image: str | None, now: float) -> bool:
        since = self._passed_over.get(image)
        return since is not None and now - since >= self.max_image_wait_s
