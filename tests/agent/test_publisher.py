"""TransactionalPublisher on the session broker: answers and offsets commit together."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from fxstream.agent import publisher as publisher_module
from fxstream.agent.offsets import OffsetTracker, decode_answered
from fxstream.agent.publisher import (
    Answer,
    PublisherFenced,
    PublisherWedged,
    Refusal,
    TransactionalPublisher,
)
from fxstream.topics import KafkaConnection
from tests.conftest import RunningPlatform
from tests.hung_calls import hang_first_call

pytestmark = pytest.mark.platform


@pytest.fixture
def topics(
    kafka_platform: RunningPlatform, unique_prefix: str, topic_cleanup: list[str]
) -> tuple[str, str]:
    queue, out = f"{unique_prefix}queue", f"{unique_prefix}out"
    admin = kafka_platform.admin()
    for future in admin.create_topics(
        [NewTopic(queue, num_partitions=2, replication_factor=1), NewTopic(out, 1, 1)]
    ).values():
        future.result(timeout=30)
    topic_cleanup.extend([queue, out])
    return queue, out


@pytest.fixture
def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def group_consumer(
    kafka: KafkaConnection, topics: tuple[str, str], group_id: str
) -> Iterator[Consumer]:
    queue, _ = topics
    consumer = Consumer(
        {
            **kafka.confluent(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 2,
        }
    )
    consumer.subscribe([queue])
    # Join the group before any publisher copies its metadata: metadata taken mid-join
    # carries a member id with a stale generation, which the broker refuses
    # (ILLEGAL_GENERATION) in every transaction that sends offsets.
    deadline = time.monotonic() + 60
    while not consumer.assignment():
        assert time.monotonic() < deadline, "the test consumer never joined its group"
        message = consumer.poll(0.2)
        assert message is None or message.error() is not None, "the queue must start empty"
    yield consumer
    consumer.close()


def _fill(kafka: KafkaConnection, topic: str, count: int) -> None:
    producer = Producer({**kafka.confluent(), "log_level": 2})
    for i in range(count):
        producer.produce(topic, key=str(i).encode(), value=f"task {i}".encode())
    assert producer.flush(30) == 0


def _take(consumer: Consumer, count: int) -> list[Message]:
    taken: list[Message] = []
    deadline = time.monotonic() + 60
    while len(taken) < count and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and message.error() is None:
            taken.append(message)
    assert len(taken) == count
    return taken


def _committed_values(kafka: KafkaConnection, topic: str) -> list[bytes]:
    reader = Consumer(
        {
            **kafka.confluent(),
            "group.id": f"r-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
            "log_level": 2,
        }
    )
    reader.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    try:
        while True:
            message = reader.poll(10)
            assert message is not None, "no end of partition within 10 s"
            if message.error() is not None:
                break  # end of partition
            values.append(message.value() or b"")
    finally:
        reader.close()
    return values


def _answer_each(
    publisher: TransactionalPublisher, tracker: OffsetTracker, messages: list[Message], out: str
) -> None:
    """Track each queue record and publish its answer ("answer " + its value) to ``out``."""
    for message in messages:
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        tracker.track(partition, offset)
        publisher.publish(
            Answer(out, message.key(), b"answer " + (message.value() or b""), partition, offset)
        )


def _publisher(
    kafka: KafkaConnection, consumer: Consumer, queue: str, tracker: OffsetTracker, txn_id: str
) -> TransactionalPublisher:
    metadata = consumer.consumer_group_metadata()
    return TransactionalPublisher(
        {**kafka.confluent(), "log_level": 2},
        transactional_id=txn_id,
        queue_topic=queue,
        tracker=tracker,
        group_metadata=lambda: metadata,
    )


def test_answers_and_their_offsets_commit_together(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer
) -> None:
    queue, out = topics
    _fill(kafka, queue, 20)
    tracker = OffsetTracker()
    publisher = _publisher(kafka, group_consumer, queue, tracker, f"t-{uuid.uuid4()}")
    publisher.start()
    try:
        _answer_each(publisher, tracker, _take(group_consumer, 20), out)
        assert publisher.flush(30)
    finally:
        publisher.close()
    assert sorted(_committed_values(kafka, out)) == sorted(
        f"answer task {i}".encode() for i in range(20)
    )
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(tp.offset for tp in committed) == 20, "every queue record's offset committed"


def test_a_restarted_agent_fences_the_old_one(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer
) -> None:
    queue, out = topics
    _fill(kafka, queue, 2)
    first, second = _take(group_consumer, 2)
    txn_id = f"t-{uuid.uuid4()}"
    tracker = OffsetTracker()
    zombie = _publisher(kafka, group_consumer, queue, tracker, txn_id)
    zombie.start()
    successor = _publisher(kafka, group_consumer, queue, OffsetTracker(), txn_id)
    successor.start()  # same transactional id: the zombie is fenced
    try:
        for message in (first, second):
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            tracker.track(partition, offset)
        zombie.publish(
            Answer(out, None, b"from the zombie", first.partition() or 0, first.offset() or 0)
        )
        assert not zombie.flush(30)
        assert isinstance(zombie.failure, PublisherFenced)
        assert "fenced" in str(zombie.failure)
    finally:
        zombie.close()
        successor.close()
    assert b"from the zombie" not in _committed_values(kafka, out)


def test_an_answer_without_a_topic_only_settles_its_offset(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer
) -> None:
    queue, out = topics
    _fill(kafka, queue, 4)
    tracker = OffsetTracker()
    publisher = _publisher(kafka, group_consumer, queue, tracker, f"t-{uuid.uuid4()}")
    publisher.start()
    try:
        for message in _take(group_consumer, 4):
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            tracker.track(partition, offset)
            publisher.publish(Answer(None, None, b"", partition, offset))
        assert publisher.flush(30)
    finally:
        publisher.close()
    assert _committed_values(kafka, out) == []
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(max(tp.offset, 0) for tp in committed) == 4


def _quarantining_publisher(
    kafka: KafkaConnection,
    consumer: Consumer,
    queue: str,
    tracker: OffsetTracker,
    refusals: list[tuple[Answer, Refusal]],
    replacement_topic: str,
    *,
    message_max_bytes: int = 1_000_000,
) -> TransactionalPublisher:
    metadata = consumer.consumer_group_metadata()

    def on_refused(answer: Answer, refusal: Refusal) -> list[Answer]:
        refusals.append((answer, refusal))
        small = b"quarantined " + (answer.key or b"")
        return [Answer(replacement_topic, answer.key, small, answer.partition, answer.offset)]

    return TransactionalPublisher(
        {**kafka.confluent(), "log_level": 2, "message.max.bytes": message_max_bytes},
        transactional_id=f"t-{uuid.uuid4()}",
        queue_topic=queue,
        tracker=tracker,
        group_metadata=lambda: metadata,
        on_refused=on_refused,
    )


def _answer_all(
    publisher: TransactionalPublisher,
    tracker: OffsetTracker,
    messages: list[Message],
    value_of: Callable[[int], tuple[str, bytes]],
) -> None:
    for index, message in enumerate(messages):
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        tracker.track(partition, offset)
        topic, value = value_of(index)
        publisher.publish(Answer(topic, message.key(), value, partition, offset))


@pytest.mark.parametrize("where", ["producer", "broker"])
def test_an_answer_kafka_refuses_is_quarantined_and_the_rest_commit(
    kafka: KafkaConnection,
    topics: tuple[str, str],
    group_consumer: Consumer,
    kafka_platform: RunningPlatform,
    unique_prefix: str,
    topic_cleanup: list[str],
    where: str,
) -> None:
    """Too large for the producer (refused at produce) or for the topic (refused by the
    broker inside the transaction): the answer is replaced, the batch commits, nothing
    is retried forever."""
    queue, out = topics
    target = out
    if where == "broker":
        target = f"{unique_prefix}small"
        admin = kafka_platform.admin()
        small = NewTopic(target, 1, 1, config={"max.message.bytes": "20000"})
        for future in admin.create_topics([small]).values():
            future.result(timeout=30)
        topic_cleanup.append(target)
    _fill(kafka, queue, 10)
    tracker = OffsetTracker()
    refusals: list[tuple[Answer, Refusal]] = []
    publisher = _quarantining_publisher(
        kafka,
        group_consumer,
        queue,
        tracker,
        refusals,
        out,
        message_max_bytes=50_000 if where == "producer" else 1_000_000,
    )
    publisher.start()
    started = time.monotonic()
    try:
        _answer_all(
            publisher,
            tracker,
            _take(group_consumer, 10),
            lambda i: (target, b"x" * 100_000) if i == 3 else (target, f"ok {i}".encode()),
        )
        assert publisher.flush(60), publisher.failure
    finally:
        publisher.close()
    assert time.monotonic() - started < 40
    assert len(refusals) == 1
    answer, refusal = refusals[0]
    assert len(answer.value) == 100_000
    assert not refusal.topic_missing
    assert "SIZE" in refusal.reason.upper()
    written = [v for v in _committed_values(kafka, target) if v.startswith(b"ok")]
    assert sorted(written) == sorted(f"ok {i}".encode() for i in range(10) if i != 3)
    assert any(v.startswith(b"quarantined") for v in _committed_values(kafka, out))
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(max(tp.offset, 0) for tp in committed) == 10, "every offset settled"


def test_an_answer_to_a_missing_topic_is_quarantined_before_its_transaction(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer, unique_prefix: str
) -> None:
    queue, out = topics
    missing = f"{unique_prefix}no-such-results"
    _fill(kafka, queue, 6)
    tracker = OffsetTracker()
    refusals: list[tuple[Answer, Refusal]] = []
    publisher = _quarantining_publisher(kafka, group_consumer, queue, tracker, refusals, out)
    publisher.start()
    started = time.monotonic()
    try:
        _answer_all(
            publisher,
            tracker,
            _take(group_consumer, 6),
            lambda i: (missing, b"lost") if i == 0 else (out, f"ok {i}".encode()),
        )
        assert publisher.flush(60), publisher.failure
    finally:
        publisher.close()
    assert time.monotonic() - started < 20, "no wait for metadata propagation"
    assert [r.topic_missing for _, r in refusals] == [True]
    values = _committed_values(kafka, out)
    assert sorted(v for v in values if v.startswith(b"ok")) == [
        f"ok {i}".encode() for i in range(1, 6)
    ]
    assert sum(1 for v in values if v.startswith(b"quarantined")) == 1
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(max(tp.offset, 0) for tp in committed) == 6


def test_answers_past_an_unanswered_record_are_named_in_the_committed_offsets_metadata(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer
) -> None:
    """The agent-kill duplicate, at the publisher: the first record of a partition is still
    running when the ones after it are answered. Their results commit, the position cannot
    pass the first, so the commit's metadata (same transaction) must name them, and a
    successor resuming from the committed offsets settles them instead of running them."""
    queue, out = topics
    _fill(kafka, queue, 12)
    taken = _take(group_consumer, 12)
    tracker = OffsetTracker()
    by_partition: dict[int, list[int]] = {}
    for message in taken:
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        tracker.track(partition, offset)
        by_partition.setdefault(partition, []).append(offset)
    partition, offsets = max(by_partition.items(), key=lambda item: len(item[1]))
    assert len(offsets) >= 3
    running, answered = offsets[0], offsets[1:]
    publisher = _publisher(kafka, group_consumer, queue, tracker, f"t-{uuid.uuid4()}")
    publisher.start()
    try:
        for offset in answered:
            publisher.publish(Answer(out, None, f"answer {offset}".encode(), partition, offset))
        assert publisher.flush(30)
    finally:
        publisher.close()
    assert sorted(_committed_values(kafka, out)) == sorted(f"answer {o}".encode() for o in answered)
    (committed,) = group_consumer.committed([TopicPartition(queue, partition)], timeout=10)
    assert committed.offset == running, "the position never passes the running record"
    assert decode_answered(committed.offset, committed.metadata) == [(answered[0], answered[-1])]
    successor = OffsetTracker()
    successor.resume(partition, committed.offset, committed.metadata)
    assert [successor.track(partition, o) for o in offsets] == [True] + [False] * len(answered)


@pytest.mark.parametrize("when", ["before its transaction", "while it produces"])
def test_a_partition_lost_mid_batch_never_commits_an_answer_without_its_offset(
    kafka: KafkaConnection, topics: tuple[str, str], group_consumer: Consumer, when: str
) -> None:
    """The lease-fault duplicate, at the publisher: a zombie wakes with answers in hand and
    its poll thread notices the lost session (new epoch, the partitions' offsets forgotten)
    just as the publisher begins their transaction. The answers must then either be dropped
    (the epoch moved before the offsets were sent) or commit with their offsets, sent with
    the group metadata the broker checks: never an answer committed with no offset (the
    tracker no longer knew the partition, so nothing asked the broker), which the
    partition's new owner answers again."""
    queue, out = topics
    _fill(kafka, queue, 4)
    taken = _take(group_consumer, 4)
    rebalancing = threading.Lock()
    epoch = [0]
    lost = threading.Event()

    def lose() -> None:  # what Intake.lost does on the poll thread
        with rebalancing:
            epoch[0] += 1
            tracker.forget_partitions({0, 1})
        lost.set()

    def lose_now() -> None:
        if not lost.is_set() and not getattr(lose_now, "fired", False):
            lose_now.fired = True  # type: ignore[attr-defined]
            thread = threading.Thread(target=lose)
            thread.start()
            # Give the poll thread its chance: it waits only if the publisher holds the lock.
            thread.join(0.5)

    class LosingTracker(OffsetTracker):
        def admit(self, partition: int, offset: int) -> bool:
            if when == "while it produces":
                lose_now()
            return super().admit(partition, offset)

    def current_epoch() -> int:
        seen = epoch[0]
        if when == "before its transaction":
            lose_now()
        return seen

    tracker = LosingTracker()
    metadata = group_consumer.consumer_group_metadata()
    publisher = TransactionalPublisher(
        {**kafka.confluent(), "log_level": 2},
        transactional_id=f"t-{uuid.uuid4()}",
        queue_topic=queue,
        tracker=tracker,
        group_metadata=lambda: metadata,
        epoch=current_epoch,
        rebalancing=rebalancing,
    )
    publisher.start()
    try:
        for message in taken:
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            tracker.track(partition, offset)
            publisher.publish(
                Answer(out, None, f"{partition}:{offset}".encode(), partition, offset)
            )
        assert publisher.flush(30)
    finally:
        publisher.close()
    assert lost.wait(10), "the poll thread never got the lock back"
    values = _committed_values(kafka, out)
    committed = {
        tp.partition: tp.offset
        for tp in group_consumer.committed(
            [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
        )
    }
    for value in values:
        partition, offset = map(int, value.split(b":"))
        assert committed[partition] > offset, (
            f"the answer of {partition}:{offset} was committed without its offset "
            f"(committed offsets {committed}): its partition's next owner runs it again"
        )
    if when == "before its transaction":
        assert values == [] and publisher.dropped == 4, "answers of a lost epoch are dropped"
    else:
        assert len(values) == 4, "the offsets went with the metadata the broker accepted"


# --- a transactional call that never returns -------------------------------------------


def _short_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transactional calls time out at 3 s, and a hung one is given up 1 s later."""
    monkeypatch.setattr(publisher_module, "CALL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(publisher_module, "SEND_OFFSETS_TIMEOUT_S", 3.0)
    monkeypatch.setattr(publisher_module, "HUNG_GRACE_S", 1.0)


@pytest.mark.parametrize(
    ("method", "after_real", "outcome"),
    [
        ("send_offsets_to_transaction", False, "did not commit"),
        ("commit_transaction", True, "went through"),
        ("commit_transaction", False, "did not go through"),
    ],
)
def test_a_producer_hung_in_a_transactional_call_is_replaced_and_every_answer_commits_once(
    kafka: KafkaConnection,
    topics: tuple[str, str],
    group_consumer: Consumer,
    group_id: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    method: str,
    after_real: bool,
    outcome: str,
) -> None:
    """The publisher waits for a transactional call its timeout and a grace, then leaves
    the producer hung there for a new one (same transactional id: the old one is fenced,
    its transaction ended); the answers commit exactly once, including after a hung commit
    that went through (read back from the group's committed offsets)."""
    _short_deadlines(monkeypatch)
    release = hang_first_call(monkeypatch, publisher_module, method, after_real=after_real)
    queue, out = topics
    _fill(kafka, queue, 20)
    tracker = OffsetTracker()
    metadata = group_consumer.consumer_group_metadata()
    replaced: list[int] = []
    publisher = TransactionalPublisher(
        {**kafka.confluent(), "log_level": 2},
        transactional_id=f"t-{uuid.uuid4()}",
        queue_topic=queue,
        tracker=tracker,
        group_metadata=lambda: metadata,
        group_id=group_id,
        on_replaced=lambda: replaced.append(1),
    )
    publisher.start()
    try:
        _answer_each(publisher, tracker, _take(group_consumer, 20), out)
        assert publisher.flush(60), publisher.failure
        assert publisher.replaced == 1
        assert replaced == [1], "the replacement is reported (the agent counts it in metrics)"
    finally:
        publisher.close()
        release.set()
    assert "replacing the producer" in caplog.text
    if outcome != "did not commit":
        assert f"the hung commit {outcome}" in caplog.text
    values = _committed_values(kafka, out)
    assert sorted(values) == sorted(f"answer task {i}".encode() for i in range(20)), (
        "every answer committed exactly once"
    )
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(tp.offset for tp in committed) == 20, "every queue record's offset committed"


def test_a_hung_commit_without_a_group_to_read_back_stops_the_publisher(
    kafka: KafkaConnection,
    topics: tuple[str, str],
    group_consumer: Consumer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether the hung commit went through cannot be learned: the publisher stops rather
    than risk a second committed result (the agent exits; its successor resumes from the
    group's committed offsets)."""
    _short_deadlines(monkeypatch)
    release = hang_first_call(monkeypatch, publisher_module, "commit_transaction", after_real=False)
    queue, out = topics
    _fill(kafka, queue, 1)
    (message,) = _take(group_consumer, 1)
    tracker = OffsetTracker()
    publisher = _publisher(kafka, group_consumer, queue, tracker, f"t-{uuid.uuid4()}")
    publisher.start()
    try:
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        tracker.track(partition, offset)
        publisher.publish(Answer(out, None, b"answer", partition, offset))
        assert not publisher.flush(30)
        assert isinstance(publisher.failure, PublisherWedged)
        assert "commit_transaction did not return" in str(publisher.failure)
    finally:
        publisher.close()
        release.set()


def test_a_producer_hung_in_the_abort_of_a_refused_answer_is_replaced_and_the_rest_commit(
    kafka: KafkaConnection,
    topics: tuple[str, str],
    group_consumer: Consumer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer too large for the producer fails its transaction, whose abort hangs (the
    first producer's, stood in for: see tests/hung_calls.py): the producer is replaced,
    the answer quarantined, and the rest commit once."""
    _short_deadlines(monkeypatch)
    release = hang_first_call(monkeypatch, publisher_module, "abort_transaction", after_real=True)
    queue, out = topics
    _fill(kafka, queue, 10)
    tracker = OffsetTracker()
    refusals: list[tuple[Answer, Refusal]] = []
    publisher = _quarantining_publisher(
        kafka, group_consumer, queue, tracker, refusals, out, message_max_bytes=50_000
    )
    publisher.start()
    try:
        _answer_all(
            publisher,
            tracker,
            _take(group_consumer, 10),
            lambda i: (out, b"x" * 100_000) if i == 3 else (out, f"ok {i}".encode()),
        )
        assert publisher.flush(60), publisher.failure
        assert publisher.replaced == 1
    finally:
        publisher.close()
        release.set()
    assert len(refusals) == 1
    values = _committed_values(kafka, out)
    assert sorted(v for v in values if v.startswith(b"ok")) == sorted(
        f"ok {i}".encode() for i in range(10) if i != 3
    ), "every other answer committed exactly once"
    committed = group_consumer.committed(
        [TopicPartition(queue, 0), TopicPartition(queue, 1)], timeout=10
    )
    assert sum(max(tp.offset, 0) for tp in committed) == 10, "every offset settled"
