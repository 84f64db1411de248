"""Arrays streamed producer -> consumer over Kafka: by reference through Redis, or inline.

One run streams ``items`` numpy arrays of ``array_bytes`` bytes through the SDK's
streams (:mod:`fxstream.sdk.streams`) from this process to a consumer in a
separate process (spawned, in a consumer group of its own), on a fresh
``streams.<name>`` topic under a prefix of the run's own, deleted afterwards:

- ``inline=False`` (``kafka+redis``): ProxyStore's ``StreamProducer`` puts each
  array in a Redis store and Kafka carries only the event with its key; the
  consumer resolves every proxy (reads the whole array from Redis).
- ``inline=True`` (``kafka-inline``): no store; each array rides inside its Kafka
  record. Only where the record fits the stream topic's ``max.message.bytes``;
  otherwise the figures are None and ``skipped`` says why.

Each array carries its index; the consumer checks order and size of every one.
One untimed array goes end to end first. Throughput runs from the first timed
send to the consumer having the last array in hand, so it includes the producer's
puts, Kafka, the consumer's fetches and, by reference, its reads from Redis.
``perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for both processes.
"""

from __future__ import annotations

import multiprocessing
import queue
import struct
import time
import uuid
from typing import Any, Final

import numpy as np
from confluent_kafka.admin import AdminClient
from proxystore.proxy import Proxy, extract
from proxystore.store import Store, unregister_store
from proxystore.stream.events import EventBatch, NewObjectEvent, event_to_bytes

from fxstream.connectors import RedisConnector, StoreSpec, StoreURLError
from fxstream.ops.bench.stack import BenchError
from fxstream.sdk.streams import (
    KafkaStreamConsumer,
    ensure_stream_topic,
    stream_consumer,
    stream_producer,
)
from fxstream.sdk.streams.publisher import RECORD_OVERHEAD_BYTES
from fxstream.topics import Catalogue, KafkaConnection

__all__ = ["measure_kafka_stream"]

STREAM: Final = "arrays"
# A run that sees no array for this long has lost one (or its consumer died): fail, don't hang.
IDLE_TIMEOUT_S: Final = 60.0
STARTUP_TIMEOUT_S: Final = 60.0
_STAMP: Final = struct.Struct("<q")
# The index of the untimed array sent first.
WARM_UP_INDEX: Final = -1
# "spawn", not fork: a forked child would inherit librdkafka clients without their threads.
_SPAWN = multiprocessing.get_context("spawn")


def _array(array_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.full(array_bytes, 7, dtype=np.uint8)


def _stamp(array: np.ndarray[Any, np.dtype[np.uint8]], index: int) -> None:
    array[: _STAMP.size] = np.frombuffer(_STAMP.pack(index), dtype=np.uint8)


def _inline_record_bytes(array_bytes: int) -> int:
    """The size of an inline record carrying an array of ``array_bytes`` bytes, with framing."""
    batch = EventBatch(STREAM, [NewObjectEvent(STREAM, _array(array_bytes), {})])
    return len(event_to_bytes(batch)) + len(STREAM) + RECORD_OVERHEAD_BYTES


def _consume(
    kafka: KafkaConnection,
    prefix: str,
    group: str,
    items: int,
    array_bytes: int,
    ready: Any,
    warmed: Any,
    results: Any,
    redis_url: str | None = None,
) -> None:
    """The consumer process: read the stream to its end, checking every array; report times.

    ``redis_url`` (given through multiprocessing's pipe, not a command line) opens the
    store once, so the proxies (whose configs carry no password) can authenticate.
    """
    try:
        if redis_url is not None:
            RedisConnector(**StoreSpec.parse(redis_url).options).close()
        consumer: KafkaStreamConsumer[Any] = stream_consumer(
            kafka, STREAM, group=group, topic_prefix=prefix, timeout_s=IDLE_TIMEOUT_S
        )
        with consumer:
            consumer.kafka.wait_for_assignment(STARTUP_TIMEOUT_S)
            ready.set()
            first = last = 0.0
            expected = WARM_UP_INDEX
            for item in consumer:
                array = extract(item) if isinstance(item, Proxy) else item
                (index,) = _STAMP.unpack(bytes(array[: _STAMP.size]))
                if index != expected or array.nbytes != array_bytes:
                    raise BenchError(
                        f"array {expected} arrived as index {index} of {array.nbytes} bytes"
                    )
                expected += 1
                if index == WARM_UP_INDEX:
                    warmed.set()
                    continue
                last = time.perf_counter()
                if index == 0:
                    first = last
        if expected != items:
            raise BenchError(f"the stream ended after {expected} of {items} arrays")
        results.put({"first": first, "last": last, "count": expected})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _redis_store(redis_url: str, name: str) -> Store[Any]:
    try:
        options = StoreSpec.parse(redis_url).options  # host, port and the store's credentials
    except StoreURLError as exc:
        raise BenchError(f"cannot use the Redis URL: {exc}") from None
    # A lease well above the run: the consumer evicts each array once it committed it.
    return Store(name, RedisConnector(**{**options, "lease_s": 3600}))


def _produce(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    store: Store[Any] | None,
    items: int,
    array_bytes: int,
    warmed: Any,
) -> tuple[float, float]:
    """Warm up, send the arrays and end the stream; when the first send began and flush ended."""
    array = _array(array_bytes)
    producer = stream_producer(kafka, STREAM, store=store, topic_prefix=catalogue.prefix)
    with producer:
        # One array end to end before the clock starts: a fresh topic's first produce and
        # first fetch each wait out a retry backoff (~0.5 s measured) while its partitions
        # settle, and the connections (Kafka, Redis) open.
        _stamp(array, WARM_UP_INDEX)
        producer.send(STREAM, array)
        producer.flush()
        if not warmed.wait(STARTUP_TIMEOUT_S):
            raise BenchError(f"the warm-up array did not arrive in {STARTUP_TIMEOUT_S:.0f} s")
        start = time.perf_counter()
        for index in range(items):
            # Safe to reuse: send() has serialized the array (into the store or the record).
            _stamp(array, index)
            producer.send(STREAM, array)
        producer.close_topics(STREAM)
        producer.flush()
        return start, time.perf_counter()


def _await_ready(ready: Any, consumer: Any) -> None:
    """Wait until the consumer process holds its partitions; fail at once if it died."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.wait(0.1):
        if not consumer.is_alive():
            raise BenchError(f"the consumer process exited ({consumer.exitcode}) before starting")
        if time.monotonic() > deadline:
            raise BenchError(f"the consumer process got no partition in {STARTUP_TIMEOUT_S:.0f} s")


def measure_kafka_stream(
    kafka: KafkaConnection, redis_url: str, array_bytes: int, items: int, *, inline: bool
) -> dict[str, Any]:
    """Stream ``items`` arrays of ``array_bytes`` bytes to a consumer process; items/s and MB/s.

    ``inline=False`` sends them by reference through a ProxyStore store on the
    Redis at ``redis_url``, ``inline=True`` inside the Kafka records (figures
    None, with ``skipped``, when a record would exceed the topic's
    ``max.message.bytes``). MB are 10**6 bytes. Raises
    :class:`~fxstream.ops.bench.stack.BenchError` when an array is lost,
    reordered or corrupted, or the consumer stalls.
    """
    if array_bytes < _STAMP.size or items < 1:
        raise ValueError(f"need array_bytes >= {_STAMP.size} and items >= 1")
    run_id = uuid.uuid4().hex[:10]
    catalogue = Catalogue(prefix=f"bench-stream-{run_id}.")
    spec = catalogue.spec("streams.{stream}")
    figures: dict[str, Any] = {
        "bench": "stream",
        "mode": "kafka-inline" if inline else "kafka+redis",
        "array_bytes": array_bytes,
        "items": items,
        "max_message_bytes": spec.max_message_bytes,
        "items_per_s": None,
        "mb_per_s": None,
    }
    if inline:
        record_bytes = _inline_record_bytes(array_bytes)
        figures["record_bytes"] = record_bytes
        if record_bytes > spec.max_message_bytes:
            figures["skipped"] = (
                f"an inline record of {record_bytes:,} bytes exceeds the stream topic's "
                f"max.message.bytes ({spec.max_message_bytes:,})"
            )
            return figures

    admin = AdminClient({**kafka.confluent(), "log_level": 3})
    topic = ensure_stream_topic(admin, catalogue, STREAM)
    store = None if inline else _redis_store(redis_url, f"bench-stream-{run_id}")
    ready, warmed, results = _SPAWN.Event(), _SPAWN.Event(), _SPAWN.Queue()
    consumer = _SPAWN.Process(
        target=_consume,
        args=(
            *(kafka, catalogue.prefix, f"bench-{run_id}", items, array_bytes),
            *(ready, warmed, results),
            None if inline else redis_url,
        ),
        daemon=True,
    )
    consumer.start()
    try:
        _await_ready(ready, consumer)
        start, flushed = _produce(kafka, catalogue, store, items, array_bytes, warmed)
        try:
            report = results.get(timeout=IDLE_TIMEOUT_S + items * 1.0)
        except queue.Empty as exc:
            raise BenchError("the consumer process did not finish the stream") from exc
        if "error" in report:
            raise BenchError(f"the consumer process failed: {report['error']}")
        consumer.join(STARTUP_TIMEOUT_S)
    finally:
        if consumer.is_alive():
            consumer.kill()
            consumer.join()
        if store is not None:
            store.close()
            unregister_store(store)
        for future in admin.delete_topics([topic], operation_timeout=30).values():
            future.result(timeout=30)
    seconds = float(report["last"]) - start
    figures.update(
        {
            "items_per_s": round(items / seconds, 1),
            "mb_per_s": round(items * array_bytes / 1e6 / seconds, 1),
            "seconds": round(seconds, 3),
            "produce_s": round(flushed - start, 3),
            "first_item_ms": round((float(report["first"]) - start) * 1e3, 1),
        }
    )
    return figures
