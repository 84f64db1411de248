"""The exceptions the SDK raises: service errors, submission errors and task failures.

Every exception is a :class:`FxstreamError`. The service's answers map to one
class per HTTP status family and carry the service's ``detail`` text; a task
that failed remotely raises :class:`TaskExecutionFailed` (or a subclass per
platform error type) holding the remote type, message and traceback text.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Sequence
from typing import Any

from fxstream.topics import Attempt, TaskError

__all__ = [
    "AuthenticationError",
    "ConfigurationError",
    "FxstreamError",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "ResultsTopicMissing",
    "ServiceError",
    "ServiceUnavailable",
    "StreamDeliveryFailed",
    "StreamError",
    "StreamTimeout",
    "SubmissionFailed",
    "TaskExecutionFailed",
    "TaskPending",
    "TaskRejected",
    "WalltimeExceeded",
    "WorkerLost",
    "task_failure",
]


class FxstreamError(Exception):
    """Base of every error the SDK raises."""


class ConfigurationError(FxstreamError):
    """A setting is missing or unusable; the message names the setting and the variable."""


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
    """401: the token is missing or unknown (register with ``Client.register_user``)."""


class PermissionDenied(ServiceError):
    """403: the caller may not see or change this object."""


class NotFound(ServiceError):
    """404: no such object (or it was deleted)."""


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

    When the remote type is a builtin exception (``ValueError``,
    ``ZeroDivisionError``, ...) the raised object is also an instance of that
    builtin, so ``except ZeroDivisionError`` works as it would locally.

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


class WalltimeExceeded(TaskExecutionFailed):
    """The task ran past its walltime and its worker was killed."""


_PLATFORM_ERRORS: dict[str, type[TaskExecutionFailed]] = {
    "TaskRejected": TaskRejected,
    "WorkerLost": WorkerLost,
    "WalltimeExceeded": WalltimeExceeded,
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


def task_failure(
    task_id: str,
    error: TaskError,
    *,
    endpoint_id: str | None = None,
    attempt: int | None = None,
    earlier_attempts: Sequence[Attempt] = (),
) -> TaskExecutionFailed:
    """The exception for a failed task: the subclass for its ``error.type``.

    ``TaskRejected``, ``WorkerLost`` and ``WalltimeExceeded`` get their own
    classes; a builtin exception type also makes the error an instance of that
    builtin; anything else is a plain :class:`TaskExecutionFailed`.
    """
    short = error.type.rsplit(".", 1)[-1]
    base = _PLATFORM_ERRORS.get(short, TaskExecutionFailed)
    cls = _with_builtin(error.type) if base is TaskExecutionFailed else base
    failure = cls.__new__(cls)
    TaskExecutionFailed.__init__(
        failure,
        task_id,
        error,
        endpoint_id=endpoint_id,
        attempt=attempt,
        earlier_attempts=earlier_attempts,
    )
    return failure
