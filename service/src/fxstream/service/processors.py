"""The service's stream processors: router, ingress, task-state and liveness, as faust apps.

- The *router* reads every ``from.user.<user>`` topic (by name,
  :mod:`fxstream.service.subscription`) in batches,
  takes the submitter from the topic, authorises each task and
  writes its dispatch, state, result or dead letter (decisions in
  :mod:`fxstream.service.router`), each batch in one Kafka transaction with its
  input offsets (:mod:`fxstream.service.router_loop`).
- The *ingress* reads every ``from.ep.<endpoint>`` topic (by name), checks
  each record against the endpoint that wrote it (a result or task event only with
  the router's routing stamp of its task for that endpoint) and forwards it to
  ``results.<user>``, ``task-events``, ``heartbeats``, ``warm``, ``data-locations`` or
  ``dead-letter``, each batch in one transaction with its input offsets
  (:mod:`fxstream.service.ingress`).
- The *task-state* processor follows every ``results.<user>`` topic and
  ``task-events`` and folds them into ``task-state`` under the task lifecycle
  (:mod:`fxstream.service.task_state`, :mod:`fxstream.service.lifecycle`).
- The *liveness* agent (a faust agent, batched with ``take_events``) follows
  ``heartbeats``: it logs agents coming online and being lost, and turns task
  leases into ``running`` and ``waiting-for-endpoint`` task events
  (:mod:`fxstream.service.liveness`).
- The *trigger* processor reads every ``events.<source>`` topic (by name), matches
  each event to the trigger rules and writes a submission per firing to the rule
  owner's ``from.user.<owner>`` (which the router authorises like any other), each
  batch in one transaction with its input offsets; per-rule limits hold events on
  their topic (:mod:`fxstream.service.trigger_processor`).
- The *dependencies* processor reads ``held-tasks`` (tasks the router holds until their
  parents succeed) and follows ``task-state``: it releases a held task, with its parents'
  results, to its submitter's ``from.user.<user>`` (the router then routes it), or fails
  it with ``ParentFailed``, ``ParentUnknown`` or ``ParentResultUnavailable``, each with
  the held record's tombstone in one transaction (:mod:`fxstream.service.dependencies`).
- The *analytics* processor reads ``task-state`` (every partition, from its horizon on,
  no consumer group: one per platform) and writes windowed aggregates per user,
  function, endpoint and rule to ``analytics`` (:mod:`fxstream.service.analytics`).

``--only ROLE`` runs one of them in its own process (what ``./fx up`` does,
under its supervisor, so one cannot take the others down); without it all
three run as tasks of one faust app (handy for development and tests). Topics
come from the catalogue and are provisioned elsewhere (``ensure_topics``); the
app never declares one. Consumer groups, whichever way they run: the router
``<app id>-router``, the task-state processor ``<app id>-task-state``, the
liveness agent the app id.

Each role scales out: several processes of one role (``--instance N``, each a
different N) share its consumer group, and Kafka spreads the input partitions over
them. The router's and the ingress's transactional ids are ``<group>-<N>``, so
instances never fence each other and a restarted instance fences only its own
predecessor; partitions change hands only between batches
(:mod:`fxstream.service.rebalance`). The task-state followers are assigned
co-partitioned (one task's results and events go to one instance); the liveness
agents share ``heartbeats`` through faust's own group, each forgetting the agents of
partitions it gives up.

Run it with ``python -m fxstream.service.processors --kafka-credentials FILE
--prefix fx. [--only router|ingress|task-state|liveness|trigger|analytics]`` (``FILE``: the service
principal's 0600 credentials file; ``--bootstrap HOST:PORT`` instead on the insecure
development platform). The router and the ingress also need the service's routing keys,
a 0600 file named by ``--routing-keys`` or ``FXSTREAM_ROUTING_KEYS``
(:mod:`fxstream.service.routing_keys`): without a readable one they do not start, and
they re-read it within about a second of a change (a rotation), without a restart.
SIGTERM or SIGINT stops it
cleanly (the batch in hand is finished and committed). An input whose output
Kafka refuses for a reason of its own (too large, invalid, topic gone) is
dead-lettered and the processor goes on (:mod:`fxstream.service.quarantine`).
Only when the broker itself fails (no answer past the timeout, fenced,
not authorised) does the process exit, with code 75 and *without*
acknowledging the batch, so a restart (by the supervisor) re-reads it: a task
is never lost. The router's batch is a transaction, so a re-read batch was
never visible; the task-state processor may write a state twice.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import faust
from faust.types import StreamT

from fxstream.service.analytics import COMPONENT as ANALYTICS
from fxstream.service.analytics import AnalyticsLoop
from fxstream.service.dependencies import DependencyLoop
from fxstream.service.ingress import COMPONENT as INGRESS
from fxstream.service.ingress import Ingress
from fxstream.service.lifecycle import TaskMemory
from fxstream.service.liveness import COMPONENT as LIVENESS
from fxstream.service.liveness import LivenessMonitor, Transition
from fxstream.service.memory_report import MemoryReport, report_interval_s
from fxstream.service.metrics import serve_metrics_from_env
from fxstream.service.outgoing import Outgoing
from fxstream.service.placement import Placement, PlacementPolicy
from fxstream.service.quarantine import write_or_quarantine
from fxstream.service.registry import RegistryView
from fxstream.service.router import Router
from fxstream.service.router_loop import EXIT_WRITE_FAILED, RouterLoop
from fxstream.service.routing_keys import (
    RoutingKeyFile,
    RoutingKeysUnavailable,
    routing_keys_for,
)
from fxstream.service.subscription import (
    TopicFeed,
    endpoint_topics,
    rule_source_topics,
    user_topics,
)
from fxstream.service.task_expiry import (
    DEFAULT_RETENTION_S,
    RETENTION_ENV,
    TaskExpiry,
    exit_when_failed,
    retention_s,
)
from fxstream.service.task_state import COMPONENT as TASK_STATE
from fxstream.service.task_state import (
    ResultsFollower,
    TaskStatePlanner,
    recall_from,
    results_pattern,
)
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.trigger_processor import TriggerLoop, TriggerPlanner, trigger_view
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import (
    ROUTING_KEYS_ENV,
    Catalogue,
    CredentialFileError,
    KafkaConnection,
    RawRecord,
    RoutingKeys,
    aiokafka_max_batch_size,
    aiokafka_max_request_size,
)
from fxstream.topics.partitioner import Murmur2Partitioner

__all__ = [
    "DEFAULT_APP_ID",
    "EXIT_WRITE_FAILED",
    "KAFKA_CREDENTIALS_ENV",
    "PLACEMENT_ENV",
    "ROLES",
    "build_app",
    "main",
    "run_processors",
]

log = logging.getLogger(__name__)

DEFAULT_APP_ID = "fxstream-processors"
# Names the Kafka credentials file when --kafka-credentials does not (as in the CLI).
KAFKA_CREDENTIALS_ENV = "FXSTREAM_KAFKA_CREDENTIALS"
# Names the router's placement policy when --placement does not (what ./fx up passes on).
PLACEMENT_ENV = "FXSTREAM_PLACEMENT"
# What --only can choose; all of them run in one process without it.
ROLES = ("router", "ingress", "task-state", "liveness", "trigger", "dependencies", "analytics")
BATCH_SIZE = 500
# How often endpoints whose heartbeats stopped are looked for.
LIVENESS_CHECK_S = 1.0


def _broker_urls(kafka: KafkaConnection) -> list[str]:
    return [f"kafka://{server.strip()}" for server in kafka.bootstrap.split(",") if server]


def _broker_settings(kafka: KafkaConnection) -> dict[str, Any]:
    """faust's broker settings: the brokers, and the SASL/SCRAM-over-TLS credentials if any."""
    settings: dict[str, Any] = {"broker": _broker_urls(kafka)}
    if kafka.secure:
        client = kafka.aiokafka()
        settings["broker_credentials"] = faust.SASLCredentials(
            username=client["sasl_plain_username"],
            password=client["sasl_plain_password"],
            ssl_context=client["ssl_context"],
            mechanism=client["sasl_mechanism"],
        )
    return settings


def _app_settings(catalogue: Catalogue, data_dir: Path) -> dict[str, Any]:
    return {
        "key_serializer": "raw",
        "value_serializer": "raw",
        "store": "memory://",
        "web_enabled": False,
        # Topics are the catalogue's, provisioned by ensure_topics; faust would
        # otherwise create its own with broker defaults (and its leader topic).
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        # A new consumer group must start from the oldest task, not skip queued ones.
        "consumer_auto_offset_reset": "earliest",
        # An agent that raises stops the worker (and a supervisor restarts it):
        # restarting the agent alone would skip the events it held, unacknowledged.
        "agent_supervisor": "mode.CrashingSupervisor",
        # aiokafka's default (1 MB) is below the catalogue's largest record (dead letters).
        "producer_max_request_size": aiokafka_max_request_size(catalogue),
        "producer_acks": -1,
        # Kafka's murmur2 placement, in C (fxstream.topics.partitioner).
        "producer_partitioner": Murmur2Partitioner(),
        # aiokafka's 16 kB per-partition batches hold ~35 dispatches: a batch of
        # tasks would take many produce requests instead of one. No larger than the
        # smallest topic's limit, which the broker applies to a whole batch.
        "producer_max_batch_size": aiokafka_max_batch_size(catalogue),
        # A write Kafka keeps refusing fails after this, and the process fail-stops.
        "producer_request_timeout": 120.0,
        "datadir": str(data_dir),
        # faust's default session (60 s) is how long a restarted worker waits for its
        # SIGKILLed predecessor to leave the group, and the router and task-state loops
        # start only after that rebalance: routing stalled a minute after each crash.
        "broker_session_timeout": 10.0,
        "broker_heartbeat_interval": 3.0,
    }


def faust_app_id(app_id: str, roles: Sequence[str]) -> str:
    """The faust app id of a process running ``roles``.

    The app id is the liveness agent's consumer group, so a process with the
    liveness agent keeps it; a router or task-state process (whose loops have
    their own groups) gets one of its own, so its idle faust consumer never
    joins another process's group.
    """
    if "liveness" in roles:
        return app_id
    return f"{app_id}-{'-'.join(roles)}-app"


def build_app(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    *,
    app_id: str = DEFAULT_APP_ID,
    data_dir: Path | None = None,
    batch_size: int = BATCH_SIZE,
    roles: Sequence[str] = ROLES,
    placement: PlacementPolicy = PlacementPolicy.WARM,
    instance: int = 0,
    task_retention_s: float = DEFAULT_RETENTION_S,
    routing_keys: RoutingKeyFile | RoutingKeys | None = None,
) -> faust.App:
    """The faust app running ``roles`` (router, task-state, liveness), not yet started.

    ``routing_keys`` are the service's routing keys: the router stamps dispatches with
    them and the ingress verifies results and events with them, so both roles need them
    (``ValueError`` without; there is no default key). Other roles never use them. A
    :class:`~fxstream.service.routing_keys.RoutingKeyFile` (what :func:`main` passes) is
    re-read when the file changes; the router and the ingress of one app share it.

    ``data_dir`` is faust's working directory (nothing durable lives there: the
    store is in memory); by default a directory under the system temp dir, one per
    ``instance`` (the process's number among those running the same roles).
    ``placement`` is how the router chooses among a grouped task's endpoints.
    ``task_retention_s`` is how long a finished task stays in task-state
    (:mod:`fxstream.service.task_expiry`).
    """
    unknown = set(roles) - set(ROLES)
    if unknown or not roles:
        raise ValueError(f"roles must be some of {', '.join(ROLES)}; got {list(roles)}")
    if instance < 0:
        raise ValueError(f"instance must be 0 or more; got {instance}")
    if routing_keys is None and {"router", "ingress"} & set(roles):
        raise ValueError("the router and the ingress need the service's routing keys")
    faust_id = faust_app_id(app_id, roles)
    own_dir = faust_id if instance == 0 else f"{faust_id}-{instance}"
    data_dir = data_dir or Path(tempfile.gettempdir()) / "fxstream" / own_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    app = faust.App(faust_id, **_broker_settings(kafka), **_app_settings(catalogue, data_dir))
    if "liveness" not in roles:
        # No faust agent: faust's own consumer would subscribe to no topic, which crashes
        # its conductor. The router and task-state loops bring their own consumers.
        app.producer_only = True
    stoppers: list[Callable[[], Awaitable[None]]] = []
    report = MemoryReport()
    if "router" in roles:
        assert routing_keys is not None
        _add_router(
            app, kafka, catalogue, app_id, batch_size, instance, stoppers, routing_keys, placement
        )
    if "ingress" in roles:
        assert routing_keys is not None
        _add_ingress(app, kafka, catalogue, app_id, batch_size, instance, stoppers, routing_keys)
    if "task-state" in roles:
        _add_task_state(
            app, kafka, catalogue, app_id, batch_size, stoppers, report, task_retention_s
        )
    if "liveness" in roles:
        _add_liveness(app, catalogue, batch_size)
    if "trigger" in roles:
        _add_trigger(app, kafka, catalogue, app_id, batch_size, instance, stoppers, report)
    if "dependencies" in roles:
        _add_dependencies(app, kafka, catalogue, app_id, batch_size, instance, stoppers, report)
    if "analytics" in roles:
        if instance != 0:
            raise ValueError("one analytics processor runs per platform (instance 0)")
        _add_analytics(app, kafka, catalogue, batch_size, stoppers)
    _add_memory_report(app, report)

    async def stop(sender: Any, /, *_: Any, signal: Any, **__: Any) -> None:
        await asyncio.gather(*(stopper() for stopper in stoppers))

    app.on_before_shutdown.connect(stop)
    return app


class _Loop(Protocol):
    """A processor's consuming loop: runs until stopped, then has committed what it did."""

    async def run(self) -> None: ...

    async def stop(self) -> None: ...


def _run_in_app(
    app: faust.App,
    stoppers: list[Callable[[], Awaitable[None]]],
    loop: _Loop,
    closed: Callable[[], None],
) -> None:
    """Run ``loop`` as a task of ``app``; at shutdown stop it, then call ``closed``."""

    async def run() -> None:
        await loop.run()

    async def stop() -> None:
        await loop.stop()
        closed()

    app.task(run)
    stoppers.append(stop)


def _add_router(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    app_id: str,
    batch_size: int,
    instance: int,
    stoppers: list[Callable[[], Awaitable[None]]],
    keys: RoutingKeyFile | RoutingKeys,
    policy: PlacementPolicy = PlacementPolicy.WARM,
) -> None:
    # Heartbeats and warm adverts: what placement chooses by (fxstream.service.placement).
    view = RegistryView(
        kafka,
        catalogue,
        follow=("users", "functions", "endpoints", "heartbeats", "warm"),
        component="router's registry view",
    )
    # One directory (and Admin client) for the router's lookups and its feed's listing.
    directory = TopicDirectory(kafka)
    router = Router(catalogue, view, directory, keys=keys, placement=Placement(view, policy))
    # Not the app id: faust's own consumer (the liveness agent) is in that group,
    # with faust's assignor.
    router_loop = RouterLoop(
        kafka,
        catalogue,
        router,
        # Every user's from.user topic: the users the router's view holds.
        topics=TopicFeed(
            directory,
            [user_topics(view, catalogue.from_user)],
            pattern=catalogue.from_user_pattern,
        ),
        group_id=f"{app_id}-router",
        instance=str(instance),
        batch_size=batch_size,
    )

    def closed() -> None:
        router.close()
        log.info("router: %s; placement (%s): %s", router.stats, policy, router.placement.stats)

    _run_in_app(app, stoppers, router_loop, closed)


def _add_ingress(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    app_id: str,
    batch_size: int,
    instance: int,
    stoppers: list[Callable[[], Awaitable[None]]],
    keys: RoutingKeyFile | RoutingKeys,
) -> None:
    # Each result and task event carries the router's routing stamp of its task: checked
    # against the keys, with no view of task-state (see fxstream.service.ingress).
    directory = TopicDirectory(kafka)
    ingress = Ingress(catalogue, directory, keys=keys)
    # Every live endpoint's from.ep topic, from a view of the endpoint registry alone.
    # It writes no dead letters: the router's view already reports a bad registry record.
    endpoints = ViewFollower(
        RegistryView(kafka, catalogue, follow=("endpoints",), component=None),
        directory,
        [catalogue.endpoints],
        name="ingress",
        catch_up_s=5.0,
        start_timeout_s=30.0,
    )
    loop = RouterLoop(
        kafka,
        catalogue,
        ingress,
        topics=TopicFeed(
            directory,
            [endpoint_topics(endpoints.view, catalogue)],
            pattern=catalogue.from_endpoint_pattern,
            owns=endpoints,
        ),
        group_id=f"{app_id}-ingress",
        instance=str(instance),
        batch_size=batch_size,
        component=INGRESS,
    )

    def closed() -> None:
        ingress.close()
        log.info("ingress: %s", ingress.stats)

    _run_in_app(app, stoppers, loop, closed)


def _add_trigger(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    app_id: str,
    batch_size: int,
    instance: int,
    stoppers: list[Callable[[], Awaitable[None]]],
    report: MemoryReport,
) -> None:
    # The rules, and the states of the rules' tasks (which are still in flight): the view
    # keeps no other task's state (trigger_view).
    view = trigger_view(kafka, catalogue)
    report.add_table("view", view.memory_figures)
    directory = TopicDirectory(kafka)
    planner = TriggerPlanner(catalogue, view, directory)
    loop = TriggerLoop(
        kafka,
        catalogue,
        planner,
        # The events topics of the sources the rules name.
        topics=TopicFeed(
            directory,
            [rule_source_topics(view, catalogue)],
            pattern=catalogue.events_pattern,
        ),
        group_id=f"{app_id}-trigger",
        instance=str(instance),
        batch_size=batch_size,
    )

    def closed() -> None:
        planner.close()
        log.info("trigger: %s", planner.stats)

    _run_in_app(app, stoppers, loop, closed)


def _add_dependencies(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    app_id: str,
    batch_size: int,
    instance: int,
    stoppers: list[Callable[[], Awaitable[None]]],
    report: MemoryReport,
) -> None:
    # Its own view of task-state (the parents' states), created by the loop.
    loop = DependencyLoop(
        kafka,
        catalogue,
        transactional_id=f"{app_id}-dependencies-{instance}",
        batch_size=batch_size,
    )
    report.add_table("view", loop.view_memory_figures)
    _run_in_app(app, stoppers, loop, lambda: log.info("dependencies: %s", loop.stats))


def _add_analytics(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    batch_size: int,
    stoppers: list[Callable[[], Awaitable[None]]],
) -> None:
    # The rules, for the rule dimension (a task group id that is a rule of its user).
    rules = RegistryView(
        kafka, catalogue, follow=("triggers",), component="analytics processor's view"
    )

    async def write(records: Sequence[Outgoing]) -> None:
        await _write_or_exit(app, catalogue, ANALYTICS, records, ())

    loop = AnalyticsLoop(kafka, catalogue, write, rules=rules, batch_size=batch_size)

    def closed() -> None:
        aggregates = loop.aggregates
        log.info(
            "analytics: %s; %d panes, %d series in memory",
            aggregates.stats,
            aggregates.pane_count,
            aggregates.series_count,
        )

    _run_in_app(app, stoppers, loop, closed)


def _add_task_state(
    app: faust.App,
    kafka: KafkaConnection,
    catalogue: Catalogue,
    app_id: str,
    batch_size: int,
    stoppers: list[Callable[[], Awaitable[None]]],
    report: MemoryReport,
    retention: float = DEFAULT_RETENTION_S,
) -> None:
    # The planner's memory of tasks: the most recent in memory, the rest read back from
    # an on-disk table of task-state (bounded memory, lifecycle enforced for every task).
    # Its directory is a fresh temporary one per process (faust's data_dir is shared by
    # every platform on the machine that uses the default app id).
    # The users too: whose results topics the follower reads. Task states are only looked
    # up by id here, so the view stores them undecoded and decodes one when it is asked.
    states = RegistryView(kafka, catalogue, follow=("task-state", "users"), task_states_by_id=True)
    report.add_table("view", states.memory_figures)
    planner = TaskStatePlanner(
        catalogue, memory=TaskMemory(recall=recall_from(states)), lookup=states.task
    )

    async def write(records: Sequence[Outgoing], inputs: Sequence[RawRecord]) -> None:
        await _write_or_exit(app, catalogue, TASK_STATE, records, inputs)

    directory = TopicDirectory(kafka)
    follower = ResultsFollower(
        kafka,
        planner,
        write,
        topics=TopicFeed(
            directory,
            [user_topics(states, catalogue.results)],
            fixed=[catalogue.task_events],
            pattern=results_pattern(catalogue),
        ),
        group_id=f"{app_id}-task-state",
        batch_size=batch_size,
        states=states,
        directory=directory,
    )

    # Finished tasks leave task-state after the retention period (tombstones, which every
    # view of it applies); it looks only once the view it asks has read task-state.
    expiry = TaskExpiry(
        kafka,
        catalogue,
        lookup=states.task,
        group_id=f"{app_id}-task-expiry",
        retention_s=retention,
        ready=lambda timeout_s: (
            follower.states_started.wait(timeout_s) and states.wait_until_current(timeout_s)
        ),
    )
    expiry.start()

    class _FollowerAndExpiry:
        async def run(self) -> None:
            # A failed expiry thread exits the process, which the supervisor restarts.
            watch = asyncio.ensure_future(exit_when_failed(expiry))
            try:
                await follower.run()
            finally:
                watch.cancel()

        async def stop(self) -> None:
            # The expiry asks the follower's view, which the follower closes as it stops.
            await asyncio.to_thread(expiry.close)
            await follower.stop()

    def closed() -> None:
        log.info("task-state: %s; expiry: %s", planner.stats, expiry.stats)

    _run_in_app(app, stoppers, _FollowerAndExpiry(), closed)


def _add_liveness(app: faust.App, catalogue: Catalogue, batch_size: int) -> None:
    liveness = LivenessMonitor(catalogue)

    async def watch_heartbeats(stream: StreamT[bytes]) -> None:
        batches = cast("faust.Stream[bytes]", stream).take_events(batch_size, within=0.5)
        async for events in batches:
            inputs = [event.message for event in events]
            transitions, records = liveness.observe(inputs)
            _log_transitions(transitions)
            await _write_or_exit(app, catalogue, LIVENESS, records, inputs)

    async def check_liveness() -> None:
        transitions, records = liveness.lost(time.time())
        _log_transitions(transitions)
        await _write_or_exit(app, catalogue, LIVENESS, records, ())

    async def forget(sender: Any, /, *args: Any, signal: Any, **__: Any) -> None:
        # Another liveness process reads these partitions now (see fxstream.service.liveness).
        revoked = args[0] if args else ()
        gone = {tp.partition for tp in revoked if tp.topic == catalogue.heartbeats}
        for agent_id in liveness.forget(gone):
            log.info("liveness: agent %s is another liveness process's now", agent_id)

    app.agent(app.topic(catalogue.heartbeats), name="liveness")(watch_heartbeats)
    app.timer(LIVENESS_CHECK_S)(check_liveness)
    app.on_partitions_revoked.connect(forget)


def _add_memory_report(app: faust.App, report: MemoryReport) -> None:
    """Log where the process's memory is every ``FXSTREAM_MEMORY_REPORT_S`` seconds
    (:mod:`fxstream.service.memory_report`), the first line that long after the start."""
    interval = report_interval_s()
    if interval == 0:
        return

    async def report_memory() -> None:
        # Off the event loop, as the API's (the trim and the object count take up to ~90 ms).
        log.info("%s", await asyncio.to_thread(report.line))

    app.timer(interval)(report_memory)


def _log_transitions(transitions: Sequence[Transition]) -> None:
    for t in transitions:
        log.info("liveness: agent %s of endpoint %s %s", t.agent_id, t.endpoint_id, t.change)


async def _write_or_exit(
    app: faust.App,
    catalogue: Catalogue,
    component: str,
    records: Sequence[Outgoing],
    inputs: Sequence[RawRecord],
) -> None:
    """Write ``records``, dead-lettering the inputs of any Kafka refuses; exit if the
    broker fails."""
    try:
        await write_or_quarantine(app.producer, catalogue, component, records, inputs)
    except Exception:
        # Exit at once, with no await in between: faust acknowledges a taken batch
        # when its generator is closed, and a commit of that batch would lose it.
        log.critical(
            "%s: cannot write to Kafka; exiting so the batch is re-read", component, exc_info=True
        )
        logging.shutdown()
        os._exit(EXIT_WRITE_FAILED)


class _Worker(faust.Worker):
    """faust's worker without the fixed second its shutdown waits for nothing.

    mode's ``Worker`` ends its shutdown by running a "sentinel" task that sleeps one
    second on the loop before closing it, after every service has stopped and every task
    has been gathered: one second added to every stop of every processor (``./fx down``).
    One pass of the loop lets any callback still scheduled run.
    """

    async def _sentinel_task(self) -> None:
        await asyncio.sleep(0)


def run_processors(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    *,
    app_id: str = DEFAULT_APP_ID,
    data_dir: Path | None = None,
    log_level: str = "INFO",
    batch_size: int = BATCH_SIZE,
    roles: Sequence[str] = ROLES,
    placement: PlacementPolicy = PlacementPolicy.WARM,
    instance: int = 0,
    task_retention_s: float = DEFAULT_RETENTION_S,
    routing_keys: RoutingKeyFile | RoutingKeys | None = None,
) -> None:
    """Run the processors of ``roles`` until SIGTERM or SIGINT, then stop cleanly and return.

    ``instance`` numbers this process among those running the same roles (0, 1, ...):
    each needs its own. ``routing_keys``: the service's routing keys, which the router
    and the ingress need (:func:`build_app`).

    Raises what crashed the worker, if something did. With ``FXSTREAM_METRICS_PORT`` set
    (the supervisor sets it), its metrics are served there (:mod:`fxstream.service.metrics`).
    """
    serve_metrics_from_env(f"processors {'+'.join(roles)} {instance}")
    app = build_app(
        kafka,
        catalogue,
        app_id=app_id,
        data_dir=data_dir,
        batch_size=batch_size,
        roles=roles,
        placement=placement,
        instance=instance,
        task_retention_s=task_retention_s,
        routing_keys=routing_keys,
    )
    worker = _Worker(app, loglevel=log_level, quiet=True, redirect_stdouts=False)
    # At WARNING and above faust's terminal spinner sets the root logger to DEBUG, and
    # aiokafka then builds a debug record for every message sent (a third of the CPU).
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fxstream.service.processors",
        description="Run fxstream's stream processors (router, task-state, liveness).",
    )
    parser.add_argument(
        "--kafka-credentials",
        type=Path,
        default=os.environ.get(KAFKA_CREDENTIALS_ENV) or None,
        help="the Kafka principal's 0600 JSON credentials file "
        f"(default: ${KAFKA_CREDENTIALS_ENV})",
    )
    parser.add_argument(
        "--routing-keys",
        type=Path,
        default=os.environ.get(ROUTING_KEYS_ENV) or None,
        help="the service's 0600 routing keys file, which the router and the ingress need "
        f"(default: ${ROUTING_KEYS_ENV})",
    )
    parser.add_argument(
        "--bootstrap",
        default=None,
        help="Kafka bootstrap servers, host:port,... (overrides the credentials file's; "
        "alone: an unauthenticated connection, the insecure platform only)",
    )
    parser.add_argument("--prefix", default="fx.", help="topic prefix (default: fx.)")
    parser.add_argument("--app-id", default=DEFAULT_APP_ID, help="faust app id = consumer group")
    parser.add_argument("--data-dir", type=Path, default=None, help="faust's working directory")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="records per batch")
    parser.add_argument(
        "--instance",
        type=int,
        default=0,
        help="this process's number among those running the same processors (default: 0)",
    )
    parser.add_argument(
        "--only",
        choices=ROLES,
        action="append",
        default=None,
        help="run only this processor (repeatable); all of them by default",
    )
    parser.add_argument(
        "--placement",
        choices=[str(p) for p in PlacementPolicy],
        default=os.environ.get(PLACEMENT_ENV) or str(PlacementPolicy.WARM),
        help="how the router chooses among a task's endpoint group: warm (warmth, then "
        "backlog, locality, a hash of the task id), backlog, round-robin or random "
        f"(default: ${PLACEMENT_ENV}, else warm)",
    )
    parser.add_argument(
        "--task-retention-s",
        type=float,
        default=None,
        help="how long a finished task stays in task-state, in seconds "
        f"(default: ${RETENTION_ENV}, else {DEFAULT_RETENTION_S:.0f}, 7 days)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.kafka_credentials is not None:
        try:
            kafka = KafkaConnection.from_file(Path(args.kafka_credentials))
        except CredentialFileError as exc:
            parser.error(str(exc))
        if args.bootstrap:
            kafka = dataclasses.replace(kafka, bootstrap=args.bootstrap)
    elif args.bootstrap:
        kafka = KafkaConnection(args.bootstrap)
    else:
        parser.error("say where Kafka is: --kafka-credentials FILE or --bootstrap HOST:PORT")
    try:
        placement = PlacementPolicy(args.placement)
    except ValueError:
        parser.error(
            f"placement {args.placement!r} (from ${PLACEMENT_ENV}?) is not one of "
            f"{', '.join(PlacementPolicy)}"
        )
    try:
        retention = retention_s(args.task_retention_s)
    except ValueError as exc:
        parser.error(str(exc))
    roles = tuple(args.only) if args.only else ROLES
    try:
        keys = routing_keys_for(roles, args.routing_keys)
    except RoutingKeysUnavailable as exc:
        parser.error(str(exc))
    run_processors(
        kafka,
        Catalogue(prefix=args.prefix),
        app_id=args.app_id,
        data_dir=args.data_dir,
        log_level=args.log_level,
        batch_size=args.batch_size,
        roles=roles,
        placement=placement,
        instance=args.instance,
        task_retention_s=retention,
        routing_keys=keys,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
