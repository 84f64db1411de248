"""An endpoint agent SIGKILLed mid-batch and restarted: no task lost, none delivered twice."""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import (
    FaultStack,
    check_exactly_once,
    describe,
    executor_on,
    mixed_workload,
)

pytestmark = pytest.mark.faults


def double(x: int) -> int:
    return 2 * x


def nap_double(x: int, nap_s: float) -> int:
    time.sleep(nap_s)
    return 2 * x


def test_an_agent_killed_mid_batch_and_restarted_loses_and_repeats_nothing(
    fault_stack: FaultStack,
) -> None:
    endpoint = fault_stack.services.endpoint
    client = fault_stack.client()
    try:
        with executor_on(fault_stack, client) as executor:
            workload = mixed_workload(executor, double, nap_double)
            workload.wait_for_progress(0.2)
            assert endpoint.kill(), "the agent was not running"
            in_flight = len(workload.futures) - workload.done
            assert in_flight > 0, "every task finished before the kill: nothing was in flight"
            endpoint.start()
            report = check_exactly_once(fault_stack, client, workload)
        # The promise above holds (each future once, nothing lost). Stronger: results commit
        # with their queue offsets, so nothing should be committed twice. It is not yet so:
        # offsets commit only up to the contiguous finished prefix, so results of tasks past a
        # slow one commit before their offsets, and the restarted agent runs them again.
        twice = report.committed_twice
        if twice:
            first = next(iter(twice.values()))
            pytest.xfail(
                f"{len(twice)} tasks committed twice on results.<user> (the SDK dropped "
                f"{report.suppressed_by_sdk}): answered past the committed offset prefix before "
                f"the kill, run again after it; e.g. {describe(first)}"
            )
    finally:
        client.close()
