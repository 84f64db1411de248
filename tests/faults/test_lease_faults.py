"""An agent lost for longer than its lease (SIGSTOP, then SIGCONT): its tasks go to the other
agent of the endpoint, the woken zombie neither crashes nor commits a duplicate result, and
across the rebalances every task has exactly one committed result."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from fxstream.sdk import Executor
from tests.faults.harness import (
    LEASE_S,
    FaultStack,
    check_exactly_once,
    describe,
    executor_on,
    mixed_workload,
    wait_until,
    worker_processes,
)

pytestmark = pytest.mark.faults


def double(x: int) -> int:
    return 2 * x


def nap_double(x: int, nap_s: float) -> int:
    time.sleep(nap_s)
    return 2 * x


def test_an_agent_stopped_past_its_lease_hands_its_tasks_over_and_its_zombie_is_fenced(
    fault_stack: FaultStack,
) -> None:
    # The local agent and a second one ("standby") serve the endpoint, 2 partitions each.
    fault_stack.configure_agent("standby")
    standby = fault_stack.agent("standby")
    standby.start()
    local = fault_stack.services.endpoint
    pid = local.pid()
    assert pid is not None
    client = fault_stack.client()
    stopped = False
    try:
        with executor_on(fault_stack, client) as executor:
            wait_until(
                lambda: _both_serve(executor, pid, standby.pid()),
                timeout_s=60,
                what="both agents answer tasks (each holds partitions of the endpoint's queue)",
            )
            workload = mixed_workload(executor, double, nap_double, slow_every=20)
            workload.wait_for_progress(0.1)
            zombie_workers = {str(w.pid) for w in worker_processes(pid)}
            stopped_at = time.time()
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            assert workload.done < len(workload.futures)
            # The standby takes over the lost agent's partitions once the lease ran out.
            time.sleep(2 * LEASE_S)
            woken_at = time.time()
            os.kill(pid, signal.SIGCONT)
            stopped = False
            report = check_exactly_once(fault_stack, client, workload)
            # Tasks the zombie took before it stopped belong to partitions it lost: the group
            # generation check must refuse its offsets and abort the transaction, so no answer
            # of those may be committed after it woke (the standby answered them). Tasks the
            # zombie answered past a partition's committed offset before it stopped are named
            # in the commit's metadata, so the standby settles them without running them.
            zombie_twice = {
                task_id: records
                for task_id, records in report.committed_twice.items()
                if any(
                    r.worker.rpartition(":")[2] in zombie_workers
                    and (r.result.timings.dequeued_at or 0) < stopped_at
                    and (r.result.timings.result_published_at or 0) >= woken_at
                    for r in records
                )
            }
            assert not zombie_twice, (
                f"the woken zombie committed {len(zombie_twice)} duplicate results, e.g. "
                f"{describe(next(iter(zombie_twice.values())))}"
            )
            twice = report.committed_twice
            assert not twice, (
                f"{len(twice)} tasks have two committed results after the partitions moved, "
                f"e.g. {describe(next(iter(twice.values())))}"
            )
            # The zombie carries on: alive, back in the group, and serving again.
            assert local.pid() == pid, f"the woken agent exited:\n{fault_stack.log(local)[-3000:]}"
            wait_until(
                lambda: _both_serve(executor, pid, standby.pid()),
                timeout_s=60,
                what="the woken agent rejoined the group and answers tasks again",
            )
            again = mixed_workload(executor, double, nap_double, count=500)
            twice = check_exactly_once(fault_stack, client, again).committed_twice
            assert not twice, (
                f"{len(twice)} tasks have two committed results after the zombie rejoined, "
                f"e.g. {describe(next(iter(twice.values())))}"
            )
            assert local.pid() == pid, f"the woken agent exited:\n{fault_stack.log(local)[-3000:]}"
        # No future resolved twice and results.<user> holds one committed result per task,
        # so the SDK had nothing to suppress.
        assert client.duplicate_results == 0
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        client.close()


def _both_serve(executor: Executor, first: int, second: int | None) -> bool:
    """Whether a round of tasks is answered by workers of both agents."""
    assert second is not None
    futures = [executor.submit(double, i) for i in range(64)]
    concurrent.futures.wait(futures, timeout=30)
    workers = {f.worker.rpartition(":")[2] for f in futures if f.done() and f.worker}
    return all(workers & {str(w.pid) for w in worker_processes(agent)} for agent in (first, second))
