"""The batch engine on a real Slurm: blocks are Slurm jobs on a single-node cluster.

The cluster is Debian's slurm-wlm 22.05 with munge, started by
``fxstream.ops.slurm`` in a temporary directory (installed by ``./fx test`` when
missing) and stopped after the module, by PID. The engine's settings are the Slurm
example of docs/hpc.md, with the site's values replaced by the test cluster's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fxstream.agent import BLOCK_LOST
from fxstream.agent.batch_engine import BatchEngine
from fxstream.agent.batch_settings import BatchSettings
from fxstream.ops.slurm import SlurmCluster
from tests.hpc.support import (
    REPO,
    RUNNER,
    WORKER_INIT,
    engine_processes,
    item,
    label_for,
    wait_until,
)

pytestmark = [
    pytest.mark.hpc,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a single-node Slurm cluster needs root (slurmd runs jobs)"
    ),
]

TIMEOUT = 120.0


def documented_slurm_endpoint() -> dict[str, Any]:
    """The Slurm endpoint YAML of docs/hpc.md."""
    text = (REPO / "docs" / "hpc.md").read_text()
    section = text.split("### An endpoint on a Slurm cluster", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "docs/hpc.md lost its Slurm example"
    loaded: dict[str, Any] = yaml.safe_load(block.group(1))
    return loaded


@pytest.fixture
def engine(slurm: SlurmCluster, tmp_path: Path) -> Iterator[BatchEngine]:
    batch = dict(documented_slurm_endpoint()["batch"])
    batch.update(
        partition=slurm.partition,
        account=None,  # no accounting on the test cluster
        address="127.0.0.1",
        worker_init=WORKER_INIT,
        max_workers_per_node=1,
        max_idletime_s=5,
        strategy_period_s=1,
        status_period_s=2,
    )
    run_dir = tmp_path / "run"
    engine = BatchEngine(BatchSettings(**batch), RUNNER, run_dir, label=label_for(run_dir))
    try:
        yield engine
    finally:
        engine.close()
    wait_until(lambda: not slurm.jobs(), 60, "the engine's Slurm jobs to end")
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")


def test_a_block_is_a_slurm_job_that_runs_tasks_and_is_released_when_idle(
    slurm: SlurmCluster, engine: BatchEngine
) -> None:
    assert not slurm.jobs(), "no block before there is work (init_blocks 0)"
    futures = [engine.submit(item(b"sleep", b"3")) for _ in range(2)]
    wait_until(lambda: "RUNNING" in slurm.jobs().values(), TIMEOUT, "a block to run as a Slurm job")
    outcomes = [f.result(TIMEOUT) for f in futures]
    assert all(o.ok and o.value == b"3" for o in outcomes), outcomes
    assert engine.counts().blocks_running >= 1
    wait_until(lambda: not slurm.jobs(), 90, "the idle block's job to be released")
    wait_until(
        lambda: engine.counts().blocks_running == 0, 60, "the released block to be counted gone"
    )


def test_a_job_cancelled_mid_task_fails_it_retryably_and_a_new_block_runs_it(
    slurm: SlurmCluster, engine: BatchEngine, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    work = item(b"mark-then-wait", f"{marker}|120".encode())
    future = engine.submit(work)
    wait_until(marker.exists, TIMEOUT, "the task to start in a Slurm job")
    running = [job for job, state in slurm.jobs().items() if state == "RUNNING"]
    assert len(running) == 1, slurm.jobs()
    slurm.cancel(running[0])  # as the scheduler would at the walltime, or an operator
    lost = future.result(TIMEOUT)
    assert lost.error_type == BLOCK_LOST and lost.retryable, lost
    # The agent retries a retryable loss: the same item again runs on a new block.
    marker.unlink()
    again = engine.submit(item(b"mark-then-wait", f"{marker}|1".encode())).result(TIMEOUT)
    assert again.ok and again.value == b"waited", again
    assert running[0] not in slurm.jobs()
