"""The task lifecycle: which state may follow which, and the memory that enforces it.

::

    submitted --> rejected                                   (router)
        |    \
        |     waiting-for-parents --> failed | cancelled      (router holds; dependencies)
        |          |
        v          v (released: the router routes it)
      routed --+--> running <--> retrying                    (liveness, agent)
               |       ^  \\        |
               |       |   v        v
               +--> waiting-for-endpoint                     (liveness: agent lost)
               |
               +--> succeeded | failed | cancelled           (a result)

From ``routed``, ``running``, ``retrying`` and ``waiting-for-endpoint`` a task
may go to any of those four or to a terminal state; ``succeeded``, ``failed``,
``rejected`` and ``cancelled`` are terminal. A task with parents (issue 15) the router
holds in ``waiting-for-parents`` until the dependencies processor releases it (the
router then routes it: ``routed``, or ``rejected``) or fails it (a ``ParentFailed``,
``ParentUnknown`` or ``ParentResultUnavailable`` result: ``failed``). The router writes
``routed``, ``waiting-for-parents`` and
``rejected`` itself (in the transaction that dispatches, holds or refuses the task),
so the task-state processor sees a task first through a later step and takes
an unknown task to be ``routed``.

After a terminal state:

- a further result is a *duplicate* (the task ran twice after a crash): the
  first stands, the rest are counted and dropped;
- a step observed by the liveness processor, or one about an earlier attempt
  than the terminal one, is *stale* (it describes a moment before the end that
  arrived late): counted and dropped;
- anything else is an *impossible transition*: logged and dead-lettered, not
  applied.

The memory of tasks is bounded (:class:`TaskMemory`): the most recent tasks in
memory, and on a miss the task's state as ``task-state`` holds it (``recall``: the
processor follows the topic into an on-disk table), so a task evicted from memory,
or known only from before a restart, is still checked against its real state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from fxstream.topics import Attempt, TaskState, TaskStateName

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_MEMORY_CAPACITY",
    "EVENT_STATES",
    "TERMINAL_STATES",
    "KnownTask",
    "Recall",
    "TaskMemory",
    "known_from_state",
    "may_follow",
]

TERMINAL_STATES: Final = frozenset(
    {
        TaskStateName.SUCCEEDED,
        TaskStateName.FAILED,
        TaskStateName.REJECTED,
        TaskStateName.CANCELLED,
    }
)
ACTIVE_STATES: Final = frozenset(
    {
        TaskStateName.ROUTED,
        TaskStateName.RUNNING,
        TaskStateName.RETRYING,
        TaskStateName.WAITING_FOR_ENDPOINT,
    }
)
EVENT_STATES: Final = frozenset(
    {
        TaskStateName.RUNNING,
        TaskStateName.RETRYING,
        TaskStateName.WAITING_FOR_ENDPOINT,
        TaskStateName.CANCELLED,
    }
)
"""The states a task event may announce; results end a task, the router starts it."""

_NEXT: Final[dict[TaskStateName, frozenset[TaskStateName]]] = {
    TaskStateName.SUBMITTED: frozenset(
        {TaskStateName.ROUTED, TaskStateName.REJECTED, TaskStateName.WAITING_FOR_PARENTS}
    ),
    TaskStateName.WAITING_FOR_PARENTS: frozenset(
        {
            TaskStateName.ROUTED,
            TaskStateName.REJECTED,
            TaskStateName.FAILED,
            TaskStateName.CANCELLED,
        }
    ),
    **{
        active: (ACTIVE_STATES - {TaskStateName.ROUTED})
        | (TERMINAL_STATES - {TaskStateName.REJECTED})
        for active in ACTIVE_STATES
    },
    **{terminal: frozenset() for terminal in TERMINAL_STATES},
}


def may_follow(current: TaskStateName, following: TaskStateName) -> bool:
    """Whether the lifecycle lets ``following`` come after ``current``."""
    return following in _NEXT[current]


@dataclass(frozen=True, slots=True)
class KnownTask:
    """What the processor remembers of a task: its state, attempt and attempt history."""

    state: TaskStateName
    attempt: int
    attempts: tuple[Attempt, ...] = ()


def known_from_state(state: TaskState) -> KnownTask:
    """What a task-state record says for the lifecycle: its state, the latest attempt
    number it names (1 if none) and its attempt history."""
    attempt = max((a.attempt for a in state.attempts), default=1)
    return KnownTask(state.state, attempt, tuple(state.attempts))


Recall = Callable[[str], KnownTask | None]
"""Looks a task up beyond the memory (the on-disk table of ``task-state``)."""

DEFAULT_MEMORY_CAPACITY: Final = 20_000


class TaskMemory:
    """The last ``capacity`` tasks whose state this processor wrote or recalled, least
    recent out first; a miss asks ``recall`` (and remembers what it answers).

    Bounded on purpose: task-state is unbounded, this memory must not be. Keys
    are 64-bit hashes of task ids; a collision, at odds near 1e-8, would make
    one task look like another. ``recall`` must not lag the processor's own
    writes by more than ``capacity`` tasks (the on-disk table lags by well under
    a second; 20,000 tasks are 40 s at 500 tasks/s).
    """

    def __init__(
        self, capacity: int = DEFAULT_MEMORY_CAPACITY, recall: Recall | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._recall = recall
        self._tasks: dict[int, KnownTask] = {}
        self.recalled = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, task_id: str) -> KnownTask | None:
        """What is remembered of ``task_id``, else what ``recall`` knows, else None."""
        known = self._tasks.get(hash(task_id))
        if known is not None or self._recall is None:
            return known
        known = self._recall(task_id)
        if known is not None:
            self.recalled += 1
            self.put(task_id, known)
        return known

    def clear(self) -> None:
        """Forget every task (``recall`` still answers): after a rebalance, another
        instance may have written the state of tasks remembered here."""
        self._tasks.clear()

    def put(self, task_id: str, known: KnownTask) -> None:
        """Remember ``known`` for ``task_id`` as the most recent entry."""
        key = hash(task_id)
        self._tasks.pop(key, None)
        self._tasks[key] = known
        if len(self._tasks) > self._capacity:
            # dicts keep insertion order, so the first key is the least recently written.
            del self._tasks[next(iter(self._tasks))]
