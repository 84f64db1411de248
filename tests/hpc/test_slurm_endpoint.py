"""An endpoint whose blocks are Slurm jobs, through the whole platform: SDK -> router ->
agent (``engine: htex``) -> a worker in a Slurm job -> result.

Real broker, service and agent (the session's shared private platform; the endpoint is
this module's own) and a real single-node Slurm (``fxstream.ops.slurm``). A block
cancelled with ``scancel`` while its tasks run loses none of them, though they were
submitted without ``max_retries``: a lost block (``BlockLost``) is never the task's
doing, so the agent runs them again on a block that replaces it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.ops.private import ExtraEndpoint
from fxstream.ops.slurm import SlurmCluster
from fxstream.sdk import Executor
from tests.e2e.stack import Stack, added_endpoint
from tests.hpc.support import WORKER_INIT, wait_until
from tests.hpc.test_slurm_engine import documented_slurm_endpoint

pytestmark = [
    pytest.mark.platform,
    pytest.mark.hpc,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a single-node Slurm cluster needs root (slurmd runs jobs)"
    ),
]

RESULT_S = 180.0


def job_and_wait(marker_dir: str, seconds: float) -> str:
    """Note this task's Slurm job in ``marker_dir``, wait, and return the job's id."""
    import os
    import pathlib
    import time

    job = os.environ.get("SLURM_JOB_ID", "")
    pathlib.Path(marker_dir, f"{job}-{os.getpid()}-{time.time_ns()}").write_text(job)
    time.sleep(seconds)
    return job


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    return shared_platform


@pytest.fixture(scope="module")
def endpoint(stack: Stack, slurm: SlurmCluster) -> Iterator[ExtraEndpoint]:
    batch = dict(documented_slurm_endpoint()["batch"])
    batch.update(
        partition=slurm.partition,
        account=None,
        address="127.0.0.1",
        worker_init=WORKER_INIT,
        max_workers_per_node=2,
        max_blocks=1,
        # Short: the module's teardown waits for the idle block's job to end.
        max_idletime_s=10,
        strategy_period_s=1,
        status_period_s=2,
    )
    batch = {key: value for key, value in batch.items() if value is not None}
    with added_endpoint(
        stack, "slurm", workers=2, prefetch=2, engine="htex", batch=batch, store_url=None
    ) as extra:
        yield extra
    wait_until(lambda: not slurm.jobs(), 60, "the endpoint's Slurm jobs to end")


def test_tasks_run_in_slurm_jobs_and_a_cancelled_block_loses_none(
    stack: Stack, slurm: SlurmCluster, endpoint: ExtraEndpoint, tmp_path: Path
) -> None:
    markers = tmp_path / "started"
    markers.mkdir()
    with stack.client() as owner:
        function = owner.register_function(job_and_wait)
        with Executor(endpoint_id=endpoint.endpoint_id, client=owner) as executor:
            warm = [executor.submit_to_registered_function(function, (str(markers), 0.1))]
            first_job = warm[0].result(timeout=RESULT_S)
            assert first_job, "the task ran outside a Slurm job"
            futures = [
                executor.submit_to_registered_function(function, (str(markers), 8.0))
                for _ in range(2)
            ]
            wait_until(lambda: len(list(markers.iterdir())) >= 3, RESULT_S, "both tasks to start")
            running = [job for job, state in slurm.jobs().items() if state == "RUNNING"]
            assert running, slurm.jobs()
            cancelled_at = time.monotonic()
            for job in running:
                slurm.cancel(job)
            jobs = [future.result(timeout=RESULT_S) for future in futures]
    assert all(job and job not in running for job in jobs), (jobs, running)
    assert time.monotonic() - cancelled_at < RESULT_S
    started_in = {path.read_text() for path in markers.iterdir()}
    assert set(running) <= started_in, "the cancelled block ran them first"
