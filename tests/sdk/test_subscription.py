"""Result subscriptions (``Client.subscribe``) on real result records of the session broker.

The tests produce ``TaskResult`` records to the user's results topic themselves, as the
platform's ingress would (in transactions, one of them aborted), with values that leave a
mark when they are unpickled: a value the subscription must not load (another group's,
another user's) would leave its mark. The subscription of a trigger rule on a running
platform is tested in ``tests/triggers/test_result_subscription.py``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from fxstream.sdk import (
    Client,
    FxstreamError,
    SubscribedResult,
    SubscriptionClosed,
    TaskExecutionFailed,
)
from fxstream.sdk.subscription import since_timestamp
from fxstream.topics import KafkaConnection, TaskError, TaskResult, encode
from tests.sdk.conftest import SdkTopics
from tests.sdk.streams import ResultWriter, failure, success


def leave_mark(path: str) -> str:
    """What unpickling a :class:`Mark` runs: creates ``path``."""
    Path(path).write_text("loaded")
    return "marked"


class Mark:
    """A value whose unpickling creates a file (shows whether a record was loaded)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return leave_mark, (self.path,)


def grouped(result: TaskResult, group: str) -> TaskResult:
    """``result`` in task group ``group``."""
    return TaskResult(
        task_id=result.task_id,
        user_id=result.user_id,
        function_id=result.function_id,
        endpoint_id=result.endpoint_id,
        task_group_id=group,
        outcome=result.outcome,
        value=result.value,
        error=result.error,
        worker=result.worker,
        timings=result.timings,
    )


class TransactionalWriter:
    """Writes result records in transactions, as the ingress does; can abort one."""

    def __init__(self, kafka: KafkaConnection) -> None:
        self._producer = Producer(
            {
                **kafka.confluent(),
                "transactional.id": f"test-subscription-{uuid.uuid4()}",
                "log_level": 3,
            }
        )
        self._producer.init_transactions(30)

    def write(self, topic: str, results: list[TaskResult], *, abort: bool = False) -> None:
        """Produce ``results`` in one transaction, committed (or aborted)."""
        self._producer.begin_transaction()
        for result in results:
            self._producer.produce(topic, key=result.task_id, value=encode(result))
        self._producer.flush(30)
        if abort:
            self._producer.abort_transaction(30)
        else:
            self._producer.commit_transaction(30)


def drain(subscription: Any, quiet_s: float = 3.0) -> list[SubscribedResult]:
    """Every result the subscription hands over until none comes for ``quiet_s`` seconds."""
    got: list[SubscribedResult] = []
    while (result := subscription.get(timeout=quiet_s)) is not None:
        got.append(result)
    return got


@pytest.fixture
def writer(sdk_topics: SdkTopics) -> ResultWriter:
    """Produces result records to the module's broker (plain, acknowledged)."""
    return ResultWriter(sdk_topics.kafka)


@pytest.fixture
def client(sdk_topics: SdkTopics) -> Iterator[Client]:
    """A Client for the module's user, closed after the test."""
    with sdk_topics.client() as the_client:
        yield the_client


def test_a_group_subscription_gets_its_committed_results_once_and_loads_nothing_else(
    client: Client, sdk_topics: SdkTopics, writer: ResultWriter, tmp_path: Path
) -> None:
    group, other = f"g-{uuid.uuid4()}", f"g-{uuid.uuid4()}"
    user = sdk_topics.user_id
    topic = sdk_topics.results
    before = str(uuid.uuid4())
    writer.result(topic, grouped(success(before, user, "before"), group))

    subscription = client.subscribe(task_group_id=group)
    ids = [str(uuid.uuid4()) for _ in range(4)]
    ours_mark = tmp_path / "ours"
    error = TaskError(type="ZeroDivisionError", message="division by zero")
    cancelled = TaskError(type="TaskCancelled", message="cancelled by the user")
    transactions = TransactionalWriter(sdk_topics.kafka)
    transactions.write(
        topic,
        [
            grouped(success(ids[0], user, {"n": 0}), group),
            # Another group's and another user's values: never loaded.
            grouped(success(str(uuid.uuid4()), user, Mark(tmp_path / "other-group")), other),
            grouped(success(str(uuid.uuid4()), "someone-else", Mark(tmp_path / "foreign")), group),
            grouped(failure(ids[1], user, error), group),
        ],
    )
    # An aborted transaction: read_committed never shows it.
    aborted = str(uuid.uuid4())
    transactions.write(
        topic, [grouped(success(aborted, user, Mark(tmp_path / "aborted")), group)], abort=True
    )
    writer.write(topic, "junk", b"not a result record")
    writer.result(topic, grouped(success(ids[0], user, "a duplicate"), group))
    writer.result(topic, grouped(failure(ids[2], user, cancelled), group))
    writer.result(topic, grouped(success(ids[3], user, Mark(ours_mark)), group))

    got = drain(subscription)
    # Each once (order holds per partition only: a task's records share one).
    assert sorted(r.task_id for r in got) == sorted(ids) and len(got) == len(ids)
    by_id = {r.task_id: r for r in got}
    assert by_id[ids[0]].ok and by_id[ids[0]].result() == {"n": 0}
    assert by_id[ids[0]].task_group_id == group and by_id[ids[0]].worker == "testhost:1"
    assert by_id[ids[0]].timings["delivered"] is not None
    failed = by_id[ids[1]]
    assert not failed.ok and isinstance(failed.error, TaskExecutionFailed)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    assert by_id[ids[2]].cancelled
    with pytest.raises(CancelledError):
        by_id[ids[2]].result()
    assert by_id[ids[3]].result() == "marked"  # our own value is loaded...
    assert ours_mark.exists()
    # ... and nothing of another group, another user or an aborted transaction ever was.
    assert not (tmp_path / "other-group").exists()
    assert not (tmp_path / "foreign").exists()
    assert not (tmp_path / "aborted").exists()
    assert subscription.delivered == 4
    assert subscription.duplicates == 1
    assert subscription.skipped == 1
    assert subscription.foreign == 1
    assert subscription.malformed == 1
    subscription.close()
    with pytest.raises(SubscriptionClosed):
        subscription.get(timeout=0.1)
    assert list(subscription) == []


def test_a_late_subscription_replays_from_a_time_and_resumes_from_positions(
    client: Client, sdk_topics: SdkTopics, writer: ResultWriter
) -> None:
    group = f"g-{uuid.uuid4()}"
    user = sdk_topics.user_id
    started = time.time()
    ids = [str(uuid.uuid4()) for _ in range(6)]
    for i, task_id in enumerate(ids):
        writer.result(sdk_topics.results, grouped(success(task_id, user, i), group))

    with client.subscribe(task_group_id=group) as live:
        assert live.get(timeout=1.5) is None  # "now": what was written before is not replayed

    with client.subscribe(task_group_id=group, since=started - 1, buffer=1) as first:
        taken = [first.get(timeout=20) for _ in range(2)]
        positions = first.positions
    assert all(r is not None for r in taken)
    with client.subscribe(task_group_id=group, from_offsets=positions) as second:
        rest = drain(second)
    received = [r.task_id for r in taken if r is not None] + [r.task_id for r in rest]
    assert sorted(received) == sorted(ids)  # each once across the two subscriptions
    assert {r.value for r in rest} == {int(ids.index(r.task_id)) for r in rest}

    with client.subscribe(task_group_id=group, since=time.time() + 3600) as future_time:
        assert future_time.get(timeout=1.0) is None


def test_closing_the_client_ends_its_subscriptions(sdk_topics: SdkTopics) -> None:
    client = sdk_topics.client()
    subscription = client.subscribe(task_group_id=f"g-{uuid.uuid4()}")
    client.close()
    assert subscription.closed
    assert list(subscription) == []
    with pytest.raises(FxstreamError, match="closed"):
        client.subscribe(task_group_id="g-1")


def test_since_and_the_arguments_are_checked_before_anything_connects() -> None:
    assert since_timestamp("now") is None
    assert since_timestamp(12.5) == 12.5
    assert since_timestamp("created", 99.0) == 99.0
    for bad in ("yesterday", -1.0, True):
        with pytest.raises(ValueError, match="since"):
            since_timestamp(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rule_id"):
        since_timestamp("created")
    client = Client(
        "http://127.0.0.1:9", kafka=KafkaConnection(bootstrap="127.0.0.1:9"), user_id="u"
    )
    with pytest.raises(ValueError, match="exactly one"):
        client.subscribe()
    with pytest.raises(ValueError, match="exactly one"):
        client.subscribe(rule_id="r", task_group_id="g")
    with pytest.raises(ValueError, match="not an id"):
        client.subscribe(task_group_id="not/an id")
    result = SubscribedResult(
        task_id="t",
        task_group_id="g",
        function_id="f",
        endpoint_id="e",
        ok=False,
        value=None,
        error=KeyError("k"),
        cancelled=False,
        attempt=1,
        worker="",
        tags={},
        timings={},
        partition=0,
        offset=0,
    )
    with pytest.raises(KeyError):
        result.result()
