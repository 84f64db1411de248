"""An endpoint agent SIGKILLed mid-batch and restarted: no task lost, none delivered twice,
and exactly one committed result per task on the results topic."""

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
        # Stronger than each future once: results.<user> holds exactly one committed result
        # per task. Tasks answered past a slow one commit before their queue offset can; the
        # commit's metadata names them, so the restarted agent settles them, never reruns.
        twice = report.committed_twice
        assert not twice, (
            f"{len(twice)} tasks have two committed results on results.<user> (the SDK dropped "
            f"{report.suppressed_by_sdk}), e.g. {describe(next(iter(twice.values())))}"
        )
        assert report.suppressed_by_sdk == 0
    finally:
        client.close()
