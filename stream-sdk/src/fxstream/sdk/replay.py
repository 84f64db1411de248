"""Replay of a :class:`~fxstream.sdk.Client`: a task group's tasks, and their futures
rebuilt in a new process (``reload_task_group``, what ``Executor.reload_tasks`` calls).

:class:`Replay` holds them; the :class:`~fxstream.sdk.Client` facade inherits them. While
the service is asked for the group's tasks, the results listener captures the group's
results, and what came before is read back from the results topic
(:mod:`fxstream.sdk.history`): no result falls in between.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from fxstream.sdk.errors import (
    FxstreamError,
    task_failure,
)
from fxstream.sdk.futures import TaskFuture
from fxstream.sdk.history import read_back_results
from fxstream.sdk.rest import RestClient
from fxstream.sdk.results import ResultListener
from fxstream.sdk.task_status import attempts_of, service_timings, task_error_of
from fxstream.topics import (
    KafkaConnection,
)
from fxstream.topics.acls import user_group_prefix

__all__ = ["Replay", "check_group_id"]

log = logging.getLogger(__name__)

_TERMINAL: Final = frozenset({"succeeded", "failed", "rejected", "cancelled"})
_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")


class Replay:
    """A task group's tasks and their futures (see the module notes)."""

    # Set by the Client facade (fxstream.sdk.client).
    kafka: KafkaConnection
    _rest: RestClient
    _kafka_config: dict[str, Any]

    if TYPE_CHECKING:

        @property
        def user_id(self) -> str:
            """The caller's user id (the facade's)."""
            ...

        def _started_listener(self) -> ResultListener: ...

        def _value_of(self, state: Mapping[str, Any]) -> Any: ...

    # --- replay ------------------------------------------------------------------------

    def get_taskgroup_tasks(self, task_group_id: str) -> list[dict[str, Any]]:
        """The caller's tasks of ``task_group_id`` with their latest states.

        Each is the service's task-state record as JSON (``GET /v1/tasks/{id}``),
        in the order the service first saw them; every page of ``GET
        /v1/task-groups/{id}/tasks`` is fetched. Raises
        :class:`~fxstream.sdk.errors.NotFound` when the service knows no task
        of the caller's in the group (yet: a task appears once the router has
        seen it); another user's tasks are never visible.
        """
        check_group_id(task_group_id)
        tasks: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page: dict[str, Any] = self._rest.get(
                f"/task-groups/{task_group_id}/tasks?offset={offset}"
            )
            tasks.extend(page["tasks"])
            following = page.get("next_offset")
            offset = int(following) if following is not None else None
        return tasks

    def reload_task_group(
        self, task_group_id: str, *, read_back_timeout: float = 120.0
    ) -> list[TaskFuture]:
        """A future for each of the caller's tasks of ``task_group_id``, sent by any process.

        What ``Executor.reload_tasks`` runs. A task that has ended gets a future
        resolved at once from the service's task-state (its value, error or
        cancellation). A task that has not gets a future the results listener
        resolves when its result arrives. Results that reached the topic before
        this call but that task-state does not show (yet), and values too large
        for task-state, are read back from ``results.<user>`` (from the task's
        submission time; at most ``read_back_timeout`` seconds). A task already
        tracked by this client keeps its future. Each result reaches its
        future once.

        Raises :class:`~fxstream.sdk.errors.NotFound` (no task of the caller's
        in the group known), as :meth:`get_taskgroup_tasks` does.
        """
        check_group_id(task_group_id)
        listener = self._started_listener()
        # The capture starts before the service is asked: a result that arrives while
        # we ask is kept, and everything before the boundary is read back below.
        with listener.capture(task_group_id) as boundary:
            states = self.get_taskgroup_tasks(task_group_id)
            futures: list[TaskFuture] = []
            unfinished: dict[str, float] = {}
            values_elsewhere: dict[str, TaskFuture] = {}
            for state in states:
                fresh = _future_of(state)
                future = listener.adopt(fresh)
                futures.append(future)
                if future is not fresh or future.done():
                    continue
                name = str(state.get("state"))
                if name not in _TERMINAL or (name == "succeeded" and state.get("value") is None):
                    unfinished[future.task_id] = _submitted_at(state)
                    if name == "succeeded":
                        values_elsewhere[future.task_id] = future
                elif listener.settle(future):
                    self._resolve_from_state(future, state)
            if unfinished:
                found = read_back_results(
                    self.kafka,
                    listener.topic,
                    unfinished,
                    boundary,
                    timeout=read_back_timeout,
                    kafka_config=self._kafka_config,
                    group_id=user_group_prefix(self.user_id) + f"sdk-history-{uuid.uuid4()}",
                )
                received = time.time()
                for result in found.values():
                    listener.offer(result, received)
        for task_id, future in values_elsewhere.items():
            if listener.settle(future):
                future._resolve_exception(
                    FxstreamError(
                        f"task {task_id} succeeded, but its value was too large for the "
                        f"service's task-state and {listener.topic} no longer holds its result "
                        "(deleted by the topic's retention)"
                    )
                )
        log.info(
            "reloaded task group %s: %d tasks, %d done, %d read back",
            task_group_id,
            len(futures),
            sum(f.done() for f in futures),
            len(unfinished),
        )
        return futures

    def _resolve_from_state(self, future: TaskFuture, state: Mapping[str, Any]) -> None:
        future.timings = service_timings(state.get("timings"))
        future.timings["delivered"] = time.time()
        attempts = state.get("attempts") or []
        if attempts and isinstance(attempts[-1], dict):
            future.worker = str(attempts[-1].get("worker") or "") or None
            future.attempt = int(attempts[-1].get("attempt") or 1)
        name = str(state.get("state"))
        error = state.get("error")
        if name == "cancelled":
            future.cancel()
        elif name in ("failed", "rejected") and isinstance(error, dict):
            attempts = attempts_of(state.get("attempts"))
            future._resolve_exception(
                task_failure(
                    future.task_id,
                    task_error_of(error),
                    endpoint_id=future.endpoint_id,
                    attempt=future.attempt,
                    earlier_attempts=attempts[:-1],
                )
            )
        else:
            try:
                value = self._value_of(state)
            except Exception as exc:  # a value that does not load here, or a state without one
                future._resolve_exception(exc)
            else:
                future._resolve_result(value)


def check_group_id(task_group_id: str) -> None:
    if not isinstance(task_group_id, str) or not _ID_RE.match(task_group_id):
        raise ValueError(
            f"task_group_id {task_group_id!r} is not an id: use 1-128 letters, digits and '-' "
            "(Executor.task_group_id of the session to reload)"
        )


def _submitted_at(state: Mapping[str, Any]) -> float:
    # Unknown submission time: read back from the start of the topic's retention.
    timings = state.get("timings")
    if isinstance(timings, dict):
        for hop in ("submitted_at", "routed_at"):
            moment = timings.get(hop)
            if isinstance(moment, int | float):
                return float(moment)
    return 0.0


def _future_of(state: Mapping[str, Any]) -> TaskFuture:
    future = TaskFuture(
        str(state.get("task_id")),
        function_id=str(state.get("function_id")),
        endpoint_id=str(state.get("endpoint_id")),
        submitted_at=_submitted_at(state) or time.time(),
    )
    tags = state.get("tags")
    if isinstance(tags, dict):
        future.tags = {str(key): str(value) for key, value in tags.items()}
    return future
