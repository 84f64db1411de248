"""The heartbeat hop: the agent's liveness, load and leases, and what it holds warm.

Every ``heartbeat_period_s`` the agent produces a ``Heartbeat`` (key: the
endpoint id) on its ``from.ep.<endpoint>`` topic: its workers (total, idle,
busy, from the engine's :meth:`~fxstream.agent.engine.Engine.counts`), its
queue depth (the engine's queue plus the local queue) and the lease of every
held task (at most ``MAX_LEASES_PER_HEARTBEAT``, fewer when long ids would
overflow the heartbeats topic's records; the group session renews the rest) and
the Python versions its workers run (:mod:`fxstream.agent.python_envs`), and, when its
workers share its node-local store, its node key (:mod:`fxstream.connectors.node_local`:
clients with the same key then pass bulk data through shared memory).
Whenever what the engine holds warm changes
(:meth:`~fxstream.agent.engine.Engine.warm`: each live worker, the image its pool runs,
the functions it has loaded and whether it is idle; a released pool's workers drop out),
as seen at a heartbeat, a ``WarmAdvert`` follows (key:
``<endpoint>/<host>``), cut to the warm topic's record size if it must be (an
advert is a routing hint). Both go on the agent's plain producer, outside the
result transactions, so a slow commit never delays them.
"""

from __future__ import annotations

import os
import time

import msgspec
from confluent_kafka import Producer

from fxstream.agent.config import EndpointConfig
from fxstream.agent.engine import Engine
from fxstream.agent.held import HeldTasks
from fxstream.agent.metrics import AgentMetrics, containers_of
from fxstream.topics import Catalogue, Heartbeat, WarmAdvert, WarmWorker, encode, fits

__all__ = ["AGENT_VERSION", "MAX_LEASES_PER_HEARTBEAT", "Heartbeats"]

AGENT_VERSION = "0.1.0"
"""The agent's version, in every heartbeat."""

MAX_LEASES_PER_HEARTBEAT = 1_000
"""Keeps a heartbeat well under the heartbeats topic's 256 kB records."""


class Heartbeats:
    """The heartbeats and warm adverts of one agent (``agent_id``), numbered in sequence."""

    def __init__(
        self,
        config: EndpointConfig,
        catalogue: Catalogue,
        *,
        agent_id: str,
        hostname: str,
        held: HeldTasks,
    ) -> None:
        self._config = config
        self._catalogue = catalogue
        self._out_topic = catalogue.from_endpoint(config.endpoint_id)
        self._agent_id = agent_id
        self._hostname = hostname
        self._held = held
        self._sequence = 0
        self._last_warm: list[WarmWorker] | None = None
        self._metrics = AgentMetrics(config.endpoint_id)
        self.python_versions: list[str] = []
        """The major.minor versions the workers run (set once they are probed)."""
        self.node_key = ""
        """The workers' node key when they share the agent's node-local store, else ''."""

    def send(self, producer: Producer, engine: Engine) -> None:
        """Produce a heartbeat, and a warm advert if what ``engine`` holds warm changed."""
        self._sequence += 1
        leases, truncated = self._held.leases(MAX_LEASES_PER_HEARTBEAT)
        counts = engine.counts()
        beat = Heartbeat(
            endpoint_id=self._config.endpoint_id,
            agent_id=self._agent_id,
            sent_at=time.time(),
            sequence=self._sequence,
            period_s=self._config.heartbeat_period_s,
            hostname=self._hostname,
            pid=os.getpid(),
            workers_total=counts.workers_total,
            workers_idle=counts.workers_idle,
            workers_busy=counts.workers_busy,
            queue_depth=counts.queued + self._held.queued,
            leases=leases,
            leases_truncated=truncated,
            agent_version=AGENT_VERSION,
            node_key=self.node_key,
            python_versions=self.python_versions,
            pool_slots=self._config.pool_slots(),
            blocks_pending=counts.blocks_pending,
            blocks_running=counts.blocks_running,
            blocks_idle=counts.blocks_idle,
        )
        key = self._config.endpoint_id.encode()
        value = encode(beat)
        spec = self._catalogue.spec("heartbeats")
        while not fits(spec, key, value) and beat.leases:
            # Long ids: list fewer leases (the rest are renewed by the group session).
            leases = beat.leases[: len(beat.leases) // 2]
            beat = msgspec.structs.replace(beat, leases=leases, leases_truncated=True)
            value = encode(beat)
        producer.produce(self._out_topic, key=key, value=value)
        engine_warm = engine.warm()
        self._metrics.heartbeat(
            workers={
                "total": beat.workers_total,
                "idle": beat.workers_idle,
                "busy": beat.workers_busy,
            },
            queue_depth=beat.queue_depth,
            blocks={
                "pending": beat.blocks_pending,
                "running": beat.blocks_running,
                "idle": beat.blocks_idle,
            },
            containers=containers_of(engine_warm),
        )
        warm = [
            WarmWorker(
                worker_id=w.worker_id,
                container=w.container,
                function_ids=list(w.function_ids),
                idle=w.idle,
            )
            for w in sorted(engine_warm, key=lambda w: w.worker_id)
        ]
        if warm != self._last_warm:
            advert = WarmAdvert(
                endpoint_id=self._config.endpoint_id,
                manager_id=self._hostname,
                advertised_at=time.time(),
                workers=warm,
            )
            warm_key = f"{self._config.endpoint_id}/{self._hostname}".encode()
            value = encode(advert)
            while not fits(self._catalogue.spec("warm"), warm_key, value) and any(
                w.function_ids for w in advert.workers
            ):
                # Many workers with many functions: advertise a subset of each (a hint).
                advert = msgspec.structs.replace(
                    advert,
                    workers=[
                        msgspec.structs.replace(
                            w, function_ids=w.function_ids[: len(w.function_ids) // 2]
                        )
                        for w in advert.workers
                    ],
                )
                value = encode(advert)
            producer.produce(self._out_topic, key=warm_key, value=value)
            self._last_warm = warm
