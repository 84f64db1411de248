"""Raw Kafka limits on this machine, measured with plain confluent-kafka and 200-byte records.

Six phases, each on fresh topics that are created here and deleted afterwards:

1. produce: one idempotent ``acks=all`` producer writes ``records`` records to a topic of
   4 partitions, timed until ``flush()`` returns;
2. consume: one consumer of a fresh group reads them back, timed from its first poll (so
   the group join counts) to the last record;
3. round trip: producer -> topic -> consumer with one record in flight at a time; a
   record's latency is its receipt time minus the send time it carries;
4. relay3, the shape of a task path: producer -> t1 -> relay A -> t2 -> relay B -> t3 ->
   consumer. End-to-end latency with one record in flight (``relay3_p50_ms``), then a
   flood of ``records // 4`` records: throughput from first send to last receipt, and
   the latency under that flood (``relay3_loaded_*``, mostly queueing).
5. relay3 with transactions (``relay3_txn_*``): the same path, each relay reading
   ``read_committed`` and writing each batch with its input offsets in one Kafka
   transaction, as the router, the agent and the ingress do. Its one-in-flight latency
   against phase 4's is what the exactly-once commit protocol costs per hop.
6. relay3 acknowledged and deduplicated (``relay3_dedup_*``), the protocol that could
   replace transactions on a lone task's path: each relay forwards a batch at once
   (idempotent producer, ``acks=all``), waits for the broker's acknowledgement of the
   batch, then commits its input offsets (so a relay killed in between reads the batch
   again: at least once), and drops any record whose id it has already forwarded (the
   record's send stamp here; a task id on the task path), so the repeats of a restart are
   not passed on. Its one-in-flight latency against phases 4 and 5 is what that protocol
   costs per hop. The relays' table of ids forwarded is a bounded dict in memory: a
   durable one (a local table written before the offsets are committed) is not measured.

Without a bootstrap address a private single-node platform is started in a temporary
directory on free ports and stopped at the end.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.stack import BenchError, percentile, private_platform
from fxstream.ops.config import PlatformConfig
from fxstream.topics import KafkaConnection

__all__ = ["BenchError", "run_kafka_bench"]

RECORD_BYTES = 200
PARTITIONS = 4
# Round trips before the timed ones: the first pay for connections and metadata lookups.
WARMUP_ROUND_TRIPS = 20
# Records of the untimed flood that warms the broker up before the first phase.
MAX_WARMUP_RECORDS = 200_000
CONSUME_BATCH = 1_000
RELAY_BATCH = 500
# A phase that sees no record for this long has lost one (or a relay died): fail, don't hang.
IDLE_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 60.0
# The throughput producer may wait a little to fill batches, as a bulk writer would.
THROUGHPUT_LINGER_MS = 5.0
# Task-path hops forward as soon as they can: a task waits for every hop's linger.
RELAY_LINGER_MS = 0.0
# librdkafka's quietest useful level (critical only): its chatter would garble the table.
LOG_LEVEL = 2

# Every record starts with its send time from perf_counter_ns, which on Linux is
# CLOCK_MONOTONIC: one clock for the whole machine, so ages are valid across processes.
_STAMP = struct.Struct(">q")

Figures = dict[str, float | int | str]


class _Flag(Protocol):
    """What the relays need of an event: threading's and multiprocessing's both fit."""

    def set(self) -> None: ...
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class _Worker(Protocol):
    """A thread or a process."""

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def is_alive(self) -> bool: ...


# --- records -------------------------------------------------------------------------------


def _stamped(padding: bytes) -> bytes:
    """A record value: the send time, then ``padding`` up to the record size."""
    return _STAMP.pack(time.perf_counter_ns()) + padding


def _age_ms(value: bytes | None, now_ns: int) -> float:
    """How long ago (ms) the record carrying ``value`` was sent."""
    if value is None or len(value) < _STAMP.size:
        raise BenchError("a record arrived without its send timestamp")
    (sent_ns,) = _STAMP.unpack_from(value)
    return float(now_ns - sent_ns) / 1e6


# --- clients -------------------------------------------------------------------------------


class _Producer:
    """A producer set up like the platform's (idempotent, ``acks=all``).

    It remembers failed deliveries and waits when its local queue is full.
    """

    def __init__(self, kafka: KafkaConnection, *, linger_ms: float) -> None:
        self.failures: list[str] = []
        self._producer = Producer(
            {
                **kafka.confluent(),
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": linger_ms,
                # librdkafka's defaults, stated so that a change of defaults cannot change
                # the figures unnoticed: batches of up to 1 MB or 10 000 records.
                "batch.size": 1_000_000,
                "batch.num.messages": 10_000,
                "compression.type": "none",
                # Only failures call back: a Python call per delivered record would cost
                # about as much as producing it.
                "delivery.report.only.error": True,
                "on_delivery": self._on_delivery,
                "log_level": LOG_LEVEL,
            }
        )

    def _on_delivery(self, error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            self.failures.append(str(error))

    def connect(self, topic: str) -> None:
        """Connect and learn ``topic``'s leaders now, so no clock times the first connection."""
        self._producer.list_topics(topic, timeout=STARTUP_TIMEOUT_S)

    def send(self, topic: str, value: bytes | None) -> None:
        """Queue one record, waiting for room when the local queue is full."""
        while True:
            try:
                self._producer.produce(topic, value)
                return
            except BufferError:
                self._producer.poll(0.005)

    def serve(self) -> None:
        """Run pending delivery callbacks (only failures call back)."""
        self._producer.poll(0)

    def flush(self) -> None:
        """Wait until every queued record is acknowledged; raise if any was not."""
        left = self._producer.flush(IDLE_TIMEOUT_S)
        if left or self.failures:
            raise BenchError(
                f"{left} record(s) unacknowledged after {IDLE_TIMEOUT_S:.0f} s, "
                f"{len(self.failures)} failed: {self.failures[:3]}"
            )


def _consumer(kafka: KafkaConnection, topic: str, *, committed: bool = False) -> Consumer:
    """A consumer of a fresh group, subscribed to ``topic``; with ``committed``, one that
    reads only committed transactions and commits no offsets itself (a transactional
    relay commits them in its transactions)."""
    extra: dict[str, Any] = {}
    if committed:
        extra = {"isolation.level": "read_committed", "enable.auto.commit": False}
    consumer = Consumer(
        {
            **kafka.confluent(),
            **extra,
            "group.id": f"bench.kafka.{uuid.uuid4().hex}",
            # The topics are new, so "earliest" loses nothing, and it keeps a record written
            # between assignment and the first fetch, which "latest" could skip.
            "auto.offset.reset": "earliest",
            "log_level": LOG_LEVEL,
        }
    )
    consumer.subscribe([topic])
    return consumer


def _check(message: Message) -> None:
    """Raise if ``message`` is an error event rather than a record."""
    error = message.error()
    if error is not None:
        raise BenchError(f"consumer error: {error}")


def _await_assignment(consumer: Consumer) -> None:
    """Poll until the group has given ``consumer`` its partitions."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not consumer.assignment():
        if time.monotonic() > deadline:
            raise BenchError(f"no partitions assigned within {STARTUP_TIMEOUT_S:.0f} s")
        message = consumer.poll(0.05)
        if message is not None:
            _check(message)
            raise BenchError("a fresh topic already held a record")


def _receive(consumer: Consumer, max_records: int, timeout_s: float) -> list[Message]:
    """Wait up to ``timeout_s`` for one record, then take what else is there without waiting.

    ``consume(n, timeout)`` alone would hold the first record until ``n`` arrived or the
    timeout passed, which is throughput-friendly but ruins latency.
    """
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    batch = [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]
    for message in batch:
        _check(message)
    return batch


class _Watchdog:
    """Turns a phase that stopped making progress into a :class:`BenchError`."""

    def __init__(self, what: str, failed: _Flag | None = None) -> None:
        self.what = what
        self.failed = failed
        self.last_progress = time.monotonic()

    def progress(self) -> None:
        """Something arrived."""
        self.last_progress = time.monotonic()

    def check(self) -> None:
        """Raise if a relay failed or nothing arrived for too long."""
        if self.failed is not None and self.failed.is_set():
            raise BenchError(f"{self.what}: a relay failed (its traceback is above)")
        if time.monotonic() - self.last_progress > IDLE_TIMEOUT_S:
            raise BenchError(f"{self.what}: no record arrived for {IDLE_TIMEOUT_S:.0f} s")


# --- topics and broker ---------------------------------------------------------------------


def _create_topics(admin: AdminClient, names: Sequence[str]) -> None:
    """Create ``names`` with the broker's default replication; return once all have leaders."""
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=PARTITIONS) for name in names],
        request_timeout=STARTUP_TIMEOUT_S,
    )
    for future in futures.values():
        future.result(timeout=STARTUP_TIMEOUT_S)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _have_leaders(admin, names):
        if time.monotonic() > deadline:
            raise BenchError(f"topics {list(names)} have no leaders after creation")
        time.sleep(0.05)


def _have_leaders(admin: AdminClient, names: Sequence[str]) -> bool:
    """True when every partition of every topic in ``names`` has a leader."""
    topics = admin.list_topics(timeout=STARTUP_TIMEOUT_S).topics
    return all(
        name in topics
        and len(topics[name].partitions) == PARTITIONS
        and all(p.leader >= 0 for p in topics[name].partitions.values())
        for name in names
    )


def _delete_topics(admin: AdminClient, names: Sequence[str]) -> list[str]:
    """Delete ``names``; return a description of each that could not be deleted."""
    problems = []
    futures = admin.delete_topics(list(names), operation_timeout=STARTUP_TIMEOUT_S)
    for name, future in futures.items():
        try:
            future.result(timeout=STARTUP_TIMEOUT_S)
        except (KafkaException, TimeoutError) as exc:
            problems.append(f"{name}: {exc}")
    return problems


@contextmanager
def _fresh_topics(console: Console, admin: AdminClient, names: list[str]) -> Iterator[list[str]]:
    """Topics that exist for the duration of the block."""
    _create_topics(admin, names)
    try:
        yield names
    finally:
        for problem in _delete_topics(admin, names):
            console.print(f"[yellow]could not delete topic {problem}[/yellow]")


@dataclass(frozen=True)
class _Broker:
    """The broker under test."""

    kafka: KafkaConnection
    label: str
    kafka_version: str


@contextmanager
def _private_broker(console: Console) -> Iterator[_Broker]:
    """A single-node platform of our own in a temporary home, stopped when the block ends."""
    with private_platform(console, services=False) as platform:
        yield _Broker(platform.kafka, "private", platform.config.kafka_version)


@contextmanager
def _broker(console: Console, kafka: KafkaConnection | None) -> Iterator[_Broker]:
    """The broker of ``kafka``, or a private one when it is None."""
    if kafka is None:
        with _private_broker(console) as broker:
            yield broker
    else:
        yield _Broker(kafka, kafka.bootstrap, PlatformConfig.load().kafka_version)


# --- relays --------------------------------------------------------------------------------


def _relay(
    kafka: KafkaConnection,
    source: str,
    target: str,
    ready: _Flag,
    stop: _Flag,
    failed: _Flag,
    mode: str = "plain",
) -> None:
    """One task-path hop, run in a thread or process: forward ``source`` to ``target``
    (``mode``: ``plain``, ``txn`` or ``dedup``, see the module)."""
    try:
        if mode == "txn":
            _forward_in_transactions(kafka, source, target, ready, stop)
        elif mode == "dedup":
            _forward_deduplicated(kafka, source, target, ready, stop)
        else:
            _forward(kafka, source, target, ready, stop)
    except BaseException:
        failed.set()
        raise


def _forward(kafka: KafkaConnection, source: str, target: str, ready: _Flag, stop: _Flag) -> None:
    """Copy every record of ``source`` to ``target`` until ``stop`` is set."""
    producer = _Producer(kafka, linger_ms=RELAY_LINGER_MS)
    producer.connect(target)
    consumer = _consumer(kafka, source)
    try:
        _await_assignment(consumer)
        ready.set()
        while not stop.is_set():
            for message in _receive(consumer, RELAY_BATCH, 0.1):
                producer.send(target, message.value())
            producer.serve()
        producer.flush()
    finally:
        consumer.close()


def _relay_producer_settings(kafka: KafkaConnection, extra: dict[str, Any]) -> dict[str, Any]:
    """A committing relay's producer, as the agent's publisher: idempotent, ``acks=all``,
    no linger, and a 5 ms retry backoff (librdkafka's 100 ms would hold a lone record
    behind each CONCURRENT_TRANSACTIONS retry)."""
    return {
        **kafka.confluent(),
        **extra,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": RELAY_LINGER_MS,
        "retry.backoff.ms": 5,
        "log_level": LOG_LEVEL,
    }


def _forward_in_transactions(
    kafka: KafkaConnection, source: str, target: str, ready: _Flag, stop: _Flag
) -> None:
    """Copy ``source`` to ``target``, each batch and its input offsets in one transaction."""
    producer = Producer(_relay_producer_settings(kafka, {"transactional.id": f"{source}.relay"}))
    producer.init_transactions(STARTUP_TIMEOUT_S)
    producer.list_topics(target, timeout=STARTUP_TIMEOUT_S)
    consumer = _consumer(kafka, source, committed=True)
    try:
        _await_assignment(consumer)
        ready.set()
        while not stop.is_set():
            messages = _receive(consumer, RELAY_BATCH, 0.1)
            if not messages:
                continue
            producer.begin_transaction()
            for message in messages:
                producer.produce(target, message.value())
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()),
                consumer.consumer_group_metadata(),
                IDLE_TIMEOUT_S,
            )
            producer.commit_transaction(IDLE_TIMEOUT_S)
    finally:
        consumer.close()


# How many record ids a deduplicating relay remembers (more than a batch can repeat).
DEDUP_IDS = 200_000


def _forward_deduplicated(
    kafka: KafkaConnection, source: str, target: str, ready: _Flag, stop: _Flag
) -> None:
    """Copy ``source`` to ``target``: a batch forwarded, acknowledged, then its offsets
    committed; a record whose id was forwarded before is dropped."""
    producer = Producer(_relay_producer_settings(kafka, {}))
    producer.list_topics(target, timeout=STARTUP_TIMEOUT_S)
    consumer = _consumer(kafka, source, committed=True)
    forwarded: dict[bytes, None] = {}
    try:
        _await_assignment(consumer)
        ready.set()
        while not stop.is_set():
            messages = _receive(consumer, RELAY_BATCH, 0.1)
            if not messages:
                continue
            for message in messages:
                value = message.value() or b""
                record_id = value[: _STAMP.size]
                if record_id in forwarded:
                    continue
                forwarded[record_id] = None
                producer.produce(target, value)
            if len(forwarded) > DEDUP_IDS:
                for stale in list(itertools.islice(forwarded, len(forwarded) - DEDUP_IDS)):
                    del forwarded[stale]
            if producer.flush(IDLE_TIMEOUT_S):
                raise BenchError(f"a batch was not acknowledged within {IDLE_TIMEOUT_S:.0f} s")
            consumer.commit(asynchronous=True)
    finally:
        consumer.close()


@dataclass(frozen=True)
class _Runtime:
    """Where relays run: threads of this process, or processes of their own."""

    name: str
    event: Callable[[], _Flag]
    worker: Callable[[Callable[..., None], tuple[Any, ...]], _Worker]


def _thread(target: Callable[..., None], args: tuple[Any, ...]) -> _Worker:
    return threading.Thread(target=target, args=args, daemon=True)


# "spawn", not fork: a forked child would inherit librdkafka clients without their threads.
_SPAWN = multiprocessing.get_context("spawn")


def _process(target: Callable[..., None], args: tuple[Any, ...]) -> _Worker:
    return _SPAWN.Process(target=target, args=args, daemon=True)


THREADS = _Runtime("thread", threading.Event, _thread)
PROCESSES = _Runtime("process", _SPAWN.Event, _process)
# Relays run as processes. Measured here (2 cores, 50 000 records, 4 alternating runs each):
# threads 42-59k records/s, processes 54-83k, p50 one in flight about equal. As threads, the
# driver, the sink and both relays share one GIL and spend their Python time (a produce()
# and a Message per record per hop) one after another; as processes they use both cores.
RELAY_RUNTIME = PROCESSES


@contextmanager
def _relays(
    runtime: _Runtime, kafka: KafkaConnection, topics: Sequence[str], mode: str
) -> Iterator[_Flag]:
    """A relay between each pair of consecutive ``topics``, all assigned before the block.

    Yields the flag a failing relay sets.
    """
    stop, failed = runtime.event(), runtime.event()
    workers: list[_Worker] = []
    readies: list[_Flag] = []
    try:
        for source, target in itertools.pairwise(topics):
            readies.append(runtime.event())
            workers.append(
                runtime.worker(_relay, (kafka, source, target, readies[-1], stop, failed, mode))
            )
            workers[-1].start()
        _await_ready(readies, failed)
        yield failed
    finally:
        stop.set()
        for worker in workers:
            worker.join(IDLE_TIMEOUT_S)
    if failed.is_set() or any(worker.is_alive() for worker in workers):
        raise BenchError("a relay failed or did not stop (see above)")


def _await_ready(readies: Sequence[_Flag], failed: _Flag) -> None:
    """Wait until every relay has its partitions."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for ready in readies:
        while not ready.wait(0.1):
            if failed.is_set() or time.monotonic() > deadline:
                raise BenchError("a relay did not start (see above)")


# --- phases --------------------------------------------------------------------------------


def _warm_up(kafka: KafkaConnection, topic: str, records: int, padding: bytes) -> None:
    """One untimed produce and consume of ``records`` records on the empty ``topic``.

    A new broker's JVM is cold (a first flood ran at a third of the later rate here) and it
    creates its offsets topic on the first group lookup, which takes seconds; the phases
    should time neither.
    """
    consumer = _consumer(kafka, topic)
    try:
        _await_assignment(consumer)
        producer = _Producer(kafka, linger_ms=THROUGHPUT_LINGER_MS)
        _send_many(producer, topic, records, padding)
        producer.flush()
        _consume_all(consumer, records, _Watchdog("warm-up"))
    finally:
        consumer.close()


def _send_many(producer: _Producer, topic: str, count: int, padding: bytes) -> None:
    """Queue ``count`` stamped records as fast as the producer takes them."""
    for i in range(count):
        producer.send(topic, _stamped(padding))
        if i % 1_000 == 0:
            producer.serve()


def _bench_produce(kafka: KafkaConnection, topic: str, records: int, padding: bytes) -> Figures:
    """Records per second one producer writes, until ``flush()`` has them all acknowledged."""
    producer = _Producer(kafka, linger_ms=THROUGHPUT_LINGER_MS)
    producer.connect(topic)
    start = time.perf_counter()
    _send_many(producer, topic, records, padding)
    producer.flush()
    rate = records / (time.perf_counter() - start)
    return {
        "produce_msgs_per_s": round(rate),
        "produce_mb_per_s": round(rate * RECORD_BYTES / 1e6, 1),
    }


def _bench_consume(kafka: KafkaConnection, topic: str, records: int) -> Figures:
    """Records per second one fresh consumer reads, from its first poll to the last record."""
    consumer = _consumer(kafka, topic)
    watchdog = _Watchdog("consume")
    try:
        start = time.perf_counter()
        first, last = _consume_all(consumer, records, watchdog)
    finally:
        consumer.close()
    return {
        "consume_msgs_per_s": round(records / (last - start)),
        "consume_first_record_ms": round((first - start) * 1e3, 1),
    }


def _consume_all(consumer: Consumer, records: int, watchdog: _Watchdog) -> tuple[float, float]:
    """Read ``records`` records in batches; when the first and the last arrived."""
    received = 0
    first = 0.0
    while received < records:
        # Asking for no more than what is left: a larger batch would wait out the timeout.
        batch = consumer.consume(min(CONSUME_BATCH, records - received), timeout=1.0)
        if not batch:
            watchdog.check()
            continue
        for message in batch:
            _check(message)
        if received == 0:
            first = time.perf_counter()
        received += len(batch)
        watchdog.progress()
    return first, time.perf_counter()


def _await_one(consumer: Consumer, watchdog: _Watchdog) -> float:
    """Wait for the next record; its age in ms."""
    while True:
        message = consumer.poll(0.1)
        now_ns = time.perf_counter_ns()
        if message is None:
            watchdog.check()
            continue
        _check(message)
        watchdog.progress()
        return _age_ms(message.value(), now_ns)


def _round_trips(
    producer: _Producer,
    topic: str,
    consumer: Consumer,
    count: int,
    padding: bytes,
    watchdog: _Watchdog,
) -> list[float]:
    """Send a record to ``topic``, wait until ``consumer`` has it, repeat; each trip in ms."""
    trips = []
    for _ in range(count):
        producer.send(topic, _stamped(padding))
        trips.append(_await_one(consumer, watchdog))
        producer.serve()
    return trips


def _bench_rtt(kafka: KafkaConnection, topic: str, samples: int, padding: bytes) -> Figures:
    """Single-hop round trip, one record in flight, producer without linger."""
    producer = _Producer(kafka, linger_ms=0)
    producer.connect(topic)
    consumer = _consumer(kafka, topic)
    try:
        _await_assignment(consumer)
        watchdog = _Watchdog("round trip")
        trips = _round_trips(
            producer, topic, consumer, WARMUP_ROUND_TRIPS + samples, padding, watchdog
        )
        producer.flush()
    finally:
        consumer.close()
    timed = trips[WARMUP_ROUND_TRIPS:]
    return {"rtt_p50_ms": percentile(timed, 50), "rtt_p99_ms": percentile(timed, 99)}


def _drain(consumer: Consumer, count: int, watchdog: _Watchdog) -> tuple[list[float], float]:
    """Receive ``count`` stamped records; their ages in ms and when the last arrived."""
    ages: list[float] = []
    last = 0.0
    while len(ages) < count:
        batch = _receive(consumer, RELAY_BATCH, 0.1)
        now_ns = time.perf_counter_ns()
        if not batch:
            watchdog.check()
            continue
        ages.extend(_age_ms(message.value(), now_ns) for message in batch)
        last = now_ns / 1e9
        watchdog.progress()
    return ages, last


def _flood(
    producer: _Producer,
    topic: str,
    sink: Consumer,
    count: int,
    padding: bytes,
    watchdog: _Watchdog,
) -> tuple[float, list[float]]:
    """Push ``count`` records while ``sink`` receives them.

    Returns records per second from the first send to the last receipt, and each
    record's age (ms) on arrival.
    """
    driver = threading.Thread(
        target=_send_many, args=(producer, topic, count, padding), daemon=True
    )
    start = time.perf_counter()
    driver.start()
    try:
        ages, last = _drain(sink, count, watchdog)
    finally:
        driver.join()
    return count / (last - start), ages


def _bench_relay3(
    runtime: _Runtime,
    kafka: KafkaConnection,
    topics: Sequence[str],
    records: int,
    samples: int,
    padding: bytes,
    mode: str = "plain",
) -> Figures:
    """End-to-end through two relays: latency one record in flight, then a flood."""
    with _relays(runtime, kafka, topics, mode) as failed:
        producer = _Producer(kafka, linger_ms=RELAY_LINGER_MS)
        producer.connect(topics[0])
        sink = _consumer(kafka, topics[-1], committed=mode == "txn")
        try:
            _await_assignment(sink)
            watchdog = _Watchdog("relay3", failed)
            trips = _round_trips(
                producer, topics[0], sink, WARMUP_ROUND_TRIPS + samples, padding, watchdog
            )[WARMUP_ROUND_TRIPS:]
            rate, ages = _flood(producer, topics[0], sink, records, padding, watchdog)
            producer.flush()
        finally:
            sink.close()
    name = {"plain": "relay3", "txn": "relay3_txn", "dedup": "relay3_dedup"}[mode]
    return {
        f"{name}_msgs_per_s": round(rate),
        f"{name}_p50_ms": percentile(trips, 50),
        f"{name}_p99_ms": percentile(trips, 99),
        f"{name}_loaded_p50_ms": percentile(ages, 50),
        f"{name}_loaded_p99_ms": percentile(ages, 99),
    }


# --- report --------------------------------------------------------------------------------

# (figure, what it is, unit), in the order the table shows them.
_ROWS = (
    ("produce_msgs_per_s", "produce (1 producer, acks=all, idempotent)", "records/s"),
    ("produce_mb_per_s", "produce", "MB/s"),
    ("consume_msgs_per_s", "consume (1 consumer, from first poll)", "records/s"),
    ("consume_first_record_ms", "consume: first poll to first record (group join)", "ms"),
    ("rtt_p50_ms", "round trip p50 (1 hop, 1 in flight)", "ms"),
    ("rtt_p99_ms", "round trip p99", "ms"),
    ("relay3_msgs_per_s", "3-hop relay throughput", "records/s"),
    ("relay3_p50_ms", "3-hop relay p50 (1 in flight)", "ms"),
    ("relay3_p99_ms", "3-hop relay p99 (1 in flight)", "ms"),
    ("relay3_loaded_p50_ms", "3-hop relay p50 under the flood", "ms"),
    ("relay3_loaded_p99_ms", "3-hop relay p99 under the flood", "ms"),
    ("relay3_txn_msgs_per_s", "3-hop relay in transactions: throughput", "records/s"),
    ("relay3_txn_p50_ms", "3-hop relay in transactions p50 (1 in flight)", "ms"),
    ("relay3_txn_p99_ms", "3-hop relay in transactions p99 (1 in flight)", "ms"),
    ("relay3_txn_loaded_p50_ms", "3-hop relay in transactions p50 under the flood", "ms"),
    ("relay3_txn_loaded_p99_ms", "3-hop relay in transactions p99 under the flood", "ms"),
    ("relay3_dedup_msgs_per_s", "3-hop relay acknowledged + deduplicated: throughput", "records/s"),
    ("relay3_dedup_p50_ms", "3-hop relay acknowledged + deduplicated p50 (1 in flight)", "ms"),
    ("relay3_dedup_p99_ms", "3-hop relay acknowledged + deduplicated p99 (1 in flight)", "ms"),
    ("relay3_dedup_loaded_p50_ms", "3-hop relay acknowledged + deduplicated p50, flood", "ms"),
    ("relay3_dedup_loaded_p99_ms", "3-hop relay acknowledged + deduplicated p99, flood", "ms"),
    ("wall_s", "wall time of the whole benchmark", "s"),
)


def _print_table(console: Console, figures: Figures) -> None:
    """The figures as a table."""
    table = Table(
        title=f"Kafka {figures['kafka_version']} on {os.cpu_count()} cores, "
        f"broker {figures['broker']}, {RECORD_BYTES}-byte records, "
        f"relays as {figures['relay3_mode']}es"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for key, label, unit in _ROWS:
        value = figures[key]
        table.add_row(label, f"{value:,}" if isinstance(value, int) else str(value), unit)
    console.print(table)


def _phase(console: Console, title: str, measure: Callable[[], Figures]) -> Figures:
    """Run one phase under a spinner and say what it found."""
    with console.status(f"[bold]{title}"):
        figures = measure()
    summary = ", ".join(f"{key} {value:,}" for key, value in figures.items())
    console.print(f"[green]done[/green] {title}: {summary}")
    return figures


@dataclass(frozen=True)
class _Run:
    """What the phases of one benchmark run share."""

    console: Console
    admin: AdminClient
    kafka: KafkaConnection
    run_id: str
    padding: bytes

    def topics(self, *phases: str) -> AbstractContextManager[list[str]]:
        """Fresh topics named after this run and ``phases``, deleted after the block."""
        names = [f"bench.kafka.{self.run_id}.{phase}" for phase in phases]
        return _fresh_topics(self.console, self.admin, names)


def _settings(broker: _Broker, records: int, samples: int) -> Figures:
    """What was measured, and how, for the report."""
    return {
        "bench": "kafka",
        "broker": broker.label,
        "kafka_version": broker.kafka_version,
        "record_bytes": RECORD_BYTES,
        "records": records,
        "latency_samples": samples,
        "warmup_records": min(records, MAX_WARMUP_RECORDS),
        "relay3_records": max(records // 4, 1),
        "relay3_mode": RELAY_RUNTIME.name,
        "cpu_count": os.cpu_count() or 0,
    }


def _warm_phase(run: _Run, records: int) -> None:
    """The untimed warm-up, under a spinner."""
    with (
        run.topics("warmup") as (topic,),
        run.console.status(f"[bold]warming the broker up with {records:,} records"),
    ):
        _warm_up(run.kafka, topic, records, run.padding)


def _throughput_phases(run: _Run, records: int) -> Figures:
    """Produce ``records`` records, then consume them."""
    with run.topics("produce") as (topic,):
        return _phase(
            run.console,
            f"producing {records:,} records",
            lambda: _bench_produce(run.kafka, topic, records, run.padding),
        ) | _phase(
            run.console,
            f"consuming {records:,} records",
            lambda: _bench_consume(run.kafka, topic, records),
        )


def _rtt_phase(run: _Run, samples: int) -> Figures:
    """The single-hop round trip."""
    with run.topics("rtt") as (topic,):
        return _phase(
            run.console,
            f"timing {samples:,} round trips",
            lambda: _bench_rtt(run.kafka, topic, samples, run.padding),
        )


def _relay3_phase(run: _Run, samples: int, records: int) -> Figures:
    """The 3-hop relay."""
    with run.topics("relay3.t1", "relay3.t2", "relay3.t3") as topics:
        return _phase(
            run.console,
            f"3-hop relay: {samples:,} round trips, then {records:,} records",
            lambda: _bench_relay3(RELAY_RUNTIME, run.kafka, topics, records, samples, run.padding),
        )


def _relay3_txn_phase(run: _Run, samples: int, records: int) -> Figures:
    """The 3-hop relay, each hop in transactions."""
    with run.topics("relay3txn.t1", "relay3txn.t2", "relay3txn.t3") as topics:
        return _phase(
            run.console,
            f"3-hop relay in transactions: {samples:,} round trips, then {records:,} records",
            lambda: _bench_relay3(
                RELAY_RUNTIME, run.kafka, topics, records, samples, run.padding, "txn"
            ),
        )


def _relay3_dedup_phase(run: _Run, samples: int, records: int) -> Figures:
    """The 3-hop relay, each hop acknowledged and deduplicated instead of transactional."""
    with run.topics("relay3dedup.t1", "relay3dedup.t2", "relay3dedup.t3") as topics:
        return _phase(
            run.console,
            f"3-hop relay acknowledged + deduplicated: {samples:,} round trips, then "
            f"{records:,} records",
            lambda: _bench_relay3(
                RELAY_RUNTIME, run.kafka, topics, records, samples, run.padding, "dedup"
            ),
        )


def _measure(console: Console, broker: _Broker, records: int, samples: int) -> Figures:
    """Every phase against ``broker``, each on topics of its own."""
    run = _Run(
        console=console,
        admin=AdminClient({**broker.kafka.confluent(), "log_level": LOG_LEVEL}),
        kafka=broker.kafka,
        run_id=uuid.uuid4().hex[:12],
        padding=os.urandom(RECORD_BYTES - _STAMP.size),
    )
    figures = _settings(broker, records, samples)
    _warm_phase(run, int(figures["warmup_records"]))
    figures |= _throughput_phases(run, records)
    figures |= _rtt_phase(run, samples)
    figures |= _relay3_phase(run, samples, int(figures["relay3_records"]))
    figures |= _relay3_txn_phase(run, samples, int(figures["relay3_records"]))
    figures |= _relay3_dedup_phase(run, samples, int(figures["relay3_records"]))
    return figures


def run_kafka_bench(
    *, console: Console, records: int, latency_samples: int, kafka: KafkaConnection | None
) -> dict[str, float | int | str]:
    """Measure raw Kafka on this machine: produce, consume, round trip and a 3-hop relay.

    Against the broker of ``kafka``, or a private single-node platform started (and
    stopped) here when it is None. Prints a table and, as the last line of stdout, the
    figures as one JSON object, which is also returned.
    """
    if records < 1 or latency_samples < 1:
        raise ValueError("records and latency_samples must be at least 1")
    started = time.perf_counter()
    with _broker(console, kafka) as broker:
        figures = _measure(console, broker, records, latency_samples)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print_table(console, figures)
    print(json.dumps(figures), flush=True)
    return figures
