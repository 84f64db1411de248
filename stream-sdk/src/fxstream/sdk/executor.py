"""The Executor: a ``concurrent.futures.Executor`` that runs functions on an fxstream endpoint.

It mirrors Globus Compute's ``Executor`` (``submit``,
``submit_to_registered_function``, ``register_function``, ``batch_size``,
``task_group_id``), and ``map`` works. Each ``submit`` serializes and checks
the arguments at once (so a too-large or unpicklable argument raises in the
caller), then a sender thread produces queued tasks to Kafka in batches of up
to ``batch_size``. Results are pushed to the futures by the Client's results
listener.

It keeps the ``concurrent.futures`` contract where the standard executors do:

* Nothing submitted is lost when the program exits without :meth:`Executor.shutdown`
  (or after ``shutdown(wait=False)``): as ``ThreadPoolExecutor`` joins its workers,
  a hook that runs when the interpreter starts to exit (before ``atexit``
  handlers, like the standard executors') sends every queued task and waits until
  Kafka has acknowledged it. From then on ``submit`` raises ``RuntimeError``, as
  the standard executors' does after interpreter shutdown.
* ``running()`` follows the task: it turns true when the platform reports the task
  running (see ``Client``); ``cancel()`` then returns False. Stopping a running
  task is its own call, :meth:`Executor.kill`.
* The executor holds no callable, future or result once it is done with it: functions
  are cached by weak reference and by the digest of their code (a fresh lambda or
  bound method of the same code is registered once), futures only while pending,
  and an executor dropped without ``shutdown()`` is finalized (its queued tasks
  sent, a client it created closed once its tasks have results).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import queue
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, ParamSpec, TypeVar

from fxstream.connectors import DEFAULT_PROXY_FUTURE_TIMEOUT_S, ProxyFuture
from fxstream.sdk.batch import refuse_user_endpoint_config
from fxstream.sdk.client import Client
from fxstream.sdk.errors import NotFound
from fxstream.sdk.futures import TaskFuture
from fxstream.sdk.shell import MPIFunction
from fxstream.sdk.staging import StagingSpec
from fxstream.sdk.submit import PreparedTask
from fxstream.topics import ResourceSpecification, Serializer, budget

__all__ = ["Executor"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_Item = tuple[PreparedTask, TaskFuture]

# Function ids by the digest of their code: a fresh lambda or bound method of the same
# code maps to one registration. Bounded; a function evicted here is registered again.
_DIGESTS_KEPT: Final = 4_096
# How long the exit hook waits for Kafka to acknowledge what was queued.
_EXIT_FLUSH_S: Final = 120.0

_interpreter_exiting = False
# Every running sender thread -> its queue and client (what the exit hook drains).
_senders: dict[threading.Thread, tuple[queue.SimpleQueue[_Item | None], Client]] = {}
_live_lock = threading.Lock()


def _send_queued_at_exit() -> None:
    """Send what every executor has queued and wait for Kafka, before the interpreter
    exits (what ``concurrent.futures.thread`` does for its workers, through the same hook).

    Executors shut down with ``wait=False`` or dropped without ``shutdown()`` included.
    """
    global _interpreter_exiting
    with _live_lock:
        _interpreter_exiting = True
        senders = list(_senders.items())
    for sender, (items, client) in senders:
        items.put(None)
        sender.join(_EXIT_FLUSH_S)
        client.flush(_EXIT_FLUSH_S)


# Runs in threading._shutdown, before non-daemon threads are joined and before atexit
# handlers: the same moment the standard executors join their workers.
threading._register_atexit(_send_queued_at_exit)  # type: ignore[attr-defined]


class Executor(concurrent.futures.Executor):
    """Runs functions on ``endpoint_id`` through ``client`` and returns :class:`TaskFuture` s.

    ``endpoint_group`` (instead of, or besides, ``endpoint_id``) lets the service choose
    the endpoint of each task among several: one that is online, preferring one with the
    function warm, then the shortest backlog, then the one holding the task's
    by-reference arguments (the router's placement policy). The user must be allowed on
    every endpoint of the group, or each task is refused with the endpoint named.
    ``future.endpoint_id`` is where the task ran once its result arrived.

    The positional parameters are Globus Compute's, in its order: ``endpoint_id``,
    ``client`` (default ``Client()``: the environment's settings or the credentials
    ``./fx up`` wrote; closed by :meth:`shutdown`), ``task_group_id`` (default: a new
    UUID; written in every task), ``resource_specification``, ``user_endpoint_config``
    (refused with ``ValueError`` when given: endpoints here are configured by their
    owner), ``label`` (shown in ``repr``), ``batch_size`` (the most tasks the sender
    thread produces per round) and ``amqp_port`` (ignored: results come from Kafka).
    ``task_count_submitted`` counts the tasks sent: their records acknowledged by Kafka
    (durable), as Globus Compute's counts the tasks its web service accepted.
    ``max_retries``, ``walltime_s`` and ``retry_user_errors`` (keywords) apply to every
    task submitted (see :meth:`Client.prepare_task`), and so do ``tags``
    (``Executor(tags={"run": "42"})``; set ``executor.tags`` to label later tasks
    otherwise), which ``Client.get_tasks(tags=...)`` filters on. ``resource_specification``
    (MPI tasks: nodes and ranks, see the property) is written in every task too; an
    :class:`~fxstream.sdk.shell.MPIFunction` is refused without one.

    Replay: ``Executor(task_group_id=...).reload_tasks()`` in a new process
    rebuilds a future for every task of that group sent by an earlier one
    (see :meth:`reload_tasks`).

    Cancelling (``future.cancel()``, ``shutdown(cancel_futures=True)``, a
    ``map`` that times out) cancels pending futures only, as the standard says:
    a future whose task is reported running returns False. A future whose task
    is still queued here is never sent; a task already sent gets a remote
    cancel, and the agent holding it skips it if it is queued there. Stopping a
    running task is :meth:`kill`. See :class:`~fxstream.sdk.futures.TaskFuture`.
    """

    def __init__(
        self,
        endpoint_id: str | None = None,
        client: Client | None = None,
        task_group_id: str | None = None,
        resource_specification: Mapping[str, int] | None = None,
        user_endpoint_config: Mapping[str, Any] | None = None,
        label: str = "",
        batch_size: int = 128,
        amqp_port: int | None = None,
        *,
        max_retries: int = 0,
        walltime_s: float | None = None,
        retry_user_errors: bool = False,
        endpoint_group: Sequence[str] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        refuse_user_endpoint_config(user_endpoint_config)
        if amqp_port is not None:
            log.info(
                "Executor(amqp_port=%s) is ignored: results come from Kafka, not AMQP", amqp_port
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if not 0 <= max_retries <= 100:
            raise ValueError(f"max_retries must be between 0 and 100, not {max_retries}")
        if walltime_s is not None and not walltime_s > 0:
            raise ValueError(f"walltime_s must be positive, not {walltime_s}")
        self.max_retries = max_retries
        self.walltime_s = walltime_s
        self.retry_user_errors = retry_user_errors
        self._tags = budget.check_tags(tags)
        self.resource_specification = resource_specification
        self.endpoint_id = endpoint_id
        self.endpoint_group: list[str] | None = (
            list(endpoint_group) if endpoint_group is not None else None
        )
        self._owns_client = client is None
        self.client = client if client is not None else Client.from_environment()
        self.batch_size = batch_size
        self.label = label
        self._delivered = _DeliveredCount()
        self.task_group_id = task_group_id if task_group_id is not None else str(uuid.uuid4())
        # fn -> function id while fn lives; code digest -> function id (bounded).
        self._by_function: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._by_digest: OrderedDict[str, str] = OrderedDict()
        self._register_lock = threading.Lock()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._outstanding: set[TaskFuture] = set()
        self._sender: threading.Thread | None = None
        self._shutdown = False
        # Done-callbacks hold the executor weakly: a done future does not keep it alive.
        self._forget_callback = _forgetter(weakref.ref(self))
        # A dropped executor: its queued tasks are sent, a client it made closed when done.
        self._finalizer = weakref.finalize(
            self,
            _finalize,
            self._queue,
            self._outstanding,
            self._lock,
            self.client if self._owns_client else None,
        )

    @property
    def tags(self) -> dict[str, str]:
        """The tags written in every task submitted from now on (a copy; set to change)."""
        return dict(self._tags)

    @tags.setter
    def tags(self, tags: Mapping[str, str] | None) -> None:
        self._tags = budget.check_tags(tags)

    @property
    def resource_specification(self) -> dict[str, int] | None:
        """What each task submitted from now on needs as an MPI task (Globus Compute's
        ``num_nodes``, ``ranks_per_node``, ``num_ranks``; completed, a copy), or ``None``.

        Set it (or pass ``Executor(resource_specification=...)``) to a dict of
        ``num_nodes`` and ``ranks_per_node`` or ``num_ranks``; a spec that cannot be met
        (``num_ranks`` not ``num_nodes x ranks_per_node``, an unknown key) raises
        ``ValueError`` here. Only an endpoint with an MPI engine runs such tasks.
        """
        spec = self._resources
        return None if spec is None else spec.as_dict()

    @resource_specification.setter
    def resource_specification(self, spec: Mapping[str, int] | None) -> None:
        self._resources = None if spec is None else ResourceSpecification.from_mapping(dict(spec))

    # --- functions ---------------------------------------------------------------------

    def register_function(
        self, fn: Callable[..., Any], function_id: str | None = None, **register_kwargs: Any
    ) -> str:
        """The function id of ``fn``, registering it with the service the first time.

        Each function is registered once per executor: known by (weak) reference
        while it lives, and by the digest of its serialized code, so a fresh
        lambda or bound method of the same code is not registered again. Given
        ``function_id``, ``fn`` is associated with that already-registered
        function and the service is not called. ``register_kwargs`` go to
        ``Client.register_function``. The executor keeps no reference to ``fn``.
        """
        with self._register_lock:
            known = self._known(fn)
            if known is not None and function_id is None:
                return known
            code: bytes | None = None
            if function_id is None or not self._remember(fn, function_id):
                code = self.client.serializer.serialize_function(fn)
                digest = hashlib.sha256(code).hexdigest()
                if function_id is None:
                    function_id = self._by_digest.get(digest)
                if function_id is None:
                    register_kwargs.setdefault("name", _name_of(fn))
                    function_id = self.client.register_serialized_function(
                        fn, code, **register_kwargs
                    )
                self._remember(fn, function_id)
                self._by_digest[digest] = function_id
                self._by_digest.move_to_end(digest)
                if len(self._by_digest) > _DIGESTS_KEPT:
                    self._by_digest.popitem(last=False)
            return function_id

    def _known(self, fn: Callable[..., Any]) -> str | None:
        try:
            return self._by_function.get(fn)
        except TypeError:  # not hashable or not weakly referenceable: by digest only
            return None

    def _remember(self, fn: Callable[..., Any], function_id: str) -> bool:
        """Cache ``fn`` by weak reference; False if it cannot be (then by digest only).

        A bound method is a new object at every attribute access: it is cached by
        digest only (a weak reference to it would die at once).
        """
        if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
            return False
        try:
            self._by_function[fn] = function_id
        except TypeError:
            return False
        return True

    # --- submitting --------------------------------------------------------------------

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> TaskFuture:
        """Run ``fn(*args, **kwargs)`` on the endpoint; ``fn`` is registered once.

        A :class:`TaskFuture` among ``args`` or ``kwargs`` (top level) makes this task
        depend on its task: the service runs it once that task succeeded, with that
        task's result in the future's place (by reference; see ``Client.pack``), and fails
        it with :class:`~fxstream.sdk.errors.ParentFailed` if that task fails.

        Raises ``RuntimeError`` after :meth:`shutdown` and once the interpreter
        has begun to exit (e.g. from an ``atexit`` handler), as the standard
        executors do: a task is either accepted and sent, or refused.
        """
        self._check_open()
        self._check_endpoint()
        if isinstance(fn, MPIFunction) and self._resources is None:
            raise ValueError(
                "an MPIFunction needs a resource_specification (how many nodes and ranks): "
                'set executor.resource_specification = {"num_nodes": 1, "ranks_per_node": 2} '
                "(or pass it to Executor) before submitting it"
            )
        function_id = self.register_function(fn)
        return self.submit_to_registered_function(function_id, args, kwargs)

    def submit_staged(
        self, staging: StagingSpec, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> TaskFuture:
        """:meth:`submit` with staged files: the endpoint copies ``staging.stage_in`` into
        the task's working directory, runs ``fn(*args, **kwargs)`` there (its current
        directory, also ``$FXSTREAM_TASK_DIR``), then copies ``staging.stage_out`` out of
        it once ``fn`` succeeded (:class:`~fxstream.sdk.staging.StagingSpec`). A transfer
        that fails fails the task with :class:`~fxstream.sdk.errors.StagingFailed` (or
        :class:`~fxstream.sdk.errors.StagingUnavailable`, retryable)."""
        self._check_open()
        self._check_endpoint()
        function_id = self.register_function(fn)
        return self.submit_to_registered_function(function_id, args, kwargs, staging=staging)

    def submit_to_registered_function(
        self,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        staging: StagingSpec | None = None,
    ) -> TaskFuture:
        """Run the registered function ``function_id`` with ``args`` and ``kwargs`` (and
        ``staging``'s files, see :meth:`submit_staged`).

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
            endpoint_group=self.endpoint_group,
            task_group_id=self.task_group_id,
            max_retries=self.max_retries,
            walltime_s=self.walltime_s,
            retry_user_errors=self.retry_user_errors,
            tags=self._tags,
            staging=staging,
            resource_specification=self.resource_specification,
        )
        future = self.client.track(task)
        with _live_lock, self._lock:
            refusal = self._refusal()
            if refusal:
                self.client.untrack(task.task_id)
                self.client.release(task)
                raise RuntimeError(refusal)
            self._outstanding.add(future)
            if self._sender is None:
                # Holds the queue and the client, not the executor (so it can be collected).
                self._sender = threading.Thread(
                    target=_send_loop,
                    args=(self._queue, self.client, self.batch_size, self._delivered),
                    name="fxstream-executor-sender",
                    daemon=True,
                )
                _senders[self._sender] = (self._queue, self.client)
                self._sender.start()
            self._queue.put((task, future))
        future.add_done_callback(self._forget_callback)
        return future

    def proxy_future(
        self,
        *,
        timeout_s: float = DEFAULT_PROXY_FUTURE_TIMEOUT_S,
        consumers: int = 1,
    ) -> tuple[ProxyFuture[Any], Any]:
        """A proxy future, ``(future, proxy)``: submit a consumer with ``proxy`` now, and
        it waits on first use until ``future.set_result(value)`` (here, or in a producer task
        given ``future``). See :meth:`Client.proxy_future`."""
        return self.client.proxy_future(timeout_s=timeout_s, consumers=consumers)

    def reload_tasks(self, task_group_id: str | None = None) -> list[TaskFuture]:
        """A future for each task of this executor's task group, e.g. after a restart.

        Like Globus Compute's ``Executor.reload_tasks``: ``task_group_id``, if
        given, becomes the executor's. Tasks that have ended come back with
        futures already resolved (value, error or cancellation), including
        those that finished while no client was running; the others resolve
        when their results arrive. Each result is delivered once, and a task
        this executor's client already tracks keeps its future. An unknown
        group (or one whose tasks the router has not seen yet, or one holding
        only another user's tasks, which are never visible) gives an empty
        list and a warning. The futures count as
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
            future.add_done_callback(self._forget_callback)
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
        cancelled if pending (running ones run on, as with the standard
        executors). Unlike Globus Compute's, this works.
        """
        return super().map(fn, *iterables, timeout=timeout, chunksize=chunksize)

    def _check_endpoint(self) -> str:
        if self.endpoint_id is not None:
            return self.endpoint_id
        if self.endpoint_group:
            return sorted(self.endpoint_group)[0]  # one candidate among the group
        raise ValueError(
            "no endpoint to run on: pass Executor(endpoint_id=...) or "
            "Executor(endpoint_group=[...]), or set executor.endpoint_id"
        )

    def _check_open(self) -> None:
        refusal = self._refusal()
        if refusal:
            raise RuntimeError(refusal)

    def _refusal(self) -> str:
        if _interpreter_exiting:
            return (
                "cannot schedule new futures after interpreter shutdown: the queued tasks "
                "were sent when the interpreter began to exit; submit before it does "
                "(not from an atexit handler)"
            )
        if self._shutdown:
            return "cannot submit tasks after the Executor was shut down"
        return ""

    def kill(self, future: TaskFuture, *, reason: str = "", timeout: float = 30.0) -> bool:
        """Stop ``future``'s task even if it is running: its worker is killed.

        Unlike ``future.cancel()`` (pending tasks only, as the standard says), this
        sends a remote cancel whatever the task's state: the agent holding it
        skips it if queued or kills its worker if it runs. Returns True once Kafka
        has acknowledged the cancel and the future is cancelled; False if the
        future was already done (a finished task keeps its result). A task still
        queued in this executor is simply never sent. See ``Client.cancel``.
        """
        if future.done():
            return False
        if future._cancel_unsent():
            return True
        # Client.cancel sends a grouped task's cancel to each endpoint of its group.
        self.client.cancel(
            future.task_id,
            endpoint_id=None if future.candidates else future.endpoint_id,
            reason=reason,
            timeout=timeout,
        )
        return future.cancelled()

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """How many of this executor's futures are not done."""
        with self._lock:
            return len(self._outstanding)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting tasks; optionally cancel the pending ones, and wait.

        ``cancel_futures`` cancels every pending future (as the standard
        executors do; running ones run on): queued tasks are not sent, and tasks
        already sent are cancelled remotely (skipped where they wait; the cancels
        are sent before a client the executor created is closed). ``wait``
        returns once every remaining future has its result (as Globus Compute's
        does). Either way every task accepted is sent: ``wait=False`` returns at
        once, and the queued tasks are still delivered (at the latest when the
        interpreter exits). A client the executor created is closed once nothing
        is outstanding.
        """
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
            sender = self._sender
            pending = list(self._outstanding)
        if cancel_futures:
            for future in pending:
                future.cancel()
        if first:
            self._finalizer.detach()
            if sender is not None:
                self._queue.put(None)
        if wait:
            if sender is not None:
                sender.join()
            concurrent.futures.wait(pending)
            if self._owns_client:
                self.client.close()
        elif first:
            # A daemon: at exit the hook above sends what is queued; results are not
            # waited for then (Kafka holds the tasks).
            threading.Thread(
                target=_close_when_done,
                args=(sender, pending, self.client if self._owns_client else None),
                name="fxstream-executor-closer",
                daemon=True,
            ).start()

    @property
    def task_count_submitted(self) -> int:
        """How many of this executor's tasks are sent (Globus Compute's name): their records
        acknowledged by Kafka, so durable even if this process dies now. A task handed to
        :meth:`submit` counts once its record is delivered, as Globus Compute's counts a
        task once its web service accepted it (its guide waits on this before a planned
        exit)."""
        return self._delivered.value

    @property
    def serializer(self) -> Serializer:
        """How functions, arguments and results are encoded: the client's serializer (read
        only: its results listener and store use it too, so choose it when making the
        client, ``Client(serializer=...)``)."""
        return self.client.serializer

    def __repr__(self) -> str:
        label = f"label={self.label!r}, " if self.label else ""
        return (
            f"Executor({label}endpoint_id={self.endpoint_id!r}, "
            f"endpoint_group={self.endpoint_group!r}, "
            f"task_group_id={self.task_group_id!r}, "
            f"batch_size={self.batch_size})"
        )


def _name_of(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else type(fn).__name__


def _forgetter(executor: weakref.ref[Executor]) -> Callable[[concurrent.futures.Future[Any]], None]:
    def forget(future: concurrent.futures.Future[Any]) -> None:
        alive = executor()
        if alive is not None:
            with alive._lock:
                alive._outstanding.discard(future)

    return forget


class _DeliveredCount:
    """How many of an executor's task records Kafka acknowledged (its sender adds to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self) -> None:
        """One more record delivered (called on the producer's delivery thread)."""
        with self._lock:
            self._count += 1

    @property
    def value(self) -> int:
        """The count so far."""
        with self._lock:
            return self._count


def _send_loop(
    items: queue.SimpleQueue[_Item | None],
    client: Client,
    batch_size: int,
    delivered: _DeliveredCount,
) -> None:
    """The sender thread: produce queued tasks in batches until the None sentinel."""
    try:
        _send_batches(items, client, batch_size, delivered)
    finally:
        with _live_lock:
            _senders.pop(threading.current_thread(), None)


def _send_batches(
    items: queue.SimpleQueue[_Item | None],
    client: Client,
    batch_size: int,
    delivered: _DeliveredCount,
) -> None:
    while True:
        batch, stop = _next_batch(items, batch_size)
        if batch:
            _send_batch(batch, client, delivered)
        # Nothing of a sent batch stays referenced while the next one is awaited.
        del batch
        if stop:
            return


def _next_batch(
    items: queue.SimpleQueue[_Item | None], batch_size: int
) -> tuple[list[_Item], bool]:
    """Up to ``batch_size`` queued items (waiting for the first); True once the sentinel came."""
    first = items.get()
    if first is None:
        return [], True
    batch = [first]
    while len(batch) < batch_size:
        try:
            following = items.get_nowait()
        except queue.Empty:
            break
        if following is None:
            return batch, True
        batch.append(following)
    return batch, False


def _send_batch(batch: list[_Item], client: Client, delivered: _DeliveredCount) -> None:
    live = []
    for task, future in batch:
        if future.cancelled():
            client.untrack(task.task_id)
            client.release(task)
        else:
            live.append((task, future))
    if not live:
        return
    try:
        client.send(live, on_sent=delivered.add)
    except Exception as exc:  # the client was closed under us, or the producer failed
        for task, future in live:
            client.untrack(task.task_id)
            client.release(task)
            future._resolve_exception(exc)


def _close_when_done(
    sender: threading.Thread | None, pending: list[TaskFuture], client: Client | None
) -> None:
    if sender is not None:
        sender.join()
    if client is None:
        return
    client.flush()
    concurrent.futures.wait(pending)
    del pending
    client.close()


def _finalize(
    items: queue.SimpleQueue[_Item | None],
    outstanding: set[TaskFuture],
    lock: threading.Lock,
    client: Client | None,
) -> None:
    """An executor collected without shutdown(): its sender ends once it sent what is
    queued, and a client it made is closed once its tasks have results."""
    items.put(None)
    if client is None:
        return
    with lock:
        pending = list(outstanding)
    threading.Thread(
        target=_close_when_done,
        args=(None, pending, client),
        name="fxstream-executor-finalizer",
        daemon=True,
    ).start()
