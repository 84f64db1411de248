"""The kafka bench's acknowledged + deduplicated relay, on the session's real broker.

``./fx bench kafka`` measures it as the protocol that could replace transactions on a
lone task's path (docs/benchmarks.md, "Transactions per hop"); these check that what it
measures is that protocol: a record forwarded once even when its source holds it twice
(what a relay restarted before committing its offsets reads again), every other record
forwarded, and its input offsets committed once the batch is acknowledged.
"""

from __future__ import annotations

import threading
import time
import uuid

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from rich.console import Console

from fxstream.ops.bench import kafka as bench
from tests.conftest import RunningPlatform


def test_the_dedup_relay_forwards_each_record_once_and_commits_after(
    kafka_platform: RunningPlatform,
) -> None:
    kafka = kafka_platform.kafka
    run = uuid.uuid4().hex[:8]
    source, target = f"bench.test.{run}.t1", f"bench.test.{run}.t2"
    admin = kafka_platform.admin()
    with bench._fresh_topics(Console(quiet=True), admin, [source, target]):
        ready, stop = threading.Event(), threading.Event()
        relay = threading.Thread(
            target=bench._forward_deduplicated, args=(kafka, source, target, ready, stop)
        )
        relay.start()
        try:
            assert ready.wait(bench.STARTUP_TIMEOUT_S)
            producer = bench._Producer(kafka, linger_ms=0)
            padding = bytes(bench.RECORD_BYTES - bench._STAMP.size)
            values = [bench._stamped(padding) for _ in range(5)]
            for value in [*values, values[1], values[3]]:  # two repeats
                producer.send(source, value)
            producer.flush()
            sink = bench._consumer(kafka, target)
            try:
                bench._await_assignment(sink)
                received: list[bytes] = []
                deadline = time.monotonic() + 30
                while len(received) < len(values) and time.monotonic() < deadline:
                    received += [m.value() or b"" for m in bench._receive(sink, 100, 0.5)]
                # Anything more (a repeat passed on) would arrive within a second or two.
                extra_until = time.monotonic() + 2
                while time.monotonic() < extra_until:
                    received += [m.value() or b"" for m in bench._receive(sink, 100, 0.2)]
            finally:
                sink.close()
            assert sorted(received) == sorted(values)
            # Its group commits the source's end once the batch is acknowledged: a relay
            # restarted now would read nothing again.
            deadline = time.monotonic() + 30
            while _committed_total(kafka_platform, source) < len(values) + 2:
                assert time.monotonic() < deadline, "the relay did not commit its offsets"
                time.sleep(0.2)
        finally:
            stop.set()
            relay.join(bench.IDLE_TIMEOUT_S)
        assert not relay.is_alive()
        assert _committed_total(kafka_platform, source) == len(values) + 2


def _committed_total(kafka_platform: RunningPlatform, topic: str) -> int:
    """The sum over ``topic``'s partitions of the offsets the bench's groups committed."""
    admin = kafka_platform.admin()
    total = 0
    for listing in admin.list_consumer_groups().result(timeout=30).valid:
        if not listing.group_id.startswith("bench.kafka."):
            continue
        request = ConsumerGroupTopicPartitions(
            listing.group_id, [TopicPartition(topic, p) for p in range(bench.PARTITIONS)]
        )
        for future in admin.list_consumer_group_offsets([request]).values():
            result = future.result(timeout=30)
            total += sum(max(tp.offset, 0) for tp in result.topic_partitions if tp.topic == topic)
    return total
