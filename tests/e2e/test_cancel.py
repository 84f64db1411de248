"""Remote cancel with every real part: SDK -> router -> agent -> worker, and back.

The session's shared platform (as `./fx up` starts it), plus a public endpoint of
this module's with one worker and no prefetch, so a second task waits in that
agent's local queue while the first runs. Side-effect files prove what ran; the
agent's committed queue offsets prove a cancel record was settled.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from fxstream.ops.private import PrivatePlatform
from fxstream.sdk import Client, ClientSettings, Executor
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    KafkaConnection,
    TaskCancel,
    TaskErrorType,
    TaskResult,
    decode,
    encode,
    record_kind,
)
from fxstream.topics.acls import endpoint_group
from tests.e2e.stack import added_endpoint, committed_records, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 60.0


@dataclass
class Stack:
    """The shared platform (:mod:`fxstream.ops.private`), its local endpoint and this
    module's one-worker endpoint."""

    private: PrivatePlatform
    single_endpoint: str

    @property
    def kafka(self) -> KafkaConnection:
        """How the tests' own clients connect (as the platform's admin)."""
        return self.private.kafka

    @property
    def catalogue(self) -> Catalogue:
        """The platform's topics."""
        return self.private.catalogue

    @property
    def settings(self) -> ClientSettings:
        """The platform user's client settings."""
        return self.private.settings

    @property
    def local_endpoint(self) -> str:
        """The platform's local endpoint."""
        return self.private.endpoint_id

    @property
    def admin_token(self) -> str:
        """The platform admin's API token (it creates users)."""
        return self.private.admin_token

    def client(self) -> Client:
        """A client of the platform's user (the caller closes it)."""
        return self.private.client()

    def records(self, topic: str, key: str) -> list[Message]:
        """Every committed record of ``topic`` with this key, read from the beginning."""
        return committed_records(self.kafka, topic, key)

    def wait_for_record(
        self, topic: str, key: str, predicate: Callable[[Message], bool]
    ) -> Message:
        """The first record of ``topic`` with ``key`` that matches, waiting up to a minute."""
        deadline = time.monotonic() + WAIT_S
        while True:
            matching = [m for m in self.records(topic, key) if predicate(m)]
            if matching:
                return matching[0]
            assert time.monotonic() < deadline, f"no matching record for {key} on {topic}"
            time.sleep(0.5)

    def results_of(self, task_id: str) -> list[TaskResult]:
        """Every committed result record of a task."""
        topic = self.catalogue.results(self.settings.user_id or "")
        return [decode(m.value(), TaskResult) for m in self.records(topic, task_id)]

    def wait_until_cancel_settled(self, endpoint_id: str, task_id: str) -> None:
        """Wait until the endpoint's group committed past the task's cancel record."""
        queue = self.catalogue.endpoint_queue(endpoint_id)
        cancel = self.wait_for_record(queue, task_id, lambda m: record_kind(m.value()) == "cancel")
        consumer = Consumer(
            {
                **self.kafka.confluent(),
                "group.id": endpoint_group(endpoint_id),
                "log_level": 2,
            }
        )
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                partition = TopicPartition(queue, cancel.partition() or 0)
                [committed] = consumer.committed([partition], timeout=10)
                if committed.offset > (cancel.offset() or 0):
                    return
                assert time.monotonic() < deadline, (
                    f"the cancel at offset {cancel.offset()} was never committed "
                    f"(committed: {committed.offset})"
                )
                time.sleep(0.2)
        finally:
            consumer.close()


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> Iterator[Stack]:
    """The session's shared platform (tests/conftest.py) and this module's one-worker
    endpoint, stopped after the module."""
    options = {"workers": 1, "prefetch": 0, "public": True}
    with added_endpoint(shared_platform, "cancel-single", **options) as single:
        yield Stack(shared_platform, single.endpoint_id)


@contextmanager
def executor_on(client: Client, endpoint_id: str) -> Iterator[Executor]:
    """An executor that never waits at exit: a failed test must not hang on its futures."""
    executor = Executor(endpoint_id=endpoint_id, client=client)
    try:
        yield executor
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def mark_then_sleep(path: str, seconds: float) -> int:
    """Write this worker's pid to ``path`` (proof the task ran), then sleep."""
    with open(path, "w") as out:
        out.write(str(os.getpid()))
    time.sleep(seconds)
    return os.getpid()


def double(x: int) -> int:
    return 2 * x


def wait_for_file(path: Path) -> int:
    """The pid a ``mark_then_sleep`` task wrote, once it has."""
    deadline = time.monotonic() + WAIT_S
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"the task never started ({path} missing)"
        time.sleep(0.05)
    return int(path.read_text())


def cancelled_result(stack: Stack, task_id: str) -> TaskResult:
    """The task's TaskCancelled result, once the agent has published it."""
    topic = stack.catalogue.results(stack.settings.user_id or "")
    message = stack.wait_for_record(
        topic,
        task_id,
        lambda m: (
            (error := decode(m.value(), TaskResult).error) is not None
            and error.type == TaskErrorType.CANCELLED
        ),
    )
    return decode(message.value(), TaskResult)


def test_a_queued_task_is_skipped_and_its_future_cancelled(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    try:
        with executor_on(client, stack.single_endpoint) as executor:
            running = executor.submit(mark_then_sleep, str(tmp_path / "first"), 3.0)
            wait_for_file(tmp_path / "first")  # the one worker is busy: the next task waits
            function_id = executor.register_function(mark_then_sleep)
            # run() returns once Kafka has the task: its cancel must go remote.
            queued_id = client.run(
                str(tmp_path / "never"),
                0.0,
                endpoint_id=stack.single_endpoint,
                function_id=function_id,
            )
            queued = client.future(queued_id)
            assert queued.cancel()
            assert queued.cancelled()
            after = executor.submit(double, 21)
            assert running.result(timeout=WAIT_S) > 0
            assert after.result(timeout=WAIT_S) == 42
        result = cancelled_result(stack, queued.task_id)
        assert result.error is not None and not result.error.retryable
        assert result.timings.started_at is None
        assert not (tmp_path / "never").exists(), "the cancelled task ran"
        assert len(stack.results_of(queued.task_id)) == 1
        stack.wait_until_cancel_settled(stack.single_endpoint, queued.task_id)
    finally:
        client.close()


def test_a_running_task_refuses_cancel_and_kill_stops_it(stack: Stack, tmp_path: Path) -> None:
    """concurrent.futures: an executing call cannot be cancelled (running() is true and
    cancel() False, and it runs on); killing it is Executor.kill."""
    client = stack.client()
    try:
        with executor_on(client, stack.single_endpoint) as executor:
            sleeper = executor.submit(mark_then_sleep, str(tmp_path / "sleeper"), 60.0)
            worker = wait_for_file(tmp_path / "sleeper")
            deadline = time.monotonic() + WAIT_S
            while not sleeper.running():
                assert time.monotonic() < deadline, "the future never reported running"
                assert not sleeper.done(), sleeper
                time.sleep(0.1)
            assert not sleeper.cancel()
            assert sleeper.running() and not sleeper.cancelled()
            time.sleep(1.0)
            assert psutil.pid_exists(worker), "cancel() of a running task killed it"
            cancelled_at = time.monotonic()
            assert executor.kill(sleeper)
            psutil.wait_procs([psutil.Process(worker)], timeout=10)
            killed_s = time.monotonic() - cancelled_at
            assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
            assert killed_s < 5, f"the worker took {killed_s:.1f} s to die"
            assert sleeper.cancelled()
            # The pool replaced the worker: the endpoint serves the next task.
            assert executor.submit(double, 5).result(timeout=WAIT_S) == 10
        result = cancelled_result(stack, sleeper.task_id)
        assert result.error is not None
        assert "was killed" in result.error.message
        assert not result.error.retryable
        stack.wait_until_cancel_settled(stack.single_endpoint, sleeper.task_id)
    finally:
        client.close()


def test_client_cancel_from_elsewhere_ends_the_submitters_future_cancelled(
    stack: Stack, tmp_path: Path
) -> None:
    submitter, other = stack.client(), stack.client()
    try:
        function_id = submitter.register_function(mark_then_sleep)
        task_id = submitter.run(
            str(tmp_path / "long"), 60.0, endpoint_id=stack.local_endpoint, function_id=function_id
        )
        wait_for_file(tmp_path / "long")
        # This client never saw the task: it asks the service for the task's endpoint.
        other.cancel(task_id, reason="stopped from another session")
        future = submitter.future(task_id)
        done, _ = concurrent.futures.wait([future], timeout=WAIT_S)
        assert done == {future}
        assert future.cancelled() and future.cancelled_remotely
        with pytest.raises(concurrent.futures.CancelledError):
            future.result()
        wait_for_state(submitter, task_id, "cancelled")
        result = cancelled_result(stack, task_id)
        assert result.error is not None and "was killed" in result.error.message
        # The task-state processor folded the TaskCancelled result: the service says so.
        deadline = time.monotonic() + WAIT_S
        while (state := other.get_task(task_id))["state"] != "cancelled":
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        # Asked of the service (not this client's task): Globus Compute's fields too.
        assert state["status"] == "cancelled" and state["pending"] is False
        assert isinstance(state["exception"], concurrent.futures.CancelledError)
        assert "result" not in state and state["completion_t"] is not None
        with pytest.raises(concurrent.futures.CancelledError):
            other.get_result(task_id)
    finally:
        submitter.close()
        other.close()


def test_cancelling_a_finished_task_changes_nothing(stack: Stack) -> None:
    client = stack.client()
    try:
        function_id = client.register_function(double)
        task_id = client.run(4, endpoint_id=stack.single_endpoint, function_id=function_id)
        assert client.future(task_id).result(timeout=WAIT_S) == 8
        client.cancel(task_id)
        stack.wait_until_cancel_settled(stack.single_endpoint, task_id)
        assert client.get_result(task_id) == 8
        assert [r.outcome for r in stack.results_of(task_id)] == ["success"]
        later = client.run(5, endpoint_id=stack.single_endpoint, function_id=function_id)
        assert client.future(later).result(timeout=WAIT_S) == 10
    finally:
        client.close()


def test_a_cancel_by_another_user_is_refused_and_dead_lettered(
    stack: Stack, tmp_path: Path
) -> None:
    owner = stack.client()
    mallory = other_user_client(stack.private, "mallory")
    try:
        function_id = owner.register_function(mark_then_sleep)
        task_id = owner.run(
            str(tmp_path / "owned"), 5.0, endpoint_id=stack.single_endpoint, function_id=function_id
        )
        wait_for_file(tmp_path / "owned")
        # Her own token on a public endpoint passes the router; the agent, which holds the
        # task and knows its submitter, refuses it.
        mallory.cancel(task_id, endpoint_id=stack.single_endpoint)
        assert owner.future(task_id).result(timeout=WAIT_S) > 0, "the task ran to its end"

        def refused(component: str) -> Callable[[Message], bool]:
            def matches(message: Message) -> bool:
                letter = decode(message.value(), DeadLetter)
                return letter.error_type == "CancelRefused" and letter.component == component

            return matches

        letter = decode(
            stack.wait_for_record(
                stack.catalogue.dead_letter,
                task_id,
                refused(f"agent {stack.single_endpoint}"),
            ).value(),
            DeadLetter,
        )
        assert "only its submitter may cancel it" in letter.reason
        assert record_kind(letter.original_value) == "cancel"
        # On her own topic (the only one she may write) with the owner's user id: the
        # router believes the topic, and dead-letters it before any queue.
        impostor = TaskCancel(
            task_id=task_id,
            user_id=stack.settings.user_id or "",
            endpoint_id=stack.single_endpoint,
            requested_at=time.time(),
        )
        # As her own principal (u.<mallory>): the broker lets her write only this topic.
        producer = Producer({**mallory.kafka.confluent(), "log_level": 2})
        producer.produce(
            stack.catalogue.from_user(mallory.user_id), key=task_id, value=encode(impostor)
        )
        assert producer.flush(10) == 0

        def mismatch(message: Message) -> bool:
            letter = decode(message.value(), DeadLetter)
            return letter.error_type == "IdentityMismatch" and letter.component == "router"

        letter = decode(
            stack.wait_for_record(stack.catalogue.dead_letter, task_id, mismatch).value(),
            DeadLetter,
        )
        assert f"names user {stack.settings.user_id!r}" in letter.reason
        assert [r.outcome for r in stack.results_of(task_id)] == ["success"]
    finally:
        owner.close()
        mallory.close()
