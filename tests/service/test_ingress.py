"""The ingress decides from what task-state held when a result arrived, never from less.

Found by the 1-hour soak (`./fx bench soak --rate 350`): once the machine was
saturated, the ingress's task-state view fell more than its 2 s catch-up budget
behind, and the ingress dead-lettered valid results as ``NotRoutedHere`` (808 in
four minutes): their tasks never completed. A lagging view must delay the
decision, not turn it into a refusal.

Here the lag is made certain, not raced for: the task's ``routed`` state is written
inside a transaction left open, so the (read_committed) view cannot read it until
the test commits. The real broker, topics and view; the ingress is driven directly.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic

from fxstream.service.ingress import Ingress
from fxstream.service.registry import RegistryView
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    decode,
    encode,
)
from tests.conftest import RunningPlatform
from tests.service.test_lifecycle import Record

# The view is waited for this long before the wait is logged as a lag (kept short here so
# the old behaviour, deciding when this budget ran out, would show within the test).
CATCH_UP_S = 0.05
HELD_OPEN_S = 1.5


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _result(task_id: str, user: str, function: str, endpoint: str) -> TaskResult:
    return TaskResult(
        task_id=task_id,
        user_id=user,
        function_id=function,
        endpoint_id=endpoint,
        outcome="success",
        value=b"a value",
        worker="host:1",
        timings=TaskTimings(submitted_at=time.time(), finished_at=time.time()),
    )


def test_a_result_waits_for_a_lagging_view_and_only_an_unrouted_one_is_refused(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    loop: asyncio.AbstractEventLoop,
) -> None:
    kafka = kafka_platform.kafka
    user, function, endpoint = (str(uuid.uuid4()) for _ in range(3))
    results = catalogue.results(user)
    admin = kafka_platform.admin()
    for future in admin.create_topics([NewTopic(results, 1, 1)]).values():
        future.result(timeout=30)  # deleted with the module's prefix
    view = RegistryView(kafka, catalogue, follow=("task-state",), component=None)
    ingress = Ingress(catalogue, view, TopicDirectory(kafka), catch_up_s=CATCH_UP_S)
    loop.run_until_complete(ingress.start())
    producer = Producer(
        {**kafka.confluent(), "transactional.id": f"test-ingress-{uuid.uuid4()}", "log_level": 2}
    )
    try:
        task_id = str(uuid.uuid4())
        routed = TaskState(
            task_id=task_id,
            user_id=user,
            function_id=function,
            endpoint_id=endpoint,
            state=TaskStateName.ROUTED,
            updated_at=time.time(),
            timings=TaskTimings(submitted_at=time.time(), routed_at=time.time()),
        )
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(catalogue.task_state, key=task_id.encode(), value=encode(routed))
        producer.flush(30)

        answer = Record(
            value=encode(_result(task_id, user, function, endpoint)),
            topic=catalogue.from_endpoint(endpoint),
            key=task_id.encode(),
        )
        planning = loop.create_task(ingress.plan([answer]))
        loop.run_until_complete(asyncio.sleep(HELD_OPEN_S))
        assert view.task(task_id) is None, "the view read an uncommitted state"
        assert not planning.done(), (
            f"the ingress decided after {HELD_OPEN_S} s from a view that had not read the "
            f"task's routed state; it wrote to {[o.topic for o in planning.result().first]}"
        )

        producer.commit_transaction(30)
        plan = loop.run_until_complete(asyncio.wait_for(planning, 30))
        assert [(o.topic, o.key) for o in plan.first] == [(results, task_id.encode())]
        assert ingress.stats.not_routed_here == 0

        # A result for a task nobody routed is still refused, and promptly: the view is
        # current, so one catch-up to the topic's end settles it.
        forged_id = str(uuid.uuid4())
        forged = Record(
            value=encode(_result(forged_id, user, function, endpoint)),
            topic=catalogue.from_endpoint(endpoint),
            key=forged_id.encode(),
        )
        began = time.monotonic()
        plan = loop.run_until_complete(asyncio.wait_for(ingress.plan([forged]), 30))
        assert time.monotonic() - began < 10
        (letter,) = plan.first
        assert letter.topic == catalogue.dead_letter
        dead = decode(letter.value, DeadLetter)
        assert dead.error_type == DeadLetterReason.NOT_ROUTED_HERE
        assert dead.task_id == forged_id
    finally:
        ingress.close()
