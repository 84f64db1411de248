"""The Client: registry calls over REST, task submission to Kafka, results pushed from Kafka.

It mirrors Globus Compute's ``Client`` (``register_function``, ``run``,
``create_batch``/``batch_run``, ``get_task``, ``get_result``,
``get_batch_result``, endpoint and function calls), with two differences
under the hood: tasks are produced straight to the user's own
``from.user.<user_id>`` (the REST service is never on a task's path; only this
user's Kafka principal may write there, which is how the router knows who
submitted), and results are pushed to futures by one listener thread reading
``results.<user_id>``. Each task pins its function's code by digest: the
``code_sha256`` the service answered when the function was registered (or
fetched once per function with :meth:`Client.function_sha256`).

The facade is split by role: the registry calls (functions, endpoints, triggers,
analytics, versions) are :class:`~fxstream.sdk.registry_calls.RegistryCalls`, task status
and results :class:`~fxstream.sdk.task_status.TaskStatus`, replay
:class:`~fxstream.sdk.replay.Replay`; this module keeps construction, submission
(``pack``, ``prepare_task``, ``run``, batches), cancel, subscriptions and the lifecycle.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from proxystore.store.base import Store

from fxstream.connectors import (
    DEFAULT_PROXY_FUTURE_TIMEOUT_S,
    ByReference,
    FutureHold,
    NamedObjects,
    NodeLocal,
    Packed,
    ProducerHold,
    ProxyFuture,
    ProxyFutureError,
    evict_objects,
    find_node_local,
    hold_futures,
    open_store,
)
from fxstream.sdk.batch import Batch, refuse_user_endpoint_config
from fxstream.sdk.errors import (
    ConfigurationError,
    FxstreamError,
    SubmissionFailed,
)
from fxstream.sdk.futures import TaskFuture
from fxstream.sdk.node_tier import EndpointNodes
from fxstream.sdk.registry_calls import RegistryCalls
from fxstream.sdk.replay import Replay, check_group_id
from fxstream.sdk.rest import DEFAULT_TIMEOUT_S, RestClient
from fxstream.sdk.results import ResultListener
from fxstream.sdk.settings import (
    DEFAULT_MAX_INLINE_BYTES,
    DEFAULT_PROXY_THRESHOLD,
    DEFAULT_TOPIC_PREFIX,
    ENV_VARIABLES,
    ClientSettings,
)
from fxstream.sdk.staging import StagingSpec
from fxstream.sdk.submit import (
    PreparedTask,
    TaskProducer,
    build_cancel,
    build_task,
    pack_arguments,
)
from fxstream.sdk.subscription import (
    DEFAULT_BUFFER,
    ResultSubscription,
    Since,
    since_timestamp,
    subscription_group,
)
from fxstream.sdk.task_status import TaskStatus
from fxstream.topics import (
    MAX_PARENTS,
    Catalogue,
    KafkaConnection,
    ParentResult,
    Serializer,
    budget,
    parents_in,
    producer_message_max_bytes,
)
from fxstream.topics.acls import user_group_prefix

__all__ = ["Client", "IssuedToken", "RegisteredUser"]

log = logging.getLogger(__name__)

# Futures of run/batch_run kept for get_result: beyond this many, the oldest finished one
# is dropped per new task (get_result then asks the service, as after forget()).
_RETAINED: Final = 100_000


# Clients with a producer: what the exit hook flushes.
_producing: weakref.WeakSet[Client] = weakref.WeakSet()
_EXIT_FLUSH_S: Final = 120.0


def _flush_at_exit() -> None:
    """Wait for Kafka to acknowledge what every client produced, before the interpreter
    exits (the producer's delivery thread is a daemon; librdkafka's queue would be lost)."""
    for client in list(_producing):
        left = client.flush(_EXIT_FLUSH_S)
        if left:
            log.error(
                "%d task records were not acknowledged by Kafka within %.0f s at exit; "
                "they are lost unless delivered (is the broker up?)",
                left,
                _EXIT_FLUSH_S,
            )


# Runs when the interpreter starts to exit, before atexit handlers (after the
# Executor's hook, registered later, which sends the tasks its sender still holds).
threading._register_atexit(_flush_at_exit)  # type: ignore[attr-defined]


class RegisteredUser(NamedTuple):
    """What ``Client.register_user`` returns: the new user's id and API token (shown once)."""

    user_id: str
    token: str


class IssuedToken(NamedTuple):
    """A token from a rotation, the admin or a login (shown once), and when it expires.

    ``previous_token_valid_until`` is when the token it replaced stops working
    (None: it stopped at once).
    """

    user_id: str
    token: str
    token_expires_at: float
    previous_token_valid_until: float | None = None


def _issued(answer: dict[str, Any]) -> IssuedToken:
    previous = answer.get("previous_token_valid_until")
    return IssuedToken(
        str(answer["user_id"]),
        str(answer["token"]),
        float(answer["token_expires_at"]),
        None if previous is None else float(previous),
    )


class Client(RegistryCalls, TaskStatus, Replay):
    """A user's connection to fxstream: the REST service and the Kafka broker.

    ``service_url`` is the REST service (docs/api.md); ``kafka`` the Kafka brokers and your
    principal on them (a :class:`~fxstream.topics.KafkaConnection`, read from your credentials
    file by :meth:`from_environment`); ``topic_prefix`` the deployment's topic prefix. A task
    needs ``token`` (and ``user_id``, which is asked from the service when not given).
    ``serializer`` encodes functions, arguments and results (default: dill by value for code;
    for data, pickle, or dill by value where the value holds a class or function of
    ``__main__``, a lambda or a closure). The data strategy also governs results: the worker
    answers with the strategy of the task's arguments.

    Large arguments travel by reference: with a ``store`` (a store URL such as
    ``redis://HOST:PORT``, or a ProxyStore ``Store``), each argument that
    serializes above ``proxy_threshold`` bytes is put there and the task
    carries a reference; results come back the same way from the endpoint's
    store and are fetched before the future resolves. Both are evicted once the
    result is consumed (docs/data-plane.md). What stays inline above
    ``max_inline_bytes`` is refused with
    :class:`~fxstream.sdk.errors.PayloadTooLarge` before anything is sent.

    Nothing connects until used. The first submission starts the results
    listener (assigned at the end of ``results.<user_id>``) and the producer;
    :meth:`close` (or ``with Client(...)``) stops them.
    """

    def __init__(
        self,
        service_url: str | None = None,
        *,
        kafka: KafkaConnection | None = None,
        topic_prefix: str | None = None,
        user_id: str | None = None,
        token: str | None = None,
        serializer: Serializer | None = None,
        max_inline_bytes: int | None = None,
        store: str | Store[Any] | None = None,
        proxy_threshold: int | None = None,
        request_timeout: float = DEFAULT_TIMEOUT_S,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        if service_url is None and kafka is None:
            # Client(): the environment's settings, else the credentials `./fx up` wrote
            # (fxstream.sdk.settings), as Globus Compute's Client() finds its login.
            found = ClientSettings.from_environment()
            service_url, kafka = found.service_url, found.kafka
            topic_prefix = found.topic_prefix if topic_prefix is None else topic_prefix
            user_id = found.user_id if user_id is None else user_id
            token = found.token if token is None else token
            store = found.store_url if store is None else store
            if max_inline_bytes is None:
                max_inline_bytes = found.max_inline_bytes
            if proxy_threshold is None:
                proxy_threshold = found.proxy_threshold
        elif service_url is None or kafka is None:
            raise ConfigurationError(
                "give a Client both service_url and kafka, or neither (then both come from "
                "FXSTREAM_CREDENTIALS, the FXSTREAM_* variables or the credentials `./fx up` "
                "wrote: see fxstream.sdk.settings)"
            )
        topic_prefix = DEFAULT_TOPIC_PREFIX if topic_prefix is None else topic_prefix
        if max_inline_bytes is None:
            max_inline_bytes = DEFAULT_MAX_INLINE_BYTES
        if proxy_threshold is None:
            proxy_threshold = DEFAULT_PROXY_THRESHOLD
        if max_inline_bytes <= 0:
            raise ValueError(f"max_inline_bytes must be positive, not {max_inline_bytes}")
        if proxy_threshold < 0:
            raise ValueError(f"proxy_threshold must not be negative, not {proxy_threshold}")
        self.service_url = service_url
        self.kafka = kafka
        self.catalogue = Catalogue(prefix=topic_prefix)
        self.serializer = serializer if serializer is not None else Serializer()
        self.max_inline_bytes = max_inline_bytes
        self._proxy_threshold = proxy_threshold
        self.store: Store[Any] | None = open_store(store) if isinstance(store, str) else store
        # Kept for store:// objects (put_object); it may hold a password: never shown.
        self._store_url = store if isinstance(store, str) else None
        self._by_reference = (
            None
            if self.store is None
            else ByReference(
                self.store, threshold_bytes=proxy_threshold, serializer=self.serializer
            )
        )
        self._user_id = user_id
        self._token = token
        self._kafka_config = dict(kafka_config or {})
        self._rest = RestClient(service_url, token=token, timeout=request_timeout)
        # The node-local tier (shared memory) for endpoints on this node: looked at when
        # first needed (fxstream.connectors.node_local, fxstream.sdk.node_tier).
        self._node: NodeLocal | None = None
        self._node_looked = False
        self._node_by_reference: ByReference | None = None
        self._endpoint_nodes = EndpointNodes(self._endpoint_node_key)
        self._lock = threading.Lock()
        self._producer: TaskProducer | None = None
        self._listener: ResultListener | None = None
        self._futures: dict[str, TaskFuture] = {}
        # Function id -> the SHA-256 of its registered code, which each task pins.
        self._digests: dict[str, str] = {}
        # Open subscriptions: closed with the client.
        self._subscriptions: weakref.WeakSet[ResultSubscription] = weakref.WeakSet()
        self._closed = False
        self.session_task_group_id = str(uuid.uuid4())
        """The task group of :meth:`run` and of batches without one (Globus Compute's), so
        they can be reloaded later; set it to resume an earlier session's group."""

    # --- construction ------------------------------------------------------------------

    @classmethod
    def from_settings(
        cls, settings: ClientSettings, *, serializer: Serializer | None = None
    ) -> Client:
        """A client from :class:`~fxstream.sdk.settings.ClientSettings`."""
        return cls(
            settings.service_url,
            kafka=settings.kafka,
            topic_prefix=settings.topic_prefix,
            user_id=settings.user_id,
            token=settings.token,
            serializer=serializer,
            max_inline_bytes=settings.max_inline_bytes,
            store=settings.store_url,
            proxy_threshold=settings.proxy_threshold,
        )

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] | None = None, *, serializer: Serializer | None = None
    ) -> Client:
        """A client configured by ``FXSTREAM_*`` variables and/or ``FXSTREAM_CREDENTIALS``.

        See :mod:`fxstream.sdk.settings` for the variables and the file format.
        """
        return cls.from_settings(ClientSettings.from_environment(env), serializer=serializer)

    @staticmethod
    def register_user(
        service_url: str, name: str, *, admin_token: str, timeout: float = DEFAULT_TIMEOUT_S
    ) -> RegisteredUser:
        """Register a new user (``POST /v1/users``, platform admin only); ``(user_id, token)``.

        ``admin_token`` is the platform admin's token (``<platform
        home>/credentials/api-admin.json``). The service also creates the user's
        results topic. Keep the token: the service stores only its hash; it
        expires after the service's token lifetime.
        """
        rest = RestClient(service_url, token=admin_token, timeout=timeout)
        try:
            answer = rest.post("/users", {"name": name})
        finally:
            rest.close()
        return RegisteredUser(str(answer["user_id"]), str(answer["token"]))

    @staticmethod
    def issue_token(
        service_url: str, user_id: str, *, admin_token: str, timeout: float = DEFAULT_TIMEOUT_S
    ) -> IssuedToken:
        """A new token for ``user_id`` (platform admin only); its earlier tokens stop at once.

        The remedy for an expired, revoked or lost token.
        """
        rest = RestClient(service_url, token=admin_token, timeout=timeout)
        try:
            answer = rest.post(f"/users/{user_id}/token", None)
        finally:
            rest.close()
        return _issued(answer)

    @staticmethod
    def login(
        service_url: str, provider: str, provider_token: str, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> IssuedToken:
        """An fxstream token for an identity provider's token (``POST /v1/login/{provider}``).

        E.g. ``provider="globus"`` with a Globus Auth access token issued for the
        service's Globus client; the first login creates the user.
        """
        rest = RestClient(service_url, timeout=timeout)
        try:
            answer = rest.post(f"/login/{provider}", {"token": provider_token})
        finally:
            rest.close()
        return _issued(answer)

    def rotate_token(self, *, grace_s: float = 0.0) -> IssuedToken:
        """Replace this client's token with a new one, which this client uses from now on.

        The old token stops at once (``grace_s`` 0) or after ``grace_s`` seconds
        (at most a day), for other processes still using it.
        """
        self._require_token()
        issued = _issued(self._rest.post("/users/me/token", {"grace_s": grace_s}))
        self._token = issued.token
        self._rest.set_token(issued.token)
        return issued

    def revoke_token(self) -> None:
        """Revoke this client's token now (a new one then comes from the platform admin)."""
        self._require_token()
        self._rest.delete("/users/me/token")

    # --- identity ----------------------------------------------------------------------

    @property
    def user_id(self) -> str:
        """This client's user id (asked from the service once when not configured)."""
        if self._user_id is None:
            self._require_token()
            self._user_id = str(self.whoami()["user_id"])
        return self._user_id

    def whoami(self) -> dict[str, Any]:
        """``GET /v1/users/me``: the caller's ``user_id`` and ``name``."""
        answer: dict[str, Any] = self._rest.get("/users/me")
        return answer

    def _require_token(self) -> str:
        if not self._token:
            raise ConfigurationError(
                "no API token configured: pass token= (from Client.register_user) or set "
                "FXSTREAM_TOKEN"
            )
        return self._token

    # --- submitting --------------------------------------------------------------------

    def local_node(self, endpoint_id: str) -> NodeLocal | None:
        """This client's node-local tier when ``endpoint_id``'s workers share it (same
        machine, boot and OS user: the node key its heartbeats advertise), else None.

        Large arguments to such an endpoint go to shared memory instead of the store,
        and its workers put large results there too (docs/data-plane.md, "Tiers");
        ``FXSTREAM_NODE_STORE=off`` turns this off."""
        with self._lock:
            if not self._node_looked:
                self._node = find_node_local()
                self._node_looked = True
            node = self._node
        if node is None:
            return None
        return node if self._endpoint_nodes.key_of(endpoint_id) == node.key else None

    def _endpoint_node_key(self, endpoint_id: str) -> str:
        status = self._rest.get(f"/endpoints/{endpoint_id}").get("status") or {}
        key = status.get("node_key", "") if isinstance(status, dict) else ""
        return key if isinstance(key, str) else ""

    def _by_reference_to(self, node: NodeLocal | None) -> ByReference | None:
        """Where large arguments go: the node-local store (the usual one when it has no
        room for a value), or the usual store."""
        if node is None:
            return self._by_reference
        with self._lock:
            if self._node_by_reference is None:
                self._node_by_reference = ByReference(
                    node.store(),
                    threshold_bytes=self._proxy_threshold,
                    serializer=self.serializer,
                    fallback=self.store,
                    has_room=node.has_room,
                )
            return self._node_by_reference

    def pack(
        self,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        endpoint_id: str | None = None,
    ) -> Packed:
        """Serialize one task's arguments, large ones by reference (see the class docs).

        With ``endpoint_id`` given and that endpoint's workers on this node
        (:meth:`local_node`), large arguments go to the node-local store in shared memory.

        A :class:`~fxstream.sdk.futures.TaskFuture` given as a top-level argument (or
        keyword argument) makes the task depend on that task (issue 15's task DAGs): the
        service holds it until that task has succeeded and the worker passes its result
        in the future's place, fetched by reference from the proxy store when it went
        there (it never comes through this client). A future this client already holds
        the value of (done, succeeded) passes that value instead. A
        :class:`~fxstream.topics.ParentResult` names a parent by task id the same way.
        A future inside a container (a list, a dict) is refused, saying to pass it as a
        top-level argument.

        A proxy future's proxy (:meth:`proxy_future`) travels as it is, never resolved
        here; as a top-level argument it makes the task hold the future until its result
        is consumed (``Packed.holds``), and a ``ProxyFuture`` itself makes it the future's
        producer (one that ends without setting it fails the future's readers).

        Raises :class:`~fxstream.sdk.errors.PayloadTooLarge` when what stays
        inline exceeds ``max_inline_bytes``.
        """
        node = None if endpoint_id is None else self.local_node(endpoint_id)
        return self._pack(function_id, args, kwargs, node)

    def _pack(
        self,
        function_id: str,
        args: Iterable[Any],
        kwargs: Mapping[str, Any] | None,
        node: NodeLocal | None,
    ) -> Packed:
        """:meth:`pack`, large arguments to ``node``'s tier when given (else the store)."""
        args, kwargs = _placeholders_for_futures(tuple(args), dict(kwargs or {}))
        parents = parents_in(args, kwargs)
        if len(parents) > MAX_PARENTS:
            raise ValueError(
                f"a task may depend on at most {MAX_PARENTS} tasks, not {len(parents)}: "
                "gather their results in one task first and depend on that one"
            )
        packed = pack_arguments(
            self.serializer,
            function_id,
            args,
            kwargs,
            max_inline_bytes=self.max_inline_bytes,
            by_reference=self._by_reference_to(node),
        )
        if parents:
            packed = dataclasses.replace(packed, parents=tuple(parents))
        holds = hold_futures(args, kwargs)
        return dataclasses.replace(packed, holds=tuple(holds)) if holds else packed

    def proxy_future(
        self,
        *,
        timeout_s: float = DEFAULT_PROXY_FUTURE_TIMEOUT_S,
        consumers: int = 1,
    ) -> tuple[ProxyFuture[Any], Any]:
        """A proxy future in this client's store: ``(future, proxy)``.

        Pass ``proxy`` to a consumer task as any argument: the task can start at once, and
        its first use of the value waits until ``future.set_result(value)`` is called,
        here or in a producer task that was given ``future`` itself (it pickles with its
        signing key). So a pipeline's stages overlap instead of waiting for each other
        (ProxyStore's ``Store.future``; docs/triggers.md, "Proxy futures").

        The value is written to the store as any by-reference value (its SHA-256 in its
        key) and announced with a pointer signed by the future's private key, which only
        ``future`` holds; a worker verifies both before it loads anything, and refuses a
        value someone else wrote with ``ProxyFutureForged`` (an integrity error). A reader
        waits at most ``timeout_s`` seconds, then raises ``ProxyFutureTimeout`` naming that
        setting; ``future.set_exception(...)`` makes readers fail at once instead.

        Lifetime: each task given ``proxy`` as a top-level argument holds the future until
        its result is consumed; once ``consumers`` of them were consumed and none is left,
        the value is evicted (``future.evict()`` evicts at once; the store's lease
        reclaims what nobody evicts). Needs a Redis or file store (``store_url``); raises
        :class:`~fxstream.sdk.errors.ConfigurationError` without one.
        """
        if self.store is None:
            raise ConfigurationError(
                "a proxy future lives in the proxy store, and this client has none: set "
                f"store_url ({ENV_VARIABLES['store_url']}; the credentials `./fx up` writes "
                "name the platform's Redis) or pass Client(store='redis://...')"
            )
        try:
            future = ProxyFuture.create(
                self.store, timeout_s=timeout_s, serializer=self.serializer, consumers=consumers
            )
        except ProxyFutureError as exc:
            raise ConfigurationError(str(exc)) from None
        return future, future.proxy()

    def prepare_task(
        self,
        endpoint_id: str,
        function_id: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        task_group_id: str | None = None,
        payload: bytes | Packed | None = None,
        max_retries: int = 0,
        walltime_s: float | None = None,
        retry_user_errors: bool = False,
        function_sha256: str | None = None,
        endpoint_group: Sequence[str] | None = None,
        tags: Mapping[str, str] | None = None,
        staging: StagingSpec | None = None,
        resource_specification: Mapping[str, int] | None = None,
    ) -> PreparedTask:
        """Build one task's record without sending it (what ``run`` and the Executor use).

        ``endpoint_group`` names further endpoints the service may run it on instead of
        ``endpoint_id``: the router chooses one that is online, preferring one with the
        function warm, then the shortest backlog, then the one holding its by-reference
        arguments. You must be allowed to use every one of them, or the task is refused.

        ``max_retries`` further attempts are made after an infrastructure failure
        (its worker died, its walltime passed), and after an exception of the
        function too if ``retry_user_errors``; ``walltime_s`` bounds one attempt.
        ``function_sha256`` pins the code to run (default: :meth:`function_sha256`).
        ``tags`` label the task for :meth:`get_tasks` (``{"run": "42"}``: at most 8 tags,
        keys of 1-32 letters, digits, '_', '.' or '-', string values of 1-64 characters).
        ``staging`` names files the endpoint stages into the task's working directory
        before it runs and out of it after it succeeded
        (:class:`~fxstream.sdk.staging.StagingSpec`; docs/api.md, "Staged files").
        ``resource_specification`` is what an MPI task needs (``{"num_nodes": 2,
        "ranks_per_node": 4}``; ``num_ranks`` is computed, or checked when given): only an
        endpoint with an MPI engine runs it (docs/hpc.md).

        Raises :class:`~fxstream.sdk.errors.PayloadTooLarge`,
        :class:`~fxstream.topics.SerializationError` or ``ValueError`` (an
        invalid id or tag, saying what to change) before anything is sent.
        """
        tags = budget.check_tags(tags)  # before the arguments are packed (and stored)
        if function_sha256 is None:
            function_sha256 = self.function_sha256(function_id)
        # One endpoint on this node (a group may run it elsewhere): shared memory.
        node = None if set(endpoint_group or ()) - {endpoint_id} else self.local_node(endpoint_id)
        if payload is None:
            payload = self._pack(function_id, args, kwargs, node)
        return build_task(
            client_node="" if node is None else node.key,
            catalogue=self.catalogue,
            user_id=self.user_id,
            endpoint_id=endpoint_id,
            function_id=function_id,
            function_sha256=function_sha256,
            payload=payload,
            task_group_id=task_group_id,
            max_retries=max_retries,
            walltime_s=walltime_s,
            retry_user_errors=retry_user_errors,
            endpoint_group=endpoint_group,
            tags=tags,
            staging=staging,
            resource_specification=resource_specification,
        )

    # --- store objects (staged files) --------------------------------------------------

    def _named_objects(self) -> NamedObjects:
        if self._store_url is None:
            raise ConfigurationError(
                "store:// objects live in the platform's Redis store, and this client has no "
                f"store URL: set store_url ({ENV_VARIABLES['store_url']}; the credentials "
                "`./fx up` writes name it) or pass Client(store='redis://...')"
            )
        try:
            return NamedObjects(self._store_url)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None

    def put_object(self, name: str, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` as your store object ``name`` (``store://NAME`` in a staging URL),
        replacing it; returns its size. It lives for the store's lease unless deleted.

        Raises ``ValueError`` for a name that is not accepted (1-256 letters, digits, '.',
        '_', '-' and '/') and :class:`~fxstream.sdk.errors.ConfigurationError` without a
        Redis store."""
        objects = self._named_objects()
        try:
            return objects.put(self.user_id, name, data)
        finally:
            objects.close()

    def get_object(self, name: str) -> bytes | None:
        """Your store object ``name`` (e.g. a task's ``store://`` output), or None."""
        objects = self._named_objects()
        try:
            return objects.get(self.user_id, name)
        finally:
            objects.close()

    def delete_object(self, name: str) -> bool:
        """Delete your store object ``name``; False when there was none."""
        objects = self._named_objects()
        try:
            return objects.delete(self.user_id, name)
        finally:
            objects.close()

    def _streams(self) -> tuple[TaskProducer, ResultListener]:
        listener = self._started_listener()
        with self._lock:
            if self._closed:
                raise FxstreamError("this Client is closed")
            if self._producer is None:
                self._producer = TaskProducer(
                    self.kafka,
                    self.catalogue.from_user(self.user_id),
                    max_message_bytes=producer_message_max_bytes(self.catalogue),
                    kafka_config=self._kafka_config,
                )
                _producing.add(self)
            return self._producer, listener

    def _started_listener(self) -> ResultListener:
        with self._lock:
            if self._closed:
                raise FxstreamError("this Client is closed")
            if self._listener is None:
                listener = ResultListener(
                    self.kafka,
                    self.catalogue.results(self.user_id),
                    self.serializer,
                    kafka_config=self._kafka_config,
                    release=self._release,
                    group_id=user_group_prefix(self.user_id) + f"sdk-{uuid.uuid4()}",
                )
                listener.start()
                self._listener = listener
            return self._listener

    def start(self) -> None:
        """Start the results listener and the producer now (else the first submission does)."""
        self._streams()

    def track(self, task: PreparedTask, *, retain: bool = False) -> TaskFuture:
        """The future of ``task``, registered with the results listener (before it is sent).

        With ``retain``, the client keeps the future so ``get_result`` and
        ``get_task`` answer from it (what ``run`` and ``batch_run`` do); the
        newest 100,000 finished ones at most, plus every unfinished one (older
        tasks are answered by the service).
        """
        listener = self._streams()[1]
        future = TaskFuture(
            task.task_id,
            function_id=task.function_id,
            endpoint_id=task.endpoint_id,
            submitted_at=task.submitted_at,
        )
        future.candidates = task.candidates
        future.tags = dict(task.tags)
        future._remote_cancel = self._send_remote_cancel
        future._state_probe = self._task_state_name
        future._stored = list(task.stored)
        listener.track(future)
        if retain:
            with self._lock:
                self._futures[task.task_id] = future
                if len(self._futures) > _RETAINED:
                    oldest = next(iter(self._futures))
                    kept = self._futures.pop(oldest)
                    if not kept.done():  # still waited for: to the back of the line
                        self._futures[oldest] = kept
        return future

    def untrack(self, task_id: str) -> None:
        """Stop waiting for a task's result (for a task whose record was never sent)."""
        listener = self._listener
        if listener is not None:
            listener.untrack(task_id)

    def send(
        self,
        tasks: Sequence[tuple[PreparedTask, TaskFuture]],
        *,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Produce tracked tasks without waiting; a refused record fails its future, and
        ``on_sent`` (if given) is called once for each record Kafka acknowledged (on the
        producer's delivery thread: keep it short)."""
        producer, listener = self._streams()
        live: list[tuple[PreparedTask, TaskFuture]] = []
        for task, future in tasks:
            if future._mark_sent():
                live.append((task, future))
            else:  # cancelled before it went out: never sent, nothing to cancel remotely
                listener.untrack(task.task_id)
        futures = {task.task_id: future for task, future in live}

        def on_delivery(task_id: str, failure: SubmissionFailed | None) -> None:
            if failure is None:
                if on_sent is not None:
                    on_sent()
            else:
                listener.untrack(task_id)
                future = futures[task_id]
                self._release_unsent(future._stored)
                future._stored = []
                future._resolve_exception(failure)

        producer.send([task for task, _ in live], on_delivery)

    def _run_tasks(self, tasks: list[PreparedTask]) -> list[str]:
        producer = self._streams()[0]
        futures = [self.track(task, retain=True) for task in tasks]
        for future in futures:
            future._mark_sent()  # nobody else has these futures yet: never refused
        try:
            producer.send_and_wait(tasks)
        except SubmissionFailed as exc:
            for future in futures:
                self._release_unsent(future._stored)
                future._stored = []
                future._resolve_exception(exc)
            raise
        return [task.task_id for task in tasks]

    # --- objects passed by reference ---------------------------------------------------

    def release(self, task: PreparedTask) -> None:
        """Evict what a task put in the proxy store, for a task that will never be sent (its
        holds on proxy futures end without counting it as a consumer)."""
        self._release_unsent(list(task.stored))

    def _release_unsent(self, objects: list[Any]) -> None:
        """:meth:`_release` for a task that never reached Kafka: its holds on proxy futures
        are discarded (it consumed nothing), its stored objects evicted."""
        kept: list[Any] = []
        for item in objects:
            if isinstance(item, FutureHold | ProducerHold):
                item.discard()
            else:
                kept.append(item)
        self._release(kept)

    def _release(self, objects: list[Any]) -> None:
        """Evict objects a consumed task no longer needs.

        Nothing is written to ``data-locations``: a user's principal writes only
        ``from.user.<user id>``, and a location a user claims could not be checked (who
        owns an object key?), while these records are routing hints only.
        """
        if objects:
            evict_objects(objects)

    def run(
        self,
        *args: Any,
        endpoint_id: str,
        function_id: str,
        endpoint_group: Sequence[str] | None = None,
        tags: Mapping[str, str] | None = None,
        staging: StagingSpec | None = None,
        **kwargs: Any,
    ) -> str:
        """Run ``function_id(*args, **kwargs)`` on ``endpoint_id`` (or, with
        ``endpoint_group``, on the one of them the service chooses: see
        :meth:`prepare_task`); returns the task id.

        ``tags`` label the task for :meth:`get_tasks` (see :meth:`prepare_task`), and
        ``staging`` names its staged files; like ``endpoint_group`` they are taken by
        ``run`` itself, so a function's own keyword
        argument of that name goes through :meth:`create_batch` / :meth:`batch_run` or the
        Executor instead.

        Returns once Kafka has acknowledged the task (it is durable). Get the
        outcome with :meth:`get_result` or :meth:`future`.
        """
        task = self.prepare_task(
            endpoint_id,
            function_id,
            args,
            kwargs,
            task_group_id=self.session_task_group_id,
            endpoint_group=endpoint_group,
            tags=tags,
            staging=staging,
        )
        return self._run_tasks([task])[0]

    def create_batch(
        self,
        task_group_id: str | None = None,
        resource_specification: Mapping[str, int] | None = None,
        user_endpoint_config: Mapping[str, Any] | None = None,
        create_websocket_queue: bool = False,
    ) -> Batch:
        """An empty :class:`~fxstream.sdk.batch.Batch` to fill with ``add`` and send with
        :meth:`batch_run` (Globus Compute's parameters): ``resource_specification`` (MPI
        tasks) applies to each of its tasks; ``user_endpoint_config`` is refused with
        ``ValueError`` (endpoints here are configured by their owner);
        ``create_websocket_queue`` is accepted and means nothing here (results always
        come back on your results topic)."""
        refuse_user_endpoint_config(user_endpoint_config)
        return Batch(self.pack, task_group_id, resource_specification=resource_specification)

    def batch_run(
        self,
        endpoint_id: str,
        batch: Batch,
        *,
        endpoint_group: Sequence[str] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run every task of ``batch`` on ``endpoint_id`` (or on the one of
        ``endpoint_group`` the service chooses, per task); returns Globus Compute's answer:
        ``{"request_id", "task_group_id", "endpoint_id", "tasks": {function_id: [task
        ids, in the order added]}}``.

        A batch without a task group runs in :attr:`session_task_group_id`, so it can be
        reloaded later (``Executor(task_group_id=...).reload_tasks()``). ``tags`` label
        every task of the batch; a task's own tags (``Batch.add(..., tags=...)``) are
        added to them and win for the same key. An empty batch raises ``ValueError``.
        """
        if not batch:
            raise ValueError("no tasks in the batch: add some with batch.add(function_id, args)")
        shared = budget.check_tags(tags)
        task_group_id = batch.task_group_id or self.session_task_group_id
        tasks = [
            self.prepare_task(
                endpoint_id,
                function_id,
                payload=payload,
                task_group_id=task_group_id,
                endpoint_group=endpoint_group,
                tags={**shared, **own} if own else shared,
                resource_specification=batch.resource_specification,
            )
            for function_id, payload, own in batch.entries()
        ]
        by_function: dict[str, list[str]] = {}
        for task_id, task in zip(self._run_tasks(tasks), tasks, strict=True):
            by_function.setdefault(task.function_id, []).append(task_id)
        return {
            "request_id": str(uuid.uuid4()),
            "task_group_id": task_group_id,
            "endpoint_id": endpoint_id,
            "tasks": by_function,
        }

    # --- cancel --------------------------------------------------------------------------

    def cancel(
        self,
        task_id: str,
        *,
        endpoint_id: str | None = None,
        reason: str = "",
        timeout: float = 30.0,
        kill: bool = True,
    ) -> None:
        """Cancel a task, running or not; returns once Kafka has acknowledged the cancel.

        This is the explicit call that stops a running task (``future.cancel()``
        cancels pending tasks only, as ``concurrent.futures`` says; see
        ``Executor.kill``). The cancel follows the task (same key, so the same
        partitions, in order): the agent holding the task skips it if it is still
        queued, or kills its worker if it runs, and answers it ``TaskCancelled``: its state becomes
        ``cancelled``, and its future (here, or in the client that submitted it)
        ends cancelled. A task that already finished keeps its result. Only the
        task's submitter may cancel it: a cancel from another user is refused
        (dead-lettered) by the router or the agent, and the task runs on.

        ``kill`` False only skips a task that has not started: one already running
        finishes and keeps its result in task-state (this client's future of it, if
        any, still ends cancelled, as ``future.cancel()`` does).

        ``endpoint_id`` is needed only for a task this client did not submit and
        the service does not know yet; otherwise it is taken from the task. A task
        submitted here with an endpoint group gets one cancel per endpoint of the group
        (the router does not look up where it sent the task; the agents that do not
        hold it ignore theirs).
        Raises :class:`~fxstream.sdk.errors.SubmissionFailed` when Kafka does not
        acknowledge the cancel within ``timeout`` seconds, and
        :class:`~fxstream.sdk.errors.NotFound` for a task nobody knows.
        """
        future = self._tracked(task_id)
        if endpoint_id is not None:
            targets: Sequence[str] = [endpoint_id]
        elif future is not None:
            targets = future.candidates or [future.endpoint_id]
        else:
            targets = [str(self._rest.get(f"/tasks/{task_id}")["endpoint_id"])]
        producer = self._streams()[0]
        acknowledgements: list[concurrent.futures.Future[SubmissionFailed | None]] = []
        for target in targets:
            record = build_cancel(
                user_id=self.user_id,
                task_id=task_id,
                endpoint_id=target,
                reason=reason,
                kill=kill,
            )
            acknowledged: concurrent.futures.Future[SubmissionFailed | None] = (
                concurrent.futures.Future()
            )
            producer.send_record(task_id, record, _acknowledge(acknowledged))
            acknowledgements.append(acknowledged)
        deadline = time.monotonic() + timeout
        for acknowledged in acknowledgements:
            try:
                failure = acknowledged.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise SubmissionFailed(
                    f"the cancel of task {task_id} was not acknowledged by Kafka within "
                    f"{timeout:.0f} s (is the broker up, and is FXSTREAM_BOOTSTRAP right?); it "
                    "may still be delivered"
                ) from None
            if failure is not None:
                raise failure
        if future is not None:
            # The cancel is on its way (a running task's worker is killed): the future
            # ends cancelled now, running or not, and sends no second cancel.
            future._force_cancel()

    def _task_state_name(self, future: TaskFuture) -> str | None:
        """The service's state name of ``future``'s task (what ``future.running()`` asks)."""
        state: dict[str, Any] = self._rest.get(f"/tasks/{future.task_id}")
        name = state.get("state")
        return str(name) if name is not None else None

    def _send_remote_cancel(self, future: TaskFuture) -> None:
        """Send a cancelled future's skip-only remote cancel without waiting
        (TaskFuture.cancel): a task already started is not killed."""
        with self._lock:
            producer = None if self._closed else self._producer
        if producer is None:
            log.warning(
                "task %s: the client is closed, its remote cancel is not sent", future.task_id
            )
            return

        def delivered(task_id: str, failure: SubmissionFailed | None) -> None:
            if failure is not None:
                log.warning("the remote cancel of task %s was not sent: %s", task_id, failure)

        # A grouped task: one cancel per endpoint it may have been routed to.
        for target in future.candidates or [future.endpoint_id]:
            record = build_cancel(
                user_id=self.user_id,
                task_id=future.task_id,
                endpoint_id=target,
                # future.cancel() never stops an executing call: if the task started
                # before this client learnt so (its running event lags by up to a
                # heartbeat), the agent lets it finish; its result is then dropped here.
                kill=False,
            )
            producer.send_record(future.task_id, record, delivered)

    def _tracked(self, task_id: str) -> TaskFuture | None:
        """This client's future of a task, kept (``run``) or only awaiting its result."""
        future = self._local(task_id)
        if future is None and self._listener is not None:
            future = self._listener.future(task_id)
        return future

    # --- result subscriptions ----------------------------------------------------------

    def subscribe(
        self,
        *,
        rule_id: str | None = None,
        task_group_id: str | None = None,
        since: Since = "now",
        from_offsets: Mapping[int, int] | None = None,
        buffer: int = DEFAULT_BUFFER,
        timeout: float = 30.0,
    ) -> ResultSubscription:
        """A stream of the results of one of your trigger rules (``rule_id``) or task groups
        (``task_group_id``), whoever submitted the tasks; give exactly one.

        Iterate the returned :class:`~fxstream.sdk.subscription.ResultSubscription` (or
        call its ``get(timeout)``) for one
        :class:`~fxstream.sdk.subscription.SubscribedResult` per task, as results arrive;
        close it (``with`` or ``close()``; closing the client closes it too). It reads your
        ``results.<user_id>`` with ``read_committed`` and loads only the values of the
        group's results (docs/triggers.md, "Result subscriptions").

        Where it starts: ``since="now"`` (the default: every result committed after this
        call returns), a time (seconds since the epoch, or a ``datetime``: replay the
        results written since then, then live), ``"created"`` (a rule's every result still
        on the topic); ``from_offsets`` (an earlier subscription's ``positions``) resumes
        exactly there. A ``rule_id`` must be one of your rules
        (:class:`~fxstream.sdk.errors.NotFound` otherwise); its results are its task
        group's. Raises :class:`~fxstream.sdk.errors.ResultsTopicMissing` when your results
        topic does not exist.
        """
        if (rule_id is None) == (task_group_id is None):
            raise ValueError("give exactly one of rule_id= and task_group_id=")
        created_at: float | None = None
        if rule_id is not None:
            rule = self.get_trigger(rule_id)
            created_at = float(rule["created_at"])
            group = rule_id
        else:
            assert task_group_id is not None
            group = task_group_id
        check_group_id(group)
        start = since_timestamp(since, created_at)
        with self._lock:
            if self._closed:
                raise FxstreamError("this Client is closed")
        subscription = ResultSubscription(
            self.kafka,
            self.catalogue.results(self.user_id),
            self.serializer,
            user_id=self.user_id,
            task_group_id=group,
            group_id=subscription_group(user_group_prefix(self.user_id)),
            since=start,
            from_offsets=from_offsets,
            buffer=buffer,
            kafka_config=self._kafka_config,
            start_timeout=timeout,
        )
        with self._lock:
            closed = self._closed
            if not closed:
                self._subscriptions.add(subscription)
        if closed:
            subscription.close()
            raise FxstreamError("this Client is closed")
        return subscription

    # --- lifecycle ---------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until every task record produced so far is acknowledged by Kafka.

        Returns how many records are still undelivered after ``timeout`` seconds
        (0 when all are durable). A closed or unused client has nothing to flush.
        """
        with self._lock:
            producer = None if self._closed else self._producer
        return 0 if producer is None else producer.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Flush queued tasks, stop the listener and the producer, close the HTTP pool.

        Futures still waiting for results stay unresolved.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            producer, listener = self._producer, self._listener
            subscriptions = list(self._subscriptions)
            # Dropped so librdkafka's threads end with the objects.
            self._producer = self._listener = None
        if producer is not None:
            producer.close(timeout)
        if listener is not None:
            listener.close()
        for subscription in subscriptions:
            subscription.close()
        self._rest.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Client({self.service_url!r}, kafka={self.kafka!r}, "
            f"topic_prefix={self.catalogue.prefix!r}, user_id={self._user_id!r})"
        )


# --- status answers ----------------------------------------------------------------------


def _placeholders_for_futures(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with each top-level :class:`TaskFuture` replaced by a
    :class:`~fxstream.topics.ParentResult` (its task becomes a parent), or by its value
    when this client already holds it (done and succeeded)."""

    def placeholder(value: Any) -> Any:
        # type(), never isinstance: a lazy proxy among the arguments would resolve.
        if not issubclass(type(value), TaskFuture):
            return value
        future: TaskFuture = value
        # Before looking at done(): a result that arrives from now on stays in the store.
        future._keep_result = True
        if future.done() and not future.cancelled() and future.exception() is None:
            return future.result()
        return ParentResult(future.task_id)

    return tuple(placeholder(v) for v in args), {k: placeholder(v) for k, v in kwargs.items()}


def _acknowledge(
    acknowledged: concurrent.futures.Future[SubmissionFailed | None],
) -> Callable[[str, SubmissionFailed | None], None]:
    """A delivery callback that resolves ``acknowledged`` with the failure (or None)."""

    def delivered(_task_id: str, failure: SubmissionFailed | None) -> None:
        acknowledged.set_result(failure)

    return delivered
