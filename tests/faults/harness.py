"""What the fault-injection tests share: a service stack on the session broker, workloads, checks.

Each test gets its own :class:`FaultStack`: the REST API, the stream processors
and a local endpoint agent, started as the real ``fxstream-service`` and
``fxstream-endpoint`` processes (the same :class:`~fxstream.ops.services.ServiceSet`
``./fx up`` uses), on the session's broker under a topic prefix of its own, so
a test that kills something never disturbs another test's topics or processes.
Every process is stopped by PID when the test ends, pass or fail.

A :class:`Workload` submits a few thousand quick tasks with some slow ones
mixed in (so a kill lands while tasks are in flight), counts the done-callbacks
of every future, and :func:`check_exactly_once` proves the promise: every future
completed exactly once with the right value, the user's results topic holds
exactly one committed result per task, and the service's task-state says
``succeeded`` for each.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from fxstream.ops import ConnectionInfo, ManagedProcess
from fxstream.ops.private import private_config
from fxstream.ops.services import LOCAL_ENDPOINT, ServiceSet
from fxstream.sdk import Client, ClientSettings, Executor, TaskFuture
from fxstream.topics import (
    Catalogue,
    KafkaConnection,
    RecordDecodeError,
    TaskDispatch,
    TaskResult,
    decode,
    ensure_topics,
    write_secret_file,
)
from tests.conftest import RunningPlatform

__all__ = [
    "LEASE_S",
    "CommittedResult",
    "FaultStack",
    "RunReport",
    "Workload",
    "add_mixed",
    "check_exactly_once",
    "committed_results",
    "delete_stack_topics",
    "describe",
    "executor_on",
    "mixed_workload",
    "service_states",
    "start_fault_stack",
    "wait_until",
    "worker_processes",
]

# Kafka's smallest session timeout (group.min.session.timeout.ms): the agents' lease here.
LEASE_S = 6.0
# The agents' warm workers are multiprocessing "spawn" children of the agent.
_WORKER_MARK = "multiprocessing.spawn"


def wait_until(check: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


@dataclass
class FaultStack:
    """One test's running service, processors and agents, and how to reach them."""

    home: Path
    services: ServiceSet
    kafka: KafkaConnection
    catalogue: Catalogue
    credentials: Path
    endpoint_id: str
    extra_agents: list[ManagedProcess] = field(default_factory=list)

    def client(self) -> Client:
        """A client of the stack's user (the caller closes it)."""
        env = {"FXSTREAM_CREDENTIALS": str(self.credentials)}
        return Client.from_settings(ClientSettings.from_environment(env))

    def admin(self) -> AdminClient:
        """A fresh admin client on the stack's broker."""
        return AdminClient({**self.kafka.confluent(), "log_level": 2})

    def configure_agent(self, name: str, **settings: Any) -> None:
        """Write endpoint config ``name``: the local endpoint's, with ``settings`` changed.

        The copy serves the same endpoint id, so it joins the same consumer group.
        """
        source = self.services.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
        config: dict[str, Any] = yaml.safe_load(source.read_text())
        # The copy uses the local endpoint's credential (its own 0600 file, by path).
        config["credentials_file"] = str(source.parent / config["credentials_file"])
        config.update(settings, name=name)
        target = self.services.endpoints_dir / name / "config.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(config, sort_keys=False))
        target.chmod(0o600)

    def agent(self, name: str) -> ManagedProcess:
        """An agent process serving endpoint config ``name`` (stopped with the stack)."""
        process = ManagedProcess(
            name=f"endpoint {name}",
            argv=[*self.services.endpoint.argv[:-1], name],
            pid_file=self.home / "services" / f"agent-{name}.pid",
            log_file=self.home / "logs" / f"endpoint-{name}.log",
            env=self.services.endpoint.env,
            die_with_parent=True,
        )
        if all(a.pid_file != process.pid_file for a in self.extra_agents):
            self.extra_agents.append(process)
        return process

    def stop(self) -> None:
        """Stop every process of the stack by PID (a stopped one is continued first)."""
        processes = [*self.extra_agents, *reversed(self.services.processes())]
        for process in processes:
            pid = process.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        for process in self.extra_agents:
            process.stop(timeout_s=30)
        # The supervisor stops the service processes, by PID.
        self.services.stop(timeout_s=30)

    def restore(self) -> None:
        """Undo a test's faults: stop the extra agents; continue or restart the services."""
        for agent in self.extra_agents:
            pid = agent.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            agent.stop(timeout_s=30)
        self.extra_agents.clear()
        for process in self.services.processes():
            pid = process.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            else:
                process.start()
        wait_until(self._api_answers, timeout_s=60, what="the service API answers")

    def _api_answers(self) -> bool:
        try:
            with self.client() as client:
                client.whoami()
        except Exception:
            return False
        return True

    def log(self, process: ManagedProcess) -> str:
        """The process's log so far (for failure messages)."""
        try:
            return process.log_file.read_text(errors="replace")
        except OSError:
            return ""


def start_fault_stack(kafka_platform: RunningPlatform, home: Path) -> FaultStack:
    """Start API, processors and the local endpoint on the session broker, in ``home``."""
    config = private_config(home)
    prefix = f"f{uuid.uuid4().hex[:10]}."
    base = kafka_platform.connection
    connection = ConnectionInfo(
        mode=base.mode,
        bootstrap_servers=base.bootstrap_servers,
        redis_url=base.redis_url,
        topic_prefix=prefix,
        replication_factor=base.replication_factor,
        min_insync_replicas=base.min_insync_replicas,
        security=base.security,
        ca_file=base.ca_file,
    )
    # It holds the store URL with its password: owner-only, as the platform writes it.
    write_secret_file(home / "platform.json", (json.dumps(asdict(connection)) + "\n").encode())
    catalogue = connection.catalogue()
    report = ensure_topics(kafka_platform.admin(), catalogue)
    assert report.ok, report
    services = ServiceSet(config)
    stack = FaultStack(
        home=home,
        services=services,
        kafka=kafka_platform.kafka,
        catalogue=catalogue,
        credentials=services.credentials_file,
        endpoint_id="",
    )
    try:
        _, endpoint_id = services.start(kafka_platform.kafka, prefix)
    except BaseException:
        stack.stop()
        raise
    stack.endpoint_id = endpoint_id
    # A short lease, so a killed agent's partitions go to its successor in seconds (the
    # group waits for a dead member until its session times out), and frequent beats.
    stack.configure_agent(LOCAL_ENDPOINT, lease_timeout_s=LEASE_S, heartbeat_period_s=1.0)
    try:
        assert services.endpoint.stop(timeout_s=60)
        services.endpoint.start()
    except BaseException:
        stack.stop()
        raise
    return stack


def delete_stack_topics(admin: AdminClient, catalogue: Catalogue) -> None:
    """Delete every topic under the stack's prefix."""
    names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(catalogue.prefix)]
    if not names:
        return
    for future in admin.delete_topics(names, operation_timeout=30).values():
        with contextlib.suppress(Exception):  # already gone
            future.result(timeout=30)


# --- workloads ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Submitted futures, the value each must end with, and its done-callback count."""

    futures: list[TaskFuture] = field(default_factory=list)
    expected: list[Any] = field(default_factory=list)
    callbacks: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(
        self, executor: Executor, fn: Callable[..., Any], args: Sequence[Any], expected: Any
    ) -> TaskFuture:
        """Submit ``fn(*args)`` and remember that it must return ``expected``."""
        future = executor.submit(fn, *args)
        self.futures.append(future)
        self.expected.append(expected)
        future.add_done_callback(self._count)
        return future

    def _count(self, future: concurrent.futures.Future[Any]) -> None:
        assert isinstance(future, TaskFuture)
        with self._lock:
            self.callbacks[future.task_id] += 1

    @property
    def done(self) -> int:
        """How many futures are done."""
        with self._lock:
            return sum(1 for count in self.callbacks.values() if count)

    @property
    def task_ids(self) -> list[str]:
        """Every task id, in submission order."""
        return [f.task_id for f in self.futures]

    def wait_for_progress(self, fraction: float, *, timeout_s: float = 120.0) -> None:
        """Wait until ``fraction`` of the futures are done (a kill then lands mid-run)."""
        wanted = max(1, int(len(self.futures) * fraction))
        wait_until(
            lambda: self.done >= wanted,
            timeout_s=timeout_s,
            what=f"{wanted} of {len(self.futures)} tasks done (have {self.done})",
        )


def add_mixed(
    workload: Workload,
    executor: Executor,
    quick: Callable[[int], int],
    slow: Callable[[int, float], int],
    inputs: range,
    *,
    slow_every: int = 50,
    slow_s: Sequence[float] = (0.2, 0.5, 0.8),
) -> None:
    """Submit ``quick(i)`` for each ``i`` of ``inputs``, ``slow(i, nap)`` for every
    ``slow_every``-th one; each must return ``2 * i``."""
    for i in inputs:
        if i % slow_every == slow_every - 1:
            nap = slow_s[(i // slow_every) % len(slow_s)]
            workload.submit(executor, slow, (i, nap), 2 * i)
        else:
            workload.submit(executor, quick, (i,), 2 * i)


def mixed_workload(
    executor: Executor,
    quick: Callable[[int], int],
    slow: Callable[[int, float], int],
    *,
    count: int = 2_000,
    slow_every: int = 50,
) -> Workload:
    """``count`` tasks, one in ``slow_every`` of them slow (see :func:`add_mixed`)."""
    workload = Workload()
    add_mixed(workload, executor, quick, slow, range(count), slow_every=slow_every)
    return workload


# --- the checks --------------------------------------------------------------------------


@dataclass(frozen=True)
class CommittedResult:
    """One committed record of ``results.<user>``: where it is, which attempt, which worker."""

    partition: int
    offset: int
    attempt: int
    worker: str
    result: TaskResult


def committed_results(
    stack: FaultStack, client: Client, task_ids: Sequence[str], *, timeout_s: float = 60.0
) -> dict[str, list[CommittedResult]]:
    """The committed results ``results.<user>`` holds for each task of ``task_ids``.

    Read from the beginning with ``read_committed`` (as every results reader does),
    on past the end offsets taken once every task has a result, so a duplicate
    committed before then is counted too.
    """
    topic = stack.catalogue.results(client.user_id)
    consumer = Consumer(
        {
            **stack.kafka.confluent(),
            "group.id": f"faults-check-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "log_level": 2,
        }
    )
    wanted = set(task_ids)
    counts: dict[str, list[CommittedResult]] = {}
    try:
        partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout_s
        ends: dict[int, int] | None = None
        # Where each partition last reported its end (offsets past transaction markers).
        eof_at: dict[int, int] = {}
        while ends is None or any(eof_at.get(p, -1) < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                missing = len(wanted - set(counts))
                raise AssertionError(
                    f"results.<user> not read to its end within {timeout_s:.0f} s "
                    f"({missing} tasks without a committed result)"
                )
            if ends is None and wanted <= set(counts):
                ends = {
                    p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                    for p in partitions
                }
            for message in consumer.consume(500, timeout=0.2):
                error = message.error()
                partition = message.partition()
                assert partition is not None
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    eof_at[partition] = message.offset() or 0
                    continue
                result = decode(message.value(), TaskResult)
                if result.task_id in wanted:
                    offset = message.offset()
                    assert offset is not None
                    counts.setdefault(result.task_id, []).append(
                        CommittedResult(partition, offset, result.attempt, result.worker, result)
                    )
        return counts
    finally:
        consumer.close()


def service_states(
    client: Client, task_ids: Sequence[str], *, timeout_s: float = 90.0
) -> dict[str, str]:
    """Each task's lifecycle state as the service's API reports it, once none is
    pending (bounded). ``client`` must hold no futures of these tasks (a client that
    ran them answers from its own futures): :meth:`FaultStack.client` gives a fresh one.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answers = client.get_batch_result(task_ids)
        except Exception:  # the API may still be starting after a restart
            answers = {}
        states = {t: str(answers.get(t, {}).get("state")) for t in task_ids}
        pending = [t for t in task_ids if answers.get(t, {"pending": True}).get("pending")]
        if not pending:
            return states
        if time.monotonic() > deadline:
            sample = Counter(states.values()).most_common()
            raise AssertionError(
                f"{len(pending)} of {len(task_ids)} tasks still pending in the service's "
                f"task-state after {timeout_s:.0f} s; states: {sample}"
            )
        time.sleep(1.0)


@dataclass(frozen=True)
class RunReport:
    """What :func:`check_exactly_once` found beyond its assertions."""

    committed: dict[str, list[CommittedResult]]
    # Tasks with more than one committed result on results.<user> (the SDK keeps the first).
    committed_twice: dict[str, list[CommittedResult]]
    # Further results the SDK's listener received and dropped.
    suppressed_by_sdk: int


def check_exactly_once(
    stack: FaultStack, client: Client, workload: Workload, *, timeout_s: float = 180.0
) -> RunReport:
    """Assert the promise: every future done exactly once with its value, none lost.

    Checks that each future completed (within ``timeout_s``) with the value it
    must have, that its done-callbacks ran exactly once, that results.<user>
    holds a committed result for every task, and that the service's task-state
    says ``succeeded`` for every task. Tasks with more than one committed result
    are returned, not asserted: whether that may happen depends on the fault.
    """
    _, not_done = concurrent.futures.wait(workload.futures, timeout=timeout_s)
    assert not not_done, f"{len(not_done)} of {len(workload.futures)} futures never completed"
    failed = [f for f in workload.futures if f.exception(timeout=0) is not None]
    assert not failed, (
        f"{len(failed)} futures failed, e.g. {failed[0].exception(timeout=0)!r}" if failed else ""
    )
    values = [f.result(timeout=0) for f in workload.futures]
    wrong = [
        (i, got, want)
        for i, (got, want) in enumerate(zip(values, workload.expected, strict=True))
        if got != want
    ]
    assert not wrong, f"{len(wrong)} wrong values, e.g. (index, got, expected) {wrong[:5]}"
    # A done-callback runs just after its waiters are woken: give the last ones a moment.
    wait_until(
        lambda: sum(workload.callbacks.values()) >= len(workload.futures),
        timeout_s=10,
        what="every done-callback ran",
    )
    once = Counter(workload.callbacks[t] for t in workload.task_ids)
    assert once == Counter({1: len(workload.futures)}), f"done-callbacks per future: {once}"
    committed = committed_results(stack, client, workload.task_ids)
    lost = [t for t in workload.task_ids if not committed.get(t)]
    assert not lost, f"{len(lost)} tasks have no committed result on results.<user>"
    with stack.client() as asker:  # holds no futures: the service answers
        states = service_states(asker, workload.task_ids)
    assert Counter(states.values()) == Counter({"succeeded": len(workload.futures)}), Counter(
        states.values()
    )
    twice = {t: records for t, records in committed.items() if len(records) > 1}
    return RunReport(committed, twice, client.duplicate_results)


def describe(records: Sequence[CommittedResult]) -> str:
    """One task's committed results, for a failure message."""
    return "; ".join(
        f"p{r.partition}@{r.offset} attempt {r.attempt} worker {r.worker} "
        f"published {r.result.timings.result_published_at}"
        for r in records
    )


# --- processes -----------------------------------------------------------------------------


def worker_processes(agent_pid: int) -> list[psutil.Process]:
    """The warm worker processes of the agent ``agent_pid`` (not multiprocessing's helpers)."""
    workers = []
    for child in psutil.Process(agent_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(_WORKER_MARK in part for part in child.cmdline()):
                workers.append(child)
    return workers


@contextlib.contextmanager
def executor_on(stack: FaultStack, client: Client, **options: Any) -> Iterator[Executor]:
    """An Executor on the stack's endpoint; unfinished futures are cancelled on the way out."""
    executor = Executor(endpoint_id=stack.endpoint_id, client=client, **options)
    try:
        yield executor
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def dispatch_counts(stack: FaultStack, task_ids: Sequence[str]) -> Counter[str]:
    """How many committed dispatches the endpoint queue holds for each of ``task_ids``
    (the router's own output: more than one means the router routed a task twice)."""
    topic = stack.catalogue.endpoint_queue(stack.endpoint_id)
    consumer = Consumer(
        {
            **stack.kafka.confluent(),
            "group.id": f"faults-dispatches-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "log_level": 2,
        }
    )
    wanted = set(task_ids)
    counts: Counter[str] = Counter()
    try:
        partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
        deadline = time.monotonic() + 60
        # Where each partition last reported its end (past any transaction marker).
        eof_at = dict.fromkeys(partitions, -1)
        while any(eof_at[p] < ends[p] for p in partitions):
            assert time.monotonic() < deadline, "the endpoint queue was not read to its end"
            for message in consumer.consume(500, timeout=0.2):
                partition = message.partition()
                assert partition is not None
                if message.error() is not None:
                    eof_at[partition] = message.offset() or 0
                    continue
                with contextlib.suppress(RecordDecodeError):  # a cancel, not a dispatch
                    dispatch = decode(message.value(), TaskDispatch)
                    if dispatch.task_id in wanted:
                        counts[dispatch.task_id] += 1
        return counts
    finally:
        consumer.close()
