"""The exceptions the SDK raises: service errors, submission errors and task failures.

Every exception is a :class:`FxstreamError`. The service's answers map to one
class per HTTP status family and carry the service's ``detail`` text; a task
that failed remotely raises :class:`TaskExecutionFailed` (or a subclass per
platform error type) holding the remote type, message and traceback text.
"""

from __future__ import annotations

import builtins
import functools
import re
import sys
from collections.abc import Sequence
from typing import Any

from fxstream.topics import Attempt, TaskError

__all__ = [
    "AuthenticationError",
    "BlockLost",
    "ConfigurationError",
    "FxstreamError",
    "InvalidRequest",
    "NotFound",
    "ParentFailed",
    "ParentResultUnavailable",
    "ParentUnknown",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "ResultsTopicMissing",
    "ServiceError",
    "ServiceUnavailable",
    "StagingFailed",
    "StagingUnavailable",
    "StreamDeliveryFailed",
    "StreamError",
    "StreamTimeout",
    "SubmissionFailed",
    "TaskExecutionFailed",
    "TaskPending",
    "TaskRejected",
    "VersionMismatch",
    "WalltimeExceeded",
    "WorkerLost",
    "task_failure",
]


class FxstreamError(Exception):
    """Base of every error the SDK raises."""


class ConfigurationError(FxstreamError):
    """A setting is missing or unusable; the message names the setting and the variable."""


class VersionMismatch(FxstreamError):
    """This SDK (or an endpoint) is older than the service accepts (``Client.version_check``)."""


# --- the REST service --------------------------------------------------------------------


class ServiceError(FxstreamError):
    """The service answered with an error.

    ``status_code`` is the HTTP status, ``error`` the service's error code and
    ``detail`` its explanation (what is wrong and what to do).
    """

    def __init__(self, status_code: int, error: str, detail: str, *, method: str, url: str):
        self.status_code = status_code
        self.error = error
        self.detail = detail
        self.method = method
        self.url = url
        super().__init__(f"{method} {url} -> {status_code} {error}: {detail}")


class AuthenticationError(ServiceError):
    """401: the token is missing, unknown, expired, revoked or rotated away.

    ``detail`` says how to get a new one (from the platform admin, or a login).
    """


class RateLimited(ServiceError):
    """429: too many registrations from this caller; ``retry_after`` says when to retry."""

    def __init__(
        self,
        status_code: int,
        error: str,
        detail: str,
        *,
        method: str,
        url: str,
        retry_after: float | None = None,
    ):
        super().__init__(status_code, error, detail, method=method, url=url)
        self.retry_after = retry_after


class PermissionDenied(ServiceError):
    """403: the caller may not see or change this object."""


class NotFound(ServiceError):
    """404: no such object, it was deleted, or it is not the caller's to see."""


class InvalidRequest(ServiceError):
    """400, 409, 413 or 422: the request is malformed; ``detail`` names the field."""


class ServiceUnavailable(FxstreamError):
    """The service could not be reached, or answered with a 5xx or with something not JSON."""


# --- submitting --------------------------------------------------------------------------


class PayloadTooLarge(FxstreamError):
    """A task's arguments or record are too large to travel inline; nothing was sent.

    ``size`` and ``limit`` are in bytes; ``setting`` names what to change.
    """

    def __init__(self, message: str, *, size: int, limit: int, setting: str) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit
        self.setting = setting


class SubmissionFailed(FxstreamError):
    """Kafka did not acknowledge a task record (the broker is unreachable or refused it)."""


class ResultsTopicMissing(FxstreamError):
    """The user's results topic does not exist, so no result could ever arrive."""


# --- streams -----------------------------------------------------------------------------


class StreamError(FxstreamError):
    """A stream's Kafka producer or consumer failed (the message says what and what to do)."""


class StreamDeliveryFailed(StreamError):
    """Kafka did not acknowledge stream records; ``failures`` holds each record's error text."""

    def __init__(self, message: str, *, failures: Sequence[str]) -> None:
        super().__init__(message)
        self.failures = list(failures)


class StreamTimeout(StreamError, TimeoutError):
    """No stream record arrived within the consumer's ``timeout_s``."""


# --- task outcomes -----------------------------------------------------------------------


class TaskPending(FxstreamError):
    """The task has no result yet; ``state`` is what is known about it."""

    def __init__(self, task_id: str, state: str) -> None:
        self.task_id = task_id
        self.state = state
        super().__init__(
            f"task {task_id} is not finished (state: {state}); wait for its future, or call "
            "get_result again later"
        )


class TaskExecutionFailed(FxstreamError):
    """A task failed where it ran: its function raised, or the platform gave up on it.

    ``remote_type``, ``remote_message`` and ``remote_traceback`` are the remote
    exception's type name, text and formatted traceback; ``retryable`` is true
    for infrastructure failures a retry may cure. ``str()`` holds all three, so
    an uncaught failure prints the remote traceback.

    The raised object is also an instance of the remote exception's type when
    the caller can import it (a builtin such as ``KeyError``, a class of an
    installed module, or of the submitting script's ``__main__``), so ``except
    KeyError`` works as it would locally, and it keeps that exception's
    ``args`` (``exc.args[0]`` is the missing key) and attributes; the remote
    exception object itself is ``remote_exception``. ``str()`` and
    ``remote_traceback`` hold the remote traceback. When the worker could not
    send the exception (too large, unserializable, or the JSON data strategy)
    or its type is not importable here, builtins still match by name and
    ``args`` holds the message.

    ``earlier_attempts`` are the failed attempts before the last one (a task
    submitted with ``max_retries``), oldest first; ``str()`` lists them too.
    """

    def __init__(
        self,
        task_id: str,
        error: TaskError,
        *,
        endpoint_id: str | None = None,
        attempt: int | None = None,
        earlier_attempts: Sequence[Attempt] = (),
    ) -> None:
        self.task_id = task_id
        self.endpoint_id = endpoint_id
        self.remote_exception: BaseException | None = None
        self.attempt = attempt
        self.earlier_attempts = list(earlier_attempts)
        self.remote_type = error.type
        self.remote_message = error.message
        self.remote_traceback = error.traceback
        self.retryable = error.retryable
        where = f" on endpoint {endpoint_id}" if endpoint_id else ""
        text = f"task {task_id} failed{where}: {error.type}: {error.message}"
        if self.earlier_attempts:
            text += f" (attempt {attempt}; earlier attempts:"
            for earlier in self.earlier_attempts:
                failure = earlier.error
                why = f"{failure.type}: {failure.message}" if failure else "no error recorded"
                where = f" on {earlier.worker}" if earlier.worker else ""
                text += f"\n  attempt {earlier.attempt}{where}: {why}"
            text += ")"
        if error.traceback:
            text += f"\n\nRemote traceback:\n{error.traceback.rstrip()}"
        self._text = text
        Exception.__init__(self, text)

    def __str__(self) -> str:
        # Builtins such as KeyError quote their argument; ours is already a message.
        return self._text

    def __reduce__(self) -> tuple[Any, ...]:
        error = TaskError(
            type=self.remote_type,
            message=self.remote_message,
            traceback=self.remote_traceback,
            retryable=self.retryable,
        )
        return (
            task_failure,
            (self.task_id, error),
            {
                "endpoint_id": self.endpoint_id,
                "attempt": self.attempt,
                "earlier_attempts": self.earlier_attempts,
            },
        )


class TaskRejected(TaskExecutionFailed):
    """The router refused the task (unknown user or token, function or endpoint not shared)."""


class WorkerLost(TaskExecutionFailed):
    """The worker running the task died (killed, crashed, out of memory)."""


class BlockLost(WorkerLost):
    """The batch scheduler's job (block) running the task ended under it (cancelled, past
    its walltime, a node failed), on every attempt the agent made (docs/hpc.md)."""


class WalltimeExceeded(TaskExecutionFailed):
    """The task ran past its walltime and its worker was killed."""


class _ParentError(TaskExecutionFailed):
    """A dependent task's failure about one of its parents; ``parent_id`` names it."""

    @property
    def parent_id(self) -> str | None:
        """The parent task the error is about (its message names it), or None."""
        found = re.search(r"parent task ([A-Za-z0-9][A-Za-z0-9-]{0,127})", self.remote_message)
        return found.group(1) if found else None


class ParentFailed(_ParentError):
    """A parent of the task failed, was rejected or was cancelled, so the task never ran;
    the message names the parent (``parent_id``) and its error."""


class ParentUnknown(_ParentError):
    """A parent of the task is not one of your tasks (no such task, or another user's)."""


class ParentResultUnavailable(_ParentError):
    """A parent succeeded but its result could not be given to the task (not kept, too
    large to pass on, or gone from the proxy store)."""


class StagingFailed(TaskExecutionFailed):
    """A file the task declared (``stage_in`` or ``stage_out``) could not be staged: the
    message names the file, the site and what to do. Staging in, the function did not
    run; staging out, it ran but its result is not kept. Not retryable as it is."""


class StagingUnavailable(StagingFailed):
    """A staging site (a Globus collection, the store) could not be reached or a transfer
    ran past the endpoint's timeout; retryable (``retryable`` is true), and retried by the
    endpoint up to the task's ``max_retries``."""


_PLATFORM_ERRORS: dict[str, type[TaskExecutionFailed]] = {
    "TaskRejected": TaskRejected,
    "WorkerLost": WorkerLost,
    "BlockLost": BlockLost,
    "WalltimeExceeded": WalltimeExceeded,
    "ParentFailed": ParentFailed,
    "ParentUnknown": ParentUnknown,
    "ParentResultUnavailable": ParentResultUnavailable,
    "StagingFailed": StagingFailed,
    "StagingUnavailable": StagingUnavailable,
}


@functools.cache
def _with_builtin(name: str) -> type[TaskExecutionFailed]:
    base = TaskExecutionFailed
    builtin = getattr(builtins, name, None)
    if (
        not isinstance(builtin, type)
        or not issubclass(builtin, Exception)
        or issubclass(builtin, FxstreamError | StopIteration | StopAsyncIteration)
    ):
        return base
    try:
        combined: type[TaskExecutionFailed] = type(
            name, (base, builtin), {"__module__": "fxstream.sdk.errors.remote"}
        )
    except TypeError:  # an instance layout that cannot be combined
        return base
    return combined


def _importable(remote: type[BaseException]) -> type[BaseException]:
    """The caller's own class for a remote exception's type.

    A class of the submitting script's ``__main__`` travels by value and loads
    as a copy; the script's own class of that name is what its ``except`` names.
    """
    if remote.__module__ == "__main__":
        main = sys.modules.get("__main__")
        own = getattr(main, remote.__qualname__, None) if main is not None else None
        if isinstance(own, type) and issubclass(own, BaseException):
            return own
    return remote


@functools.lru_cache(maxsize=256)
def _with_type(remote: type) -> type[TaskExecutionFailed] | None:
    if not issubclass(remote, Exception) or issubclass(
        remote, FxstreamError | StopIteration | StopAsyncIteration
    ):
        return None
    try:
        combined: type[TaskExecutionFailed] = type(
            remote.__name__,
            (TaskExecutionFailed, remote),
            {"__module__": "fxstream.sdk.errors.remote", "__qualname__": remote.__qualname__},
        )
    except TypeError:  # an instance layout that cannot be combined
        return None
    return combined


def task_failure(
    task_id: str,
    error: TaskError,
    *,
    endpoint_id: str | None = None,
    attempt: int | None = None,
    earlier_attempts: Sequence[Attempt] = (),
    exception: BaseException | None = None,
) -> TaskExecutionFailed:
    """The exception for a failed task: the subclass for its ``error.type``.

    ``TaskRejected``, ``WorkerLost`` and ``WalltimeExceeded`` get their own
    classes. ``exception`` (the remote exception object, when the worker sent
    it and it loads here) makes the error an instance of its type too, with its
    ``args`` and attributes; without it, a builtin exception type still makes
    the error an instance of that builtin; anything else is a plain
    :class:`TaskExecutionFailed`.
    """
    short = error.type.rsplit(".", 1)[-1]
    base = _PLATFORM_ERRORS.get(short, TaskExecutionFailed)
    cls: type[TaskExecutionFailed] | None = None
    if base is TaskExecutionFailed and exception is not None:
        remote: type = _importable(type(exception))
        cls = _with_type(remote)
    if cls is None:
        cls = _with_builtin(error.type) if base is TaskExecutionFailed else base
        exception = None
    failure = cls.__new__(cls)
    TaskExecutionFailed.__init__(
        failure,
        task_id,
        error,
        endpoint_id=endpoint_id,
        attempt=attempt,
        earlier_attempts=earlier_attempts,
    )
    if exception is not None:
        own = dict(vars(failure))
        failure.__dict__.update(vars(exception))
        failure.__dict__.update(own)  # ours win: task_id, remote_type, ...
        failure.args = exception.args
        failure.remote_exception = exception
    return failure
