"""``./fx status`` at a glance: the platform's Prometheus metrics, summarised.

The API's ``/metrics`` (read with the platform admin's token) gives tasks by state, hop
latencies, endpoints, consumer lag and dead letters; the supervisor's gives restarts.
:func:`summarize` turns their text into a :class:`MetricsSummary`; docs/metrics.md lists
the series.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EndpointFigures", "MetricsSummary", "scrape", "summarize"]


@dataclass(frozen=True)
class EndpointFigures:
    """One endpoint's load, as its last heartbeat said."""

    up: bool
    queue_depth: int
    workers_busy: int
    workers_total: int


@dataclass
class MetricsSummary:
    """The few numbers ``status`` prints (and ``status --json`` gives as ``metrics``)."""

    tasks: dict[str, int] = field(default_factory=dict)
    # hop -> (finished tasks counted, mean seconds)
    hops: dict[str, tuple[int, float]] = field(default_factory=dict)
    endpoints: dict[str, EndpointFigures] = field(default_factory=dict)
    endpoints_dropped: int = 0
    lag: dict[str, int] = field(default_factory=dict)
    dead_letters: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The summary as a few short lines."""
        out = []
        tasks = ", ".join(f"{s} {n}" for s, n in sorted(self.tasks.items()) if n) or "none yet"
        out.append(f"tasks since the API started: {tasks}")
        hops = [
            f"{hop.replace('_to_', '->')} {mean * 1000:.1f} ms"
            for hop, (count, mean) in self.hops.items()
            if count and hop != "submitted_to_result_published"
        ]
        if hops:
            out.append("mean hop latency: " + ", ".join(hops))
        for endpoint, e in sorted(self.endpoints.items()):
            state = "up" if e.up else "lost"
            out.append(
                f"endpoint {endpoint}: {state}, queue {e.queue_depth}, workers "
                f"{e.workers_busy}/{e.workers_total} busy"
            )
        if self.endpoints_dropped:
            out.append(f"... and {self.endpoints_dropped} more endpoints (not exported)")
        if self.lag:
            out.append(
                "consumer lag: " + ", ".join(f"{g} {n}" for g, n in sorted(self.lag.items()))
            )
        letters = ", ".join(f"{r} {n}" for r, n in sorted(self.dead_letters.items()) if n)
        out.append(f"dead letters since the API started: {letters or 'none'}")
        restarts = ", ".join(f"{r} {n}" for r, n in sorted(self.restarts.items()) if n)
        out.append(f"restarts: {restarts or 'none'}")
        return out


def scrape(url: str, token: str | None = None, timeout_s: float = 5.0) -> str:
    """The text of one ``/metrics`` (raises ``httpx.HTTPError`` if it does not answer 200)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return response.text


def _samples(texts: Iterable[str]) -> Iterable[tuple[str, dict[str, str], float]]:
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value


def summarize(*texts: str) -> MetricsSummary:
    """The summary of the exposition ``texts`` (the API's, the supervisor's, ...)."""
    summary = MetricsSummary()
    hop_sum: dict[str, float] = {}
    hop_count: dict[str, int] = {}
    endpoint: dict[str, dict[str, float]] = defaultdict(dict)
    for name, labels, value in _samples(texts):
        if name == "fxstream_tasks_total":
            summary.tasks[labels["state"]] = int(value)
        elif name == "fxstream_task_hop_seconds_sum":
            hop_sum[labels["hop"]] = value
        elif name == "fxstream_task_hop_seconds_count":
            hop_count[labels["hop"]] = int(value)
        elif name == "fxstream_endpoint_up":
            endpoint[labels["endpoint"]]["up"] = value
        elif name == "fxstream_endpoint_queue_depth":
            endpoint[labels["endpoint"]]["queue"] = value
        elif name == "fxstream_endpoint_workers":
            endpoint[labels["endpoint"]][labels["state"]] = value
        elif name == "fxstream_endpoint_series_dropped":
            summary.endpoints_dropped = int(value)
        elif name == "fxstream_consumer_lag":
            summary.lag[labels["group"]] = int(value)
        elif name == "fxstream_dead_letters_total":
            summary.dead_letters[labels["reason"]] = int(value)
        elif name == "fxstream_process_restarts_total":
            summary.restarts[labels["role"]] = int(value)
    for hop, count in hop_count.items():
        summary.hops[hop] = (count, hop_sum.get(hop, 0.0) / count if count else 0.0)
    for endpoint_id, figures in endpoint.items():
        summary.endpoints[endpoint_id] = EndpointFigures(
            up=figures.get("up", 0.0) >= 1.0,
            queue_depth=int(figures.get("queue", 0)),
            workers_busy=int(figures.get("busy", 0)),
            workers_total=int(figures.get("total", 0)),
        )
    return summary
