"""Prometheus metrics on a running platform: the named series exist and move when tasks run.

On the shared platform (real broker, processors, agent and supervisor): the API's
``/metrics`` (admin token only), each processor's and the agent's port (assigned by the
supervisor, listed by ``status``), the supervisor's restarts, and ``status``'s summary.
docs/metrics.md lists the series.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from fxstream.ops.private import PrivatePlatform

pytestmark = pytest.mark.platform

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
TASKS = 20


def _parse(text: str) -> tuple[Samples, set[str]]:
    samples: Samples = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, families


def _scrape(url: str, token: str | None = None) -> tuple[Samples, set[str], str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, headers=headers, timeout=15)
    assert response.status_code == 200, response.text
    samples, families = _parse(response.text)
    return samples, families, response.text


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _square(x: int) -> int:
    return x * x


def _run_tasks(stack: PrivatePlatform, count: int = TASKS) -> None:
    with stack.executor() as executor:
        futures = [executor.submit(_square, i) for i in range(count)]
        assert [f.result(timeout=120) for f in futures] == [i * i for i in range(count)]


@pytest.fixture(scope="module")
def api_metrics_url(shared_platform: PrivatePlatform) -> str:
    return f"{shared_platform.settings.service_url}/metrics"


def test_the_apis_metrics_need_the_admin_token(
    shared_platform: PrivatePlatform, api_metrics_url: str
) -> None:
    assert httpx.get(api_metrics_url, timeout=15).status_code == 401
    user = shared_platform.settings.token
    assert user is not None
    refused = httpx.get(api_metrics_url, headers={"Authorization": f"Bearer {user}"}, timeout=15)
    assert refused.status_code == 401
    assert "admin" in refused.json()["detail"]


def test_the_apis_series_move_when_tasks_run(
    shared_platform: PrivatePlatform, api_metrics_url: str
) -> None:
    stack = shared_platform
    token = stack.admin_token
    endpoint = stack.endpoint_id
    before, families, _ = _scrape(api_metrics_url, token)
    for name in (
        "fxstream_tasks",
        "fxstream_task_hop_seconds",
        "fxstream_endpoint_queue_depth",
        "fxstream_endpoint_workers",
        "fxstream_endpoint_up",
        "fxstream_consumer_lag",
        "fxstream_dead_letters",
        "process_resident_memory_bytes",
    ):
        assert name in families, name
    assert _value(before, "fxstream_endpoint_up", endpoint=endpoint) == 1.0
    assert _value(before, "fxstream_endpoint_workers", endpoint=endpoint, state="total") >= 1
    for group in ("router", "ingress", "task-state", "liveness"):
        assert ("fxstream_consumer_lag", frozenset({("group", group)})) in before, group

    _run_tasks(stack)

    def moved() -> bool:
        after, _, _ = _scrape(api_metrics_url, token)
        return (
            _value(after, "fxstream_tasks_total", state="succeeded")
            >= _value(before, "fxstream_tasks_total", state="succeeded") + TASKS
            and _value(after, "fxstream_tasks_total", state="routed")
            >= _value(before, "fxstream_tasks_total", state="routed") + TASKS
        )

    _wait_until(moved, f"{TASKS} more succeeded and routed states in fxstream_tasks_total")
    after, _, text = _scrape(api_metrics_url, token)
    for hop in (
        "submitted_to_routed",
        "routed_to_dequeued",
        "dequeued_to_started",
        "started_to_finished",
        "finished_to_result_published",
    ):
        grew = _value(after, "fxstream_task_hop_seconds_count", hop=hop) - _value(
            before, "fxstream_task_hop_seconds_count", hop=hop
        )
        assert grew >= TASKS, (hop, grew)
        assert _value(after, "fxstream_task_hop_seconds_sum", hop=hop) > _value(
            before, "fxstream_task_hop_seconds_sum", hop=hop
        )
    # Counts only: no user's token, no user id, no task data.
    user = stack.settings
    assert user.token is not None and user.token not in text
    assert user.user_id is not None and user.user_id not in text
    assert token not in text


def test_a_dead_letter_is_counted_by_reason(
    shared_platform: PrivatePlatform, api_metrics_url: str
) -> None:
    stack = shared_platform
    token = stack.admin_token
    reason = "RecordDecodeError"
    before, _, _ = _scrape(api_metrics_url, token)
    user_id = stack.settings.user_id
    assert user_id is not None
    producer = Producer({**stack.kafka.confluent(), "log_level": 2})
    producer.produce(stack.catalogue.from_user(user_id), key=b"metrics", value=b"not a record")
    assert producer.flush(30) == 0

    def counted() -> bool:
        after, _, _ = _scrape(api_metrics_url, token)
        return _value(after, "fxstream_dead_letters_total", reason=reason) >= (
            _value(before, "fxstream_dead_letters_total", reason=reason) + 1
        )

    _wait_until(counted, "the router's dead letter in fxstream_dead_letters_total")


def test_processors_agent_and_supervisor_serve_their_own(shared_platform: PrivatePlatform) -> None:
    stack = shared_platform
    services = stack.platform.services()
    urls = services.metrics_urls()
    for name in ("supervisor", "router", "ingress", "task-state", "liveness", "endpoint local"):
        assert urls.get(name, "").startswith("http://127.0.0.1:"), (name, urls)
    router, task_state, agent = urls["router"], urls["task-state"], urls["endpoint local"]
    before = {url: _scrape(url)[0] for url in (router, task_state, agent)}

    _run_tasks(stack)

    queue = "tasks.ep.{endpoint_id}"

    def moved() -> bool:
        now = {url: _scrape(url)[0] for url in (router, task_state, agent)}
        checks = [
            (router, "fxstream_processor_records_read_total", {"component": "router"}),
            (
                router,
                "fxstream_processor_records_written_total",
                {"component": "router", "topic": queue},
            ),
            (
                task_state,
                "fxstream_processor_records_written_total",
                {"component": "task-state", "topic": "task-state"},
            ),
            (
                agent,
                "fxstream_agent_tasks_answered_total",
                {"endpoint": stack.endpoint_id, "outcome": "success"},
            ),
        ]
        return all(
            _value(now[url], name, **labels) >= _value(before[url], name, **labels) + TASKS
            for url, name, labels in checks
        )

    _wait_until(moved, f"the router, task-state and agent counted {TASKS} more tasks")
    agent_now, families, _ = _scrape(agent)
    assert "fxstream_agent_task_run_seconds" in families
    assert (
        _value(agent_now, "fxstream_agent_workers", endpoint=stack.endpoint_id, state="total") >= 1
    )
    assert _value(agent_now, "fxstream_agent_heartbeats_total", endpoint=stack.endpoint_id) >= 1
    supervisor, _, _ = _scrape(urls["supervisor"])
    for role in ("api", "router", "task-state", "endpoint"):
        assert ("fxstream_process_restarts_total", frozenset({("role", role)})) in supervisor
        assert _value(supervisor, "fxstream_process_up", role=role) == 1.0


def test_status_summarises_the_metrics(shared_platform: PrivatePlatform) -> None:
    _run_tasks(shared_platform, 5)

    def summarised() -> bool:
        metrics = shared_platform.platform.status().metrics
        return metrics is not None and metrics.tasks.get("succeeded", 0) >= 5

    _wait_until(summarised, "status's summary counts the succeeded tasks")
    status = shared_platform.platform.status()
    assert status.metrics is not None, status.metrics_error
    summary = status.metrics
    local = summary.endpoints[shared_platform.endpoint_id]
    assert local.up and local.workers_total >= 1
    assert {"router", "task-state"} <= set(summary.lag)
    assert "api" in summary.restarts
    lines = "\n".join(summary.lines())
    assert "tasks since the API started" in lines and "restarts" in lines
