"""The agent's Prometheus metrics, served on an optional port (off by default).

``fxstream-endpoint start NAME --metrics-port P`` (or ``FXSTREAM_METRICS_PORT=P``; the
platform's supervisor gives the local endpoint a free port) serves
``http://127.0.0.1:P/metrics`` (``FXSTREAM_METRICS_ADDR`` for another address) with the
agent's series (docs/metrics.md) and its process's CPU and memory. The load series are
set at each heartbeat from the figures the heartbeat carries (so they agree with the
API's per-endpoint series); answered tasks and their run time are counted as they are
answered. One agent serves one endpoint: the ``endpoint`` label has one value per process.
No series carries a token, a user id or any task data.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import start_http_server as _start_http_server

__all__ = [
    "METRICS_ADDR_ENV",
    "METRICS_PORT_ENV",
    "AgentMetrics",
    "containers_of",
    "serve_metrics",
]

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "FXSTREAM_METRICS_PORT"
"""The agent's metrics port; unset or 0: no metrics server."""
METRICS_ADDR_ENV = "FXSTREAM_METRICS_ADDR"
"""The address its metrics server listens on (default 127.0.0.1)."""

_RUN_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 3600.0)


class _Series:
    """The agent's metric families, registered once per process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        label = ["endpoint"]
        self.workers = Gauge(
            "fxstream_agent_workers",
            "The agent's workers by state (total, idle, busy), as its last heartbeat said",
            [*label, "state"],
            registry=registry,
        )
        self.queue = Gauge(
            "fxstream_agent_queue_depth",
            "Tasks fetched and not yet started (engine queue + local queue), last heartbeat",
            label,
            registry=registry,
        )
        self.containers = Gauge(
            "fxstream_agent_containers",
            "Warm workers running in a container image (the engine's warm state)",
            label,
            registry=registry,
        )
        self.blocks = Gauge(
            "fxstream_agent_blocks",
            "A batch engine's blocks (scheduler jobs) by state, last heartbeat",
            [*label, "state"],
            registry=registry,
        )
        self.heartbeats = Counter(
            "fxstream_agent_heartbeats", "Heartbeats the agent sent", label, registry=registry
        )
        self.answered = Counter(
            "fxstream_agent_tasks_answered",
            "Tasks the agent answered, by outcome (success or error)",
            [*label, "outcome"],
            registry=registry,
        )
        self.replaced = Counter(
            "fxstream_agent_producers_replaced",
            "Transactional producers replaced after a call hung past its deadline",
            label,
            registry=registry,
        )
        self.run = Histogram(
            "fxstream_agent_task_run_seconds",
            "Time a worker ran a task (started to finished)",
            label,
            buckets=_RUN_BUCKETS,
            registry=registry,
        )


_series: _Series | None = None
_series_lock = threading.Lock()


def _process_series() -> _Series:
    global _series
    with _series_lock:
        if _series is None:
            _series = _Series(REGISTRY)
        return _series


class AgentMetrics:
    """The agent's series for one endpoint (in this process's default registry)."""

    def __init__(self, endpoint_id: str, series: _Series | None = None) -> None:
        """The children of ``endpoint_id`` (the process's families unless ``series``)."""
        self.endpoint_id = endpoint_id
        self._s = series or _process_series()
        self._success = self._s.answered.labels(endpoint=endpoint_id, outcome="success")
        self._error = self._s.answered.labels(endpoint=endpoint_id, outcome="error")
        self._run = self._s.run.labels(endpoint=endpoint_id)
        self._beats = self._s.heartbeats.labels(endpoint=endpoint_id)
        self._replaced = self._s.replaced.labels(endpoint=endpoint_id)

    def heartbeat(
        self,
        *,
        workers: Mapping[str, int],
        queue_depth: int,
        blocks: Mapping[str, int],
        containers: int,
    ) -> None:
        """Set the load series from one heartbeat's figures."""
        e = self.endpoint_id
        for state, value in workers.items():
            self._s.workers.labels(endpoint=e, state=state).set(value)
        self._s.queue.labels(endpoint=e).set(queue_depth)
        for state, value in blocks.items():
            self._s.blocks.labels(endpoint=e, state=state).set(value)
        self._s.containers.labels(endpoint=e).set(containers)
        self._beats.inc()

    def producer_replaced(self) -> None:
        """Count one transactional producer replaced (a call of it hung)."""
        self._replaced.inc()

    def answered(self, ok: bool, started_at: float | None, finished_at: float | None) -> None:
        """Count one answered task and, when it ran, its run time."""
        (self._success if ok else self._error).inc()
        if started_at is not None and finished_at is not None and finished_at >= started_at:
            self._run.observe(finished_at - started_at)


def containers_of(warm: Iterable[object]) -> int:
    """How many of the engine's warm workers run in a container image."""
    return sum(1 for w in warm if getattr(w, "container", None))


def serve_metrics(
    what: str,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    start: Callable[..., object] = _start_http_server,
) -> int | None:
    """Serve the default registry on ``port`` (else ``$FXSTREAM_METRICS_PORT``) at
    ``$FXSTREAM_METRICS_ADDR`` (127.0.0.1) in a daemon thread; the port, or None when none
    is set or it cannot be bound (logged, never fatal)."""
    source = os.environ if env is None else env
    raw = str(port) if port else source.get(METRICS_PORT_ENV, "").strip()
    if not raw or raw == "0":
        return None
    addr = source.get(METRICS_ADDR_ENV, "").strip() or "127.0.0.1"
    try:
        number = int(raw)
        start(number, addr=addr)
    except (ValueError, OSError) as exc:
        log.warning("%s: no metrics server on %s:%s (%s)", what, addr, raw, exc)
        return None
    log.info("%s: metrics on http://%s:%d/metrics", what, addr, number)
    return number
