"""Function code for the pull hop: fetched from the service, cached, checked against its task.

The agent fetches a function's code from the service's API
(``GET /v1/functions/<id>``, with the endpoint's own token) on the poll thread,
so the engine's thread never waits on HTTP, and keeps the most recently used
functions (:class:`CodeCache`). A task runs only the code whose SHA-256 is the
digest its dispatch was routed with (:func:`verified_code`); otherwise it fails
with ``CodeIntegrityError`` and nothing of the code is deserialized. A service
that cannot answer (unreachable, 5xx, 429) makes the task wait rather than fail
(:class:`FunctionUnavailable` ``transient``).
"""

from __future__ import annotations

import base64

import httpx

from fxstream.topics import TaskDispatch, code_sha256

__all__ = ["CodeCache", "CodeIntegrityError", "FunctionUnavailable", "verified_code"]


class FunctionUnavailable(Exception):
    """The service would not give the function's code (unknown, deleted, forbidden, down).

    ``transient`` is true when the service could not answer (unreachable, 5xx, 429):
    the task waits for it instead of failing.
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class CodeCache:
    """Function code by id, fetched from the service's API on a miss; the ``capacity``
    most recently used functions are kept (a client that registers a fresh function per
    task must not grow the agent)."""

    def __init__(self, service_url: str, token: str, capacity: int = 1_024) -> None:
        self._http = httpx.Client(
            base_url=service_url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0
        )
        self._capacity = capacity
        self._code: dict[str, tuple[str, bytes]] = {}
        self._containers: dict[str, str | None] = {}

    def get(self, function_id: str) -> tuple[str, bytes]:
        """The function's ``(sha256, code)``, from the cache or the service; raises
        :class:`FunctionUnavailable` when the service would not give it."""
        cached = self._code.pop(function_id, None)
        if cached is not None:
            self._code[function_id] = cached  # re-inserted last: the dict is in LRU order
            return cached
        try:
            response = self._http.get(f"/v1/functions/{function_id}")
        except httpx.HTTPError as exc:
            raise FunctionUnavailable(
                f"cannot reach the service to fetch function {function_id}: {exc}",
                transient=True,
            ) from exc
        status = response.status_code
        if status != 200:
            try:
                detail = response.json().get("detail", response.text) if response.content else ""
            except ValueError:
                detail = response.text
            raise FunctionUnavailable(
                f"the service refused function {function_id} ({status}): {detail}",
                transient=status >= 500 or status == 429,
            )
        record = response.json()
        code = base64.b64decode(record["code"])
        entry = (code_sha256(code), code)
        self._code[function_id] = entry
        container = record.get("container")
        self._containers[function_id] = container if isinstance(container, str) else None
        if len(self._code) > self._capacity:
            evicted = next(iter(self._code))
            del self._code[evicted]
            self._containers.pop(evicted, None)
        return entry

    def container(self, function_id: str) -> str | None:
        """The container the function was registered with (None: none, or not fetched)."""
        return self._containers.get(function_id)

    def forget(self, function_id: str) -> None:
        """Drop a cached function (its code did not have the digest a task expects)."""
        self._code.pop(function_id, None)
        self._containers.pop(function_id, None)

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()


class CodeIntegrityError(Exception):
    """Function code whose SHA-256 is not the digest its task was routed with."""


def verified_code(
    codes: CodeCache, dispatch: TaskDispatch, submission_function: str
) -> tuple[str, bytes]:
    """The code of the dispatch's function, whose SHA-256 must be the dispatch's digest.

    A cached copy with another digest is dropped and fetched once more (the function
    may have been fetched before a change); still another digest raises
    :class:`CodeIntegrityError`, before anything is deserialized.
    """
    sha, code = codes.get(submission_function)
    if sha == dispatch.function_sha256:
        return sha, code
    codes.forget(submission_function)
    sha, code = codes.get(submission_function)
    if sha == dispatch.function_sha256:
        return sha, code
    raise CodeIntegrityError(
        f"task {dispatch.task_id}: the code fetched for function {submission_function} has "
        f"SHA-256 {sha}, not {dispatch.function_sha256} as the task was routed with; it was "
        "not loaded. The function changed after the task was submitted, or the code was "
        "tampered with on its way: submit the task again to run the current code"
    )
