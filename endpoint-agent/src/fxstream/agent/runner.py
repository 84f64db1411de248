"""What a warm worker runs: load a function from its code once, then call it per task.

The worker receives each task's *submission record* as it was submitted (the
bytes the router forwarded untouched), so arguments are deserialized only here,
inside the worker, never in the agent's poll loop. The submitter's
:class:`~fxstream.topics.ClientInfo` travels in that record, so a payload that
cannot be loaded yields an error naming both sides' Python and serializer
versions rather than a bare failure.

Bulk data never passes through the agent: arguments sent by reference are
fetched here from the proxy store (lazily, on first use, except bytes-like
values, fetched as the payload loads), and with the endpoint's ``store_url``
set a result above ``proxy_threshold`` is written to that store here and only
its reference goes back to the agent (:mod:`fxstream.connectors.reference`). A task
whose client runs on this node as this user (``TaskSubmission.client_node`` is the
node key the agent advertises) has its large result written to the node-local store
instead, in shared memory (:mod:`fxstream.connectors.node_local`), or to the endpoint's
store when that has no room.

A task with parents (issue 15's task DAGs) carries each parent's serialized result
(``TaskSubmission.parent_results``, inline or the by-reference envelope of an object in
the proxy store): each is loaded here, fetched from the store with the same digest check
as any by-reference argument, and put in its :class:`~fxstream.topics.ParentResult`
placeholder's place before the function is called. A result that cannot be loaded fails
the task with ``ParentResultUnavailable`` naming the parent (an integrity error stays
itself).

A result is written with the data strategy of the task's arguments, the one the
client chose (``Client(serializer=...)``), so the client reads it as it asked;
an argument proxy inside a result is written as its value
(:func:`~fxstream.connectors.proxies_by_value`). An exception the function
raises is serialized the same way, when it fits in ``EXCEPTION_MAX_BYTES``, and
travels beside its text, so the client can raise it with its own type and
``args`` (:data:`EXCEPTION_ATTRIBUTE`).

A task that declares staged files (``stage_in``, ``stage_out``; :mod:`fxstream.agent.staging`)
runs in its working directory, ``<task_root>/<task id>``, where the agent staged its
inputs: the function's current directory is that directory while it runs, and
``FXSTREAM_TASK_DIR`` (and Globus Compute's ``GC_TASK_SANDBOX_DIR``) name it; both are
restored after the call, so the warm worker's next task starts where it was.

A proxy future's proxy among the arguments (:mod:`fxstream.connectors.futures`) is an
ordinary lazy proxy: the function's first use of it waits for the value, then verifies
its signed pointer and its digest before loading it. A timeout, a producer's failure or
an evicted value fails the task with that ``ProxyFutureError`` itself (ProxyStore's
``ProxyResolveError`` wrapper is dropped), a forged value with ``ProxyFutureForged``
(an integrity error). A ``ProxyFuture`` among the arguments lets the function set it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

from fxstream.connectors import (
    DEFAULT_PROXY_THRESHOLD_BYTES,
    ByReference,
    NodeLocal,
    ProxyFutureError,
    open_store,
    proxies_by_value,
)
from fxstream.topics import (
    ClientInfo,
    DeserializationError,
    IntegrityError,
    ParentResultUnavailable,
    Serializer,
    TaskSubmission,
    bind_parents,
    decode,
    strategy_of,
)

__all__ = [
    "EXCEPTION_ATTRIBUTE",
    "EXCEPTION_MAX_BYTES",
    "RUNNER",
    "in_task_dir",
    "load_function",
    "runner_for",
]

EXCEPTION_ATTRIBUTE: Final = "__fxstream_exception__"
"""Where the runner leaves a raised exception's serialized form for the worker pool."""

EXCEPTION_MAX_BYTES: Final = 16 * 1024
"""A serialized exception larger than this stays behind (its text still travels)."""

RUNNER = "fxstream.agent.runner:load_function"
"""The runner spec the agent gives its :class:`~fxstream.agent.WorkerPool` (no proxy store)."""

_serializer = Serializer()

# fxstream.agent.staging's TASK_DIR_ENV and TASK_DIR_ENV_GC (that module is not imported in
# the workers).
_TASK_DIR_VARIABLES: Final = ("FXSTREAM_TASK_DIR", "GC_TASK_SANDBOX_DIR")


@functools.cache
def _store(store_url: str) -> Any:
    # One store per worker process, opened at its first task.
    return open_store(store_url)


@functools.cache
def _results_by_reference(
    store_url: str, threshold: int, site: str, strategy_id: str
) -> ByReference:
    return ByReference(
        _store(store_url),
        threshold_bytes=threshold,
        serializer=_serializer_for(strategy_id),
        site=site,
    )


@functools.cache
def _results_node_local(
    node_store_dir: str,
    node_key: str,
    store_url: str | None,
    threshold: int,
    site: str,
    strategy_id: str,
) -> ByReference:
    # Results for a client on this node (its task's client_node is this node's key): the
    # node-local store, else the endpoint's store when the node has no room.
    node = NodeLocal(Path(node_store_dir), node_key)
    return ByReference(
        node.store(),
        threshold_bytes=threshold,
        serializer=_serializer_for(strategy_id),
        site=site,
        fallback=None if store_url is None else _store(store_url),
        has_room=node.has_room,
    )


@functools.cache
def _serializer_for(strategy_id: str) -> Serializer:
    return _serializer.with_data(strategy_id)


def _result_strategy(payload: bytes) -> str:
    """The data strategy of the arguments (the client's), which its result is written with."""
    try:
        strategy = strategy_of(payload)
    except DeserializationError:  # the arguments loaded, so this cannot happen; be safe
        return _serializer.data.id
    return strategy.id if strategy.kind == "data" else _serializer.data.id


def runner_for(
    store_url: str | None,
    *,
    proxy_threshold: int = DEFAULT_PROXY_THRESHOLD_BYTES,
    site: str = "",
    task_root: str | None = None,
    node: NodeLocal | None = None,
) -> Callable[[bytes], Callable[[bytes], bytes]] | str:
    """The runner spec for an endpoint: results by reference through ``store_url`` if set,
    staged tasks run in their directories under ``task_root`` if set, and a client's on
    this node through the node-local store ``node`` if given."""
    if store_url is None and task_root is None and node is None:
        return RUNNER
    return functools.partial(
        load_function,
        store_url=store_url,
        proxy_threshold=proxy_threshold,
        site=site,
        task_root=task_root,
        node_store_dir=None if node is None else str(node.directory),
        node_key="" if node is None else node.key,
    )


@contextlib.contextmanager
def in_task_dir(task_root: str | None, submission: TaskSubmission) -> Iterator[None]:
    """Run the block in the task's working directory when it declares staged files."""
    if task_root is None or not (submission.stage_in or submission.stage_out):
        yield
        return
    directory = os.path.join(task_root, submission.task_id)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"the task's working directory {directory} is not on this worker's file system: "
            "the endpoint's staging.work_dir must be on a file system its workers share "
            "with the agent (a batch engine's compute nodes too)"
        )
    previous_dir = os.getcwd()
    previous_env = {name: os.environ.get(name) for name in _TASK_DIR_VARIABLES}
    os.chdir(directory)
    for name in _TASK_DIR_VARIABLES:
        os.environ[name] = directory
    try:
        yield
    finally:
        os.chdir(previous_dir)
        for name, value in previous_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_function(
    code: bytes,
    *,
    store_url: str | None = None,
    proxy_threshold: int = DEFAULT_PROXY_THRESHOLD_BYTES,
    site: str = "",
    task_root: str | None = None,
    node_store_dir: str | None = None,
    node_key: str = "",
) -> Callable[[bytes], bytes]:
    """Loader for the worker pool: ``code`` is a serialized function (any code strategy).

    The function itself is deserialized at the first call, where the
    submitter's versions are known for the error message; it is kept after that. A task
    with staged files runs in ``<task_root>/<task id>`` (:func:`in_task_dir`). A task
    whose ``client_node`` is ``node_key`` (its client runs on this node, as this user)
    gets a large result through the node-local store in ``node_store_dir``
    (:mod:`fxstream.connectors.node_local`).
    """
    loaded: list[Callable[..., Any]] = []
    if store_url is not None:
        # Opened now, so the store's credentials are known in this worker before an
        # argument proxy (whose config carries no password) resolves.
        _store(store_url)

    def function_for(client: ClientInfo) -> Callable[..., Any]:
        if not loaded:
            loaded.append(_serializer.deserialize_function(code, submitted_by=client))
        return loaded[0]

    def call(submission_bytes: bytes) -> bytes:
        submission = decode(submission_bytes, TaskSubmission)
        function = function_for(submission.client)
        try:
            args, kwargs = _serializer.unpack_arguments(
                submission.payload, submitted_by=submission.client
            )
            if submission.depends_on:
                args, kwargs = bind_parents(args, kwargs, _parent_values(submission))
        except IntegrityError as exc:
            # A substituted by-reference argument (fetched as the payload loads): the
            # client gets the integrity error itself, as for one found inside the function.
            _attach_serialized(exc, _serializer)
            raise
        strategy_id = _result_strategy(submission.payload)
        try:
            with in_task_dir(task_root, submission):
                value = function(*args, **kwargs)
        except Exception as exc:
            integrity = _integrity_cause(exc)
            if integrity is not None:
                # A substituted argument met inside the function: ProxyStore wraps it in
                # ProxyResolveError; the client gets the integrity error itself.
                _attach_serialized(integrity, _serializer)
                raise integrity from None
            waited = _cause_of(exc, ProxyFutureError)
            if waited is not None and waited is not exc:
                # A proxy future that timed out, failed or was evicted, met inside the
                # function: the client gets that error (naming the setting), not ProxyStore's.
                _attach_serialized(waited, _serializer)
                raise waited from None
            _attach_serialized(exc, _serializer_for(strategy_id))
            raise
        # The arguments are not needed to answer: a large one not returned is freed before
        # the result is written (the worker holds the result, not both).
        del args, kwargs
        if node_store_dir is not None and node_key and submission.client_node == node_key:
            by_reference = _results_node_local(
                node_store_dir, node_key, store_url, proxy_threshold, site, strategy_id
            )
            return by_reference.pack_value(value).payload
        if store_url is None:
            return _serializer_for(strategy_id).serialize_value(value, substitute=proxies_by_value)
        by_reference = _results_by_reference(store_url, proxy_threshold, site, strategy_id)
        return by_reference.pack_value(value).payload

    return call


def _parent_values(submission: TaskSubmission) -> dict[str, Any]:
    """Each parent's result, loaded (fetched from the store if it went by reference)."""
    values: dict[str, Any] = {}
    for parent in submission.depends_on:
        payload = submission.parent_results.get(parent)
        if payload is None:
            raise ParentResultUnavailable(
                f"the result of parent task {parent} did not come with this task (it must be "
                "released by the service's dependencies processor, which adds it)"
            )
        try:
            values[parent] = _serializer.deserialize(payload)
        except IntegrityError:
            raise
        except Exception as exc:  # a store miss (evicted, unreachable), a bad payload
            cause = _integrity_cause(exc)
            if cause is not None:
                raise cause from None
            raise ParentResultUnavailable(
                f"the result of parent task {parent} cannot be read on this endpoint: "
                f"{type(exc).__name__}: {exc} (a result passed by reference lives in the proxy "
                "store until it expires or is evicted, and this endpoint must reach that store)"
            ) from exc
    return values


def _integrity_cause(exc: BaseException) -> IntegrityError | None:
    """The integrity error behind ``exc`` (itself, or its cause's chain), if any."""
    return _cause_of(exc, IntegrityError)


_E = TypeVar("_E", bound=BaseException)


def _cause_of(exc: BaseException, kind: type[_E]) -> _E | None:
    """The exception of type ``kind`` behind ``exc`` (itself, or its cause's chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _attach_serialized(exc: Exception, serializer: Serializer) -> None:
    """Leave ``exc`` serialized on itself for the pool, if it serializes small enough."""
    try:
        payload = serializer.serialize_value(exc)
    except Exception:  # an exception holding something unserializable: its text suffices
        return
    if len(payload) <= EXCEPTION_MAX_BYTES:
        with contextlib.suppress(Exception):  # an exception refusing new attributes
            setattr(exc, EXCEPTION_ATTRIBUTE, payload)
