"""Filtered task queries and per-task event logs: what ``GET /v1/tasks`` and the ``events``
of ``GET /v1/tasks/{id}`` are made of (the walk itself is
:meth:`~fxstream.service.task_table.TaskStateTable.query`).

- :func:`parse_tag` reads a query's ``tag=key:value``;
- :func:`encode_cursor` / :func:`decode_cursor` turn a position in a query's order into
  the opaque ``cursor`` a client passes back (a position only: the user whose tasks are
  walked is always the caller, so no cursor reaches another user's tasks);
- :func:`event_log` lists the site timestamps a task-state record holds as an ordered
  log of ``{state, at, where, attempt}``.

The event log is in lifecycle order (submitted, routed, each attempt's start and end,
the result's publication, the state now), not sorted by time: its times come from
different clocks (the client's, the service's, each endpoint's), and a skewed clock must
not reorder the steps. On one host they are also in time order.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Final

from fxstream.topics import TaskState, TaskStateName
from fxstream.topics.records import TAG_KEY_PATTERN, TAG_VALUE_PATTERN

__all__ = [
    "MAX_CURSOR_CHARS",
    "decode_cursor",
    "encode_cursor",
    "event_log",
    "parse_tag",
]

MAX_CURSOR_CHARS: Final = 256
_TAG_KEY: Final = re.compile(TAG_KEY_PATTERN)
_TAG_VALUE: Final = re.compile(TAG_VALUE_PATTERN)
_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}\Z")
_TIME_BYTES: Final = 8


def parse_tag(text: str) -> tuple[str, str]:
    """``"key:value"`` as ``(key, value)``; ``ValueError`` saying the expected form."""
    key, colon, value = text.partition(":")
    if not colon or not _TAG_KEY.match(key) or not _TAG_VALUE.match(value):
        raise ValueError(
            f"tag {text!r} is not key:value: write tag=KEY:VALUE, e.g. tag=run:42, with a "
            "key of 1-32 letters, digits, '_', '.' or '-' and a value of 1-64 characters "
            "(repeat tag= for several; a task must carry all of them)"
        )
    return key, value


def encode_cursor(position: bytes) -> str:
    """The opaque cursor for a position of a query's order."""
    return base64.urlsafe_b64encode(position).decode().rstrip("=")


def decode_cursor(cursor: str) -> bytes:
    """The position a cursor names; ``ValueError`` if it is not one this service made."""
    problem = (
        "cursor is not one this service gave: pass the next_cursor of the previous page "
        "unchanged, or leave it out to start from the first page"
    )
    if len(cursor) > MAX_CURSOR_CHARS:
        raise ValueError(problem)
    try:
        position = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(problem) from None
    task_id = position[_TIME_BYTES:]
    try:
        valid = len(position) > _TIME_BYTES and bool(_ID.match(task_id.decode("ascii")))
    except UnicodeDecodeError:
        valid = False
    if not valid:
        raise ValueError(problem)
    return position


def _event(state: str, at: float | None, where: str, attempt: int | None = None) -> dict[str, Any]:
    return {"state": state, "at": at, "where": where, "attempt": attempt}


def event_log(state: TaskState) -> list[dict[str, Any]]:
    """The task's recorded steps, in lifecycle order, each ``{state, at, where, attempt}``.

    ``where`` names the site: ``client`` (submitted, by the SDK's clock), ``router``,
    ``endpoint:<id>`` (taken off its queue, result published), ``worker:<host:pid>``
    (an attempt started and finished; ``attempt`` numbers it), ``task-state`` (the
    processor that recorded the state the task is in now). A step the record holds no
    time for is left out.
    """
    timings = state.timings
    endpoint = f"endpoint:{state.endpoint_id}"
    events = [
        _event("submitted", timings.submitted_at, "client"),
        _event("routed", timings.routed_at, "router"),
    ]
    attempts = list(state.attempts)
    if not attempts:
        events.append(_event("dequeued", timings.dequeued_at, endpoint))
        events.append(_event("started", timings.started_at, endpoint))
        events.append(_event("finished", timings.finished_at, endpoint))
    for index, attempt in enumerate(attempts):
        last = index == len(attempts) - 1
        where = f"worker:{attempt.worker}" if attempt.worker else endpoint
        if last:
            events.append(_event("dequeued", timings.dequeued_at, endpoint, attempt.attempt))
        started = attempt.started_at
        finished = attempt.finished_at
        if last:
            started = started if started is not None else timings.started_at
            finished = finished if finished is not None else timings.finished_at
        events.append(_event("started", started, where, attempt.attempt))
        events.append(_event("finished", finished, where, attempt.attempt))
    events.append(_event("result-published", timings.result_published_at, endpoint))
    if state.state is not TaskStateName.ROUTED:
        by_router = (TaskStateName.REJECTED, TaskStateName.WAITING_FOR_PARENTS)
        recorded_by = "router" if state.state in by_router else "task-state"
        events.append(_event(str(state.state), state.updated_at, recorded_by))
    return [event for event in events if event["at"] is not None]
