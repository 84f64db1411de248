"""fxstream.sdk: the user SDK, shaped like Globus Compute's.

- :class:`Client`: registry calls over REST (users, functions, endpoints, task
  status), tasks produced straight to Kafka, results pushed from Kafka.
- :class:`Executor`: a ``concurrent.futures.Executor`` bound to an endpoint;
  ``submit``, ``map`` and :class:`TaskFuture` s resolved by push.
- :class:`ShellFunction`: a shell command as a function (:class:`ShellResult`).
- :class:`MPIFunction`: an MPI program as a function, run under the launcher of the
  endpoint's MPI engine for the task's ``resource_specification``.
- Task DAGs: a :class:`TaskFuture` (or a :class:`ParentResult` naming a task by id) passed
  as a top-level argument makes that task a parent: the service runs the task once its
  parents succeeded, with their results (by reference); a failed parent fails it with
  :class:`ParentFailed`.
- Proxy futures: :meth:`Client.proxy_future` / :meth:`Executor.proxy_future` give a
  :class:`ProxyFuture` and a proxy of its value; a task given the proxy waits on first use
  until the future is set (by the client, or by a producer task given the future), so
  pipeline stages overlap (:class:`ProxyFutureTimeout`, :class:`ProxyFutureFailed`,
  :class:`ProxyFutureForged`).
- :meth:`Client.subscribe`: a trigger rule's or a task group's results as a stream
  (:class:`ResultSubscription` of :class:`SubscribedResult`).
- :func:`stream_producer` / :func:`stream_consumer`: ProxyStore streams over
  Kafka (:mod:`~fxstream.sdk.streams`), bulk objects in a store.
- Staged files: :class:`StagingSpec` with :meth:`Executor.submit_staged` (or
  ``Client.run(..., staging=...)``): inputs copied into the task's working directory before
  it runs, outputs out after (``file://``, ``store://`` through :meth:`Client.put_object` /
  :meth:`Client.get_object`, ``globus://``); a failed transfer raises :class:`StagingFailed`.
- :mod:`~fxstream.sdk.errors`: the exceptions, all :class:`FxstreamError`.

Modules: ``client`` (the facade; its roles in ``registry_calls``, ``task_status``,
``replay``), ``executor``, ``batch``, ``futures``, ``results`` (the
listener thread), ``history`` (results read back for replay), ``subscription`` (result
subscriptions), ``submit`` (records and the producer), ``rest``, ``settings``, ``shell``,
``staging``, ``errors``, ``streams``, ``heap`` (a drained backlog's heap given back),
``status`` (Globus Compute's status words), ``versions``, ``hardware`` (the worker
hardware report).
"""

from fxstream.connectors import (
    ProxyFuture,
    ProxyFutureError,
    ProxyFutureFailed,
    ProxyFutureForged,
    ProxyFutureTimeout,
)
from fxstream.sdk.batch import Batch
from fxstream.sdk.client import Client, IssuedToken, RegisteredUser
from fxstream.sdk.errors import (
    AuthenticationError,
    BlockLost,
    ConfigurationError,
    FxstreamError,
    InvalidRequest,
    NotFound,
    ParentFailed,
    ParentResultUnavailable,
    ParentUnknown,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    ResultsTopicMissing,
    ServiceError,
    ServiceUnavailable,
    StagingFailed,
    StagingUnavailable,
    StreamDeliveryFailed,
    StreamError,
    StreamTimeout,
    SubmissionFailed,
    TaskExecutionFailed,
    TaskPending,
    TaskRejected,
    VersionMismatch,
    WalltimeExceeded,
    WorkerLost,
)
from fxstream.sdk.executor import Executor
from fxstream.sdk.futures import TIMING_KEYS, TaskFuture
from fxstream.sdk.settings import DEFAULT_MAX_INLINE_BYTES, ClientSettings
from fxstream.sdk.shell import MPIFunction, ShellFunction, ShellResult
from fxstream.sdk.staging import StagingSpec
from fxstream.sdk.streams import (
    KafkaPublisher,
    KafkaStreamConsumer,
    KafkaStreamProducer,
    KafkaSubscriber,
    stream_consumer,
    stream_producer,
)
from fxstream.sdk.subscription import ResultSubscription, SubscribedResult, SubscriptionClosed
from fxstream.sdk.task_status import TaskPage
from fxstream.topics import ParentResult

__all__ = [
    "DEFAULT_MAX_INLINE_BYTES",
    "TIMING_KEYS",
    "AuthenticationError",
    "Batch",
    "BlockLost",
    "Client",
    "ClientSettings",
    "ConfigurationError",
    "Executor",
    "FxstreamError",
    "InvalidRequest",
    "IssuedToken",
    "KafkaPublisher",
    "KafkaStreamConsumer",
    "KafkaStreamProducer",
    "KafkaSubscriber",
    "MPIFunction",
    "NotFound",
    "ParentFailed",
    "ParentResult",
    "ParentResultUnavailable",
    "ParentUnknown",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProxyFuture",
    "ProxyFutureError",
    "ProxyFutureFailed",
    "ProxyFutureForged",
    "ProxyFutureTimeout",
    "RateLimited",
    "RegisteredUser",
    "ResultSubscription",
    "ResultsTopicMissing",
    "ServiceError",
    "ServiceUnavailable",
    "ShellFunction",
    "ShellResult",
    "StagingFailed",
    "StagingSpec",
    "StagingUnavailable",
    "StreamDeliveryFailed",
    "StreamError",
    "StreamTimeout",
    "SubmissionFailed",
    "SubscribedResult",
    "SubscriptionClosed",
    "TaskExecutionFailed",
    "TaskFuture",
    "TaskPage",
    "TaskPending",
    "TaskRejected",
    "VersionMismatch",
    "WalltimeExceeded",
    "WorkerLost",
    "stream_consumer",
    "stream_producer",
]
