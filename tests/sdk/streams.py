"""Kafka helpers for the SDK tests: read and write real records, and a responder thread.

The :class:`Responder` stands in for the router and an agent (being built in
parallel): it consumes one user's ``from.user.<user>``, loads each task's function from
its registered code bytes, runs it, and produces a real ``TaskResult`` with
timings to the user's results topic. Everything goes through the broker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition

from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    Serializer,
    TaskError,
    TaskResult,
    TaskSubmission,
    TaskTimings,
    decode,
    describe_exception,
    encode,
    record_kind,
)


def _consumer(kafka: KafkaConnection) -> Consumer:
    return Consumer(
        {
            **kafka.confluent(),
            "group.id": "fxstream-sdk-tests",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "log_level": 3,
        }
    )


def end_offsets(kafka: KafkaConnection, topic: str) -> dict[int, int]:
    """Partition -> current end offset of ``topic`` (retried while leaders are being elected)."""
    consumer = _consumer(kafka)
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                metadata = consumer.list_topics(topic, timeout=10)
                return {
                    p: consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=10, cached=False
                    )[1]
                    for p in metadata.topics[topic].partitions
                }
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        consumer.close()


def read_from(
    kafka: KafkaConnection,
    topic: str,
    start: dict[int, int],
    *,
    count: int,
    timeout: float = 20.0,
) -> list[Message]:
    """The first ``count`` records of ``topic`` after the ``start`` offsets (fewer on timeout)."""
    consumer = _consumer(kafka)
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in start.items()])
        found: list[Message] = []
        deadline = time.monotonic() + timeout
        while len(found) < count and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=count, timeout=0.2):
                if message.error() is None:
                    found.append(message)
        return found
    finally:
        consumer.close()


def read_to_end(kafka: KafkaConnection, topic: str, start: dict[int, int]) -> list[Message]:
    """Every committed record of ``topic`` from the ``start`` offsets to its end offsets now.

    For "exactly these and no more" checks: once the writer has flushed (its records are
    acknowledged), the end offsets taken here bound everything it wrote, so nothing is
    awaited past them.
    """
    end = end_offsets(kafka, topic)
    wanted = {p: o for p, o in end.items() if o > start.get(p, 0)}
    consumer = _consumer(kafka)
    try:
        consumer.assign([TopicPartition(topic, p, start.get(p, 0)) for p in wanted])
        found: list[Message] = []
        deadline = time.monotonic() + 30
        while wanted:
            assert time.monotonic() < deadline, f"{topic} not read to {end} in 30 s"
            for message in consumer.consume(num_messages=100, timeout=0.2):
                if message.error() is None:
                    found.append(message)
            for tp in consumer.position([TopicPartition(topic, p) for p in list(wanted)]):
                if tp.offset >= wanted[tp.partition]:
                    del wanted[tp.partition]
        return found
    finally:
        consumer.close()


class ResultWriter:
    """Produces records to a topic and waits for each to be acknowledged."""

    def __init__(self, kafka: KafkaConnection) -> None:
        self._producer = Producer({**kafka.confluent(), "acks": "all", "log_level": 3})

    def write(self, topic: str, key: str, value: bytes) -> None:
        """Produce one record and flush."""
        self._producer.produce(topic, key=key, value=value)
        assert self._producer.flush(30) == 0

    def result(self, topic: str, result: TaskResult) -> None:
        """Produce one ``TaskResult`` keyed by its task id."""
        self.write(topic, result.task_id, encode(result))


def success(
    task_id: str,
    user_id: str,
    value: Any,
    *,
    function_id: str = "f-1",
    endpoint_id: str = "ep-1",
    timings: TaskTimings | None = None,
) -> TaskResult:
    """A success result holding ``value`` (pickled, as an agent would)."""
    return TaskResult(
        task_id=task_id,
        user_id=user_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        outcome="success",
        value=Serializer().serialize_value(value),
        worker="testhost:1",
        timings=timings or TaskTimings(),
    )


def failure(
    task_id: str,
    user_id: str,
    error: TaskError,
    *,
    function_id: str = "f-1",
    endpoint_id: str = "ep-1",
) -> TaskResult:
    """An error result."""
    return TaskResult(
        task_id=task_id,
        user_id=user_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        outcome="error",
        error=error,
    )


class Responder:
    """A thread that answers tasks for one endpoint: consume, run, produce the result.

    ``functions`` maps function ids to code payloads (what registration would
    store). Tasks read together are answered in reverse order, so results
    arrive out of submission order. Use as a context manager.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        endpoint_id: str,
        functions: dict[str, bytes],
        *,
        user_id: str,
        reverse: bool = True,
    ) -> None:
        self._kafka = kafka
        self._user_id = user_id
        self._catalogue = catalogue
        self._endpoint_id = endpoint_id
        self._code = functions
        self._loaded: dict[str, Callable[..., Any]] = {}
        self._reverse = reverse
        self._serializer = Serializer()
        self._stop = threading.Event()
        self._consumer = _consumer(kafka)
        self._producer = Producer({**kafka.confluent(), "acks": "all", "log_level": 3})
        self._thread = threading.Thread(target=self._run, name="test-responder", daemon=True)
        self.answered: list[str] = []
        self.errors: list[BaseException] = []

    def __enter__(self) -> Responder:
        topic = self._catalogue.from_user(self._user_id)
        start = end_offsets(self._kafka, topic)
        self._consumer.assign([TopicPartition(topic, p, o) for p, o in start.items()])
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()
        self._producer.flush(10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                messages = self._consumer.consume(num_messages=64, timeout=0.05)
                tasks = [
                    decode(m.value(), TaskSubmission)
                    for m in messages
                    if m.error() is None and record_kind(m.value()) != "cancel"
                ]
                tasks = [t for t in tasks if t.endpoint_id == self._endpoint_id]
                for task in reversed(tasks) if self._reverse else tasks:
                    self._answer(task, time.time())
                self._producer.flush(10)
        except BaseException as exc:  # surfaced by the tests through .errors
            self.errors.append(exc)

    def _answer(self, task: TaskSubmission, dequeued: float) -> None:
        fn = self._loaded.get(task.function_id)
        if fn is None:
            fn = self._serializer.deserialize_function(self._code[task.function_id])
            self._loaded[task.function_id] = fn
        args, kwargs = self._serializer.unpack_arguments(task.payload, submitted_by=task.client)
        started = time.time()
        value: bytes | None = None
        error: TaskError | None = None
        try:
            value = self._serializer.serialize_value(fn(*args, **kwargs))
        except Exception as exc:
            error = describe_exception(exc)
        finished = time.time()
        result = TaskResult(
            task_id=task.task_id,
            user_id=task.user_id,
            function_id=task.function_id,
            endpoint_id=task.endpoint_id,
            task_group_id=task.task_group_id,
            outcome="success" if error is None else "error",
            value=value,
            error=error,
            worker="responder:1",
            timings=TaskTimings(
                submitted_at=task.submitted_at,
                routed_at=dequeued,
                dequeued_at=dequeued,
                started_at=started,
                finished_at=finished,
                result_published_at=time.time(),
            ),
        )
        self._producer.produce(
            self._catalogue.results(task.user_id), key=task.task_id, value=encode(result)
        )
        self.answered.append(task.task_id)


def submissions(messages: list[Message]) -> Iterator[tuple[str, TaskSubmission]]:
    """(key, decoded submission) for each record that is not a cancel."""
    for message in messages:
        key = message.key()
        assert key is not None
        if record_kind(message.value()) == "cancel":
            continue
        yield key.decode(), decode(message.value(), TaskSubmission)
