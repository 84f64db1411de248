"""Two routers in one consumer group, one SIGKILLed under load: every task routed exactly once.

The fault stack's supervised router (instance 0) gets a second router process beside it
(``fxstream-service worker --only router --instance 1``: the process the supervisor starts
for ``router_instances = 2``), so the two share the router's consumer group, each with
its own transactional id. Tasks stream in; router 0 is SIGKILLed by PID mid-stream and
the supervisor restarts it (its successor, same transactional id, aborts its open
transaction), which makes router 1 give partitions up while it routes. Every task must
then have exactly one committed dispatch on ``tasks.ep.<endpoint>`` and exactly one
committed result, and none may be lost.

The second test stops router 1 (SIGSTOP) for longer than its consumer session, so the
group hands its partitions to router 0, and then wakes it (SIGCONT): the zombie must
commit nothing it took or held before it stopped (aiokafka has no KIP-447 fencing; the
router notices its own stall instead, see docs/faults.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from fxstream.ops import ManagedProcess
from fxstream.sdk import Client, Executor
from fxstream.service.processors import DEFAULT_APP_ID
from tests.faults.harness import (
    FaultStack,
    Workload,
    check_exactly_once,
    describe,
    dispatch_counts,
    executor_on,
    wait_until,
)

pytestmark = pytest.mark.faults

ROUTER_GROUP = f"{DEFAULT_APP_ID}-router"
TASKS = 2_000
WAVES = 40
WAVE_GAP_S = 0.45


def noop(x: int) -> int:
    return x


def second_router(stack: FaultStack) -> ManagedProcess:
    """Router instance 1 of the stack's platform, started as the supervisor would."""
    router = stack.services.router
    return ManagedProcess(
        name="router-1",
        argv=[*router.argv, "--instance", "1"],
        pid_file=stack.home / "services" / "test-router-1.pid",
        log_file=stack.home / "logs" / "service-router-1.log",
        env=router.env,
        cwd=stack.services.state_dir,
        die_with_parent=True,
    )


def router_partitions(stack: FaultStack, topic: str) -> list[set[int]]:
    """Per member of the router group owning partitions of ``topic``, those partitions."""
    admin = stack.admin()  # kept referenced: its futures never resolve once it is freed
    futures = admin.describe_consumer_groups([ROUTER_GROUP], request_timeout=30)
    group = futures[ROUTER_GROUP].result(timeout=60)
    owned = [
        {tp.partition for tp in member.assignment.topic_partitions if tp.topic == topic}
        for member in group.members
    ]
    return [partitions for partitions in owned if partitions]


@pytest.fixture
def two_routers(fault_stack: FaultStack) -> Iterator[ManagedProcess]:
    """Router 1 beside the stack's router 0, both owning partitions of the user's topic;
    stopped by PID (continued first) after the test."""
    extra = second_router(fault_stack)
    try:
        with fault_stack.client() as client:
            submissions = fault_stack.catalogue.from_user(client.user_id)
        extra.start()
        wait_until(
            lambda: len(router_partitions(fault_stack, submissions)) == 2,
            timeout_s=60,
            what=f"both routers own partitions of {submissions}",
        )
        yield extra
    finally:
        pid = extra.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        extra.stop(timeout_s=30)


def stream(executor: Executor, workload: Workload, wave: int) -> None:
    """Submit wave ``wave`` of the no-op tasks (the caller pauses before the next)."""
    per_wave = TASKS // WAVES
    for i in range(wave * per_wave, (wave + 1) * per_wave):
        workload.submit(executor, noop, (i,), i)


def check_routed_once(stack: FaultStack, client: Client, workload: Workload) -> None:
    """Every task done once with its value; one committed result and one committed
    dispatch each."""
    report = check_exactly_once(stack, client, workload)
    twice = list(report.committed_twice.items())[:3]
    assert not twice, "; ".join(f"{task}: {describe(records)}" for task, records in twice)
    assert client.duplicate_results == 0
    routed = dispatch_counts(stack, workload.task_ids)
    assert set(routed) == set(workload.task_ids), "a task was never dispatched"
    assert max(routed.values()) == 1, routed.most_common(3)


def test_two_routers_one_sigkilled_under_load_route_every_task_exactly_once(
    fault_stack: FaultStack, two_routers: ManagedProcess
) -> None:
    router_0 = fault_stack.services.router
    client = fault_stack.client()
    try:
        with executor_on(fault_stack, client) as executor:
            workload = Workload()
            # ~18 s of submissions: the kill lands mid-stream, and so does the rebalance
            # that gives router 0's successor its partitions (the group waits for the
            # killed member's session, 10 s, to expire).
            for wave in range(WAVES):
                stream(executor, workload, wave)
                if wave == 8:
                    # Killed right after a wave is handed over, so its tasks are in flight
                    # (after the pause the platform has usually finished them all).
                    assert workload.done < len(workload.futures)
                    assert router_0.kill(), "router 0 was not running"
                if wave == 11:
                    # The supervisor restarts it after its backoff; start() does it now.
                    router_0.start()
                time.sleep(WAVE_GAP_S)
            check_routed_once(fault_stack, client, workload)
        # Router 1 routed throughout and gave partitions up to router 0's successor.
        log = fault_stack.log(two_routers)
        assert "giving up" in log, log[-3000:]
        assert two_routers.pid() is not None, "router 1 died"
    finally:
        client.close()


def test_a_router_stopped_past_its_session_commits_nothing_it_held_when_it_wakes(
    fault_stack: FaultStack, two_routers: ManagedProcess
) -> None:
    zombie = two_routers
    pid = zombie.pid()
    assert pid is not None
    client = fault_stack.client()
    stopped_at = 0.0
    try:
        with executor_on(fault_stack, client) as executor:
            workload = Workload()
            for wave in range(WAVES):
                stream(executor, workload, wave)
                if wave == 6:
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                if wave == 36:
                    # Past the routers' 10 s session: router 0 owns every partition now.
                    assert time.monotonic() - stopped_at > 12
                    os.kill(pid, signal.SIGCONT)
                time.sleep(WAVE_GAP_S)
            check_routed_once(fault_stack, client, workload)
        log = fault_stack.log(zombie)
        assert "stood still" in log, log[-3000:]
        assert zombie.pid() == pid, "the woken router died"
    finally:
        client.close()
