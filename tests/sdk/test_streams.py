"""SDK streams: ProxyStore StreamProducer/StreamConsumer over the real broker and Redis.

Arrays go to the platform's Redis through a ProxyStore store; Kafka carries the
events. Consumers that must die are real processes (``tests.sdk.stream_child``)
killed with SIGKILL by PID. Every topic made under this module's prefix is
deleted at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from proxystore.store import unregister_store
from proxystore.stream import StreamProducer
from proxystore.stream.shims.kafka import KafkaPublisher as ProxyStoreKafkaShim

from fxstream.sdk import (
    KafkaPublisher,
    PayloadTooLarge,
    StreamDeliveryFailed,
    StreamTimeout,
    stream_consumer,
    stream_producer,
)
from fxstream.sdk.streams import KafkaStreamConsumer, stream_group_id
from fxstream.topics import Catalogue, DeadLetter, KafkaConnection, decode, ensure_topics
from tests.conftest import RunningPlatform, write_kafka_credentials
from tests.sdk.stream_child import check_array, indexed_array, redis_store

MB: Final = 1 << 20
REPO_ROOT: Final = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class StreamEnv:
    """The module's broker, Redis and topic prefix."""

    kafka: KafkaConnection
    redis_url: str
    catalogue: Catalogue

    @property
    def prefix(self) -> str:
        """The module's topic prefix."""
        return self.catalogue.prefix


@pytest.fixture(scope="module")
def env(kafka_platform: RunningPlatform) -> Iterator[StreamEnv]:
    """A prefix of this module's own; every topic under it is deleted afterwards."""
    catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    yield StreamEnv(
        kafka_platform.kafka,
        kafka_platform.connection.redis_url,
        catalogue,
    )
    admin = kafka_platform.admin()
    mine = [t for t in admin.list_topics(timeout=30).topics if t.startswith(catalogue.prefix)]
    if mine:
        for future in admin.delete_topics(mine, operation_timeout=30).values():
            future.result(timeout=30)


@pytest.fixture
def stream() -> str:
    """A stream name no other test uses."""
    return f"s-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store_name() -> Iterator[str]:
    """A store name of this test's own, unregistered afterwards (consumers register it)."""
    name = f"stream-test-{uuid.uuid4().hex[:8]}"
    yield name
    unregister_store(name)


def produce_arrays(
    env: StreamEnv, stream: str, store_name: str | None, count: int, nbytes: int
) -> None:
    """Send ``count`` indexed arrays, then end the stream."""
    store = redis_store(env.redis_url, store_name) if store_name is not None else None
    with stream_producer(env.kafka, stream, store=store, topic_prefix=env.prefix) as producer:
        for index in range(count):
            producer.send(stream, indexed_array(index, nbytes))
        producer.close_topics(stream)


def consumer_for(
    env: StreamEnv, stream: str, group: str, *, timeout_s: float = 30.0
) -> KafkaStreamConsumer[Any]:
    """A consumer of ``stream`` in ``group`` that gives up after ``timeout_s`` without items."""
    return stream_consumer(
        env.kafka, stream, group=group, topic_prefix=env.prefix, timeout_s=timeout_s
    )


def committed_offset(env: StreamEnv, stream: str, group: str) -> int:
    """The group's committed offset on the stream's partition (every item is in one)."""
    consumer = Consumer(
        {
            **env.kafka.confluent(),
            "group.id": stream_group_id(env.catalogue, stream, group),
            "log_level": 3,
        }
    )
    try:
        topic = env.catalogue.stream(stream)
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=30)
    finally:
        consumer.close()
    used = [tp.offset for tp in committed if tp.offset >= 0]
    assert len(used) <= 1, f"a stream's items spread over partitions: {committed}"
    return used[0] if used else -1


def describe_stream(env: StreamEnv, stream: str, group: str) -> str:
    """The stream topic's watermarks, the group's committed offsets and each record's events.

    Put in an assertion's message, so an unexpected start point explains itself
    (a start past offset 0, a commit nobody made, records that are not the items).
    """
    topic = env.catalogue.stream(stream)
    reader = Consumer({**env.kafka.confluent(), "group.id": f"describe-{uuid.uuid4().hex}"})
    try:
        partitions = reader.list_topics(topic, timeout=30).topics[topic].partitions
        lines = [f"topic {topic}, group {stream_group_id(env.catalogue, stream, group)}:"]
        for partition in partitions:
            low, high = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
            lines.append(f"  partition {partition}: offsets {low}..{high}")
            reader.assign([TopicPartition(topic, partition, low)])
            for message in reader.consume(max(high - low, 0), timeout=10):
                if message.error() is None:
                    value = message.value() or b""
                    lines.append(f"    @{message.offset()}: {len(value)} bytes {value[:80]!r}")
        lines.append(f"  committed: {committed_offset(env, stream, group)}")
        return "\n".join(lines)
    finally:
        reader.close()


# --- data through the store, in order ------------------------------------------------------


def test_arrays_stream_by_proxy_in_order_and_are_evicted_after_commit(
    env: StreamEnv, stream: str, store_name: str
) -> None:
    count = 24
    objects = redis_store(env.redis_url, store_name).connector
    produce_arrays(env, stream, store_name, count, MB)
    assert objects.count_objects() == count, "each array should sit in Redis"

    with consumer_for(env, stream, "readers") as consumer:
        indices = []
        for item in consumer:
            assert type(item).__name__ == "Proxy", "bulk data should arrive by reference"
            indices.append(check_array(item, MB))
            # Resolving twice must work: the object lives until its record is committed.
            check_array(item, MB)
    assert indices == list(range(count))
    assert objects.count_objects() == 0, "committed items' objects should be evicted"


def test_end_of_stream_ends_iteration_and_is_committed_with_the_items(
    env: StreamEnv, stream: str
) -> None:
    # Inline items: two groups read this stream, and the default evict=True means one group
    # owns the stored objects (see docs/data-plane-streams.md).
    produce_arrays(env, stream, None, 3, 1024)
    with consumer_for(env, stream, "first") as consumer:
        assert [check_array(item) for item in consumer] == [0, 1, 2]
    # The group finished the stream: a restart has nothing left to read.
    with pytest.raises(StreamTimeout), consumer_for(env, stream, "first", timeout_s=3) as again:
        next(again)
    # Another group reads it from the start, to its end.
    with consumer_for(env, stream, "second") as other:
        assert [check_array(item) for item in other] == [0, 1, 2]


# --- resume --------------------------------------------------------------------------------


def read_lines_until(process: subprocess.Popen[str], key: str) -> list[dict[str, Any]]:
    """The child's JSON lines up to and including the first holding ``key``."""
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the consumer process exited ({process.wait()}) before {key}")
        lines.append(json.loads(line))
        if key in lines[-1]:
            return lines
    raise AssertionError(f"no {key!r} from the consumer process in {CHILD_TIMEOUT_S:.0f} s")


def test_consumer_killed_mid_stream_resumes_in_a_new_process_without_skipping(
    env: StreamEnv, stream: str, store_name: str, tmp_path: Path
) -> None:
    count, hold_after = 30, 12
    produce_arrays(env, stream, store_name, count, 256 * 1024)
    credentials = write_kafka_credentials(env.kafka, tmp_path / "kafka.json")
    child = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.sdk.stream_child"),
            *(str(credentials), env.prefix, stream, "resume", str(hold_after), "member-1"),
        ],
        cwd=REPO_ROOT,
        # The store's credentials, as a consumer's environment would hold them.
        env={**os.environ, "FXSTREAM_STORE_URL": env.redis_url},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = read_lines_until(child, "holding")
        seen = [line["index"] for line in lines if "index" in line]
        assert seen == list(range(hold_after))
        # It holds item hold_after-1; the ones before are done and committed asynchronously.
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while committed_offset(env, stream, "resume") != hold_after - 1:
            assert time.monotonic() < deadline, "the done items were never committed"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=CHILD_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    # The same static member id takes the dead process's partitions over at once (another
    # id would wait for the group's session timeout to expire first).
    restarted = stream_consumer(
        env.kafka,
        stream,
        group="resume",
        topic_prefix=env.prefix,
        timeout_s=30,
        instance_id="member-1",
    )
    with restarted:
        resumed = [check_array(item) for item in restarted]
    # Exactly the item the killed process held comes again (its object was not evicted);
    # nothing is skipped.
    assert resumed == list(range(hold_after - 1, count))


@pytest.mark.parametrize("stop", ["normally", "by-exception"])
def test_consumer_stopped_in_process_resumes_where_it_was(
    env: StreamEnv, stream: str, store_name: str, stop: str
) -> None:
    count, taken = 10, 4
    produce_arrays(env, stream, store_name, count, 4096)

    class Stop(Exception):
        """Raised inside the consumer's block to leave it by an exception."""

    first = []
    expected_error = pytest.raises(Stop) if stop == "by-exception" else contextlib.nullcontext()
    with expected_error, consumer_for(env, stream, "g") as consumer:
        for item in consumer:
            first.append(check_array(item))
            if len(first) == taken:
                if stop == "by-exception":
                    raise Stop
                break
    assert first == list(range(taken)), describe_stream(env, stream, "g")

    with consumer_for(env, stream, "g") as consumer:
        rest = [check_array(item) for item in consumer]
    # A normal exit commits the item in hand; an exception leaves it to be read again.
    start = taken if stop == "normally" else taken - 1
    assert rest == list(range(start, count))


def test_rebalance_commits_done_items_before_the_partition_moves(
    env: StreamEnv, stream: str, store_name: str
) -> None:
    count, taken = 12, 5
    produce_arrays(env, stream, store_name, count, 4096)
    # commit_every far above the stream: only a rebalance (or close) commits.
    first = stream_consumer(
        env.kafka,
        stream,
        group="shared",
        topic_prefix=env.prefix,
        timeout_s=30,
        commit_every=1_000,
    )
    try:
        got_first = [check_array(next(first)) for _ in range(taken)]
        assert committed_offset(env, stream, "shared") == -1
        joined = threading.Event()

        def join_second() -> None:
            second = consumer_for(env, stream, "shared")
            second.kafka.wait_for_assignment()
            joined.set()
            second.close()

        joiner = threading.Thread(target=join_second, daemon=True)
        joiner.start()
        # The first member keeps item taken-1 in hand and only serves the group meanwhile.
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not joined.is_set():
            assert time.monotonic() < deadline, "the second member never got partitions"
            first.kafka.serve_group(0.1)
        joiner.join(CHILD_TIMEOUT_S)
        # The revoke committed the done items (0..taken-2), never the one in hand.
        assert committed_offset(env, stream, "shared") == taken - 1
        assert got_first == list(range(taken))
        # The second member left: the first gets the partition back at the committed offset,
        # so the item it held comes again and nothing is skipped.
        rest = [check_array(item) for item in first]
        assert rest == list(range(taken - 1, count))
    finally:
        first.close()


# --- the publisher -------------------------------------------------------------------------


def produce_requests(stats: list[dict[str, Any]]) -> int:
    """Produce requests sent to real brokers, from the last librdkafka statistics."""
    brokers = stats[-1]["brokers"].values()
    return sum(int(b.get("req", {}).get("Produce", 0)) for b in brokers if b["nodeid"] >= 0)


def collect_stats(producer: Producer, stats: list[dict[str, Any]], after: int) -> None:
    """Serve the producer until a statistics report newer than report number ``after``."""
    deadline = time.monotonic() + 10
    while len(stats) <= after + 1:
        assert time.monotonic() < deadline, "no librdkafka statistics"
        producer.poll(0.05)


def test_publisher_batches_records_where_proxystore_shim_sends_one_request_each(
    env: StreamEnv, stream: str
) -> None:
    events = 200
    ours: list[dict[str, Any]] = []
    stats_config = {"statistics.interval.ms": 100, "stats_cb": lambda s: ours.append(json.loads(s))}
    publisher = KafkaPublisher(env.kafka, catalogue=env.catalogue, kafka_config=stats_config)
    producer = StreamProducer[int](publisher)
    started = time.perf_counter()
    for index in range(events):
        producer.send(stream, index)
    queued_s = time.perf_counter() - started
    publisher.flush()
    collect_stats(publisher.producer, ours, len(ours))
    ours_requests = produce_requests(ours)

    shim_stats: list[dict[str, Any]] = []
    shim_producer = Producer(
        {
            **env.kafka.confluent(),
            "statistics.interval.ms": 100,
            "stats_cb": lambda s: shim_stats.append(json.loads(s)),
            "log_level": 3,
        }
    )
    shim = StreamProducer[int](ProxyStoreKafkaShim(shim_producer))
    shim_topic = publisher.ensure_stream(f"{stream}-shim")
    for index in range(events):
        shim.send(shim_topic, index)
    collect_stats(shim_producer, shim_stats, len(shim_stats))
    shim_requests = produce_requests(shim_stats)
    publisher.close()

    assert shim_requests >= events, "ProxyStore's shim flushes (one request) per message"
    assert ours_requests <= events // 10, (ours_requests, queued_s)
    # Batching kept every record and their order (one key, one partition).
    with consumer_for(env, stream, "count") as consumer:
        assert [next(consumer) for _ in range(events)] == list(range(events))


def test_delivery_failures_are_raised_not_lost(env: StreamEnv, stream: str) -> None:
    publisher = KafkaPublisher(
        env.kafka,
        catalogue=env.catalogue,
        create_topics=False,
        kafka_config={"message.timeout.ms": 1500},
    )
    producer = StreamProducer[int](publisher)
    producer.send(stream, 1)  # queued: the topic does not exist and will not be created
    with pytest.raises(StreamDeliveryFailed, match=env.catalogue.stream(stream)) as failed:
        publisher.flush()
    assert len(failed.value.failures) == 1


def test_oversized_inline_object_is_refused_naming_the_store(env: StreamEnv, stream: str) -> None:
    with (
        stream_producer(env.kafka, stream, store=None, topic_prefix=env.prefix) as producer,
        pytest.raises(PayloadTooLarge, match="store") as refused,
    ):
        producer.send(stream, np.zeros(2 * MB, dtype=np.uint8))
    assert refused.value.limit == env.catalogue.spec("streams.{stream}").max_message_bytes
    # Small objects still travel inline.
    produce_arrays(env, stream, None, 2, 1024)
    with consumer_for(env, stream, "inline") as consumer:
        items = list(consumer)
    assert [check_array(item) for item in items] == [0, 1]
    assert all(isinstance(item, np.ndarray) for item in items)


def test_malformed_record_is_dead_lettered_and_skipped(
    kafka_platform: RunningPlatform, env: StreamEnv, stream: str
) -> None:
    dead_letter = env.catalogue.dead_letter
    ensure_topics(
        kafka_platform.admin(), env.catalogue, {dead_letter: env.catalogue.spec("dead-letter")}
    )
    publisher = KafkaPublisher(env.kafka, catalogue=env.catalogue)
    topic = publisher.ensure_stream(stream)
    publisher.producer.produce(topic, b"not an event", key=stream.encode())
    producer = StreamProducer[int](publisher)
    producer.send(stream, 7)
    producer.close(topics=[stream])

    with consumer_for(env, stream, "dl") as consumer:
        assert list(consumer) == [7]
    reader = Consumer(
        {
            **env.kafka.confluent(),
            "group.id": f"dl-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        reader.subscribe([dead_letter])
        message = None
        deadline = time.monotonic() + 30
        while message is None and time.monotonic() < deadline:
            message = reader.poll(0.2)
    finally:
        reader.close()
    assert message is not None and message.error() is None
    letter = decode(message.value() or b"", DeadLetter)
    assert (letter.original_topic, letter.original_offset) == (topic, 0)
    assert letter.original_value == b"not an event"
