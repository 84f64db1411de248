"""The Executor: a ``concurrent.futures.Executor`` that runs functions on an fxstream endpoint.

It mirrors Globus Compute's ``Executor`` (``submit``,
``submit_to_registered_function``, ``register_function``, ``batch_size``,
``task_group_id``), and ``map`` works. Each ``submit`` serializes and checks
the arguments at once (so a too-large or unpicklable argument raises in the
caller), then a sender thread produces queued tasks to Kafka in batches of up
to ``batch_size``. Results are pushed to the futures by the Client's results
listener.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from fxstream.sdk.client import Client
from fxstream.sdk.errors import NotFound
from fxstream.sdk.futures import TaskFuture
from fxstream.sdk.submit import PreparedTask

__all__ = ["Executor"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_Item = tuple[PreparedTask, TaskFuture]


class Executor(concurrent.futures.Executor):
    """Runs functions on ``endpoint_id`` through ``client`` and returns :class:`TaskFuture` s.

    ``client`` defaults to ``Client.from_environment()`` (closed by
    :meth:`shutdown`). ``task_group_id`` (default: a new UUID) is written in
    every task. ``batch_size`` is the most tasks the sender thread produces
    per round. ``max_retries``, ``walltime_s`` and ``retry_user_errors`` apply
    to every task submitted (see :meth:`Client.prepare_task`).

    Replay: ``Executor(task_group_id=...).reload_tasks()`` in a new process
    rebuilds a future for every task of that group sent by an earlier one
    (see :meth:`reload_tasks`).

    Cancelling (``future.cancel()``, ``shutdown(cancel_futures=True)``, a
    ``map`` that times out): a future whose task is still queued here is never
    sent. A task already sent gets a remote cancel: the agent holding it skips
    it if it is queued there, or kills its worker if it runs (a task that
    finished first keeps its result, which is discarded). The future is
    cancelled at once either way. See :class:`~fxstream.sdk.futures.TaskFuture`.
    """

    def __init__(
        self,
        endpoint_id: str | None = None,
        client: Client | None = None,
        batch_size: int = 128,
        task_group_id: str | None = None,
        *,
        max_retries: int = 0,
        walltime_s: float | None = None,
        retry_user_errors: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if not 0 <= max_retries <= 100:
            raise ValueError(f"max_retries must be between 0 and 100, not {max_retries}")
        if walltime_s is not None and not walltime_s > 0:
            raise ValueError(f"walltime_s must be positive, not {walltime_s}")
        self.max_retries = max_retries
        self.walltime_s = walltime_s
        self.retry_user_errors = retry_user_errors
        self.endpoint_id = endpoint_id
        self._owns_client = client is None
        self.client = client if client is not None else Client.from_environment()
        self.batch_size = batch_size
        self.task_group_id = task_group_id if task_group_id is not None else str(uuid.uuid4())
        self._functions: dict[int, tuple[Callable[..., Any], str]] = {}
        self._register_lock = threading.Lock()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._outstanding: set[TaskFuture] = set()
        self._sender: threading.Thread | None = None
        self._shutdown = False

    # --- functions ---------------------------------------------------------------------

    def register_function(
        self, fn: Callable[..., Any], function_id: str | None = None, **register_kwargs: Any
    ) -> str:
        """The function id of ``fn``, registering it with the service the first time.

        Functions are cached by identity, so each is registered once per
        executor. Given ``function_id``, ``fn`` is associated with that
        already-registered function and the service is not called.
        ``register_kwargs`` go to ``Client.register_function``.
        """
        with self._register_lock:
            cached = self._functions.get(id(fn))
            if cached is not None and cached[0] is fn:
                return cached[1]
            if function_id is None:
                function_id = self.client.register_function(fn, **register_kwargs)
            # Keeping fn alive keeps its id() from being reused by another object.
            self._functions[id(fn)] = (fn, function_id)
            return function_id

    # --- submitting --------------------------------------------------------------------

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> TaskFuture:
        """Run ``fn(*args, **kwargs)`` on the endpoint; ``fn`` is registered once."""
        self._check_open()
        self._check_endpoint()
        function_id = self.register_function(fn)
        return self.submit_to_registered_function(function_id, args, kwargs)

    def submit_to_registered_function(
        self,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> TaskFuture:
        """Run the registered function ``function_id`` with ``args`` and ``kwargs``.

        Raises at once (nothing sent) for arguments that are too large
        (:class:`~fxstream.sdk.errors.PayloadTooLarge`) or not serializable.
        """
        self._check_open()
        endpoint_id = self._check_endpoint()
        task = self.client.prepare_task(
            endpoint_id,
            function_id,
            args,
            kwargs,
            task_group_id=self.task_group_id,
            max_retries=self.max_retries,
            walltime_s=self.walltime_s,
            retry_user_errors=self.retry_user_errors,
        )
        future = self.client.track(task)
        with self._lock:
            if self._shutdown:
                self.client.untrack(task.task_id)
                raise RuntimeError("cannot submit tasks after the Executor was shut down")
            self._outstanding.add(future)
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name="fxstream-executor-sender", daemon=True
                )
                self._sender.start()
            self._queue.put((task, future))
        future.add_done_callback(self._forget)
        return future

    def reload_tasks(self, task_group_id: str | None = None) -> list[TaskFuture]:
        """A future for each task of this executor's task group, e.g. after a restart.

        Like Globus Compute's ``Executor.reload_tasks``: ``task_group_id``, if
        given, becomes the executor's. Tasks that have ended come back with
        futures already resolved (value, error or cancellation), including
        those that finished while no client was running; the others resolve
        when their results arrive. Each result is delivered once, and a task
        this executor's client already tracks keeps its future. An unknown
        group (or one whose tasks the router has not seen yet) gives an empty
        list and a warning; another user's group raises
        :class:`~fxstream.sdk.errors.PermissionDenied`. The futures count as
        outstanding for :meth:`shutdown`. See ``Client.reload_task_group``.
        """
        if task_group_id is not None:
            self.task_group_id = task_group_id
        self._check_open()
        try:
            futures = self.client.reload_task_group(self.task_group_id)
        except NotFound:
            log.warning(
                "no task of task group %s is known to the service (yet); nothing to reload",
                self.task_group_id,
            )
            return []
        with self._lock:
            self._outstanding.update(f for f in futures if not f.done())
        for future in futures:
            future.add_done_callback(self._forget)
        return futures

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[T]:
        """``fn`` over ``iterables`` on the endpoint; results in input order.

        Every call is submitted at once (as separate tasks; ``chunksize`` is
        accepted for compatibility and ignored). ``timeout`` bounds the whole
        iteration; on a timeout or a failure, the futures not yet consumed are
        cancelled. Unlike Globus Compute's, this works.
        """
        return super().map(fn, *iterables, timeout=timeout, chunksize=chunksize)

    def _check_endpoint(self) -> str:
        if self.endpoint_id is None:
            raise ValueError(
                "no endpoint to run on: pass Executor(endpoint_id=...) or set executor.endpoint_id"
            )
        return self.endpoint_id

    def _check_open(self) -> None:
        if self._shutdown:
            raise RuntimeError("cannot submit tasks after the Executor was shut down")

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._outstanding.discard(future)

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.batch_size:
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None:
                    stop = True
                    break
                batch.append(following)
            live = []
            for task, future in batch:
                if future.cancelled():
                    self.client.untrack(task.task_id)
                else:
                    live.append((task, future))
            if not live:
                continue
            try:
                self.client.send(live)
            except Exception as exc:  # the client was closed under us, or the producer failed
                for task, future in live:
                    self.client.untrack(task.task_id)
                    future._resolve_exception(exc)

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """How many of this executor's futures are not done."""
        with self._lock:
            return len(self._outstanding)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting tasks; optionally cancel the unfinished ones, and wait.

        ``cancel_futures`` cancels every future not done: queued tasks are not
        sent, and tasks already sent are cancelled remotely (skipped, or their
        worker killed; the cancels are sent before a client the executor
        created is closed). ``wait`` returns
        once every remaining future has its result (as Globus Compute's does).
        A client the executor created is closed once nothing is outstanding.
        """
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
            sender = self._sender
            pending = list(self._outstanding)
        if cancel_futures:
            for future in pending:
                future.cancel()
        if first and sender is not None:
            self._queue.put(None)
        if wait:
            if sender is not None:
                sender.join()
            concurrent.futures.wait(pending)
            if self._owns_client:
                self.client.close()
        elif self._owns_client and first:
            threading.Thread(
                target=self._close_client_when_done,
                args=(sender, pending),
                name="fxstream-executor-closer",
                daemon=True,
            ).start()

    def _close_client_when_done(
        self, sender: threading.Thread | None, pending: list[TaskFuture]
    ) -> None:
        if sender is not None:
            sender.join()
        concurrent.futures.wait(pending)
        self.client.close()

    def __repr__(self) -> str:
        return (
            f"Executor(endpoint_id={self.endpoint_id!r}, task_group_id={self.task_group_id!r}, "
            f"batch_size={self.batch_size})"
        )
