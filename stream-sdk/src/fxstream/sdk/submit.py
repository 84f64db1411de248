"""Submitting tasks: building ``submission`` records and producing them to ``from.user.<user>``.

A user writes its submissions and cancels to its own topic, which only its Kafka
principal may write: the router takes the submitter from the topic, so the records
carry no credential. Each submission pins its function's code by digest
(``function_sha256``, the ``code_sha256`` the service answered at registration).

Tasks go straight to Kafka, never through the REST service. The producer is
idempotent with ``acks=all``, so an acknowledged task is durable and a retried
send never duplicates it; records are keyed by task id.

Large arguments travel by reference: with a proxy store configured, each
argument that serializes above ``proxy_threshold`` goes to the store and the
record carries a reference (:mod:`fxstream.connectors.reference`). Size limits
are checked *before* anything is sent: what is left inline above
``max_inline_bytes`` (default 512 KiB), or a record above the topic's
``max.message.bytes``, raises :class:`~fxstream.sdk.errors.PayloadTooLarge`
naming the setting to change.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from confluent_kafka import KafkaError, Message, Producer

from fxstream.connectors import (
    ByReference,
    FutureHold,
    Packed,
    ProducerHold,
    StoredObject,
    evict_objects,
)
from fxstream.sdk.errors import PayloadTooLarge, SubmissionFailed
from fxstream.sdk.settings import ENV_VARIABLES
from fxstream.sdk.staging import StagingSpec
from fxstream.topics import (
    MAX_ENDPOINT_GROUP,
    Catalogue,
    KafkaConnection,
    RecordDecodeError,
    ResourceSpecification,
    Serializer,
    TaskCancel,
    TaskSubmission,
    budget,
    client_info,
    decode,
    encode,
)

__all__ = [
    "RECORD_OVERHEAD_BYTES",
    "DeliveryCallback",
    "PreparedTask",
    "TaskProducer",
    "build_cancel",
    "build_task",
    "pack_arguments",
]

RECORD_OVERHEAD_BYTES: Final = budget.RECORD_OVERHEAD_BYTES
"""Headroom for Kafka's batch and record framing when comparing a record with the topic limit."""

_NO_STORE_NOTE: Final = (
    "Configure a proxy store so large arguments travel by reference: set store_url "
    f"({ENV_VARIABLES['store_url']}, e.g. redis://HOST:6379; the credentials `./fx up` writes "
    "name the platform's Redis) or pass Client(store=...)"
)
_PROXY_NOTE: Final = (
    "Arguments above the proxy threshold travel by reference when a proxy store is configured "
    f"(store_url, {ENV_VARIABLES['store_url']})"
)

DeliveryCallback = Callable[[str, "SubmissionFailed | None"], None]
"""Called from the producer's thread with a task id and None (acknowledged) or the failure."""


@dataclass(frozen=True)
class PreparedTask:
    """A task ready to send: its encoded ``submission`` record and the facts about it."""

    task_id: str
    function_id: str
    endpoint_id: str
    submitted_at: float
    record: bytes
    task_group_id: str | None = None
    stored: tuple[StoredObject | FutureHold | ProducerHold, ...] = ()
    """Objects its arguments put in the proxy store (evicted once its result is consumed),
    and its holds on the proxy futures it was given (released then)."""
    candidates: tuple[str, ...] = ()
    """The endpoints the router may choose among (``endpoint_id`` and its group, sorted);
    empty for a task that names one endpoint."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """The task's tags, as its record carries them."""


def pack_arguments(
    serializer: Serializer,
    function_id: str,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    max_inline_bytes: int,
    by_reference: ByReference | None = None,
) -> Packed:
    """Serialize ``(args, kwargs)`` into a task payload, large arguments by reference.

    Without ``by_reference`` (no store) everything is inline. Raises
    :class:`PayloadTooLarge` (naming the size, the limit and the setting) when
    what stays inline exceeds ``max_inline_bytes``, after evicting anything it
    put in the store; or :class:`~fxstream.topics.SerializationError`.
    """
    if by_reference is None:
        packed = Packed(serializer.pack_arguments(tuple(args), kwargs))
    else:
        packed = by_reference.pack_arguments(tuple(args), kwargs)
    size = len(packed.payload)
    if size <= max_inline_bytes:
        return packed
    evict_objects(packed.stored)
    limit = (
        f"above the inline limit of {max_inline_bytes:,} bytes (setting max_inline_bytes, "
        f"variable {ENV_VARIABLES['max_inline_bytes']}); nothing was sent."
    )
    if by_reference is None or by_reference.store is None:
        advice = _NO_STORE_NOTE
    else:
        advice = (
            f"Each argument above proxy_threshold ({by_reference.threshold_bytes:,} bytes, "
            f"{ENV_VARIABLES['proxy_threshold']}) already went by reference: what is left is "
            "many smaller values. Lower proxy_threshold, pass them as one larger value (a list "
            "or an array), or raise max_inline_bytes"
        )
    raise PayloadTooLarge(
        f"the arguments of the task for function {function_id} serialize to {size:,} bytes, "
        f"{limit} {advice}.",
        size=size,
        limit=max_inline_bytes,
        setting="max_inline_bytes",
    )


def build_task(
    *,
    catalogue: Catalogue,
    user_id: str,
    endpoint_id: str,
    function_id: str,
    function_sha256: str,
    payload: bytes | Packed,
    task_group_id: str | None = None,
    max_retries: int = 0,
    walltime_s: float | None = None,
    retry_user_errors: bool = False,
    endpoint_group: Sequence[str] | None = None,
    tags: Mapping[str, str] | None = None,
    staging: StagingSpec | None = None,
    resource_specification: Mapping[str, int] | ResourceSpecification | None = None,
    client_node: str = "",
) -> PreparedTask:
    """Build a valid ``submission`` record around a packed payload; nothing is sent.

    A ``payload`` packed with parents (``Packed.parents``, the SDK's TaskFutures passed
    as arguments) makes them the task's ``depends_on``.

    ``endpoint_group``: further endpoints the router may run it on instead of
    ``endpoint_id`` (it chooses by liveness, warm workers, backlog and data locality;
    the user must be allowed on every one, or the task is refused). ``tags``: the
    task's labels for filtered queries (:func:`fxstream.topics.budget.check_tags`).
    ``staging``: the files staged into the task's working directory before it runs and
    out after it succeeded (:class:`~fxstream.sdk.staging.StagingSpec`).
    ``resource_specification``: what an MPI task needs (Globus Compute's dict of
    ``num_nodes``, ``ranks_per_node``, ``num_ranks``; completed and checked by
    :meth:`~fxstream.topics.ResourceSpecification.from_mapping`). ``client_node``: this
    client's node key when the endpoint's workers share its node-local store (they then
    put a large result there; :mod:`fxstream.connectors.node_local`).

    Raises :class:`PayloadTooLarge` when the record exceeds the limit of
    ``from.user.<user>``, and ``ValueError`` when a field is invalid (an id that
    is not an id, a digest that is not one); either way the payload's stored
    objects are evicted.
    """
    packed = payload if isinstance(payload, Packed) else Packed(payload)
    try:
        return _build_task(
            catalogue=catalogue,
            user_id=user_id,
            endpoint_id=endpoint_id,
            function_id=function_id,
            function_sha256=function_sha256,
            packed=packed,
            task_group_id=task_group_id,
            max_retries=max_retries,
            walltime_s=walltime_s,
            retry_user_errors=retry_user_errors,
            endpoint_group=endpoint_group,
            tags=tags,
            staging=staging,
            resource_specification=resource_specification,
            client_node=client_node,
        )
    except (PayloadTooLarge, ValueError):
        evict_objects(packed.stored)
        for hold in packed.holds:
            hold.discard()
        raise


def _build_task(
    *,
    catalogue: Catalogue,
    user_id: str,
    endpoint_id: str,
    function_id: str,
    function_sha256: str,
    packed: Packed,
    task_group_id: str | None,
    max_retries: int,
    walltime_s: float | None,
    retry_user_errors: bool,
    endpoint_group: Sequence[str] | None,
    tags: Mapping[str, str] | None,
    staging: StagingSpec | None,
    resource_specification: Mapping[str, int] | ResourceSpecification | None,
    client_node: str,
) -> PreparedTask:
    payload = packed.payload
    checked_tags = budget.check_tags(tags)
    resources = (
        None
        if resource_specification is None
        else ResourceSpecification.from_mapping(
            resource_specification
            if isinstance(resource_specification, ResourceSpecification)
            else dict(resource_specification)
        )
    )
    group = sorted(set(endpoint_group or ()) - {endpoint_id}) or None
    if group is not None and len(group) > MAX_ENDPOINT_GROUP:
        raise ValueError(
            f"an endpoint group may name at most {MAX_ENDPOINT_GROUP} endpoints besides "
            f"endpoint_id, not {len(group)}: split the work over several groups"
        )
    task_id = str(uuid.uuid4())
    submitted_at = time.time()
    submission = TaskSubmission(
        task_id=task_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        user_id=user_id,
        function_sha256=function_sha256,
        payload=payload,
        client=client_info(),
        submitted_at=submitted_at,
        task_group_id=task_group_id,
        max_retries=max_retries,
        walltime_s=walltime_s,
        retry_user_errors=retry_user_errors,
        endpoint_group=group,
        tags=checked_tags,
        depends_on=list(packed.parents),
        stage_in=list(staging.stage_in) if staging is not None else [],
        stage_out=list(staging.stage_out) if staging is not None else [],
        resource_specification=resources,
        client_node=client_node,
    )
    record = encode(submission)
    spec = catalogue.spec("from.user.{user_id}")
    # Within from.user.<user>, and, wrapped in the router's dispatch, within an endpoint queue.
    room = budget.max_submission_bytes(catalogue, task_id.encode())
    if len(record) > room:
        size = len(record) + (spec.max_message_bytes - room)
        raise PayloadTooLarge(
            f"the task record for function {function_id} would be {size:,} bytes with Kafka's "
            f"framing and its routing, above the {spec.max_message_bytes:,}-byte limit of "
            f"topic {catalogue.from_user(user_id)} and the endpoint queues (their "
            f"max.message.bytes, the catalogue's max_message_bytes); nothing was sent. Keep "
            f"max_inline_bytes ({ENV_VARIABLES['max_inline_bytes']}) well below that limit. "
            f"{_PROXY_NOTE}",
            size=size,
            limit=spec.max_message_bytes,
            setting="max_message_bytes",
        )
    try:
        # msgspec checks constraints when decoding only: check ours before the router does.
        decode(record, TaskSubmission)
    except RecordDecodeError as exc:
        raise ValueError(f"cannot submit this task: {exc.reason}") from None
    return PreparedTask(
        task_id=task_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        submitted_at=submitted_at,
        record=record,
        task_group_id=task_group_id,
        stored=(*packed.stored, *packed.holds),
        candidates=submission.candidates() if group else (),
        tags=checked_tags,
    )


def build_cancel(
    *,
    user_id: str,
    task_id: str,
    endpoint_id: str,
    reason: str = "",
    kill: bool = True,
) -> bytes:
    """The encoded ``cancel`` record for a task; ``ValueError`` if a field is invalid.

    ``kill`` False asks only to skip the task if it has not started yet.
    """
    record = encode(
        TaskCancel(
            task_id=task_id,
            user_id=user_id,
            endpoint_id=endpoint_id,
            requested_at=time.time(),
            reason=reason,
            kill=kill,
        )
    )
    try:
        decode(record, TaskCancel)
    except RecordDecodeError as exc:
        raise ValueError(f"cannot cancel task {task_id!r}: {exc.reason}") from None
    return record


class TaskProducer:
    """The Client's Kafka producer for its user's ``from.user.<user>``, with its own delivery
    thread.

    Settings: ``acks=all``, idempotence, ``linger.ms=1``, lz4 compression. The linger is
    short because the Executor already hands over whole batches; under load records
    also gather while earlier requests are in flight.
    :meth:`send` never blocks for the broker; delivery reports arrive through
    the callback, from the producer's thread.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        *,
        max_message_bytes: int,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.topic = topic
        config: dict[str, Any] = {
            **kafka.confluent_producer(),
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 1,
            "compression.type": "lz4",
            # The catalogue's producer limit (fxstream.topics.budget): records are
            # checked against their topic before they are sent.
            "message.max.bytes": max_message_bytes,
            "delivery.timeout.ms": 120_000,
            "client.id": "fxstream-sdk",
            "log_level": 3,
            **(kafka_config or {}),
        }
        self._producer = Producer(config)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"fxstream-delivery-{topic}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    def send(self, tasks: Iterable[PreparedTask], on_delivery: DeliveryCallback) -> None:
        """Queue each task's record (key: task id); ``on_delivery`` reports each outcome."""
        for task in tasks:
            self.send_record(task.task_id, task.record, on_delivery)

    def send_record(self, task_id: str, record: bytes, on_delivery: DeliveryCallback) -> None:
        """Queue one record keyed by ``task_id`` (a submission, or that task's cancel)."""
        callback = self._callback(task_id, on_delivery)
        while True:
            try:
                self._producer.produce(self.topic, key=task_id, value=record, on_delivery=callback)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(0.05)

    def _callback(
        self, task_id: str, on_delivery: DeliveryCallback
    ) -> Callable[[KafkaError | None, Message], None]:
        topic = self.topic

        def delivered(error: KafkaError | None, _message: Message) -> None:
            if error is None:
                on_delivery(task_id, None)
            else:
                on_delivery(
                    task_id,
                    SubmissionFailed(
                        f"task {task_id} was not accepted by Kafka topic {topic}: {error.str()} "
                        "(is the broker up, and is FXSTREAM_BOOTSTRAP right?)"
                    ),
                )

        return delivered

    def send_and_wait(self, tasks: list[PreparedTask], timeout: float = 130.0) -> None:
        """Send and return once every record is acknowledged; raise the first failure.

        Raises :class:`SubmissionFailed` when a record is refused or not
        acknowledged within ``timeout`` seconds.
        """
        remaining = {t.task_id for t in tasks}
        failures: list[SubmissionFailed] = []
        done = threading.Event()
        lock = threading.Lock()

        def on_delivery(task_id: str, failure: SubmissionFailed | None) -> None:
            with lock:
                remaining.discard(task_id)
                if failure is not None:
                    failures.append(failure)
                if not remaining:
                    done.set()

        if not remaining:
            return
        self.send(tasks, on_delivery)
        if not done.wait(timeout):
            with lock:
                left = len(remaining)
            raise SubmissionFailed(
                f"{left} of {len(tasks)} task records were not acknowledged by Kafka within "
                f"{timeout:.0f} s (is the broker up, and is FXSTREAM_BOOTSTRAP right?); they may "
                "still be delivered"
            )
        if failures:
            raise failures[0]

    @property
    def producer(self) -> Producer:
        """The underlying producer (data-locations records ride on it too)."""
        return self._producer

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until queued records are delivered; the number still queued after ``timeout``."""
        return int(self._producer.flush(timeout))

    def close(self, timeout: float = 30.0) -> int:
        """Flush, then stop the delivery thread; the number of records left undelivered."""
        left = self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout)
        return left
