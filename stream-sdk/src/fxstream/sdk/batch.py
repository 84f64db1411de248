"""Batches: several tasks sent together with ``Client.batch_run`` (Globus Compute's ``Batch``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from fxstream.connectors import Packed
from fxstream.topics import ResourceSpecification, budget

__all__ = ["Batch", "Packer", "refuse_user_endpoint_config"]

Packer = Callable[[str, tuple[Any, ...], Mapping[str, Any] | None], Packed]
"""(function_id, args, kwargs) -> the task's argument payload (raises if it cannot be sent)."""


def refuse_user_endpoint_config(config: Mapping[str, Any] | None) -> None:
    """Globus Compute's per-user endpoint templates have no counterpart here: say so
    (``ValueError``), rather than run tasks on an endpoint configured otherwise than
    asked. ``None`` or an empty mapping passes."""
    if config:
        raise ValueError(
            "user_endpoint_config is not supported: an fxstream endpoint is configured by "
            "its owner (fxstream-endpoint configure), not per user; submit to an endpoint "
            "configured as you need (its worker environment, engine and resources), and "
            "pass MPI needs as resource_specification"
        )


class Batch:
    """Tasks to run together; create with ``Client.create_batch()``.

    Arguments are serialized and size-checked in :meth:`add`, so a bad
    argument raises there, not at ``batch_run``; the endpoint is chosen at
    ``batch_run``. Iterating gives ``(function_id, packed payload)`` pairs;
    :meth:`entries` gives each task's tags too. ``resource_specification`` (an MPI
    task's nodes and ranks, checked when set) is written in each of its tasks.
    """

    def __init__(
        self,
        pack: Packer,
        task_group_id: str | None = None,
        *,
        resource_specification: Mapping[str, int] | None = None,
    ) -> None:
        self.task_group_id = task_group_id
        self.resource_specification = resource_specification
        self._pack = pack
        self._tasks: list[tuple[str, Packed]] = []
        self._tags: list[dict[str, str]] = []

    def add(
        self,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """Add one call of ``function_id`` with ``args`` and ``kwargs``, labelled ``tags``
        (added to those ``batch_run`` gives every task; see ``Client.prepare_task``).

        Raises :class:`~fxstream.sdk.errors.PayloadTooLarge` or
        :class:`~fxstream.topics.SerializationError` for arguments that cannot
        be sent, ``ValueError`` for tags that cannot (saying what to change).
        """
        checked = budget.check_tags(tags)
        self._tasks.append((function_id, self._pack(function_id, tuple(args), kwargs)))
        self._tags.append(checked)

    def entries(self) -> Iterator[tuple[str, Packed, dict[str, str]]]:
        """``(function_id, packed payload, tags)`` of each task, in the order added."""
        for (function_id, packed), tags in zip(self._tasks, self._tags, strict=True):
            yield function_id, packed, tags

    def prepare(self) -> dict[str, Any]:
        """What ``batch_run`` sends, as Globus Compute's ``Batch.prepare()`` shows it:
        ``task_group_id``, ``resource_specification`` and ``tasks`` (function id -> the
        packed argument payload of each of its tasks, in order)."""
        tasks: dict[str, list[bytes]] = {}
        for function_id, packed in self._tasks:
            tasks.setdefault(function_id, []).append(packed.payload)
        return {
            "task_group_id": self.task_group_id,
            "resource_specification": self.resource_specification,
            "tasks": tasks,
        }

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[tuple[str, Packed]]:
        return iter(self._tasks)

    def __repr__(self) -> str:
        return f"Batch({len(self._tasks)} tasks, task_group_id={self.task_group_id!r})"

    @property
    def resource_specification(self) -> dict[str, int] | None:
        """What each MPI task of the batch needs (completed: all three keys), or ``None``."""
        spec = self._resources
        return None if spec is None else spec.as_dict()

    @resource_specification.setter
    def resource_specification(self, spec: Mapping[str, int] | None) -> None:
        self._resources = None if spec is None else ResourceSpecification.from_mapping(dict(spec))
