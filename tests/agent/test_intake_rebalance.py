"""The intake across a lost and regained assignment, on the session broker.

An agent's partitions can be lost with its group session (its group coordinator died,
or it stalled past its lease) and given back to it moments later. Its tracker, its
local queue and its consumer must then all start again from the committed offset: in a
full-suite run of 2026-11-29 the agent lost its four partitions when the broker holding
its group coordinator was killed, was assigned them again 10 s later, and went on past
443 dispatches it had taken before the loss (their answers dropped, as they must be)
without ever taking them again. Since then the intake gives the consumer the committed
offsets it read as the start offsets, the tracker always starts a resumed partition
afresh, and a record fetched before the loss is left untaken; that did not cure the
loss, which was seen again the same day (docs/faults.md, "Not cured").

This drives a real :class:`~fxstream.agent.pull.Intake` with a real consumer. The
records are not dispatches, so each is dead-lettered into a publisher that is never
started: nothing runs, and the tracker shows what was taken. The loss is staged by
exceeding ``max.poll.interval.ms`` (the cheapest loss one broker can stage). librdkafka
restarts at the committed offset here with or without the change (the test passed before
it too), so it holds the contract (the start offsets the intake now gives the consumer,
and the commit metadata read again), not the failing run, which has not been reproduced.
Neither has the other case the change guards against, a record ``poll`` returned before
a rebalance that ``consume`` then served being taken after it: a member joining with
records fetched ahead did not stage it (the rebalance was served before the records).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from fxstream.agent import OffsetTracker, ProcessEngine
from fxstream.agent.answer import Answerer
from fxstream.agent.config import EndpointConfig
from fxstream.agent.function_code import CodeCache
from fxstream.agent.held import HeldTasks
from fxstream.agent.offsets import encode_answered
from fxstream.agent.policy import TaskPolicy
from fxstream.agent.publisher import TransactionalPublisher
from fxstream.agent.pull import Intake
from fxstream.topics import Catalogue, KafkaConnection
from tests.conftest import RunningPlatform

pytestmark = pytest.mark.platform

COMMITTED = 10
ANSWERED = (12, 13)  # answered past the committed offset, by the "previous owner"
SESSION_MS = 6_000  # the broker's least (group.min.session.timeout.ms)
MAX_POLL_MS = 7_000


def _pull_until(intake: Intake, consumer: Consumer, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"{what} not within 60 s"
        intake.pull(consumer)


def test_a_lost_and_regained_partition_starts_again_at_its_committed_offset(
    kafka_platform: RunningPlatform,
    kafka: KafkaConnection,
    unique_prefix: str,
    topic_cleanup: list[str],
) -> None:
    queue = f"{unique_prefix}queue"
    admin = kafka_platform.admin()
    admin.create_topics([NewTopic(queue, num_partitions=1, replication_factor=1)])[queue].result(
        timeout=30
    )
    topic_cleanup.append(queue)
    producer = Producer({**kafka.confluent(), "log_level": 2})
    for i in range(300):
        producer.produce(queue, value=f"not a dispatch {i}".encode())
    assert producer.flush(30) == 0

    group = f"g-{uuid.uuid4().hex[:8]}"
    base = {**kafka.confluent(), "group.id": group, "enable.auto.commit": False, "log_level": 2}
    committer = Consumer(base)
    metadata = encode_answered(COMMITTED, [ANSWERED])
    committer.commit(
        offsets=[TopicPartition(queue, 0, COMMITTED, metadata=metadata)], asynchronous=False
    )
    committer.close()

    config = EndpointConfig(
        name="lab",
        endpoint_id=f"ep-{uuid.uuid4().hex[:8]}",
        service_url="http://127.0.0.1:9",  # never called: no record is a task
        bootstrap_servers=kafka.bootstrap,
    )
    catalogue = Catalogue()
    tracker, held = OffsetTracker(), HeldTasks()
    answers = Answerer(config, catalogue, tracker=tracker, held=held, hostname="test")
    # Never started: the dead letters only queue in it, and no offset is ever committed.
    publisher = TransactionalPublisher(
        {**kafka.confluent(), "log_level": 2},
        transactional_id=f"t-{uuid.uuid4().hex[:8]}",
        queue_topic=queue,
        tracker=tracker,
        group_metadata=lambda: None,
    )
    answers.open(publisher, producer)
    codes = CodeCache(config.service_url, "unused")
    assignments: list[list[int]] = []
    with ProcessEngine(1) as engine:
        intake = Intake(
            config,
            catalogue,
            engine,
            policy=TaskPolicy.of(config),
            codes=codes,
            tracker=tracker,
            held=held,
            answers=answers,
        )

        def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            assignments.append([p.partition for p in partitions])
            intake.assigned(consumer, partitions)

        consumer = Consumer(
            {
                **base,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "session.timeout.ms": SESSION_MS,
                "heartbeat.interval.ms": 1_000,
                "max.poll.interval.ms": MAX_POLL_MS,
            }
        )
        try:
            consumer.subscribe(
                [queue],
                on_assign=on_assign,
                on_revoke=lambda _c, parts: intake.give_up(parts),
                on_lost=lambda _c, parts: intake.lost(parts),
            )
            _pull_until(intake, consumer, lambda: tracker.pending_count >= 100, "100 records")
            assert assignments == [[0]]
            assert intake.answered_before == len(ANSWERED)
            assert publisher.pending == tracker.pending_count + len(ANSWERED)

            time.sleep(MAX_POLL_MS / 1000 + 2)  # the session is lost: no poll for too long
            _pull_until(intake, consumer, lambda: len(assignments) == 2, "the assignment again")
            assert assignments == [[0], [0]]
            _pull_until(intake, consumer, lambda: tracker.pending_count >= 20, "20 records")
            # Taken again from the committed offset (before the consumer closes: closing
            # revokes, and the tracker forgets): the records answered past it settled
            # again from the commit metadata, the first after it in flight again.
            assert intake.answered_before == 2 * len(ANSWERED)
            assert tracker.done(0, COMMITTED), f"offset {COMMITTED} was not taken again"
            assert tracker.done(0, COMMITTED + 1)
            assert not tracker.done(0, ANSWERED[0]), "settled from the metadata, not taken"
        finally:
            consumer.close()
            codes.close()
