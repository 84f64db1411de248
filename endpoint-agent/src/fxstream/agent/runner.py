"""What a warm worker runs: load a function from its code once, then call it per task.

The worker receives each task's *submission record* as it was submitted (the
bytes the router forwarded untouched), so arguments are deserialized only here,
inside the worker, never in the agent's poll loop. The submitter's
:class:`~fxstream.topics.ClientInfo` travels in that record, so a payload that
cannot be loaded yields an error naming both sides' Python and serializer
versions rather than a bare failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fxstream.topics import ClientInfo, Serializer, TaskSubmission, decode

__all__ = ["RUNNER", "load_function"]

RUNNER = "fxstream.agent.runner:load_function"
"""The runner spec the agent gives its :class:`~fxstream.agent.WorkerPool`."""

_serializer = Serializer()


def load_function(code: bytes) -> Callable[[bytes], bytes]:
    """Loader for the worker pool: ``code`` is a serialized function (any code strategy).

    The function itself is deserialized at the first call, where the
    submitter's versions are known for the error message; it is kept after that.
    """
    loaded: list[Callable[..., Any]] = []

    def function_for(client: ClientInfo) -> Callable[..., Any]:
        if not loaded:
            loaded.append(_serializer.deserialize_function(code, submitted_by=client))
        return loaded[0]

    def call(submission_bytes: bytes) -> bytes:
        submission = decode(submission_bytes, TaskSubmission)
        function = function_for(submission.client)
        args, kwargs = _serializer.unpack_arguments(
            submission.payload, submitted_by=submission.client
        )
        return _serializer.serialize_value(function(*args, **kwargs))

    return call
