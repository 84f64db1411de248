"""Batches: several tasks sent together with ``Client.batch_run`` (Globus Compute's ``Batch``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from fxstream.connectors import Packed

__all__ = ["Batch", "Packer"]

Packer = Callable[[str, tuple[Any, ...], Mapping[str, Any] | None], Packed]
"""(function_id, args, kwargs) -> the task's argument payload (raises if it cannot be sent)."""


class Batch:
    """Tasks to run together; create with ``Client.create_batch()``.

    Arguments are serialized and size-checked in :meth:`add`, so a bad
    argument raises there, not at ``batch_run``; the endpoint is chosen at
    ``batch_run``. Iterating gives ``(function_id, packed payload)`` pairs.
    """

    def __init__(self, pack: Packer, task_group_id: str | None = None) -> None:
        self.task_group_id = task_group_id
        self._pack = pack
        self._tasks: list[tuple[str, Packed]] = []

    def add(
        self,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Add one call of ``function_id`` with ``args`` and ``kwargs``.

        Raises :class:`~fxstream.sdk.errors.PayloadTooLarge` or
        :class:`~fxstream.topics.SerializationError` for arguments that cannot
        be sent.
        """
        self._tasks.append((function_id, self._pack(function_id, tuple(args), kwargs)))

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[tuple[str, Packed]]:
        return iter(self._tasks)

    def __repr__(self) -> str:
        return f"Batch({len(self._tasks)} tasks, task_group_id={self.task_group_id!r})"
