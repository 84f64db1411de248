"""The whole task path with every real part: SDK -> router -> agent -> warm worker -> future.

One platform for the module, started as `./fx up` starts it (broker, Redis, the
service API, the stream processors and a local endpoint, each its own process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from confluent_kafka import Consumer, Producer

from fxstream.ops.services import LOCAL_ENDPOINT
from fxstream.sdk import (
    Client,
    Executor,
    MPIFunction,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ShellFunction,
    TaskExecutionFailed,
    TaskRejected,
    WorkerLost,
)
from fxstream.topics import (
    DeadLetter,
    TaskDispatch,
    TaskEvent,
    TaskResult,
    TaskStateName,
    TaskSubmission,
    decode,
    read_routing_keys,
)
from tests.e2e.stack import Stack, committed_records, other_user_client, running_stack

pytestmark = pytest.mark.platform


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from running_stack(tmp_path_factory.mktemp("e2e"))


def double(x: int) -> int:
    return 2 * x


def divide(a: float, b: float) -> float:
    return a / b


def crash() -> None:
    os._exit(3)


def test_register_run_and_get_the_result_with_timings(stack: Stack) -> None:
    with stack.executor() as executor:
        future = executor.submit(double, 21)
        assert future.result(timeout=60) == 42
    timings = future.timings
    for hop in ("submitted", "routed", "dequeued", "started", "finished", "result_published"):
        assert timings[hop] is not None, hop
    assert timings["delivered"] is not None
    assert timings["submitted"] <= timings["routed"] <= timings["dequeued"]  # type: ignore[operator]


def test_map_over_a_thousand_inputs_keeps_order(stack: Stack) -> None:
    with stack.executor() as executor:
        assert list(executor.map(double, range(1_000), timeout=120)) == [
            2 * i for i in range(1_000)
        ]


def test_a_raising_function_reraises_with_the_remote_traceback(stack: Stack) -> None:
    with stack.executor() as executor:
        future = executor.submit(divide, 1, 0)
        with pytest.raises(TaskExecutionFailed) as info:
            future.result(timeout=60)
    assert isinstance(info.value, ZeroDivisionError)
    assert "ZeroDivisionError" in str(info.value)
    assert "return a / b" in str(info.value)


def test_a_shell_function_returns_output_and_walltime_gives_124(stack: Stack) -> None:
    with stack.executor() as executor:
        echo = executor.submit(ShellFunction("echo hello {name}"), name="fxstream")
        slow = executor.submit(ShellFunction("sleep 30", walltime=0.5))
        result = echo.result(timeout=60)
        assert result.returncode == 0
        assert "hello fxstream" in result.stdout
        assert slow.result(timeout=60).returncode == 124


def test_an_mpi_function_on_an_endpoint_without_mpi_is_refused_saying_what_to_do(
    stack: Stack,
) -> None:
    # The stack's endpoint runs the process engine: the agent refuses the task before
    # fetching its code (never retried); the task with no specification still runs there.
    with stack.executor() as executor:
        executor.resource_specification = {"num_nodes": 1, "ranks_per_node": 2}
        refused = executor.submit(MPIFunction("hostname"))
        with pytest.raises(TaskExecutionFailed, match=r"engine: htex and batch\.mpi") as info:
            refused.result(timeout=60)
        assert info.value.remote_type == "ResourcesUnavailable" and not info.value.retryable
        executor.resource_specification = None
        assert executor.submit(double, 4).result(timeout=60) == 8


def test_a_worker_that_dies_fails_only_its_task(stack: Stack) -> None:
    with stack.executor() as executor:
        lost = executor.submit(crash)
        fine = executor.submit(double, 5)
        with pytest.raises(WorkerLost, match=r"function"):
            lost.result(timeout=60)
        assert fine.result(timeout=60) == 10
        assert executor.submit(double, 6).result(timeout=60) == 12


def crash_first_time(marker: str, value: int) -> int:
    # The marker file outlives the worker, so the retry sees that it already crashed once.
    path = Path(marker)
    if not path.exists():
        path.write_text("crashed")
        os._exit(9)
    return value


def raise_first_time(marker: str, value: int) -> int:
    path = Path(marker)
    if not path.exists():
        path.write_text("raised")
        raise RuntimeError("transient failure")
    return value


def test_a_lost_worker_is_retried_up_to_max_retries(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    try:
        with Executor(endpoint_id=stack.endpoint_id, client=client, max_retries=2) as executor:
            recovered = executor.submit(crash_first_time, str(tmp_path / "once"), 7)
            doomed = executor.submit(crash)
            assert recovered.result(timeout=60) == 7
            assert recovered.attempt == 2
            with pytest.raises(WorkerLost) as info:
                doomed.result(timeout=60)
    finally:
        client.close()
    failure = info.value
    assert failure.attempt == 3
    assert [a.attempt for a in failure.earlier_attempts] == [1, 2]
    assert all(
        a.error is not None and a.error.type == "WorkerLost" for a in failure.earlier_attempts
    )
    assert "attempt 1 on" in str(failure) and "attempt 2 on" in str(failure)


def test_the_agent_answers_with_the_routers_stamp_which_the_platforms_key_verifies(
    stack: Stack, tmp_path: Path
) -> None:
    """The router stamps the dispatch with the key ./fx up made (0600, in credentials/); the
    agent copies the stamp into its retrying event and its result; the ingress forwards
    both (it holds the key, no view of task-state)."""
    keys_file = stack.home / "credentials" / "routing-keys.json"
    assert keys_file.stat().st_mode & 0o077 == 0
    keys = read_routing_keys(keys_file)
    client = stack.client()
    try:
        with Executor(endpoint_id=stack.endpoint_id, client=client, max_retries=1) as executor:
            future = executor.submit(crash_first_time, str(tmp_path / "once"), 5)
            assert future.result(timeout=60) == 5
        task_id, user_id = future.task_id, client.user_id
    finally:
        client.close()
    catalogue = stack.catalogue
    (dispatch,) = [
        decode(m.value(), TaskDispatch)
        for m in committed_records(
            stack.kafka, catalogue.endpoint_queue(stack.endpoint_id), task_id
        )
    ]
    submission_function = decode(dispatch.submission, TaskSubmission).function_id
    keys.verify(
        dispatch.routing_stamp,
        task_id=task_id,
        endpoint_id=stack.endpoint_id,
        user_id=user_id,
        function_id=submission_function,
    )
    (result,) = [
        decode(m.value(), TaskResult)
        for m in committed_records(stack.kafka, catalogue.results(user_id), task_id)
    ]
    assert result.routing_stamp == dispatch.routing_stamp and result.attempt == 2
    deadline = time.monotonic() + 30
    while True:  # the event goes on the agent's plain producer, a hint: it may trail
        events = [
            decode(m.value(), TaskEvent)
            for m in committed_records(stack.kafka, catalogue.task_events, task_id)
        ]
        retrying = [e for e in events if e.state is TaskStateName.RETRYING]
        if retrying or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert retrying, f"no retrying event forwarded; saw {[e.state for e in events]}"
    assert all(e.routing_stamp == dispatch.routing_stamp for e in retrying)


def test_user_errors_are_retried_only_when_asked(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    try:
        with (
            Executor(endpoint_id=stack.endpoint_id, client=client, max_retries=1) as plain,
            pytest.raises(RuntimeError, match="transient failure"),
        ):
            plain.submit(raise_first_time, str(tmp_path / "plain"), 1).result(timeout=60)
        with Executor(
            endpoint_id=stack.endpoint_id, client=client, max_retries=1, retry_user_errors=True
        ) as retrying:
            future = retrying.submit(raise_first_time, str(tmp_path / "retried"), 2)
            assert future.result(timeout=60) == 2
            assert future.attempt == 2
    finally:
        client.close()


def test_a_long_task_shows_running_while_its_agent_holds_it(stack: Stack) -> None:
    with stack.executor() as executor:
        future = executor.submit(ShellFunction("sleep 12"))
        task_id = future.task_id
        states: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "running" not in states:
            with contextlib.suppress(NotFound):  # until task-state has seen it
                states.append(executor.client.get_task(task_id)["state"])
            time.sleep(0.5)
        assert "running" in states, f"never running; seen {sorted(set(states))}"
        assert future.result(timeout=60).returncode == 0
        deadline = time.monotonic() + 30
        while executor.client.get_task(task_id)["state"] != "succeeded":
            assert time.monotonic() < deadline, "task-state never folded the result"
            time.sleep(0.2)


def test_unknown_function_is_rejected_with_a_clear_reason(stack: Stack) -> None:
    client = stack.client()
    try:
        unknown = str(uuid.uuid4())
        # The client asks the service for the code's digest first: nothing is sent.
        with pytest.raises(NotFound, match=unknown):
            client.run(endpoint_id=stack.endpoint_id, function_id=unknown)
        # Sent anyway, pinned to a made-up digest: the router refuses it.
        task = client.prepare_task(stack.endpoint_id, unknown, function_sha256="0" * 64)
        future = client.track(task)
        client.send([(task, future)])
        with pytest.raises(TaskRejected, match="does not exist or is not shared"):
            future.result(timeout=60)
    finally:
        client.close()


def test_another_users_private_function_is_refused(stack: Stack) -> None:
    owner = stack.client()
    intruder = other_user_client(stack, "mallory")
    try:
        private = owner.register_function(double)
        # The service does not even tell the intruder the code's digest (403, or 404) ...
        with pytest.raises((PermissionDenied, NotFound)):
            intruder.function_sha256(private)
        # ... and a task pinned to a guessed one is refused by the router.
        task = intruder.prepare_task(stack.endpoint_id, private, (3,), function_sha256="0" * 64)
        future = intruder.track(task)
        intruder.send([(task, future)])
        with pytest.raises(TaskRejected, match="not shared"):
            future.result(timeout=60)
    finally:
        owner.close()
        intruder.close()


def test_an_argument_too_large_names_the_setting(stack: Stack) -> None:
    # With the platform's store it would go by reference (tests/e2e/test_data_plane.py);
    # without one it must be refused, naming both ways out.
    settings = dataclasses.replace(stack.settings, store_url=None)
    with (
        Client.from_settings(settings) as client,
        Executor(endpoint_id=stack.endpoint_id, client=client) as executor,
        pytest.raises(PayloadTooLarge, match=r"FXSTREAM_MAX_INLINE_BYTES.*FXSTREAM_STORE_URL"),
    ):
        executor.submit(double, b"x" * 2_000_000).result(timeout=60)


def test_malformed_submissions_are_dead_lettered_and_routing_goes_on(stack: Stack) -> None:
    marker = uuid.uuid4().bytes
    producer = Producer({**stack.kafka.confluent(), "log_level": 2})
    user_id = stack.settings.user_id or ""
    producer.produce(stack.catalogue.from_user(user_id), key=b"garbage", value=marker)
    assert producer.flush(30) == 0
    with stack.executor() as executor:
        assert executor.submit(double, 8).result(timeout=60) == 16
    consumer = Consumer(
        {
            **stack.kafka.confluent(),
            "group.id": f"e2e-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "log_level": 2,
        }
    )
    consumer.subscribe([f"{stack.prefix}dead-letter"])
    letters: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(d.original_value == marker for d in letters):
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                letters.append(decode(message.value(), DeadLetter))
    finally:
        consumer.close()
    letter = next(d for d in letters if d.original_value == marker)
    assert letter.component == "router"
    assert letter.reason


def test_tasks_wait_for_a_stopped_endpoint_and_survive_an_agent_kill(stack: Stack) -> None:
    services = stack.platform.services()
    client = stack.client()
    try:
        function_id = client.register_function(double)
        assert services.endpoint.stop(timeout_s=60)
        # Kafka's shortest lease (its smallest session timeout), as the fault tests use: the
        # killed agent's partitions come back to its successor after 6 s, not the default 30.
        # This module's own platform keeps the setting for its later tests; none depends on it.
        config_file = services.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
        config = yaml.safe_load(config_file.read_text())
        config.update(lease_timeout_s=6.0, heartbeat_period_s=1.0)
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        task_ids = [
            client.run(i, endpoint_id=stack.endpoint_id, function_id=function_id)
            for i in range(200)
        ]
        time.sleep(1.0)
        assert not any(client.future(t).done() for t in task_ids), "nobody served them"
        services.endpoint.start()
        # Kill the agent mid-batch, without grace, then start it again.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(client.future(t).done() for t in task_ids):
            time.sleep(0.01)
        pid = services.endpoint.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(timeout=30)
        services.endpoint.start()
        results = [client.future(t).result(timeout=120) for t in task_ids]
        assert results == [2 * i for i in range(200)]
    finally:
        client.close()
        services.endpoint.start()


def nap(x: int) -> int:
    time.sleep(0.1)
    return x


def test_a_stopped_agent_hands_back_its_local_queue(stack: Stack) -> None:
    # The agent takes up to max_local_queue tasks off Kafka ahead of its 2 workers. A
    # graceful stop must not wait for those to run: it finishes what the workers hold,
    # leaves the rest uncommitted, and the next agent runs them, each exactly once.
    services = stack.platform.services()
    client = stack.client()
    try:
        function_id = client.register_function(nap)
        task_ids = [
            client.run(i, endpoint_id=stack.endpoint_id, function_id=function_id)
            for i in range(200)
        ]
        client.future(task_ids[0]).result(timeout=60)
        started = time.monotonic()
        assert services.endpoint.stop(timeout_s=60)
        stop_s = time.monotonic() - started
        unfinished = sum(not client.future(t).done() for t in task_ids)
        assert unfinished > 0, "the agent ran every task before it stopped: nothing to hand back"
        # 200 naps at 2 workers take 10 s; the pool holds at most 18 of them (0.9 s).
        assert stop_s < 6, f"stop took {stop_s:.1f} s: the local queue was run, not handed back"
        services.endpoint.start()
        results = [client.future(t).result(timeout=120) for t in task_ids]
        assert results == list(range(200))
        assert all(client.future(t).duplicates == 0 for t in task_ids)
    finally:
        client.close()
        services.endpoint.start()


def test_a_service_restart_keeps_the_registry(stack: Stack) -> None:
    services = stack.platform.services()
    client = stack.client()
    try:
        function_id = client.register_function(double, name="kept")
        assert services.api.stop(timeout_s=60)
        services.api.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.get_function(function_id)["name"] == "kept"
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert any(e["endpoint_id"] == stack.endpoint_id for e in client.list_endpoints())
    finally:
        client.close()


def test_status_reports_every_service_and_a_stopped_one(stack: Stack) -> None:
    status = stack.platform.status()
    assert status.healthy, status.to_json()
    names = {c.name for c in status.components}
    assert {"supervisor", "service api", "router", "ingress", "task-state", "liveness"} <= names
    assert "endpoint local" in names
    services = stack.platform.services()
    assert services.task_state.stop(timeout_s=60)
    try:
        stopped = stack.platform.status()
        assert not stopped.healthy
        task_state = next(c for c in stopped.components if c.name == "task-state")
        assert task_state.pid is None and task_state.detail == "not running"
        # Held stopped, not crashed: the supervisor leaves it stopped.
        time.sleep(2.0)
        assert services.task_state.pid() is None
    finally:
        services.task_state.start()


def test_a_service_process_killed_with_sigkill_is_restarted_and_status_json_shows_it(
    stack: Stack,
) -> None:
    services = stack.platform.services()
    before = services.router.state()
    assert before is not None
    pid = services.router.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while services.router.pid() in (None, pid):
        assert time.monotonic() < deadline, "the supervisor did not restart the router"
        time.sleep(0.1)
    # The real CLI, as an operator runs it.
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fxstream"), "status", "--json"],
        env={**os.environ, "FXSTREAM_HOME": str(stack.platform.config.home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    body = json.loads(done.stdout)
    router = next(c for c in body["components"] if c["name"] == "router")
    assert router["restarts"] == before.restarts + 1, router
    assert router["last_exit_code"] == -signal.SIGKILL, router
    assert router["pid"] not in (None, pid) and router["last_restart_at"] is not None
    assert not router["crash_looping"] and router["healthy"], router
    assert done.returncode == 0 and body["healthy"], done.stdout
    # And the restarted router routes.
    with stack.executor() as executor:
        assert executor.submit(double, 4).result(timeout=60) == 8


def test_the_quickstart_runs_and_reports_its_rate(stack: Stack) -> None:
    from rich.console import Console

    from fxstream.ops.quickstart import run_quickstart

    console = Console(record=True, width=120)
    rate = run_quickstart(console, stack.credentials, stack.endpoint_id, tasks=200)
    assert rate > 0
    text = console.export_text()
    assert "200 tasks in" in text
    assert "square(7) = 49" in text
