"""The service at scale: many endpoints heartbeating, a large backlog of queued tasks.

Issue 16's target: 10,000 endpoints heartbeating every 5 s and 1,000,000 queued tasks,
with the service within 1 GB of RSS and an endpoint's status reflecting its last
heartbeat within 2 s at p99. A secure private platform (SASL_SSL/SCRAM Kafka with ACLs,
Redis, the REST API, the stream processors and the local endpoint) runs in a temporary
home; then:

1. **Registration.** ``endpoints`` endpoints owned by the platform's local user are
   registered as ``POST /v1/endpoints`` registers one: their Kafka principal ``ep.<E>``
   with its ACLs and SCRAM credential and their two topics (``tasks.ep.<E>``,
   ``from.ep.<E>``), through :meth:`AccountManager.create_endpoint_principals`, then
   their :class:`~fxstream.topics.EndpointRecord` on ``endpoints``. *Shortcut:* the
   bench calls the account manager as the platform admin in batches instead of the REST
   route, whose per-user rate limit (20 at once, 100 an hour) exists to stop exactly
   this many registrations; the records it writes are the ones the route writes.
2. **Heartbeats.** One simulator process (confluent-kafka, one producer) sends every
   endpoint's :class:`~fxstream.topics.Heartbeat` every ``period_s`` (phases spread
   evenly over the period) on that endpoint's ``from.ep.<E>``, keyed by the endpoint,
   as an agent does (:mod:`fxstream.agent.heartbeat`): sequence numbers, the period, an
   idle engine's counts, ``sent_at`` = the time it is produced; and, with its first
   beat, the empty warm advert an idle agent sends. The ingress checks each, forwards
   it to ``heartbeats``, and the liveness processor, the router's and the API's views
   fold it. *Shortcut:* the simulator produces as the platform admin, not as each
   endpoint's ``ep.<E>``: 10,000 SCRAM logins would take 10,000 producers (each with
   its connections and threads) in one process. The broker still authorises every
   write (the admin may write any topic), and the ingress's checks (the heartbeat names
   the endpoint whose topic it is on, under that endpoint's key) are unchanged. The
   simulated endpoints never consume: no task is ever pulled.
3. **Queued tasks.** ``tasks`` no-op tasks go through the SDK's batch path
   (``Client.create_batch`` / ``batch_run``, ``batch`` tasks per call) to
   ``task_endpoints`` of the simulated endpoints in turn; the router routes each one to
   its endpoint's queue. A fresh client every :data:`_TASKS_PER_CLIENT` tasks keeps
   the bench's own memory bounded (a client keeps the future of every unfinished task).
   The backlog is then *counted*: a read_committed consumer reads every dispatch record
   on those queues (without committing, so they stay queued) until it has them all
   (``queued_tasks``).
4. **A steady window** of ``minutes`` with everything in place.

Measured throughout, from the start of the heartbeats to the end of the window:

- **Status lag.** A prober process (its own, so the bench's CPU cannot delay it) asks
  the API for the status of ``sample_endpoints`` of the endpoints in turn
  (``Client.get_endpoint_status``, i.e. ``GET /v1/endpoints/{id}``); each time an
  endpoint's ``last_seen`` changes, the lag is the time the change was seen minus that
  heartbeat's ``sent_at``. A change is seen at most one probe cycle late
  (``probe_cycle_s``), so the figures are upper bounds within that resolution. Lags are
  reported overall (``status_lag_p50_s`` / ``status_lag_p99_s``) and per phase (while
  the tasks are queued and routed; the steady window).
- **Service RSS.** Every ``interval_s`` the RSS of each service process (the REST API,
  every stream processor, their supervisor, with any children) is sampled;
  ``service_rss_mb`` is the largest sum seen. The broker, Redis and the local endpoint
  (an agent, not the service) are reported beside it, not counted. Each process's CPU
  seconds over the same time (``cpu_s``) say which one falls behind.
- **Client costs.** After the run, :func:`~fxstream.ops.bench.client_costs.client_costs`
  times aiokafka's metadata refresh and fetch round (the ingress's consumer) at this
  many endpoints and at 10,000 (``client_costs``), and what a pattern subscription's
  refresh of every topic cost before.

Every endpoint adds 5 partitions to the broker (``tasks.ep`` 4, ``from.ep`` 1), which
keeps a file open and two index files mapped for each: the bench raises its own
open-file limit, which the platform inherits, when it may (``open_files_limit``).

The printed table lists the figures and the per-process peaks; the last line is one
JSON object.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import random
import resource
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import psutil
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.client_costs import FROM_EP_PARTITIONS, QUEUE_PARTITIONS, client_costs
from fxstream.ops.bench.stack import (
    IDLE_TIMEOUT_S,
    BenchError,
    PrivatePlatform,
    noop,
    percentile,
    private_platform,
)
from fxstream.ops.platform import Platform
from fxstream.sdk import Client, ClientSettings
from fxstream.service.accounts import AccountManager
from fxstream.service.auth import new_token, token_sha256
from fxstream.service.registry import LIVENESS_PERIODS
from fxstream.topics import (
    PRODUCER_PARTITIONER,
    Catalogue,
    EndpointRecord,
    Heartbeat,
    WarmAdvert,
    encode,
)

__all__ = [
    "ServiceScaleSettings",
    "broker_open_files",
    "check_open_files",
    "run_service_scale_bench",
    "simulate_heartbeats",
]

MB = 1_000_000
# A client keeps the future of every task it sent that has no result; these never get one.
_TASKS_PER_CLIENT = 100_000
# What the simulated agents say about themselves.
_HOSTNAME = "fxstream-bench-sim"
_AGENT_VERSION = "0.1.0"
# A broker keeps a file open per partition (its active segment): every endpoint has 8.
_OPEN_FILES = 1_048_576
# The status targets of issue 16.
TARGET_ENDPOINTS = 10_000
TARGET_RSS_MB = 1_000
TARGET_LAG_P99_S = 2.0


@dataclass(frozen=True)
class ServiceScaleSettings:
    """What ``./fx bench service-scale`` runs."""

    endpoints: int = 10_000
    tasks: int = 1_000_000
    minutes: float = 3.0
    period_s: float = 5.0
    task_endpoints: int = 16
    sample_endpoints: int = 20
    interval_s: float = 5.0
    batch: int = 2_000
    register_batch: int = 250
    kafka_heap_mb: int | None = None

    @property
    def broker_heap_mb(self) -> int:
        """The broker's heap: as asked, else 1 GB or 0.3 MB per endpoint (each endpoint's
        five partitions hold a log, two indexes and their bookkeeping on the heap)."""
        if self.kafka_heap_mb is not None:
            return self.kafka_heap_mb
        return max(1_024, round(self.endpoints * 0.3))

    def validate(self) -> None:
        """Raise ValueError naming the option that is out of range."""
        if self.endpoints < 1:
            raise ValueError("--endpoints must be at least 1")
        if self.tasks < 0:
            raise ValueError("--tasks must be 0 or more")
        if self.minutes <= 0:
            raise ValueError("--minutes must be positive")
        if self.period_s <= 0:
            raise ValueError("--period must be positive")
        if not 1 <= self.task_endpoints <= self.endpoints:
            raise ValueError("--task-endpoints must be between 1 and --endpoints")
        if not 1 <= self.sample_endpoints <= self.endpoints:
            raise ValueError("--sample-endpoints must be between 1 and --endpoints")
        if self.interval_s <= 0:
            raise ValueError("--interval must be positive")
        if self.batch < 1 or self.register_batch < 1:
            raise ValueError("--batch and --register-batch must be at least 1")


# --- the heartbeat simulator (a process of its own) ------------------------------------------


def simulate_heartbeats(
    kafka_config: dict[str, str | int],
    prefix: str,
    endpoint_ids: Sequence[str],
    period_s: float,
    stop: MpEvent,
    report: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Send each endpoint's heartbeat every ``period_s`` on its ``from.ep.<E>`` until
    ``stop``; put the counts on ``report`` at the end.

    The k-th heartbeat overall is endpoint ``k % n``'s, due ``k * period_s / n`` seconds
    after the start: the beats are spread evenly, as independent agents' would be.
    """
    catalogue = Catalogue(prefix=prefix)
    n = len(endpoint_ids)
    topics = [catalogue.from_endpoint(e) for e in endpoint_ids]
    keys = [e.encode() for e in endpoint_ids]
    agents = [str(uuid.uuid4()) for _ in endpoint_ids]
    errors: list[str] = []

    def delivered(error: KafkaError | None, _message: object) -> None:
        if error is not None:
            errors.append(str(error))

    producer = Producer(
        {
            **kafka_config,
            "partitioner": PRODUCER_PARTITIONER,
            # The agent's plain producer's settings (fxstream.agent.agent).
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 1,
            "log_level": 3,
        }
    )
    pid = os.getpid()
    sent = 0
    most_behind_s = 0.0
    start = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        due = int((now - start) * n / period_s) + 1
        if due - sent > n:  # a whole period behind: say so, don't burst to catch up
            most_behind_s = max(most_behind_s, (due - sent) * period_s / n)
        while sent < due and not stop.is_set():
            i, sequence = sent % n, sent // n + 1
            beat = Heartbeat(
                endpoint_id=endpoint_ids[i],
                agent_id=agents[i],
                sent_at=time.time(),
                sequence=sequence,
                period_s=period_s,
                hostname=_HOSTNAME,
                pid=pid,
                workers_total=0,
                workers_idle=0,
                workers_busy=0,
                queue_depth=0,
                agent_version=_AGENT_VERSION,
            )
            try:
                producer.produce(topics[i], key=keys[i], value=encode(beat), on_delivery=delivered)
                if sequence == 1:  # an idle agent's first warm advert: nothing warm
                    advert = WarmAdvert(
                        endpoint_id=endpoint_ids[i],
                        manager_id=_HOSTNAME,
                        advertised_at=time.time(),
                    )
                    producer.produce(
                        topics[i],
                        key=f"{endpoint_ids[i]}/{_HOSTNAME}".encode(),
                        value=encode(advert),
                        on_delivery=delivered,
                    )
            except BufferError:
                producer.poll(0.05)
                continue
            sent += 1
            most_behind_s = max(most_behind_s, time.monotonic() - start - sent * period_s / n)
        producer.poll(0)
        time.sleep(0.005)
    left = producer.flush(10)
    report.put(
        {
            "heartbeats_sent": sent,
            "heartbeat_errors": len(errors),
            "first_heartbeat_error": errors[0] if errors else "",
            "heartbeats_undelivered_at_stop": left,
            "simulator_most_behind_s": round(most_behind_s, 3),
            "simulator_cpu_s": round(sum(os.times()[:2]), 1),
        }
    )


# --- the status prober (a process of its own) ----------------------------------------------


def probe_status(
    credentials: str,
    endpoint_ids: Sequence[str],
    stop: MpEvent,
    report: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Ask the API for each endpoint's status in turn until ``stop``; report every
    observed change of ``last_seen`` as ``(seen_at, lag_s)`` and the mean cycle time."""
    settings = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": credentials})
    client = Client.from_settings(settings)
    last: dict[str, float | None] = {}
    changes: list[tuple[float, float]] = []
    failures = 0
    first_failure = ""
    cycles = 0
    started = time.monotonic()
    try:
        while not stop.is_set():
            for endpoint_id in endpoint_ids:
                try:
                    status = client.get_endpoint_status(endpoint_id)
                except Exception as exc:  # counted and reported, the probe goes on
                    failures += 1
                    first_failure = first_failure or repr(exc)
                    continue
                seen_at = time.time()
                last_seen = status.get("last_seen")
                now_seen = float(last_seen) if isinstance(last_seen, int | float) else None
                # Not on the first look: only a change since the last look has a known
                # window (it became visible within the last cycle).
                if endpoint_id in last and now_seen is not None and now_seen != last[endpoint_id]:
                    changes.append((seen_at, seen_at - now_seen))
                last[endpoint_id] = now_seen
            cycles += 1
    finally:
        client.close()
    elapsed = time.monotonic() - started
    report.put(
        {
            "changes": changes,
            "probe_failures": failures,
            "first_probe_failure": first_failure,
            "probe_cycle_s": round(elapsed / cycles, 4) if cycles else None,
        }
    )


@contextmanager
def _child(
    target: Callable[..., None], name: str, *args: Any
) -> Iterator[tuple[MpEvent, Callable[[], dict[str, Any]]]]:
    """Run ``target(*args, stop, report)`` in a spawned process for the block; yields the
    stop event and a function that stops it and returns its report."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    report: multiprocessing.Queue[dict[str, Any]] = context.Queue()
    process = context.Process(target=target, name=name, args=(*args, stop, report), daemon=True)
    process.start()
    result: dict[str, Any] = {}

    def finish() -> dict[str, Any]:
        if not result:
            stop.set()
            try:
                result.update(report.get(timeout=60))
            except queue.Empty as exc:
                raise BenchError(
                    f"the {name} process did not report (exit {process.exitcode})"
                ) from exc
        return result

    try:
        yield stop, finish
    finally:
        stop.set()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


# --- RSS -----------------------------------------------------------------------------------


@dataclass
class _Rss:
    """Peak and last RSS per labelled process, and the service's summed series."""

    times: list[float] = field(default_factory=list)
    service_mb: list[float] = field(default_factory=list)
    peak: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    # CPU seconds (user + system, with children) at the first and the latest sample.
    cpu_first: dict[str, float] = field(default_factory=dict)
    cpu_last: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _tree(pid: int | None, *, children: bool = True) -> tuple[float, float]:
    """RSS (MB) and CPU seconds of a process and (unless ``children`` is false) its
    descendants (0 if it is gone)."""
    if pid is None:
        return 0.0, 0.0
    rss, cpu = 0, 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *(root.children(recursive=True) if children else ())]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    for process in processes:
        try:
            with process.oneshot():
                rss += process.memory_info().rss
                times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        cpu += times.user + times.system
    return rss / MB, cpu


def _sample(
    platform: Platform,
) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """``(service processes, the others)``: label -> (MB, CPU seconds)."""
    services = platform.services()
    # The supervisor alone: the API, the processors and the local endpoint are its
    # children, each counted (or not) on its own line below.
    service = {"supervisor": _tree(services.supervisor.pid(), children=False)}
    for process in [services.api, *services.processors()]:
        service[process.name] = _tree(process.pid())
    endpoint = f"endpoint {services.endpoint.name} (not service)"
    others = {endpoint: _tree(services.endpoint.pid())}
    for node in platform.nodes(cluster=platform.running_mode() == "cluster"):
        others[f"kafka node {node.node_id}"] = _tree(node.process.pid())
    others["redis"] = _tree(platform.redis().process.pid())
    return service, others


@contextmanager
def _rss_sampler(platform: Platform, interval_s: float, t0: float) -> Iterator[_Rss]:
    rss = _Rss()
    stop = threading.Event()

    def take() -> None:
        service, others = _sample(platform)
        with rss.lock:
            rss.times.append(round(time.monotonic() - t0, 1))
            rss.service_mb.append(round(sum(mb for mb, _ in service.values()), 1))
            for label, (mb, cpu) in [*service.items(), *others.items()]:
                rss.peak[label] = max(rss.peak.get(label, 0.0), mb)
                rss.last[label] = mb
                rss.cpu_first.setdefault(label, cpu)
                rss.cpu_last[label] = cpu

    def run() -> None:
        while not stop.wait(interval_s):
            take()

    take()
    thread = threading.Thread(target=run, name="fxstream-bench-rss", daemon=True)
    thread.start()
    try:
        yield rss
    finally:
        stop.set()
        thread.join()
        take()


# --- the phases ----------------------------------------------------------------------------


def _raise_open_files(wanted: int = _OPEN_FILES) -> int:
    """Raise this process's open-file limit (the platform it starts inherits it) towards
    ``wanted``; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for new_hard in (max(hard, wanted), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, new_hard), new_hard))
            break
        except (ValueError, OSError):  # raising the hard limit needs privileges
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] or soft


# Each endpoint's partitions (tasks.ep and from.ep): the broker keeps each one's active
# log segment open.
_ENDPOINT_PARTITIONS = QUEUE_PARTITIONS + FROM_EP_PARTITIONS
# The broker's other files and sockets: the static topics, its clients, the JVM.
_BROKER_FILES_BESIDE = 1_500


def broker_open_files(endpoints: int) -> int:
    """About how many files the broker holds open with ``endpoints`` endpoints."""
    return endpoints * _ENDPOINT_PARTITIONS + _BROKER_FILES_BESIDE


def check_open_files(endpoints: int, limit: int) -> None:
    """Raise :class:`BenchError` saying what to do if a broker allowed ``limit`` open files
    cannot hold ``endpoints`` endpoints' partitions (it would fail with "Too many open
    files" while they are registered)."""
    needed = broker_open_files(endpoints)
    if limit >= needed:
        return
    most = max(0, (limit - _BROKER_FILES_BESIDE) // _ENDPOINT_PARTITIONS)
    raise BenchError(
        f"the broker needs about {needed:,} open files for {endpoints:,} endpoints (a log "
        f"file per partition, {_ENDPOINT_PARTITIONS} partitions per endpoint) but may open "
        f"only {limit:,} here (the hard limit, `ulimit -Hn`, which only a process with "
        f"CAP_SYS_RESOURCE can raise); raise the hard limit (`ulimit -Hn {needed}` as root, "
        f"or LimitNOFILE= for a systemd service) or run with --endpoints {most} or fewer"
    )


def _raise_map_count(wanted: int) -> tuple[int, int | None]:
    """Raise the kernel's ``vm.max_map_count`` to ``wanted`` when it is lower and this
    process may (root): the broker maps two index files per partition, and 65,530 (the
    default) ends at about 30,000 partitions with "Map failed". Returns the count now in
    force and the one to restore afterwards (None: unchanged)."""
    path = Path("/proc/sys/vm/max_map_count")
    try:
        current = int(path.read_text())
    except (OSError, ValueError):
        return 0, None
    if current >= wanted:
        return current, None
    try:
        path.write_text(str(wanted))
    except OSError:
        return current, None
    return wanted, current


def _restore_map_count(previous: int | None) -> None:
    if previous is not None:
        with contextlib.suppress(OSError):
            Path("/proc/sys/vm/max_map_count").write_text(str(previous))


def _register(
    console: Console, private: PrivatePlatform, owner_id: str, settings: ServiceScaleSettings
) -> tuple[list[str], float]:
    """Register the endpoints (principal, ACLs, credential, topics, record); their ids and
    the seconds it took."""
    started = time.monotonic()
    catalogue = private.catalogue
    manager = AccountManager.connect(private.kafka, catalogue, timeout_s=120.0)
    writer = Producer(
        {**private.kafka.confluent_producer(), "acks": "all", "enable.idempotence": True}
    )
    ids: list[str] = []
    failures: list[str] = []

    def delivered(error: KafkaError | None, _message: object) -> None:
        if error is not None:
            failures.append(str(error))

    try:
        for first in range(0, settings.endpoints, settings.register_batch):
            count = min(settings.register_batch, settings.endpoints - first)
            batch = [str(uuid.uuid4()) for _ in range(count)]
            manager.create_endpoint_principals(batch)
            for n, endpoint_id in enumerate(batch, start=first):
                record = EndpointRecord(
                    endpoint_id=endpoint_id,
                    name=f"sim-{n:05d}",
                    owner_id=owner_id,
                    created_at=time.time(),
                    description="simulated by ./fx bench service-scale",
                    token_sha256=token_sha256(new_token()),
                )
                writer.produce(
                    catalogue.endpoints,
                    key=endpoint_id.encode(),
                    value=encode(record),
                    on_delivery=delivered,
                )
                writer.poll(0)
            ids.extend(batch)
            console.print(
                f"  registered {len(ids):,} / {settings.endpoints:,} endpoints "
                f"({time.monotonic() - started:.0f} s)",
                highlight=False,
            )
        if writer.flush(60) or failures:
            raise BenchError(f"endpoint records not written: {failures[:1] or 'flush timed out'}")
    finally:
        writer.flush(10)
    return ids, round(time.monotonic() - started, 1)


def _wait_listed(client: Client, endpoint_ids: Sequence[str], timeout_s: float) -> None:
    """Until the API knows the last endpoint registered (the records are in order)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.get_endpoint(endpoint_ids[-1])
            return
        except Exception as exc:  # 404 until the API's view reads the record
            if time.monotonic() > deadline:
                raise BenchError(
                    f"the API does not list the registered endpoints after {timeout_s:.0f} s: {exc}"
                ) from exc
            time.sleep(0.5)


def _online(client: Client, endpoint_ids: set[str]) -> int:
    """How many of ``endpoint_ids`` the API says are online."""
    return sum(
        1
        for endpoint in client.list_endpoints()
        if endpoint["endpoint_id"] in endpoint_ids and endpoint["status"]["state"] == "online"
    )


def _wait_online(
    console: Console, client: Client, endpoint_ids: Sequence[str], timeout_s: float
) -> tuple[int, float]:
    """Wait until every simulated endpoint is online (or ``timeout_s``); how many were and
    after how long."""
    started = time.monotonic()
    wanted = set(endpoint_ids)
    while True:
        online = _online(client, wanted)
        waited = time.monotonic() - started
        if online == len(wanted) or waited > timeout_s:
            console.print(f"  {online:,} / {len(wanted):,} endpoints online after {waited:.0f} s")
            return online, round(waited, 1)
        time.sleep(2.0)


def _queue_tasks(
    console: Console,
    private: PrivatePlatform,
    targets: Sequence[str],
    settings: ServiceScaleSettings,
) -> tuple[list[str], float]:
    """Send ``tasks`` no-op tasks through ``batch_run``, batches to ``targets`` in turn;
    a sample of their ids and the seconds the sending took."""
    started = time.monotonic()
    sample: list[str] = []
    sent = 0
    function_id = ""
    digest = ""
    while sent < settings.tasks:
        with private.client() as client:
            if not function_id:
                function_id = client.register_function(noop)
                digest = client.function_sha256(function_id)
            else:
                client.pin_function(function_id, digest)
            for_this_client = min(_TASKS_PER_CLIENT, settings.tasks - sent)
            done_here = 0
            while done_here < for_this_client:
                count = min(settings.batch, for_this_client - done_here)
                batch = client.create_batch()
                for n in range(sent, sent + count):
                    batch.add(function_id, (n,))
                target = targets[(sent // settings.batch) % len(targets)]
                ids = client.batch_run(target, batch)["tasks"][function_id]
                sample.append(ids[-1])
                sent += count
                done_here += count
                if sent % (settings.batch * 25) == 0 or sent == settings.tasks:
                    took = time.monotonic() - started
                    console.print(
                        f"  sent {sent:,} / {settings.tasks:,} tasks ({took:.0f} s, "
                        f"{sent / took:,.0f}/s)",
                        highlight=False,
                    )
    return sample, round(time.monotonic() - started, 1)


def _count_queued(
    console: Console, private: PrivatePlatform, targets: Sequence[str], expected: int
) -> tuple[int, float]:
    """Read every committed record on the targets' queues (no commit: they stay queued)
    until ``expected`` are there or none arrives for :data:`IDLE_TIMEOUT_S`."""
    started = time.monotonic()
    consumer = Consumer(
        {
            **private.kafka.confluent(),
            "group.id": f"fxstream-bench-queue-count-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": False,
            "log_level": 3,
        }
    )
    count = 0
    try:
        topics = [private.catalogue.endpoint_queue(e) for e in targets]
        metadata = consumer.list_topics(timeout=30)
        partitions = [
            TopicPartition(topic, p, OFFSET_BEGINNING)
            for topic in topics
            for p in metadata.topics[topic].partitions
        ]
        consumer.assign(partitions)
        last_change = time.monotonic()
        next_note = time.monotonic() + 10
        while count < expected:
            messages = consumer.consume(num_messages=10_000, timeout=1.0)
            fresh = sum(1 for m in messages if m.error() is None)
            if fresh:
                count += fresh
                last_change = time.monotonic()
            elif time.monotonic() - last_change > IDLE_TIMEOUT_S:
                break
            if time.monotonic() > next_note:
                console.print(f"  {count:,} / {expected:,} tasks routed to their queues")
                next_note += 10
    finally:
        consumer.close()
    return count, round(time.monotonic() - started, 1)


def _states_of(private: PrivatePlatform, task_ids: Sequence[str]) -> dict[str, int]:
    """How many of ``task_ids`` are in each state, as the API says."""
    states: dict[str, int] = {}
    with private.client() as client:
        for task_id in task_ids:
            try:
                state = str(client.get_task(task_id).get("state"))
            except Exception as exc:  # reported as a state, not hidden
                state = f"error: {type(exc).__name__}"
            states[state] = states.get(state, 0) + 1
    return states


# --- figures -------------------------------------------------------------------------------


def _lag_figures(changes: Sequence[tuple[float, float]], prefix: str) -> dict[str, Any]:
    lags = [lag for _, lag in changes]
    if not lags:
        return {f"{prefix}samples": 0, f"{prefix}p50_s": None, f"{prefix}p99_s": None}
    return {
        f"{prefix}samples": len(lags),
        f"{prefix}p50_s": percentile(lags, 50),
        f"{prefix}p99_s": percentile(lags, 99),
        f"{prefix}max_s": round(max(lags), 3),
    }


def _print(console: Console, report: dict[str, Any], rss: _Rss) -> None:
    table = Table(
        title=f"{report['endpoints']:,} endpoints heartbeating every {report['period_s']:g} s, "
        f"{report['queued_tasks']:,} queued tasks"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    rows: list[tuple[str, str, str]] = [
        ("service RSS, peak sum (MB)", f"{report['service_rss_mb']:,.0f}", f"<= {TARGET_RSS_MB:,}"),
        ("service RSS at the end (MB)", f"{report['service_rss_end_mb']:,.0f}", ""),
        ("status lag p50 (s)", str(report["status_lag_p50_s"]), ""),
        ("status lag p99 (s)", str(report["status_lag_p99_s"]), f"<= {TARGET_LAG_P99_S:g}"),
        (
            "  while queueing: p50 / p99 (s)",
            f"{report['queueing_lag_p50_s']} / {report['queueing_lag_p99_s']}",
            "",
        ),
        (
            "  steady window: p50 / p99 (s)",
            f"{report['steady_lag_p50_s']} / {report['steady_lag_p99_s']}",
            "",
        ),
        ("endpoints online at the end", f"{report['online_at_end']:,}", f"{report['endpoints']:,}"),
        ("tasks sent (tasks/s)", f"{report['tasks_sent']:,} ({report['send_rate']:,}/s)", ""),
        ("tasks counted on the queues", f"{report['queued_tasks']:,}", f"{report['tasks_sent']:,}"),
        ("registration (s)", f"{report['register_s']:,.0f}", ""),
    ]
    for row in rows:
        table.add_row(*row)
    wide = console if console.is_terminal else Console(file=console.file, width=150)
    wide.print(table)
    peaks = Table(title=f"Per process over the {report['measured_s']:,.0f} s measured: RSS and CPU")
    peaks.add_column("process")
    peaks.add_column("peak MB", justify="right")
    peaks.add_column("end MB", justify="right")
    peaks.add_column("CPU s", justify="right")
    for label in sorted(rss.peak, key=lambda k: -rss.peak[k]):
        peaks.add_row(
            label,
            f"{rss.peak[label]:,.1f}",
            f"{rss.last.get(label, 0.0):,.1f}",
            f"{report['cpu_s'].get(label, 0.0):,.1f}",
        )
    wide.print(peaks)
    costs = Table(title="aiokafka's Python protocol code per round (no broker; a lower bound)")
    for column in (
        "endpoints",
        "cluster partitions",
        "ingress metadata s",
        "(by pattern) s",
        "ingress fetch s",
    ):
        costs.add_column(column, justify="right")
    for c in report["client_costs"]:
        costs.add_row(
            f"{c['endpoints']:,}",
            f"{c['cluster_partitions']:,}",
            f"{c['metadata_s']:.3f}",
            f"{c['pattern_metadata_s']:.3f}",
            f"{c['fetch_round_s']:.3f}",
        )
    wide.print(costs)


def run_service_scale_bench(*, console: Console, settings: ServiceScaleSettings) -> dict[str, Any]:
    """Run the scale bench; print a table and, as the last line of stdout, one JSON object.

    Every process started here (the platform, the simulator, the prober) is stopped
    before it returns.
    """
    settings.validate()
    wall = time.monotonic()
    open_files = _raise_open_files()
    check_open_files(settings.endpoints, open_files)
    # Five partitions per endpoint, two mapped indexes each, and the JVM's own.
    map_count, previous_map_count = _raise_map_count(65_530 + settings.endpoints * 5 * 2 * 2)
    try:
        return _run(console, settings, wall, open_files, map_count)
    finally:
        _restore_map_count(previous_map_count)


def _run(
    console: Console,
    settings: ServiceScaleSettings,
    wall: float,
    open_files: int,
    map_count: int,
) -> dict[str, Any]:
    with private_platform(
        console, services=True, settings={"kafka_heap_mb": settings.broker_heap_mb}
    ) as private:
        platform = Platform(private.config)
        credentials = str(private.credentials)
        with private.client() as owner:
            owner_id = owner.user_id
        console.print(
            f"service-scale: {settings.endpoints:,} endpoints every {settings.period_s:g} s, "
            f"{settings.tasks:,} tasks to {settings.task_endpoints} of them, "
            f"{settings.minutes:g} min steady"
        )
        endpoint_ids, register_s = _register(console, private, owner_id, settings)
        with private.client() as owner:
            _wait_listed(owner, endpoint_ids, timeout_s=120.0)
        rng = random.Random(16)
        probed = rng.sample(endpoint_ids, settings.sample_endpoints)
        targets = endpoint_ids[: settings.task_endpoints]
        t0 = time.monotonic()
        with (
            _rss_sampler(platform, settings.interval_s, t0) as rss,
            _child(
                simulate_heartbeats,
                "heartbeat simulator",
                dict(private.kafka.confluent()),
                private.prefix,
                endpoint_ids,
                settings.period_s,
            ) as (_, simulator),
            _child(probe_status, "status prober", credentials, probed) as (_, prober),
        ):
            with private.client() as owner:
                online_first, online_after_s = _wait_online(
                    console,
                    owner,
                    endpoint_ids,
                    timeout_s=LIVENESS_PERIODS * settings.period_s + 120.0,
                )
            queue_start = time.time()
            sample, send_s = _queue_tasks(console, private, targets, settings)
            queued, count_s = _count_queued(console, private, targets, settings.tasks)
            queue_end = time.time()
            console.print(
                f"  {queued:,} tasks queued; steady window of {settings.minutes:g} min",
                highlight=False,
            )
            time.sleep(settings.minutes * 60)
            with private.client() as owner:
                online_at_end = _online(owner, set(endpoint_ids))
            probe = prober()
            simulated = simulator()
        checked = rng.sample(sample, min(50, len(sample)))
        task_states = _states_of(private, checked)
    # Once the platform is stopped, so it measures nothing of the run: what aiokafka's
    # Python protocol code costs the router and the ingress per round at this scale and
    # at the target's (fxstream.ops.bench.client_costs).
    costs = [client_costs(n) for n in sorted({settings.endpoints, TARGET_ENDPOINTS})]
    changes: list[tuple[float, float]] = probe.pop("changes")
    queueing = [(at, lag) for at, lag in changes if queue_start <= at <= queue_end]
    steady = [(at, lag) for at, lag in changes if at > queue_end]
    overall = _lag_figures(changes, "status_lag_")
    service_end = rss.service_mb[-1] if rss.service_mb else 0.0
    report: dict[str, Any] = {
        "bench": "service-scale",
        "endpoints": settings.endpoints,
        "queued_tasks": queued,
        "service_rss_mb": max(rss.service_mb) if rss.service_mb else 0.0,
        "status_lag_p99_s": overall["status_lag_p99_s"],
        "status_lag_p50_s": overall["status_lag_p50_s"],
        "status_lag_max_s": overall.get("status_lag_max_s"),
        "status_lag_samples": overall["status_lag_samples"],
        **_lag_figures(queueing, "queueing_lag_"),
        **_lag_figures(steady, "steady_lag_"),
        "service_rss_end_mb": service_end,
        "rss_within_target": bool(rss.service_mb) and max(rss.service_mb) <= TARGET_RSS_MB,
        "lag_within_target": overall["status_lag_p99_s"] is not None
        and overall["status_lag_p99_s"] <= TARGET_LAG_P99_S,
        "period_s": settings.period_s,
        "minutes": settings.minutes,
        "task_endpoints": settings.task_endpoints,
        "sample_endpoints": settings.sample_endpoints,
        "register_s": register_s,
        "online_first": online_first,
        "online_after_s": online_after_s,
        "online_at_end": online_at_end,
        "tasks_sent": settings.tasks,
        "send_s": send_s,
        "send_rate": round(settings.tasks / send_s) if send_s > 0 else 0,
        "routed_wait_s": count_s,
        "sampled_task_states": task_states,
        **probe,
        **simulated,
        "rss_peak_mb": {k: round(v, 1) for k, v in rss.peak.items()},
        "rss_end_mb": {k: round(v, 1) for k, v in rss.last.items()},
        "cpu_s": {k: round(v - rss.cpu_first.get(k, 0.0), 1) for k, v in rss.cpu_last.items()},
        "measured_s": rss.times[-1] if rss.times else 0.0,
        "rss_times_s": rss.times,
        "service_rss_series_mb": rss.service_mb,
        "client_costs": costs,
        "cpu_count": os.cpu_count() or 0,
        "open_files_limit": open_files,
        "max_map_count": map_count,
        "kafka_heap_mb": settings.broker_heap_mb,
        "wall_s": round(time.monotonic() - wall, 1),
    }
    _print(console, report, rss)
    print(json.dumps(report), flush=True)
    return report
