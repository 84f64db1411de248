"""Task status and results of a :class:`~fxstream.sdk.Client`: ``get_task``,
``get_tasks`` / ``iter_tasks``, ``get_result``, ``get_batch_result``, the futures it keeps.

:class:`TaskStatus` holds them; the :class:`~fxstream.sdk.Client` facade inherits them. A
task this client ran is answered from its own future when it can be (the result came on
the results topic); any other is asked of the service's task-state view
(``GET /v1/tasks/...``). Each answer carries fxstream's ``state`` and Globus Compute's
``status`` (:mod:`fxstream.sdk.status`), and once done ``result`` or ``exception`` and
``completion_t``.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import CancelledError
from datetime import datetime
from typing import Any, Final, NamedTuple
from urllib.parse import urlencode

from fxstream.sdk.errors import (
    FxstreamError,
    NotFound,
    TaskExecutionFailed,
    TaskPending,
    TaskRejected,
    task_failure,
)
from fxstream.sdk.futures import TaskFuture, Timings, timings_of
from fxstream.sdk.rest import RestClient
from fxstream.sdk.results import ResultListener, unreadable_result
from fxstream.sdk.status import completion_time, globus_status
from fxstream.topics import (
    Attempt,
    Serializer,
    TaskError,
    TaskTimings,
    budget,
)

__all__ = ["TaskPage", "TaskStatus", "attempts_of", "service_timings", "task_error_of"]

_STATUS_CHUNK: Final = 1_000
_PENDING_LOCALLY: Final = "submitted (no result received yet)"


class TaskPage(NamedTuple):
    """One page of :meth:`Client.get_tasks`: the tasks (each as :meth:`Client.get_task`
    answers from the service) and the cursor of the next page (None at the end)."""

    tasks: list[dict[str, Any]]
    next_cursor: str | None


class TaskStatus:
    """What a client knows of tasks (see the module notes)."""

    # Set by the Client facade (fxstream.sdk.client).
    serializer: Serializer
    _rest: RestClient
    _lock: threading.Lock
    _futures: dict[str, TaskFuture]
    _listener: ResultListener | None

    # --- results and status ------------------------------------------------------------

    def future(self, task_id: str) -> TaskFuture:
        """The future of a task this client ran with ``run`` or ``batch_run``.

        Raises ``KeyError`` for a task it did not run.
        """
        with self._lock:
            return self._futures[task_id]

    def forget(self, task_ids: Iterable[str]) -> None:
        """Drop the kept futures of these tasks (``get_result`` then asks the service)."""
        with self._lock:
            for task_id in task_ids:
                self._futures.pop(task_id, None)

    def _local(self, task_id: str) -> TaskFuture | None:
        with self._lock:
            return self._futures.get(task_id)

    def get_task(self, task_id: str) -> dict[str, Any]:
        """What is known about a task: ``state``, ``status``, ``pending``, ``timings``,
        ``error``, ``tags``, ``events``, ...; once it is done, also Globus Compute's
        ``result`` (its value) or ``exception`` (its failure, returned, not raised) and
        ``completion_t`` (epoch seconds, a string).

        ``state`` is fxstream's lifecycle state; ``status`` the same in Globus Compute's
        words (``success`` for ``succeeded``, ``waiting-for-ep`` before it runs:
        :mod:`fxstream.sdk.status`). A succeeded task whose value can no longer be read
        (a by-reference result evicted once consumed) has ``reason`` instead of
        ``result``.

        ``events`` is the task's log of site timestamps, in lifecycle order, each
        ``{"state", "at", "where", "attempt"}``: submitted (``client``), routed
        (``router``), dequeued and result-published (``endpoint:<id>``), each attempt's
        started and finished (``worker:<host:pid>``), and the state it is in now
        (``task-state``). A task this client ran and got the result of is answered
        locally (its events end with ``delivered``, when this client received the
        result, in place of the service's last step); otherwise the service's task-state
        view is asked (``GET /v1/tasks/{id}``).
        """
        future = self._local(task_id)
        if future is not None and future.done():
            return _with_local_outcome(_local_task(future), future)
        try:
            state: dict[str, Any] = self._rest.get(f"/tasks/{task_id}")
        except NotFound:
            if future is None:
                raise
            return _local_task(future)
        task = _service_task(state)
        return task if task["pending"] else self._with_outcome(task, state)

    def _with_outcome(self, task: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
        """``task`` (from the service's ``state``) with Globus Compute's ``result``, or
        ``exception`` (its failure), or ``reason`` (a value no longer readable), and
        ``completion_t``; still ``pending`` if the service has no outcome yet."""
        try:
            task["result"] = self._value_of(state)
        except TaskPending:
            task["pending"] = True
            return task
        except Exception as exc:
            if task["state"] == "succeeded":  # its value is no longer readable
                task["reason"] = str(exc)
            else:
                task["exception"] = exc
        task["completion_t"] = completion_time(task["timings"])
        return task

    def get_tasks(
        self,
        *,
        tags: Mapping[str, str] | None = None,
        state: str | Iterable[str] | None = None,
        function_id: str | None = None,
        endpoint_id: str | None = None,
        task_group_id: str | None = None,
        since: float | datetime | None = None,
        until: float | datetime | None = None,
        newest_first: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """One page of this user's tasks that match every filter given (``GET /v1/tasks``).

        ``tags``: the task must carry each ``key: value``; ``state``: one state or several
        (``"running"``, ``["succeeded", "failed"]``); ``since`` / ``until``: submitted
        within (epoch seconds or an aware ``datetime``), oldest first unless
        ``newest_first``. Pass the page's ``next_cursor`` as ``cursor`` (with the same
        filters) for the next page: a page may hold fewer than ``limit`` tasks, even none,
        and still have one (the service reads a bounded part of its index per request);
        :meth:`iter_tasks` follows the cursors for you. Only this user's tasks are ever
        returned; every task the service's task-state holds is queryable.
        """
        params: list[tuple[str, str]] = [
            ("tag", f"{key}:{value}") for key, value in budget.check_tags(tags).items()
        ]
        states = [state] if isinstance(state, str) else list(state or ())
        params += [("state", str(name)) for name in states]
        for name, value in (
            ("function_id", function_id),
            ("endpoint_id", endpoint_id),
            ("group", task_group_id),
            ("cursor", cursor),
        ):
            if value is not None:
                params.append((name, value))
        for name, moment in (("since", since), ("until", until)):
            if moment is not None:
                params.append((name, repr(_epoch_seconds(moment, name))))
        params += [("order", "desc" if newest_first else "asc"), ("limit", str(limit))]
        page: dict[str, Any] = self._rest.get(f"/tasks?{urlencode(params)}")
        following = page.get("next_cursor")
        return TaskPage(
            [_service_task(task) for task in page.get("tasks", [])],
            str(following) if following is not None else None,
        )

    def iter_tasks(
        self,
        *,
        tags: Mapping[str, str] | None = None,
        state: str | Iterable[str] | None = None,
        function_id: str | None = None,
        endpoint_id: str | None = None,
        task_group_id: str | None = None,
        since: float | datetime | None = None,
        until: float | datetime | None = None,
        newest_first: bool = False,
        page_size: int = 100,
    ) -> Iterator[dict[str, Any]]:
        """Every task :meth:`get_tasks` matches, fetching page after page as it is read."""
        states = [state] if isinstance(state, str) else list(state or ())
        cursor: str | None = None
        while True:
            page = self.get_tasks(
                tags=tags,
                state=states,
                function_id=function_id,
                endpoint_id=endpoint_id,
                task_group_id=task_group_id,
                since=since,
                until=until,
                newest_first=newest_first,
                limit=page_size,
                cursor=cursor,
            )
            yield from page.tasks
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def get_result(self, task_id: str) -> Any:
        """The task's return value; raises its error if it failed.

        Raises :class:`~fxstream.sdk.errors.TaskPending` when it has no result
        yet, :class:`~fxstream.sdk.errors.TaskExecutionFailed` (or a subclass)
        when it failed. Tasks this client ran are answered from their futures
        (never by polling); others are asked from the service.
        """
        future = self._local(task_id)
        if future is not None:
            if not future.done():
                raise TaskPending(task_id, _PENDING_LOCALLY)
            return future.result()
        state: dict[str, Any] = self._rest.get(f"/tasks/{task_id}")
        return self._value_of(state)

    def _value_of(self, state: Mapping[str, Any]) -> Any:
        name = str(state.get("state"))
        task_id = str(state.get("task_id"))
        if name == "succeeded":
            value = state.get("value")
            if value is None:
                raise FxstreamError(f"task {task_id} succeeded but the service holds no value")
            payload = base64.b64decode(value)
            try:
                return self.serializer.deserialize(payload)
            except Exception as exc:  # a by-reference result whose object was evicted
                raise unreadable_result(task_id, exc, payload) from exc
        error = state.get("error")
        if name in ("failed", "rejected") and isinstance(error, dict):
            raise task_failure(task_id, task_error_of(error), endpoint_id=state.get("endpoint_id"))
        if name == "cancelled":
            raise CancelledError(f"task {task_id} was cancelled")
        raise TaskPending(task_id, name)

    def get_batch_result(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Task id -> ``{"pending", "status", "result" | "exception", "timings"}``.

        Like Globus Compute's: failures are returned as ``"exception"``, not
        raised. Tasks this client ran are answered locally; the others are
        asked from the service in one request per 1,000.
        """
        answers: dict[str, dict[str, Any]] = {}
        remote: list[str] = []
        for task_id in task_ids:
            future = self._local(task_id)
            if future is None:
                remote.append(task_id)
            elif not future.done():
                answers[task_id] = {
                    "task_id": task_id,
                    "pending": True,
                    "state": "submitted",
                    "status": globus_status("submitted"),
                    "timings": dict(future.timings),
                }
            else:
                answers[task_id] = _batch_entry(_local_task(future), future)
        for start in range(0, len(remote), _STATUS_CHUNK):
            chunk = remote[start : start + _STATUS_CHUNK]
            states: dict[str, Any] = self._rest.post("/tasks/status", {"task_ids": chunk})
            for task_id in chunk:
                state = states.get(task_id)
                if state is None:
                    answers[task_id] = {"task_id": task_id, "pending": True, "status": "unknown"}
                    continue
                answers[task_id] = self._with_outcome(_service_task(state), state)
        return answers

    @property
    def result_stats(self) -> dict[str, int]:
        """The results listener's counters: delivered, duplicates, unknown, discarded, malformed."""
        listener = self._listener
        if listener is None:
            return dict.fromkeys(
                ("delivered", "duplicates", "unknown", "discarded", "malformed"), 0
            )
        return {
            "delivered": listener.delivered,
            "duplicates": listener.duplicates,
            "unknown": listener.unknown,
            "discarded": listener.discarded,
            "malformed": listener.malformed,
        }

    @property
    def duplicate_results(self) -> int:
        """Result records ignored because their task already had a result."""
        return self.result_stats["duplicates"]


def task_error_of(data: Mapping[str, Any]) -> TaskError:
    return TaskError(
        type=str(data.get("type", "")),
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", "")),
        retryable=bool(data.get("retryable", False)),
    )


def attempts_of(data: Any) -> list[Attempt]:
    attempts: list[Attempt] = []
    for item in data if isinstance(data, list) else []:
        if not isinstance(item, dict):
            continue
        error = item.get("error")
        attempts.append(
            Attempt(
                attempt=int(item.get("attempt") or 1),
                worker=str(item.get("worker") or ""),
                started_at=item.get("started_at"),
                finished_at=item.get("finished_at"),
                error=task_error_of(error) if isinstance(error, dict) else None,
            )
        )
    return attempts


def service_timings(data: Any) -> Timings:
    data = data if isinstance(data, dict) else {}
    names = (
        "submitted_at",
        "routed_at",
        "dequeued_at",
        "started_at",
        "finished_at",
        "result_published_at",
    )
    reported = TaskTimings(**{n: data.get(n) for n in names})
    return timings_of(reported, submitted=None, delivered=None)


def _epoch_seconds(moment: float | datetime, name: str) -> float:
    if isinstance(moment, datetime):
        if moment.tzinfo is None:
            raise ValueError(
                f"{name} is a naive datetime: give it a time zone (datetime.now(timezone.utc)) "
                "or pass seconds since the epoch"
            )
        return moment.timestamp()
    return float(moment)


# The local timings of a finished future, in lifecycle order, with the site of each.
_LOCAL_EVENTS: Final = (
    ("submitted", "submitted", "client"),
    ("routed", "routed", "router"),
    ("dequeued", "dequeued", "endpoint"),
    ("started", "started", "worker"),
    ("finished", "finished", "worker"),
    ("result-published", "result_published", "endpoint"),
    ("delivered", "delivered", "client"),
)


def _local_events(future: TaskFuture) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for name, key, site in _LOCAL_EVENTS:
        at = future.timings.get(key)
        if at is None:
            continue
        where = site
        if site == "endpoint":
            where = f"endpoint:{future.endpoint_id}"
        elif site == "worker":
            where = f"worker:{future.worker}" if future.worker else f"endpoint:{future.endpoint_id}"
        attempt = future.attempt if site == "worker" else None
        events.append({"state": name, "at": at, "where": where, "attempt": attempt})
    return events


def _service_task(state: Mapping[str, Any]) -> dict[str, Any]:
    name = str(state.get("state"))
    return {
        "task_id": state.get("task_id"),
        "state": name,
        "status": globus_status(name),
        "pending": name not in ("succeeded", "failed", "rejected", "cancelled"),
        "function_id": state.get("function_id"),
        "endpoint_id": state.get("endpoint_id"),
        "task_group_id": state.get("task_group_id"),
        "timings": service_timings(state.get("timings")),
        "error": state.get("error"),
        "attempts": state.get("attempts", []),
        "tags": state.get("tags") or {},
        "events": state.get("events") or [],
    }


def _local_task(future: TaskFuture) -> dict[str, Any]:
    error: dict[str, Any] | None = None
    if not future.done():
        name = "submitted"
    elif future.cancelled():
        name = "cancelled"
    else:
        exc = future.exception()
        if exc is None:
            name = "succeeded"
        else:
            name = "rejected" if isinstance(exc, TaskRejected) else "failed"
            if isinstance(exc, TaskExecutionFailed):
                error = {
                    "type": exc.remote_type,
                    "message": exc.remote_message,
                    "traceback": exc.remote_traceback,
                    "retryable": exc.retryable,
                }
            else:
                error = {"type": type(exc).__name__, "message": str(exc), "traceback": ""}
    return {
        "task_id": future.task_id,
        "state": name,
        "status": globus_status(name),
        "pending": not future.done(),
        "function_id": future.function_id,
        "endpoint_id": future.endpoint_id,
        "timings": dict(future.timings),
        "error": error,
        "worker": future.worker,
        "attempt": future.attempt,
        "stdout": future.stdout,
        "stderr": future.stderr,
        "tags": dict(future.tags),
        "events": _local_events(future),
    }


def _with_local_outcome(task: dict[str, Any], future: TaskFuture) -> dict[str, Any]:
    """``task`` (of a done future) with Globus Compute's ``result`` or ``exception`` and
    ``completion_t``."""
    if future.cancelled():
        task["exception"] = CancelledError(f"task {future.task_id} was cancelled")
    elif future.exception() is not None:
        task["exception"] = future.exception()
    else:
        task["result"] = future.result()
    task["completion_t"] = completion_time(task["timings"])
    return task


def _batch_entry(task: dict[str, Any], future: TaskFuture) -> dict[str, Any]:
    entry = {key: task[key] for key in ("task_id", "pending", "state", "status", "timings")}
    return _with_local_outcome(entry, future)
