"""Task DAGs: the placeholder that stands in an argument for a parent task's result.

A task may depend on other tasks, its *parents* (``TaskSubmission.depends_on``). Its
arguments then hold a :class:`ParentResult` wherever a parent's result goes, as a
top-level positional or keyword argument. The service holds the task (state
``waiting-for-parents``) until every parent has succeeded, then releases it with
``TaskSubmission.parent_results`` set: each parent's serialized result exactly as its
result record carried it (inline, or the by-reference envelope naming the object in
the proxy store, so bulk data stays in the store). The worker loads each one and puts
it in the placeholder's place (:func:`bind_parents`) before it calls the function.

A parent that fails, is rejected or cancelled fails its children with
``ParentFailed``, naming the parent and its error; a parent that is not the
submitter's task (or not a task at all) fails them with ``ParentUnknown``; a parent
whose result can no longer be read, with ``ParentResultUnavailable``.

Placeholders are top-level only: :func:`parents_in` and :func:`bind_parents` look at
the arguments themselves, never inside containers, so the SDK refuses a future nested
in a list or dict instead of sending a placeholder the worker would never replace.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = [
    "MAX_PARENTS",
    "ParentResult",
    "ParentResultUnavailable",
    "bind_parents",
    "parents_in",
]

MAX_PARENTS: Final = 32
"""The most parents one task may depend on (``TaskSubmission.depends_on``)."""

# The topics' id rule (records.Id): 1-128 letters, digits and '-'.
_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")


class ParentResult:
    """Stands in an argument for "the result of parent task ``task_id``".

    Pickles as itself (by reference to this class, which every side imports), so it
    travels inside an argument payload of the pickle-based strategies; the worker
    replaces it by the parent's result. Compare and hash by ``task_id``.
    """

    __slots__ = ("task_id",)

    def __init__(self, task_id: str) -> None:
        if not isinstance(task_id, str) or not _ID.fullmatch(task_id):
            raise ValueError(
                f"a parent task id is 1-128 letters, digits and '-' (a task's id), not {task_id!r}"
            )
        self.task_id = task_id

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return ParentResult, (self.task_id,)

    def __eq__(self, other: object) -> bool:
        return type(other) is ParentResult and other.task_id == self.task_id

    def __hash__(self) -> int:
        return hash(("ParentResult", self.task_id))

    def __repr__(self) -> str:
        return f"ParentResult({self.task_id!r})"


class ParentResultUnavailable(Exception):
    """A parent's result cannot be read where the child runs (e.g. its object was evicted
    from the proxy store, or the store is not reachable from the child's endpoint).

    Raised by the worker before the function is called; the task's error type is then
    ``ParentResultUnavailable`` and the message names the parent.
    """


def _placeholders(args: Iterable[Any], kwargs: Mapping[str, Any]) -> Iterable[ParentResult]:
    # type(), never isinstance: a lazy proxy among the arguments would resolve on isinstance.
    for value in (*args, *kwargs.values()):
        if type(value) is ParentResult:
            yield value


def parents_in(args: Iterable[Any], kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The task ids of the :class:`ParentResult` placeholders among the top-level
    arguments, each once, in the order first met."""
    seen: dict[str, None] = {}
    for placeholder in _placeholders(args, kwargs or {}):
        seen.setdefault(placeholder.task_id, None)
    return list(seen)


def bind_parents(
    args: Iterable[Any], kwargs: Mapping[str, Any], values: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with each top-level :class:`ParentResult` replaced by
    ``values[its task_id]``.

    Raises ``KeyError`` naming a placeholder whose parent has no value in ``values``.
    """

    def bound(value: Any) -> Any:
        if type(value) is not ParentResult:
            return value
        if value.task_id not in values:
            raise KeyError(f"no result of parent task {value.task_id} was given to this task")
        return values[value.task_id]

    return tuple(bound(v) for v in args), {k: bound(v) for k, v in kwargs.items()}
