"""Client.reload_task_group against the real service (run in-process) and the real broker.

Task states are written to the task-state topic, and results to the user's
results topic, by the test, as the processors and an agent would; a group of
more than one page of tasks in every state is reloaded.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import CancelledError

import pytest
import uvicorn
from confluent_kafka import Producer

from fxstream.ops.process import free_ports
from fxstream.sdk import Client, NotFound, TaskExecutionFailed, TaskRejected
from fxstream.service.api import MAX_GROUP_PAGE, create_app
from fxstream.topics import (
    Attempt,
    Catalogue,
    Serializer,
    TaskError,
    TaskState,
    TaskStateName,
    TaskTimings,
    encode,
    ensure_topics,
)
from tests.conftest import RunningPlatform
from tests.sdk.streams import success
from tests.sdk.test_rest import Service


@pytest.fixture(scope="module")
def service(kafka_platform: RunningPlatform) -> Iterator[Service]:
    """The REST service on a prefix of this module's own."""
    kafka = kafka_platform.kafka
    catalogue = Catalogue(prefix=f"t{uuid.uuid4().hex[:10]}.")
    admin = kafka_platform.admin()
    ensure_topics(admin, catalogue)
    config = uvicorn.Config(
        create_app(kafka, catalogue),
        host="127.0.0.1",
        port=free_ports(1)[0],
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "the service did not start (see its log above)"
        assert time.monotonic() < deadline, "the service did not start in 60 s"
        time.sleep(0.05)
    try:
        yield Service(f"http://127.0.0.1:{config.port}", kafka, catalogue)
    finally:
        server.should_exit = True
        thread.join(30)
        ours = [t for t in admin.list_topics(timeout=10).topics if t.startswith(catalogue.prefix)]
        for future in admin.delete_topics(ours, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                continue


def state_of(
    task_id: str,
    user_id: str,
    group: str,
    name: TaskStateName,
    *,
    value: object = None,
    error: TaskError | None = None,
    attempts: list[Attempt] | None = None,
) -> TaskState:
    """A task-state record as the processors write it."""
    now = time.time()
    return TaskState(
        task_id=task_id,
        user_id=user_id,
        function_id="f-1",
        endpoint_id="ep-1",
        task_group_id=group,
        state=name,
        updated_at=now,
        timings=TaskTimings(submitted_at=now - 5, routed_at=now - 4),
        error=error,
        attempts=attempts or [],
        value=None if value is None else Serializer().serialize_value(value),
    )


def test_a_group_of_every_state_over_several_pages_is_reloaded(service: Service) -> None:
    user = Client.register_user(service.url, "replayer")
    client = service.client(user)
    group = str(uuid.uuid4())
    producer = Producer({**service.kafka.confluent(), "acks": "all", "log_level": 2})
    results = service.catalogue.results(user.user_id)
    try:
        succeeded = {str(uuid.uuid4()): i for i in range(MAX_GROUP_PAGE + 205)}
        failed, rejected, cancelled = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
        running, lagging = str(uuid.uuid4()), str(uuid.uuid4())
        states = [
            state_of(task_id, user.user_id, group, TaskStateName.SUCCEEDED, value=i)
            for task_id, i in succeeded.items()
        ]
        states += [
            state_of(
                failed,
                user.user_id,
                group,
                TaskStateName.FAILED,
                error=TaskError(type="ZeroDivisionError", message="division by zero"),
                attempts=[
                    Attempt(
                        attempt=1,
                        worker="lost-host:1",
                        error=TaskError(type="WorkerLost", message="worker died"),
                    ),
                    Attempt(
                        attempt=2,
                        worker="host:2",
                        error=TaskError(type="ZeroDivisionError", message="division by zero"),
                    ),
                ],
            ),
            state_of(
                rejected,
                user.user_id,
                group,
                TaskStateName.REJECTED,
                error=TaskError(type="TaskRejected", message="function not shared"),
            ),
            state_of(cancelled, user.user_id, group, TaskStateName.CANCELLED),
            state_of(running, user.user_id, group, TaskStateName.RUNNING),
            state_of(lagging, user.user_id, group, TaskStateName.ROUTED),
        ]
        for record in states:
            producer.produce(service.catalogue.task_state, key=record.task_id, value=encode(record))
        # Its result is on the topic, but task-state still says routed (the processor lags).
        producer.produce(
            results, key=lagging, value=encode(success(lagging, user.user_id, "read back"))
        )
        assert producer.flush(30) == 0
        with pytest.raises(NotFound, match="router"):
            client.get_taskgroup_tasks(str(uuid.uuid4()))
        deadline = time.monotonic() + 60
        while len(client.get_taskgroup_tasks(group)) < len(states):
            assert time.monotonic() < deadline, "the service did not list the whole group"
            time.sleep(0.2)

        futures = client.reload_task_group(group)
        by_id = {f.task_id: f for f in futures}
        assert len(futures) == len(by_id) == len(states)
        assert all(by_id[t].result(timeout=0) == i for t, i in succeeded.items())
        with pytest.raises(ZeroDivisionError):
            by_id[failed].result(timeout=0)
        failure = by_id[failed].exception(timeout=0)
        assert isinstance(failure, TaskExecutionFailed)
        assert [a.worker for a in failure.earlier_attempts] == ["lost-host:1"]
        assert by_id[failed].attempt == 2
        with pytest.raises(TaskRejected, match="not shared"):
            by_id[rejected].result(timeout=0)
        with pytest.raises(CancelledError):
            by_id[cancelled].result(timeout=0)
        assert by_id[lagging].result(timeout=0) == "read back"
        assert not by_id[running].done()

        producer.produce(results, key=running, value=encode(success(running, user.user_id, 7)))
        assert producer.flush(30) == 0
        assert by_id[running].result(timeout=30) == 7
        stats = client.result_stats
        assert stats["delivered"] == len(states)
        assert stats["duplicates"] == 0
    finally:
        client.close()
