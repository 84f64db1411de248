"""The service's processes SIGKILLed mid-stream and restarted: the stream processors (router and
task-state, each its own supervised process) and the REST API (which agents fetch function code
from)."""

from __future__ import annotations

import time

import pytest

from fxstream.sdk import Client
from tests.faults.harness import (
    FaultStack,
    Workload,
    add_mixed,
    check_exactly_once,
    dispatch_counts,
    executor_on,
    wait_until,
)

pytestmark = pytest.mark.faults


def double(x: int) -> int:
    return 2 * x


def nap_double(x: int, nap_s: float) -> int:
    time.sleep(nap_s)
    return 2 * x


def twice(x: int) -> int:
    return x + x


def test_the_processors_killed_mid_stream_and_restarted_route_every_task_once(
    fault_stack: FaultStack,
) -> None:
    processors = [fault_stack.services.router, fault_stack.services.task_state]
    client = fault_stack.client()
    try:
        with executor_on(fault_stack, client) as executor:
            workload = Workload()
            # Submissions keep arriving before, during and after the outage, so the kill
            # lands while the router has batches in flight and task-state is folding.
            for wave in range(20):
                add_mixed(
                    workload, executor, double, nap_double, range(wave * 100, wave * 100 + 100)
                )
                time.sleep(0.1)
                if wave == 6:
                    assert workload.done < len(workload.futures)
                    for process in processors:
                        assert process.kill(), f"{process.name} was not running"
                if wave == 12:
                    # The supervisor restarts them after its backoff; start() does it now.
                    for process in processors:
                        process.start()
            check_exactly_once(fault_stack, client, workload)
        # The router never routes a task twice: a killed router's open transaction is
        # aborted, and its successor re-reads only batches that never committed. (Results
        # committed twice can still come from the agent's offset-prefix gap after a
        # rebalance: see docs/faults.md; check_exactly_once shows none reaches a future.)
        routed = dispatch_counts(fault_stack, workload.task_ids)
        assert set(routed) == set(workload.task_ids), "a task was never dispatched"
        assert max(routed.values()) == 1, routed.most_common(3)
    finally:
        client.close()


def test_the_api_killed_and_restarted_while_tasks_run_fails_no_task(
    fault_stack: FaultStack,
) -> None:
    api = fault_stack.services.api
    client = fault_stack.client()
    try:
        with executor_on(fault_stack, client) as executor:
            # Registered now, first run during the outage: the agent must fetch its code
            # from the API while the API is down.
            executor.register_function(twice)
            workload = Workload()
            add_mixed(workload, executor, double, nap_double, range(1_000))
            workload.wait_for_progress(0.2)
            assert api.kill(), "the API was not running"
            for i in range(1_000, 2_000):
                workload.submit(executor, twice if i % 2 else double, (i,), 2 * i)
            time.sleep(2.0)
            api.start()
            check_exactly_once(fault_stack, client, workload)
            # Registration works again once the API is back.
            fresh = Workload()
            wait_until(
                lambda: _registers(client),
                timeout_s=60,
                what="the restarted API registers a function",
            )
            for i in range(200):
                fresh.submit(executor, _tripled_minus_x, (i,), 2 * i)
            check_exactly_once(fault_stack, client, fresh)
        assert client.duplicate_results == 0
    finally:
        client.close()


def _tripled_minus_x(x: int) -> int:
    return 3 * x - x


def _registers(client: Client) -> bool:
    try:
        client.register_function(_tripled_minus_x)
    except Exception:
        return False
    return True
