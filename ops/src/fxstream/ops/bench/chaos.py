"""Chaos: tasks through the 3-broker cluster while a killer SIGKILLs a random component.

``./fx bench chaos`` starts a private cluster platform (3 KRaft brokers with
replication 3 and ``min.insync.replicas=2``, Redis, the REST API, the stream
processors and the local endpoint with 2 warm workers) in a temporary home,
shortens the endpoint's lease to Kafka's smallest session timeout (6 s, so a
killed agent's partitions move on quickly), and then:

- a *submitter* keeps up to ``window`` tasks outstanding until ``tasks`` were
  submitted: mostly no-op tasks, a ``sleep_fraction`` of them sleeping a few
  milliseconds (so a kill lands on running work), each returning a value derived
  from its index, with ``max_retries=3``;
- a *killer* waits ``kill_interval_s``, picks a component at random (a warm
  worker, the agent, the stream processors that host the router, one broker),
  SIGKILLs it, and restarts it after ``downtime_s`` (a killed worker is replaced
  by the agent's pool itself). Before it kills a broker it waits until every
  partition is fully replicated again, so one kill never becomes two;
- the killer stops once every task was submitted and at most
  :data:`QUIET_TAIL` of them are outstanding (or nothing finished for
  :data:`STALL_S`); what is still not done ``deadline_s`` after the last restart
  is *lost*.

The ledger counts every future's done-callbacks and checks every value:
*duplicates delivered* is a future resolved more than once or with a wrong
value; *duplicates suppressed* is the SDK's own count of further results for a
task it had answered (``Client.duplicate_results``). Finally the user's results
topic is read back (``read_committed``) to count the committed result records
per task: *duplicates committed* is the number of tasks with more than one
(target 0, like *lost* and *duplicates delivered*). The last line of stdout is
the figures as one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console

from fxstream.ops.bench.stack import BenchError, progress, sigterm_as_exit
from fxstream.ops.config import PlatformConfig
from fxstream.ops.install import ensure_java
from fxstream.ops.kafka import KafkaNode, cluster_id_for, wait_for_cluster
from fxstream.ops.platform import ConnectionInfo, Platform
from fxstream.ops.process import free_port_block, free_ports
from fxstream.ops.services import LOCAL_ENDPOINT, Credentials, ServiceSet
from fxstream.ops.supervisor import SupervisedProcess
from fxstream.sdk import Client, Executor, TaskFuture
from fxstream.topics import KafkaConnection, TaskResult, decode

__all__ = [
    "COMPONENTS",
    "LEASE_S",
    "ChaosCluster",
    "ChaosLedger",
    "ChaosSettings",
    "Kill",
    "Killer",
    "chaos_task",
    "expected_value",
    "private_cluster",
    "read_result_counts",
    "read_topic",
    "run_chaos_bench",
]

# What the killer picks from.
COMPONENTS = ("worker", "agent", "router", "broker")
# Kafka's smallest consumer session timeout (group.min.session.timeout.ms): the lease
# of the chaos endpoint, so a killed agent's tasks are redelivered after 6 s, not 30 s.
LEASE_S = 6.0
HEARTBEAT_S = 2.0
# The killer stops once this fraction of the tasks (or fewer) is outstanding.
QUIET_TAIL = 0.05
# Nothing finished for this long while the killer runs: stop killing and settle.
STALL_S = 120.0
# The agent's warm workers are multiprocessing "spawn" children of the agent.
_WORKER_MARK = "multiprocessing.spawn"


def chaos_task(index: int, sleep_s: float = 0.0) -> int:
    """The chaos bench's task: sleep ``sleep_s`` (0 for a no-op), return a value of ``index``.

    The value differs for every index, so a result delivered to the wrong future shows.
    """
    if sleep_s > 0:
        time.sleep(sleep_s)
    return index * 7 + 3


def expected_value(index: int) -> int:
    """What :func:`chaos_task` returns for ``index``."""
    return index * 7 + 3


# --- the cluster and its components ----------------------------------------------------------


@dataclass
class ChaosCluster:
    """A running cluster platform with its services, and how to kill and restart each part."""

    platform: Platform
    connection: ConnectionInfo
    services: ServiceSet
    credentials: Credentials
    endpoint_id: str
    nodes: list[KafkaNode]

    @classmethod
    def start(cls, platform: Platform, step: Callable[[str], None] | None = None) -> ChaosCluster:
        """Start ``platform`` as a 3-broker cluster with its services; lease the endpoint short.

        The caller stops it with ``platform.down()``.
        """
        report = step or (lambda _text: None)
        connection = platform.up(cluster=True, services=True, step=report)
        services = platform.services()
        credentials = Credentials.load(services.credentials_file)
        endpoint_id = services.local_endpoint_id()
        if credentials is None or endpoint_id is None:
            raise BenchError("the cluster platform started without its user or local endpoint")
        report(f"restarting the local endpoint with a {LEASE_S:g} s lease")
        _shorten_lease(services)
        nodes = platform.nodes(cluster=True, java=ensure_java(), security=platform.security())
        return cls(platform, connection, services, credentials, endpoint_id, nodes)

    # --- clients -------------------------------------------------------------------------

    def client(self) -> Client:
        """A client of the local user; librdkafka's own log is kept to critical messages.

        (A killed broker makes every client log refused connections otherwise.)
        """
        return Client(
            self.credentials.service_url,
            kafka=self.credentials.kafka,
            topic_prefix=self.connection.topic_prefix,
            user_id=self.credentials.user_id,
            token=self.credentials.token,
            kafka_config={"log_level": 2},
        )

    @property
    def kafka(self) -> KafkaConnection:
        """How the chaos bench's own clients connect: as the platform's admin."""
        return self.platform.kafka(cluster=True)

    def admin(self) -> AdminClient:
        """An admin client on the cluster."""
        return AdminClient(
            {
                **self.kafka.confluent(),
                "socket.timeout.ms": 5000,
                "log_level": 0,
            }
        )

    @property
    def task_topics(self) -> list[str]:
        """The topics a task crosses before it runs: the user's from.user topic and the
        endpoint queue."""
        catalogue = self.connection.catalogue()
        return [
            catalogue.from_user(self.credentials.user_id),
            catalogue.endpoint_queue(self.endpoint_id),
        ]

    # --- brokers -------------------------------------------------------------------------

    def node(self, node_id: int) -> KafkaNode:
        """The node ``node_id``."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no Kafka node {node_id}")

    def partition_leaders(self, topics: Sequence[str]) -> Counter[int]:
        """How many partitions of ``topics`` each broker leads."""
        metadata = self.admin().list_topics(timeout=10)
        leaders: Counter[int] = Counter()
        for name in topics:
            topic = metadata.topics.get(name)
            if topic is None or topic.error is not None:
                raise BenchError(f"topic {name} is not in the cluster's metadata")
            for partition in topic.partitions.values():
                if partition.leader >= 0:
                    leaders[partition.leader] += 1
        return leaders

    def broker_leading(self, topics: Sequence[str]) -> KafkaNode:
        """The broker that leads the most partitions of ``topics``."""
        leaders = self.partition_leaders(topics)
        if not leaders:
            raise BenchError(f"no partition of {', '.join(topics)} has a leader")
        return self.node(leaders.most_common(1)[0][0])

    def group_coordinator(self, group_id: str) -> KafkaNode:
        """The broker coordinating consumer group ``group_id`` (its sessions and offsets)."""
        admin = self.admin()  # kept alive until the answer: its futures die with it
        future = admin.describe_consumer_groups([group_id], request_timeout=10)[group_id]
        return self.node(future.result(timeout=15).coordinator.id)

    def under_replicated(self) -> int:
        """Partitions (of every topic) whose in-sync replicas are fewer than their replicas."""
        metadata = self.admin().list_topics(timeout=10)
        return sum(
            1
            for topic in metadata.topics.values()
            for partition in topic.partitions.values()
            if len(partition.isrs) < len(partition.replicas)
        )

    def wait_fully_replicated(self, timeout_s: float = 120.0) -> bool:
        """Wait until no partition is under-replicated; False if that took too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(KafkaException):
                if self.under_replicated() == 0:
                    return True
            time.sleep(0.5)
        return False

    def kill_broker(self, node: KafkaNode) -> bool:
        """SIGKILL one broker (no clean shutdown); True if it was running."""
        return node.process.kill()

    def restart_broker(self, node: KafkaNode, timeout_s: float = 90.0) -> None:
        """Start a stopped broker again and wait until every broker is registered."""
        node.start(cluster_id_for(node.directory.parent))
        wait_for_cluster(self.nodes, self.platform.kafka(cluster=True), timeout_s=timeout_s)

    # --- the Python services -------------------------------------------------------------

    @property
    def agent(self) -> SupervisedProcess:
        """The local endpoint's agent process."""
        return self.services.endpoint

    @property
    def router(self) -> SupervisedProcess:
        """The router's process (supervised: a killed one is restarted with backoff)."""
        return self.services.router

    def workers(self) -> list[psutil.Process]:
        """The agent's warm worker processes (not multiprocessing's helpers)."""
        pid = self.agent.pid()
        if pid is None:
            return []
        found = []
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if any(_WORKER_MARK in part for part in child.cmdline()):
                        found.append(child)
        return found

    def kill_worker(self, chooser: random.Random) -> int | None:
        """SIGKILL one warm worker; its PID, or None if the agent has none right now."""
        workers = self.workers()
        if not workers:
            return None
        victim = chooser.choice(workers)
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            return None
        return victim.pid


def _shorten_lease(services: ServiceSet) -> None:
    """Give the local endpoint Kafka's shortest lease and restart it with it (and the
    librdkafka debug contexts ``FXSTREAM_CHAOS_KAFKA_DEBUG`` names for its queue consumer,
    to diagnose a fault run)."""
    path = services.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
    settings = yaml.safe_load(path.read_text())
    debug = os.environ.get("FXSTREAM_CHAOS_KAFKA_DEBUG", "")
    wanted = (LEASE_S, HEARTBEAT_S, debug)
    if (
        settings.get("lease_timeout_s"),
        settings.get("heartbeat_period_s"),
        settings.get("kafka_debug", ""),
    ) == wanted:
        return
    settings["lease_timeout_s"] = LEASE_S
    settings["heartbeat_period_s"] = HEARTBEAT_S
    if debug:
        settings["kafka_debug"] = debug
    else:
        settings.pop("kafka_debug", None)
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    path.chmod(0o600)
    services.endpoint.stop()
    services.endpoint.start()


def _private_cluster_config(home: Path) -> PlatformConfig:
    """A config in ``home`` on free ports whose processes die with this one."""
    kafka_port, controller_port, redis_port, service_port = free_ports(4)
    return PlatformConfig.load(
        env={},
        home=home,
        kafka_port=kafka_port,
        controller_port=controller_port,
        redis_port=redis_port,
        service_port=service_port,
        cluster_base_port=free_port_block(6),
        tie_to_caller=True,
    )


@contextlib.contextmanager
def private_cluster(console: Console) -> Iterator[ChaosCluster]:
    """A cluster platform of our own in a temporary home, every process stopped afterwards."""
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="fxstream-chaos-") as directory:
        platform = Platform(_private_cluster_config(Path(directory)))
        try:
            with console.status("[bold]starting a private 3-broker cluster platform") as status:
                cluster = ChaosCluster.start(
                    platform, step=lambda text: status.update(f"[bold]{text}")
                )
            console.print(
                f"private cluster at {cluster.connection.bootstrap_servers} (home {directory})"
            )
            yield cluster
        finally:
            with console.status("[bold]stopping the private cluster platform"):
                platform.down()


# --- the ledger ------------------------------------------------------------------------------


@dataclass
class ChaosLedger:
    """Every submitted future, how often it resolved, and whether with the right value."""

    futures: list[TaskFuture] = field(default_factory=list)
    resolutions: list[int] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    wrong_values: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, index: int, future: TaskFuture) -> None:
        """Track ``future``, the task of ``index`` (indices are added in order from 0)."""
        with self._lock:
            if index != len(self.futures):
                raise ValueError(f"task {index} added out of order")
            self.futures.append(future)
            self.resolutions.append(0)
        future.add_done_callback(lambda done: self._resolved(index, done))

    def _resolved(self, index: int, future: Any) -> None:
        with self._lock:
            self.resolutions[index] += 1
            if self.resolutions[index] > 1:
                return
            if future.cancelled():
                return
            error = future.exception()
            if error is not None:
                self.failed += 1
                self.errors[type(error).__name__] += 1
            elif future.result() != expected_value(index):
                self.wrong_values += 1
            else:
                self.completed += 1

    @property
    def submitted(self) -> int:
        """Tasks submitted so far."""
        with self._lock:
            return len(self.futures)

    @property
    def done(self) -> int:
        """Tasks resolved at least once."""
        with self._lock:
            return self.completed + self.failed + self.wrong_values

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not resolved yet."""
        with self._lock:
            return sum(1 for count in self.resolutions if count == 0)

    @property
    def resolved_more_than_once(self) -> int:
        """Futures whose done-callbacks ran more than once."""
        with self._lock:
            return sum(1 for count in self.resolutions if count > 1)

    @property
    def duplicates_delivered(self) -> int:
        """A future resolved more than once, or with a value not its own."""
        return self.resolved_more_than_once + self.wrong_values

    def outstanding_task_ids(self) -> list[str | None]:
        """The task ids of the futures not resolved yet (None: not sent yet), in order."""
        with self._lock:
            return [
                future.task_id
                for future, count in zip(self.futures, self.resolutions, strict=True)
                if count == 0
            ]

    def task_ids(self) -> list[str]:
        """Every submitted task id, in submission order."""
        with self._lock:
            return [future.task_id for future in self.futures]


# --- the killer ------------------------------------------------------------------------------


@dataclass
class Kill:
    """One kill: what, when (seconds into the run), and how long until it was back."""

    component: str
    at_s: float
    detail: str
    restarted_after_s: float | None = None


class Killer:
    """Kills a random component every ``interval_s`` and restarts it ``downtime_s`` later.

    Runs in its own thread between :meth:`start` and :meth:`stop`; one kill at a time.
    """

    def __init__(
        self,
        cluster: ChaosCluster,
        *,
        components: Sequence[str] = COMPONENTS,
        interval_s: float = 5.0,
        downtime_s: float = 1.0,
        seed: int | None = None,
        on_kill: Callable[[Kill], None] | None = None,
    ) -> None:
        unknown = set(components) - set(COMPONENTS)
        if unknown or not components:
            raise ValueError(
                f"components must be some of {', '.join(COMPONENTS)}, not {sorted(unknown)}"
            )
        self.cluster = cluster
        self.components = list(components)
        self.interval_s = interval_s
        self.downtime_s = downtime_s
        self.random = random.Random(seed)
        self.kills: list[Kill] = []
        self.failures: list[str] = []
        self.last_restart_at = time.monotonic()
        self._on_kill = on_kill
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._quiet = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fxstream-chaos-killer", daemon=True)

    def start(self) -> None:
        """Begin killing."""
        self._started = time.monotonic()
        self._thread.start()

    def stop(self, timeout_s: float = 180.0) -> None:
        """Stop killing, once the kill in hand is restarted."""
        self._stop.set()
        if self._thread.is_alive():
            self._quiet.wait(timeout_s)

    def release(self) -> None:
        """Let the killer thread end: only once the platform is no longer needed, since
        Linux sends a parent-death signal (``PR_SET_PDEATHSIG``, see ManagedProcess) when
        the *thread* that started a process exits, and this thread restarts processes."""
        self._stop.set()
        self._released.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def counts(self) -> dict[str, int]:
        """Kills per component."""
        counted = Counter(kill.component for kill in self.kills)
        return {component: counted[component] for component in self.components}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            component = self.random.choice(self.components)
            try:
                self.kill_and_restart(component)
            except Exception as exc:  # a failed restart is reported, and the next kill waits
                self.failures.append(f"{component}: {exc}")
                self.last_restart_at = time.monotonic()
        self._quiet.set()
        self._released.wait()

    def kill_and_restart(self, component: str) -> Kill | None:
        """Kill ``component`` now and bring it back; the kill, or None if nothing was killed."""
        cluster = self.cluster
        at = time.monotonic()
        if component == "worker":
            pid = cluster.kill_worker(self.random)
            if pid is None:
                return None
            kill = self._record(Kill(component, at - self._started, f"worker pid {pid}"))
            kill.restarted_after_s = 0.0  # the agent's pool starts the replacement
        elif component == "broker":
            # Never two brokers out of the ISR at once: wait for the last one to catch up.
            if not cluster.wait_fully_replicated():
                raise BenchError("partitions stayed under-replicated for 120 s")
            node = self.random.choice(cluster.nodes)
            if not cluster.kill_broker(node):
                return None
            kill = self._record(Kill(component, at - self._started, f"kafka node {node.node_id}"))
            self._down()
            cluster.restart_broker(node)
            kill.restarted_after_s = round(time.monotonic() - at, 2)
        else:
            process = cluster.agent if component == "agent" else cluster.router
            pid = process.pid()
            if not process.kill():
                return None
            kill = self._record(Kill(component, at - self._started, f"{process.name} pid {pid}"))
            self._down()
            process.start()
            kill.restarted_after_s = round(time.monotonic() - at, 2)
        self.last_restart_at = time.monotonic()
        return kill

    def _record(self, kill: Kill) -> Kill:
        kill.at_s = round(kill.at_s, 2)
        self.kills.append(kill)
        if self._on_kill is not None:
            self._on_kill(kill)
        return kill

    def _down(self) -> None:
        # Not interruptible by stop(): a killed component always comes back.
        time.sleep(self.downtime_s)


# --- reading the results topic back -----------------------------------------------------------


def read_topic(
    kafka: KafkaConnection,
    topic: str,
    *,
    isolation: str = "read_committed",
    timeout_s: float = 60.0,
) -> Iterator[Message]:
    """Every record of ``topic`` from its start to its end as of the call (an audit: no
    group offsets committed). Raises :class:`BenchError` if the end is not reached in
    ``timeout_s``."""
    consumer = Consumer(
        {
            **kafka.confluent(),
            "group.id": f"fxstream-audit-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            "log_level": 0,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        ends: dict[int, int] = {}
        for partition in metadata.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            if high > low:
                ends[partition] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.5):
                if message.error() is None:
                    yield message
            # Transaction markers and aborted records take offsets too: the consumer's
            # position, not the last record read, says whether a partition is read.
            for tp in consumer.position([TopicPartition(topic, p) for p in list(ends)]):
                if tp.offset >= ends[tp.partition]:
                    del ends[tp.partition]
        if ends:
            raise BenchError(f"could not read {topic} to its end in {timeout_s:.0f} s")
    finally:
        consumer.close()


def read_result_counts(
    cluster: ChaosCluster, task_ids: Sequence[str], timeout_s: float = 60.0
) -> Counter[str]:
    """Committed result records per task id on the user's results topic (``read_committed``).

    Only records of ``task_ids`` are counted; the topic is read from the start to its end.
    """
    wanted = set(task_ids)
    topic = cluster.connection.catalogue().results(cluster.credentials.user_id)
    counts: Counter[str] = Counter()
    for message in read_topic(cluster.kafka, topic, timeout_s=timeout_s):
        value = message.value()
        if value is not None:
            with contextlib.suppress(Exception):  # not a result: not ours to count
                result = decode(value, TaskResult)
                if result.task_id in wanted:
                    counts[result.task_id] += 1
    return counts


# --- the bench ---------------------------------------------------------------------------------


Figures = dict[str, Any]


@dataclass
class ChaosSettings:
    """What one chaos run does."""

    tasks: int = 50_000
    kill_interval_s: float = 5.0
    downtime_s: float = 1.0
    deadline_s: float = 120.0
    sleep_fraction: float = 0.1
    sleep_ms: tuple[int, int] = (5, 50)
    window: int = 5_000
    max_retries: int = 3
    components: tuple[str, ...] = COMPONENTS
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the option that cannot work."""
        if self.tasks < 1:
            raise ValueError("--tasks must be at least 1")
        if self.kill_interval_s <= 0 or self.downtime_s < 0 or self.deadline_s <= 0:
            raise ValueError("--kill-interval and --deadline must be positive, --downtime >= 0")
        if not 0 <= self.sleep_fraction <= 1:
            raise ValueError("--sleep-fraction must be between 0 and 1")
        if self.window < 1:
            raise ValueError("--window must be at least 1")
        unknown = set(self.components) - set(COMPONENTS)
        if unknown or not self.components:
            raise ValueError(f"--components must be some of {','.join(COMPONENTS)}")


def _submit_all(
    executor: Executor,
    ledger: ChaosLedger,
    settings: ChaosSettings,
    chooser: random.Random,
    stop: threading.Event,
) -> None:
    """Submit ``settings.tasks`` tasks, keeping at most ``settings.window`` outstanding."""
    low, high = settings.sleep_ms
    for index in range(settings.tasks):
        while ledger.outstanding >= settings.window and not stop.is_set():
            time.sleep(0.01)
        if stop.is_set():
            return
        sleep_s = (
            chooser.uniform(low, high) / 1000 if chooser.random() < settings.sleep_fraction else 0
        )
        ledger.add(index, executor.submit(chaos_task, index, sleep_s))


def _kills_text(killer: Killer) -> str:
    return ", ".join(f"{name} {count}" for name, count in killer.counts().items())


def run_chaos_bench(*, console: Console, settings: ChaosSettings) -> Figures:
    """Run the chaos bench on a private cluster; print the figures, last the JSON line.

    Every process started here is stopped before it returns.
    """
    settings.validate()
    chooser = random.Random(settings.seed)
    started = time.perf_counter()
    with private_cluster(console) as cluster:
        figures = _chaos_on(console, cluster, settings, chooser)
        if (
            figures["lost"]
            or figures["duplicates_delivered"]
            or figures["duplicates_committed"]
            or figures["kill_failures"]
        ):
            # The temporary home goes with the platform: keep its logs for the post-mortem.
            kept = Path(tempfile.mkdtemp(prefix="fxstream-chaos-logs-"))
            shutil.copytree(cluster.platform.config.home / "logs", kept / "logs")
            figures["logs"] = str(kept / "logs")
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print_figures(console, figures)
    print(json.dumps(figures), flush=True)
    return figures


def _chaos_on(
    console: Console, cluster: ChaosCluster, settings: ChaosSettings, chooser: random.Random
) -> Figures:
    ledger = ChaosLedger()
    client = cluster.client()
    executor = Executor(
        endpoint_id=cluster.endpoint_id, client=client, max_retries=settings.max_retries
    )
    stop_submitting = threading.Event()
    killer = Killer(
        cluster,
        components=settings.components,
        interval_s=settings.kill_interval_s,
        downtime_s=settings.downtime_s,
        seed=chooser.randrange(2**32),
        on_kill=lambda kill: console.log(
            f"killed {kill.component} ({kill.detail}) at {kill.at_s:.1f} s"
        ),
    )
    executor.register_function(chaos_task)
    submitter = threading.Thread(
        target=_submit_all,
        args=(executor, ledger, settings, chooser, stop_submitting),
        name="fxstream-chaos-submitter",
        daemon=True,
    )
    run_started = time.perf_counter()
    try:
        with progress(console) as display:
            bar = display.add_task("chaos: tasks done", total=settings.tasks)
            submitter.start()
            killer.start()
            _watch_chaos(display, bar, ledger, killer, settings)
            killer.stop()
            chaos_s = time.perf_counter() - run_started
            settle_deadline = killer.last_restart_at + settings.deadline_s
            while ledger.outstanding and time.monotonic() < settle_deadline:
                display.update(
                    bar,
                    completed=ledger.done,
                    description=f"settling (kills: {_kills_text(killer)})",
                )
                time.sleep(0.5)
            display.update(bar, completed=ledger.done, description="chaos: tasks done")
        tasks_s = time.perf_counter() - run_started
        stop_submitting.set()
        submitter.join(30)
        lost = ledger.outstanding
        suppressed = client.duplicate_results
        with console.status("[bold]reading the results topic back"):
            counts = read_result_counts(cluster, ledger.task_ids())
    finally:
        stop_submitting.set()
        killer.stop()
        executor.shutdown(wait=False, cancel_futures=True)
        client.close()
        killer.release()
    return {
        "bench": "chaos",
        "brokers": len(cluster.nodes),
        "replication_factor": cluster.connection.replication_factor,
        "min_insync_replicas": cluster.connection.min_insync_replicas,
        "tasks": settings.tasks,
        "submitted": ledger.submitted,
        "completed": ledger.completed,
        "lost": lost,
        "failed": ledger.failed,
        "errors": dict(ledger.errors),
        "duplicates_delivered": ledger.duplicates_delivered,
        "wrong_values": ledger.wrong_values,
        "duplicates_suppressed": suppressed,
        "duplicates_committed": sum(1 for n in counts.values() if n > 1),
        "results_on_topic": sum(counts.values()),
        "kills": killer.counts(),
        "kills_total": len(killer.kills),
        "kill_failures": killer.failures,
        "kill_interval_s": settings.kill_interval_s,
        "downtime_s": settings.downtime_s,
        "max_retries": settings.max_retries,
        "sleep_fraction": settings.sleep_fraction,
        "chaos_s": round(chaos_s, 1),
        "tasks_s": round(tasks_s, 1),
        "tasks_per_s": round(ledger.done / tasks_s) if tasks_s > 0 else 0,
    }


def _watch_chaos(
    display: Any, bar: Any, ledger: ChaosLedger, killer: Killer, settings: ChaosSettings
) -> None:
    """Show progress until the killer should stop: the quiet tail, or a stall."""
    last_done, since = -1, time.monotonic()
    tail = int(settings.tasks * QUIET_TAIL)
    while True:
        done = ledger.done
        display.update(bar, completed=done, description=f"chaos (kills: {_kills_text(killer)})")
        if ledger.submitted == settings.tasks and ledger.outstanding <= tail:
            return
        now = time.monotonic()
        if done != last_done:
            last_done, since = done, now
        elif now - since > STALL_S:
            return
        time.sleep(0.5)


def _print_figures(console: Console, figures: Figures) -> None:
    """The run's figures in words, with the targets (0 lost, 0 duplicates delivered or
    committed)."""

    def verdict(value: int) -> str:
        return f"[green]{value:,}[/green]" if value == 0 else f"[red]{value:,}[/red]"

    console.print(f"tasks submitted:        {figures['submitted']:,}")
    console.print(f"completed:              {figures['completed']:,}")
    console.print(f"lost:                   {verdict(figures['lost'])} (target 0)")
    console.print(f"failed:                 {figures['failed']:,} {figures['errors'] or ''}")
    console.print(f"duplicates delivered:   {verdict(figures['duplicates_delivered'])} (target 0)")
    console.print(
        f"duplicates committed:   {verdict(figures['duplicates_committed'])} (target 0: tasks "
        "with more than one committed result on the results topic)"
    )
    console.print(f"duplicates suppressed:  {figures['duplicates_suppressed']:,} (by the SDK)")
    console.print(f"results on the topic:   {figures['results_on_topic']:,}")
    kills = ", ".join(f"{name} {count}" for name, count in figures["kills"].items())
    console.print(f"kills:                  {figures['kills_total']} ({kills})")
    if figures.get("logs"):
        console.print(f"[red]logs kept in {figures['logs']}[/red]")
    if figures["kill_failures"]:
        console.print(f"[red]kills that failed:[/red] {figures['kill_failures']}")
    console.print(
        f"wall time:              {figures['wall_s']} s "
        f"(tasks {figures['tasks_s']} s, {figures['tasks_per_s']:,} tasks/s under chaos)"
    )
