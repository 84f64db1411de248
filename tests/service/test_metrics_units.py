"""The metrics' pure parts: lag arithmetic, task and hop counting, topic families, the
metrics servers' settings, the supervisor's series and ``status``'s summary.

No broker: the series against a running platform are in tests/e2e/test_metrics.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fxstream.agent.metrics import AgentMetrics, containers_of, serve_metrics
from fxstream.ops.metrics_summary import summarize
from fxstream.ops.supervisor import ChildrenCollector, ChildSpec, Supervisor, SupervisorSpec
from fxstream.service.metrics import (
    ProcessorMetrics,
    TaskMetrics,
    consumer_lag,
    exported_endpoints,
    metrics_access,
    serve_metrics_from_env,
)
from fxstream.service.outgoing import Outgoing
from fxstream.service.registry import EndpointStatus
from fxstream.topics import Catalogue, TaskState, TaskTimings


def _samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_lag_is_the_end_less_the_committed_offset_per_partition() -> None:
    assert consumer_lag({0: 5, 1: 7}, {0: 0, 1: 0}, {0: 10, 1: 7}) == 5
    # No commit on a partition: everything retained there is lag.
    assert consumer_lag({0: 5}, {0: 0, 1: 2}, {0: 5, 1: 9}) == 7
    # A commit older than retention counts from the partition's start.
    assert consumer_lag({0: 3}, {0: 8}, {0: 10}) == 2
    # Never negative (a commit past a read_committed end: an open transaction).
    assert consumer_lag({0: 12}, {0: 0}, {0: 10}) == 0
    assert consumer_lag({}, {}, {}) == 0


def _state(state: str, **timings: float) -> TaskState:
    return TaskState(
        task_id="t-1",
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=state,  # type: ignore[arg-type]
        updated_at=100.0,
        timings=TaskTimings(**timings),
    )


def test_tasks_are_counted_by_state_once_enabled_and_finished_ones_give_hops() -> None:
    registry = CollectorRegistry()
    tasks = TaskMetrics(registry)
    tasks.observe("t-1", _state("routed"))  # before enable: the start's re-read
    assert (
        _samples(registry).get(("fxstream_tasks_total", frozenset({("state", "routed")}))) is None
    )
    tasks.enable()
    tasks.observe("t-1", _state("routed", submitted_at=1.0, routed_at=1.5))
    finished = _state(
        "succeeded",
        submitted_at=1.0,
        routed_at=1.5,
        dequeued_at=1.75,
        started_at=2.0,
        finished_at=3.0,
        result_published_at=2.9,  # another host's clock, 0.1 s behind: counted as 0
    )
    tasks.observe("t-1", finished)
    samples = _samples(registry)
    assert samples[("fxstream_tasks_total", frozenset({("state", "routed")}))] == 1
    assert samples[("fxstream_tasks_total", frozenset({("state", "succeeded")}))] == 1

    def hop(name: str, what: str) -> float:
        return samples[(f"fxstream_task_hop_seconds_{what}", frozenset({("hop", name)}))]

    # Only the finished state's timings are hop samples (the routed state gave none).
    assert hop("submitted_to_routed", "count") == 1
    assert hop("submitted_to_routed", "sum") == pytest.approx(0.5)
    assert hop("routed_to_dequeued", "sum") == pytest.approx(0.25)
    assert hop("started_to_finished", "sum") == pytest.approx(1.0)
    assert hop("finished_to_result_published", "count") == 1
    assert hop("finished_to_result_published", "sum") == 0.0
    assert hop("submitted_to_result_published", "sum") == pytest.approx(1.9)


def test_processor_records_are_counted_by_topic_family() -> None:
    registry = CollectorRegistry()
    metrics = ProcessorMetrics(registry)
    catalogue = Catalogue(prefix="x.")
    written = [
        Outgoing(catalogue.endpoint_queue("ep-1"), b"k", b"v"),
        Outgoing(catalogue.endpoint_queue("ep-2"), b"k", b"v"),
        Outgoing(catalogue.task_state, b"k", b"v"),
        Outgoing("elsewhere", b"k", b"v"),
    ]
    metrics.batch("router", catalogue, 3, written)
    samples = _samples(registry)

    def count(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert count("fxstream_processor_batches_total", component="router") == 1
    assert count("fxstream_processor_records_read_total", component="router") == 3
    queue = "tasks.ep.{endpoint_id}"
    written_total = "fxstream_processor_records_written_total"
    assert count(written_total, component="router", topic=queue) == 2
    assert count(written_total, component="router", topic="task-state") == 1
    assert count(written_total, component="router", topic="other") == 1


def test_metrics_access_settings() -> None:
    assert metrics_access(None) == "admin"
    assert metrics_access(" OPEN ") == "open"
    assert metrics_access("off") == "off"
    with pytest.raises(ValueError, match="FXSTREAM_API_METRICS"):
        metrics_access("everyone")


def test_a_metrics_port_that_is_unset_or_taken_serves_nothing_and_never_fails() -> None:
    assert serve_metrics_from_env("p", env={}) is None
    assert serve_metrics_from_env("p", env={"FXSTREAM_METRICS_PORT": "0"}) is None
    assert serve_metrics_from_env("p", env={"FXSTREAM_METRICS_PORT": "x"}) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"FXSTREAM_METRICS_PORT": str(port)}
        assert serve_metrics_from_env("p", env=env) is None
        assert serve_metrics("agent", env=env) is None
    calls: list[tuple[int, str]] = []
    served = serve_metrics_from_env(
        "p",
        env={"FXSTREAM_METRICS_PORT": "9123", "FXSTREAM_METRICS_ADDR": "0.0.0.0"},
        start=lambda port, addr, registry: calls.append((port, addr)),
    )
    assert served == 9123 and calls == [(9123, "0.0.0.0")]


def test_the_agents_series_follow_its_heartbeats_and_answers() -> None:
    metrics = AgentMetrics("ep-unit")
    metrics.heartbeat(
        workers={"total": 4, "idle": 1, "busy": 3},
        queue_depth=7,
        blocks={"pending": 0, "running": 1, "idle": 0},
        containers=2,
    )
    metrics.answered(True, 10.0, 10.5)
    metrics.answered(False, None, 11.0)
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"endpoint": "ep-unit", **labels})

    assert value("fxstream_agent_workers", state="busy") == 3
    assert value("fxstream_agent_queue_depth") == 7
    assert value("fxstream_agent_containers") == 2
    assert value("fxstream_agent_blocks", state="running") == 1
    assert value("fxstream_agent_tasks_answered_total", outcome="success") == 1
    assert value("fxstream_agent_tasks_answered_total", outcome="error") == 1
    assert value("fxstream_agent_task_run_seconds_count") == 1
    assert value("fxstream_agent_task_run_seconds_sum") == pytest.approx(0.5)

    class Warm:
        def __init__(self, container: str | None) -> None:
            self.container = container

    assert containers_of([Warm("img"), Warm(None), Warm("img")]) == 2


def test_the_supervisors_series_are_its_childrens_states(tmp_path: Path) -> None:
    spec = SupervisorSpec(
        state_dir=str(tmp_path),
        children=[
            ChildSpec(name="router", key="router", argv=["true"], log_file=str(tmp_path / "r")),
            ChildSpec(name="api", key="api", argv=["true"], log_file=str(tmp_path / "a")),
        ],
    )
    supervisor = Supervisor(spec)
    router, api = supervisor._children
    router.status.restarts, router.status.state = 3, "running"
    api.status.state, api.status.exits_in_a_row, api.status.crash_looping = "backoff", 4, True
    registry = CollectorRegistry()
    registry.register(ChildrenCollector(supervisor._children))
    samples = _samples(registry)
    assert samples[("fxstream_process_restarts_total", frozenset({("role", "router")}))] == 3
    assert samples[("fxstream_process_up", frozenset({("role", "router")}))] == 1
    assert samples[("fxstream_process_up", frozenset({("role", "api")}))] == 0
    assert samples[("fxstream_process_crash_looping", frozenset({("role", "api")}))] == 1


def test_status_summary_reads_the_exposition_text() -> None:
    api = "\n".join(
        [
            "# TYPE fxstream_tasks_total counter",
            'fxstream_tasks_total{state="succeeded"} 12.0',
            'fxstream_tasks_total{state="routed"} 13.0',
            "# TYPE fxstream_task_hop_seconds histogram",
            'fxstream_task_hop_seconds_bucket{hop="submitted_to_routed",le="+Inf"} 4.0',
            'fxstream_task_hop_seconds_count{hop="submitted_to_routed"} 4.0',
            'fxstream_task_hop_seconds_sum{hop="submitted_to_routed"} 0.02',
            "# TYPE fxstream_endpoint_up gauge",
            'fxstream_endpoint_up{endpoint="e1"} 1.0',
            "# TYPE fxstream_endpoint_queue_depth gauge",
            'fxstream_endpoint_queue_depth{endpoint="e1"} 3.0',
            "# TYPE fxstream_endpoint_workers gauge",
            'fxstream_endpoint_workers{endpoint="e1",state="total"} 4.0',
            'fxstream_endpoint_workers{endpoint="e1",state="busy"} 2.0',
            "# TYPE fxstream_consumer_lag gauge",
            'fxstream_consumer_lag{group="router"} 5.0',
            "# TYPE fxstream_dead_letters_total counter",
            'fxstream_dead_letters_total{reason="TaskRejected"} 2.0',
            "",
        ]
    )
    supervisor = "\n".join(
        [
            "# TYPE fxstream_process_restarts_total counter",
            'fxstream_process_restarts_total{role="router"} 1.0',
            "",
        ]
    )
    summary = summarize(api, supervisor)
    assert summary.tasks == {"succeeded": 12, "routed": 13}
    count, mean = summary.hops["submitted_to_routed"]
    assert count == 4 and mean == pytest.approx(0.005)
    e1 = summary.endpoints["e1"]
    assert (e1.up, e1.queue_depth, e1.workers_busy, e1.workers_total) == (True, 3, 2, 4)
    assert summary.lag == {"router": 5}
    assert summary.dead_letters == {"TaskRejected": 2}
    assert summary.restarts == {"router": 1}
    lines = "\n".join(summary.lines())
    assert "routed 13, succeeded 12" in lines
    assert "submitted->routed 5.0 ms" in lines
    assert "endpoint e1: up, queue 3, workers 2/4 busy" in lines
    assert "router 1" in lines


def test_endpoint_series_are_capped_online_first_then_most_recent() -> None:
    statuses = [
        ("lost-old", EndpointStatus(state="lost", last_seen=10.0)),
        ("online-old", EndpointStatus(state="online", last_seen=50.0)),
        ("never", EndpointStatus(state="never-seen")),
        ("lost-new", EndpointStatus(state="lost", last_seen=90.0)),
        ("online-new", EndpointStatus(state="online", last_seen=100.0)),
    ]
    kept, dropped = exported_endpoints(statuses, 3)
    assert [eid for eid, _ in kept] == ["online-new", "online-old", "lost-new"]
    assert dropped == 1
    kept, dropped = exported_endpoints(statuses, 100)
    assert len(kept) == 4 and dropped == 0
