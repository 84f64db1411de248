"""The dependencies processor's table of held tasks, and which held tasks wait for whom.

``held-tasks`` is compacted and keyed by task id: its latest record per key is a held
task (:class:`~fxstream.topics.HeldTask`) or a tombstone (the task was released or
failed). :class:`HeldTable` folds that topic, read from its beginning, into memory: the
held tasks by id, and for each parent the held tasks that name it, so a parent's end
finds its children without a scan. Nothing else is kept: the topic is the table's only
durable form, so a processor restarted anywhere rebuilds it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fxstream.topics import HeldTask

__all__ = ["HeldEntry", "HeldTable"]


@dataclass(frozen=True, slots=True)
class HeldEntry:
    """One held task: its record and the Kafka headers it was held with (trace context)."""

    held: HeldTask
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def task_id(self) -> str:
        """The held task's id."""
        return self.held.task_id


class HeldTable:
    """Held tasks by id, and the held tasks waiting for each parent."""

    def __init__(self) -> None:
        self._held: dict[str, HeldEntry] = {}
        self._children: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._held

    def __iter__(self) -> Iterator[HeldEntry]:
        return iter(list(self._held.values()))

    def get(self, task_id: str) -> HeldEntry | None:
        """The held task ``task_id``, or None."""
        return self._held.get(task_id)

    def put(self, entry: HeldEntry) -> None:
        """Hold ``entry`` (replacing what its id held before)."""
        self.remove(entry.task_id)
        self._held[entry.task_id] = entry
        for parent in entry.held.depends_on:
            self._children.setdefault(parent, set()).add(entry.task_id)

    def remove(self, task_id: str) -> HeldEntry | None:
        """Forget ``task_id`` (released, failed, or a tombstone read); what it held."""
        entry = self._held.pop(task_id, None)
        if entry is None:
            return None
        for parent in entry.held.depends_on:
            children = self._children.get(parent)
            if children is not None:
                children.discard(task_id)
                if not children:
                    del self._children[parent]
        return entry

    def children_of(self, parent_id: str) -> list[str]:
        """The held tasks that name ``parent_id`` among their parents."""
        return sorted(self._children.get(parent_id, ()))

    def waits_for(self, parent_id: str) -> bool:
        """True if some held task names ``parent_id`` among its parents."""
        return parent_id in self._children
