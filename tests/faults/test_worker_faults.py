"""A warm worker dies mid-task (os._exit on a first attempt; SIGKILL from outside): the agent
retries the task (WorkerLost is an infrastructure failure) and every future gets its value once."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults.harness import (
    FaultStack,
    Workload,
    add_mixed,
    check_exactly_once,
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


def exit_on_first_attempt(x: int, marker_dir: str) -> int:
    # The marker outlives the worker: the retry (in a fresh worker) finds it and succeeds.
    marker = Path(marker_dir) / f"{x}.tried"
    if not marker.exists():
        marker.touch()
        os._exit(1)
    return 2 * x


def test_a_worker_that_exits_mid_task_is_retried_and_the_retry_succeeds(
    fault_stack: FaultStack, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    client = fault_stack.client()
    try:
        with executor_on(fault_stack, client, max_retries=2) as executor:
            workload = Workload()
            crashing = 0
            # 800 tasks, one crash per hundred: each crash costs a worker restart (about
            # 2.5 s of this test's time), so eight crashes, not more.
            for start in range(0, 800, 100):
                add_mixed(workload, executor, double, nap_double, range(start, start + 99))
                workload.submit(
                    executor, exit_on_first_attempt, (start + 99, str(markers)), 2 * (start + 99)
                )
                crashing += 1
            check_exactly_once(fault_stack, client, workload)
        # Every crashing task really crashed once (its marker), and still succeeded.
        assert len(list(markers.iterdir())) == crashing
        assert client.duplicate_results == 0
    finally:
        client.close()


def test_workers_sigkilled_mid_run_are_replaced_and_their_tasks_retried(
    fault_stack: FaultStack,
) -> None:
    endpoint = fault_stack.services.endpoint
    client = fault_stack.client()
    killed = 0
    try:
        with executor_on(fault_stack, client, max_retries=2) as executor:
            workload = mixed_workload(executor, double, nap_double, slow_every=20)
            workload.wait_for_progress(0.1)
            # Two rounds, each killing every worker once: a task dies at most twice, which
            # max_retries=2 covers. The pause lets the replacements start (a worker killed
            # while starting counts as a start failure, which delays the next respawn).
            for _ in range(2):
                agent_pid = endpoint.pid()
                assert agent_pid is not None
                workers = worker_processes(agent_pid)
                assert workers, "the agent has no worker processes"
                for worker in workers:
                    os.kill(worker.pid, signal.SIGKILL)
                    killed += 1
                assert workload.done < len(workload.futures), "the kill landed after the run"
                old = {w.pid for w in workers}
                wait_until(
                    functools.partial(_replaced, agent_pid, old),
                    timeout_s=30,
                    what="the killed workers were replaced",
                )
                time.sleep(1.5)
            check_exactly_once(fault_stack, client, workload)
        assert killed >= 2
        assert client.duplicate_results == 0
    finally:
        client.close()


def _replaced(agent_pid: int, old: set[int]) -> bool:
    current = {w.pid for w in worker_processes(agent_pid)}
    return len(current) >= len(old) and not current & old
