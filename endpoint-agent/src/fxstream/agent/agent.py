"""The endpoint agent: the loop that pulls this endpoint's queue, runs tasks, answers them.

One thread polls Kafka; tasks run on an :class:`~fxstream.agent.engine.Engine`,
never in the poll loop. Each hop is in the module named for it, and this one
keeps only the loop (:meth:`Agent.run`) and its lifecycle (start, rebalances,
stop):

* **pull** (:mod:`fxstream.agent.pull`): the queue into the bounded local
  queue, with flow control, every identity and policy check before anything is
  deserialized, the function's verified code (:mod:`fxstream.agent.function_code`),
  cancels, and the commit metadata read on assignment;
* **held** (:mod:`fxstream.agent.held`): the tasks taken and not yet answered,
  where each waits (local queue, engine, retry backoff, code wait), and the
  assignment epoch;
* **run** (:mod:`fxstream.agent.engine`, the protocol; the first engine is
  :mod:`fxstream.agent.process_engine`, whose workers run
  :mod:`fxstream.agent.worker_process`): the engine is fed from the local queue
  and its outcomes retried or answered by :mod:`fxstream.agent.feed`;
* **staging** (:mod:`fxstream.agent.staging`): the files a task declares, staged into its
  working directory before the engine runs it and out after it succeeded;
* **answer** (:mod:`fxstream.agent.answer`): results, dead letters, task events
  and data locations, through the transactional publisher
  (:mod:`fxstream.agent.publisher`);
* **heartbeat** (:mod:`fxstream.agent.heartbeat`): liveness, load, leases and
  warm adverts.

Acknowledgement: a task's result and its queue offset are written in one Kafka
transaction (:class:`~fxstream.agent.publisher.TransactionalPublisher`): the
commit position is the contiguous prefix of finished tasks per partition
(:class:`~fxstream.agent.offsets.OffsetTracker`), and the commit's metadata names
the tasks answered past it. Nothing is acknowledged on dispatch, so an agent
killed mid-batch loses nothing: its uncommitted tasks are delivered again when
it (or a replacement) returns, and a result whose transaction did not commit was
never visible. On assignment the agent reads the committed offsets with their
metadata (:meth:`~fxstream.agent.pull.Intake.assigned`), and a redelivered
record that was answered already is settled without running. A task may
therefore run twice (killed before its result committed), but exactly one of
its results is committed. On a revoke the answers in hand are committed first
(the partitions are still ours); on a lost session nothing in hand is.

Identity: everything this agent writes (results, task events, heartbeats, warm
adverts, data locations, dead letters) goes to one topic, ``from.ep.<endpoint>``,
which only this endpoint's principal may write; the service's ingress checks
each record against the endpoint and forwards it. The agent authenticates with
its endpoint's own credential (Kafka principal and API token,
:mod:`fxstream.agent.credentials`), never its owner's; its secrets are kept from
the tasks it runs by :mod:`fxstream.agent.environment` (applied by the CLI).

Stop: tasks not yet started are handed back uncommitted; running tasks get
``STOP_GRACE_S`` to finish and their answers to commit, then are killed and
handed back (the next agent runs them again): the agent is gone within 10 s of
the signal.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, Producer, TopicPartition

from fxstream.agent.answer import Answerer
from fxstream.agent.config import EndpointConfig
from fxstream.agent.containers import runtime_for
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.engine import Engine
from fxstream.agent.feed import EngineFeed
from fxstream.agent.function_code import CodeCache
from fxstream.agent.heartbeat import AGENT_VERSION, Heartbeats
from fxstream.agent.held import HeldTasks
from fxstream.agent.image_pools import ImagePools
from fxstream.agent.log_shipper import LogShipper
from fxstream.agent.metrics import AgentMetrics
from fxstream.agent.offsets import OffsetTracker
from fxstream.agent.policy import TaskPolicy
from fxstream.agent.process_engine import ProcessEngine
from fxstream.agent.publisher import TransactionalPublisher
from fxstream.agent.pull import Intake
from fxstream.agent.python_envs import probe_environments
from fxstream.agent.runner import runner_for
from fxstream.agent.staging import Stager
from fxstream.agent.worker_process import RunnerSpec
from fxstream.connectors import FileConnector, NodeLocal, StoreSpec, find_node_local
from fxstream.topics import PRODUCER_PARTITIONER, Catalogue, producer_message_max_bytes
from fxstream.topics.acls import endpoint_group, endpoint_transactional_prefix

__all__ = ["AGENT_VERSION", "Agent"]

log = logging.getLogger(__name__)

# The longest a rebalance waits for the answers in hand to commit.
CALL_FLUSH_S = 10.0
# A stop (SIGTERM) lets running tasks finish and their answers commit for this long; what
# is still running then is killed and handed back uncommitted (the next agent runs it).
# With the closes below, the agent is gone within 10 s of the signal.
STOP_GRACE_S = 5.0
# How long the agent waits for its workers before it serves with those that are up.
WORKERS_READY_S = 60.0
STOP_CLOSE_S = 1.5
# How often tasks waiting for an unreachable service try to fetch their code again.
CODE_RETRY_S = 2.0

SWEEP_PERIOD_S = 300.0
"""How often an endpoint with a file store deletes objects whose lease ended."""


class Agent:
    """Serves one endpoint until :meth:`stop` (or the ``stop`` event passed to :meth:`run`)."""

    def __init__(
        self,
        config: EndpointConfig,
        *,
        runner: RunnerSpec | None = None,
        credentials: EndpointCredentials | None = None,
    ) -> None:
        config.validate()
        self.config = config
        # The endpoint's own credential (read from its 0600 file unless given).
        self._credentials = credentials if credentials is not None else config.credentials()
        self.policy = TaskPolicy.of(config)
        self.agent_id = str(uuid.uuid4())
        self.catalogue = Catalogue(prefix=config.topic_prefix)
        self.queue_topic = self.catalogue.endpoint_queue(config.endpoint_id)
        # The one topic this endpoint writes (the ingress checks and forwards it).
        self.out_topic = self.catalogue.from_endpoint(config.endpoint_id)
        staging_root = config.staging_root()
        # The node-local tier (shared memory), for clients on this node as this user: only
        # when the workers are plain processes beside the agent (a container's or a batch
        # block's workers do not share its /dev/shm directory; docs/data-plane.md, "Tiers").
        self.node: NodeLocal | None = (
            find_node_local()
            if config.engine == "process"
            and config.runtime == "process"
            and not config.images
            and runner is None
            else None
        )
        self._runner: RunnerSpec = (
            runner
            if runner is not None
            else runner_for(
                config.store_url,
                proxy_threshold=config.proxy_threshold,
                site=config.endpoint_id,
                task_root=None if staging_root is None else str(staging_root),
                node=self.node,
            )
        )
        # Staged files (fxstream.agent.staging): in and out of each task's directory.
        self._stager = Stager(
            config.staging, endpoint_dir=config.directory, store_url=config.store_url
        )
        self._stop = threading.Event()
        self._tracker = OffsetTracker()
        # Every task taken off Kafka and not yet answered durably, where it waits, and the
        # assignment epoch (bumped whenever partitions are revoked or lost: answers to
        # tasks taken in an earlier epoch are dropped by the publisher).
        self._held = HeldTasks(config.max_image_wait_s)
        self._hostname = socket.gethostname()
        # Results, dead letters, task events and data locations (given its clients in run).
        self._answers = Answerer(
            config, self.catalogue, tracker=self._tracker, held=self._held, hostname=self._hostname
        )
        self._beats = Heartbeats(
            config, self.catalogue, agent_id=self.agent_id, hostname=self._hostname, held=self._held
        )
        self._beats.node_key = "" if self.node is None else self.node.key
        # The agent's log for its owner (fxstream.agent.log_shipper): shipped with each
        # heartbeat once a logger has it (the CLI's `start` adds it to the root logger).
        self.log_shipper = LogShipper(
            endpoint_id=config.endpoint_id,
            agent_id=self.agent_id,
            hostname=self._hostname,
            topic=self.out_topic,
        )
        self._engine: Engine | None = None
        self._feed: EngineFeed | None = None
        self._intake: Intake | None = None
        self._publisher: TransactionalPublisher | None = None
        self.results_published = 0

    # --- public ------------------------------------------------------------------------

    @property
    def answered_before(self) -> int:
        """Records settled without running: a previous owner of their partition answered
        them."""
        return 0 if self._intake is None else self._intake.answered_before

    @property
    def retries_scheduled(self) -> int:
        """Retries this agent has scheduled."""
        return 0 if self._feed is None else self._feed.retries_scheduled

    def stop(self) -> None:
        """Ask :meth:`run` to finish the tasks it holds and return."""
        self._stop.set()

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until stopped. ``ready`` is called once workers and Kafka are up."""
        began = time.monotonic()  # the start-up's phases are logged from here
        # Each worker environment's Python version, before anything starts: an interpreter
        # that cannot run workers stops the agent here (PythonEnvironmentError).
        pythons = probe_environments(self.config, self._runner)
        self._beats.python_versions = pythons.versions()
        log.info(
            "worker Python versions %s found %.1f s after start",
            ", ".join(pythons.versions()),
            time.monotonic() - began,
        )
        kafka = self.config.kafka(self._credentials).confluent()
        readonly, writable = self.config.worker_paths()
        engine: Engine
        if self.config.images or self.config.interpreters:
            # A pool per allowed image and interpreter; the default's started now, the
            # others at first use.
            engine = ImagePools(
                self.config.workers,
                self._runner,
                default=self.config.worker_image(),
                images=list(self.config.allowed_images().values()),
                readonly=readonly,
                writable=writable,
                idle_s=self.config.pool_idle_s,
                max_workers=self.config.max_workers,  # None: every pool at full size
                interpreters=pythons.interpreters,
            )
        elif self.config.engine == "htex":
            # Parsl is imported only by endpoints that use it (a second of start-up).
            from fxstream.agent.batch_engine import BatchEngine, BlockContainer

            image = self.config.worker_image()
            engine = BatchEngine(
                self.config.batch_settings(),
                self._runner,
                self.config.directory / "batch",
                label=f"fxstream-{self.config.name}",
                container=(
                    None
                    if image is None
                    else BlockContainer(runtime_for(image.runtime), image, readonly, writable)
                ),
            )
        else:
            engine = ProcessEngine(self.config.workers, self._runner)
        codes = CodeCache(self.config.service_url, self._credentials.token)
        intake = Intake(
            self.config,
            self.catalogue,
            engine,
            policy=self.policy,
            codes=codes,
            tracker=self._tracker,
            held=self._held,
            answers=self._answers,
            pythons=pythons,
            stager=self._stager,
        )
        self._start_lease_sweeper()
        # Heartbeats and warm adverts: outside the transactions, never delayed by them.
        producer = Producer(
            {
                **kafka,
                "partitioner": PRODUCER_PARTITIONER,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 1,
                "message.max.bytes": producer_message_max_bytes(self.catalogue),
                "log_level": 3,
            }
        )
        consumer = Consumer(
            {
                **kafka,
                # The one group the endpoint's principal may use (fxstream.topics.acls).
                "group.id": endpoint_group(self.config.endpoint_id),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                # A dispatch ends the broker's wait at once (fetch.min.bytes is 1); an idle
                # queue costs two fetches a second.
                "fetch.wait.max.ms": 500,
                # The lease: librdkafka's background thread keeps the session alive while
                # this process lives; a stopped or hung process loses its partitions.
                "session.timeout.ms": int(self.config.lease_timeout_s * 1000),
                "heartbeat.interval.ms": max(1000, int(self.config.lease_timeout_s * 1000 / 10)),
                "log_level": 7 if self.config.kafka_debug else 3,
                **({"debug": self.config.kafka_debug} if self.config.kafka_debug else {}),
            }
        )
        publisher = TransactionalPublisher(
            {
                **kafka,
                "message.max.bytes": producer_message_max_bytes(self.catalogue),
                "log_level": 3,
            },
            transactional_id=self.transactional_id,
            queue_topic=self.queue_topic,
            tracker=self._tracker,
            group_metadata=lambda: intake.group_metadata,
            on_committed=self._count_committed,
            epoch=lambda: self._held.epoch,
            on_refused=self._answers.quarantine,
            rebalancing=intake.rebalancing,
            group_id=endpoint_group(self.config.endpoint_id),
            on_replaced=AgentMetrics(self.config.endpoint_id).producer_replaced,
        )
        self._engine, self._publisher, self._intake = engine, publisher, intake
        self._feed = EngineFeed(
            self.config,
            engine,
            held=self._held,
            answers=self._answers,
            stopping=self._stop,
            hostname=self._hostname,
            stager=self._stager,
        )
        self._answers.open(publisher, producer)
        try:
            # The transactional id is registered while the workers start up (both take
            # a while, one on the broker, the other in the worker processes).
            publisher.start()
            log.info(
                "registered transactional id %s %.1f s after start",
                self.transactional_id,
                time.monotonic() - began,
            )
            if engine.wait_ready(timeout=WORKERS_READY_S):
                log.info(
                    "%d workers ready %.1f s after start",
                    self.config.workers,
                    time.monotonic() - began,
                )
            else:
                log.warning(
                    "the workers are not all up %.0f s after start (a loaded machine?): "
                    "serving with those that are",
                    time.monotonic() - began,
                )
            consumer.subscribe(
                [self.queue_topic],
                on_assign=lambda c, parts: self._on_assign(intake, c, parts, began),
                on_revoke=lambda c, parts: self._on_revoke(intake, parts),
                on_lost=lambda c, parts: intake.lost(parts),
            )
            self._beats.send(producer, engine)
            if ready is not None:
                ready()
            self._serve(consumer, producer, engine, intake)
        finally:
            self._shutdown(consumer, producer, engine, codes)

    @property
    def transactional_id(self) -> str:
        """Stable per agent (endpoint, host, name), so a restart fences its predecessor."""
        prefix = endpoint_transactional_prefix(self.config.endpoint_id)  # what its ACLs allow
        return f"{prefix}{self._hostname}.{self.config.name}"

    def _count_committed(self, answers: int) -> None:
        self.results_published += answers

    def _start_lease_sweeper(self) -> None:
        """A file store has no TTLs: a thread deletes its objects past their lease (the
        endpoint's file store, and the node-local store its clients on this node use)."""
        urls = [] if self.config.store_url is None else [self.config.store_url]
        if self.node is not None:
            urls.append(self.node.store_url)
        connectors = []
        for url in urls:
            spec = StoreSpec.parse(url)
            if spec.connector_type() is FileConnector:
                connectors.append((spec.url, FileConnector.from_config(spec.options)))
        if not connectors:
            return

        def sweep() -> None:
            while not self._stop.wait(SWEEP_PERIOD_S):
                for url, connector in connectors:
                    try:
                        removed = connector.sweep_expired()
                    except OSError as exc:
                        log.warning("cannot sweep the file store %s: %s", connector.store_dir, exc)
                        continue
                    if removed:
                        log.info("swept %d objects past their lease from %s", removed, url)

        threading.Thread(target=sweep, name="fxstream-lease-sweeper", daemon=True).start()

    # --- the loop ----------------------------------------------------------------------

    def _serve(
        self, consumer: Consumer, producer: Producer, engine: Engine, intake: Intake
    ) -> None:
        """The loop: pull, feed the engine, retry code fetches, beat; until stopped."""
        next_beat = time.monotonic() + self.config.heartbeat_period_s
        next_code_fetch = time.monotonic()
        publisher, feed = self._publisher, self._feed
        assert publisher is not None and feed is not None
        while not self._stop.is_set():
            if not publisher.alive:
                # Fenced by a newer agent of this endpoint, or Kafka refused for good.
                raise RuntimeError(f"the result publisher stopped: {publisher.failure}")
            intake.pull(consumer)
            feed.feed()
            producer.poll(0)
            now = time.monotonic()
            if self._held.awaiting_code and now >= next_code_fetch:
                intake.fetch_awaited_code()
                next_code_fetch = time.monotonic() + CODE_RETRY_S
            if now >= next_beat:
                self._beats.send(producer, engine)
                self.log_shipper.ship(producer)
                next_beat = now + self.config.heartbeat_period_s

    def _on_assign(
        self, intake: Intake, consumer: Consumer, partitions: list[TopicPartition], began: float
    ) -> None:
        log.info(
            "assigned partitions %s of %s %.1f s after start",
            sorted(p.partition for p in partitions),
            self.queue_topic,
            time.monotonic() - began,
        )
        intake.assigned(consumer, partitions)

    def _on_revoke(self, intake: Intake, partitions: list[TopicPartition]) -> None:
        # Commit what is answered while the partitions are still ours; the engine's tasks of
        # revoked partitions finish and are answered, but their offsets are the new owner's.
        publisher = self._publisher
        if publisher is not None and publisher.alive:
            # Stopping, the answers had their chance already: keep the stop within 10 s.
            publisher.flush(STOP_CLOSE_S if self._stop.is_set() else CALL_FLUSH_S)
        intake.give_up(partitions)

    def _answering(self) -> bool:
        """True while a task is in the engine or a result is not yet acknowledged."""
        held = bool(self._held)
        publisher = self._publisher
        return held or (publisher is not None and publisher.alive and publisher.pending > 0)

    def _shutdown(
        self, consumer: Consumer, producer: Producer, engine: Engine, codes: CodeCache
    ) -> None:
        # Tasks not yet started stay uncommitted and go to the next agent; the engine's are
        # finished and answered first.
        self._held.hand_back_waiting()
        deadline = time.monotonic() + STOP_GRACE_S
        while self._answering() and time.monotonic() < deadline:
            producer.poll(0.05)
        self.log_shipper.ship(producer)  # the last lines, the stop among them
        producer.flush(STOP_CLOSE_S)
        if self._publisher is not None:
            # Commits what is queued; the group must still be joined for its offsets.
            self._publisher.close(STOP_CLOSE_S)
        consumer.close()
        # Tasks still staging are handed back (PoolClosed), then those still running are
        # killed; uncommitted, they run again on the next agent.
        self._stager.close()
        engine.close(timeout=STOP_CLOSE_S)
        codes.close()
