"""An MPI function through the whole platform: SDK (``MPIFunction`` with a
``resource_specification``) -> router -> an endpoint's agent with ``engine: htex`` and
``batch.mpi`` -> Parsl's MPI mode on a 2-node Slurm job -> MPICH's ``mpiexec`` -> the
``ShellResult`` at the future.

Real broker, service and agent (the session's shared private platform; the endpoint is
this module's own), a real 2-node Slurm on this machine (``fxstream.ops.slurm``) and
MPICH from Debian. A task asking for more nodes than a block has is refused by the agent
before it runs (``ResourcesUnavailable``), not left waiting.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.ops.private import ExtraEndpoint
from fxstream.ops.slurm import SlurmCluster
from fxstream.sdk import Executor, MPIFunction, ShellResult, TaskExecutionFailed
from tests.e2e.stack import Stack, added_endpoint
from tests.hpc.support import WORKER_INIT, wait_until
from tests.hpc.test_mpi_engine import documented_mpi_endpoint, programs, ranks, two_nodes

pytestmark = [
    pytest.mark.platform,
    pytest.mark.hpc,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a Slurm cluster on this machine needs root (slurmd runs jobs)"
    ),
]

__all__ = ["programs", "two_nodes"]  # the MPI engine module's fixtures, used here too

RESULT_S = 240.0


@pytest.fixture(scope="module")
def endpoint(shared_platform: Stack, two_nodes: SlurmCluster) -> Iterator[ExtraEndpoint]:
    """The documented MPI endpoint (docs/hpc.md) on the 2-node cluster."""
    batch = dict(documented_mpi_endpoint()["batch"])
    batch.update(
        partition=two_nodes.partition,
        account=None,  # no accounting on the test cluster
        address="127.0.0.1",
        worker_init=WORKER_INIT,
        max_blocks=1,
        max_idletime_s=10,  # short: the teardown waits for the idle block's job to end
        strategy_period_s=1,
        status_period_s=2,
    )
    batch = {key: value for key, value in batch.items() if value is not None}
    with added_endpoint(
        shared_platform, "mpi", workers=2, prefetch=2, engine="htex", batch=batch, store_url=None
    ) as extra:
        yield extra
    wait_until(lambda: not two_nodes.jobs(), 90, "the endpoint's Slurm jobs to end")


def test_an_mpi_function_runs_on_4_ranks_through_the_platform(
    shared_platform: Stack, endpoint: ExtraEndpoint, programs: Path, two_nodes: SlurmCluster
) -> None:
    client = shared_platform.client()
    try:
        with Executor(
            endpoint_id=endpoint.endpoint_id,
            client=client,
            resource_specification={"num_nodes": 2, "ranks_per_node": 2},
        ) as executor:
            hello = MPIFunction(f"{programs}/hello {{tag}}", walltime=RESULT_S)
            future = executor.submit(hello, tag="platform")
            result = future.result(timeout=RESULT_S)
            assert isinstance(result, ShellResult) and result.returncode == 0, result
            found = ranks(result)
            assert sorted(rank for _, rank, _, _ in found) == [0, 1, 2, 3], result.stdout
            assert {size for _, _, size, _ in found} == {4}
            assert {tag for tag, _, _, _ in found} == {"platform"}
            # A task no block can hold is refused by the agent at once, naming the setting.
            executor.resource_specification = {"num_nodes": 3, "ranks_per_node": 1}
            refused = executor.submit(hello, tag="three")
            with pytest.raises(TaskExecutionFailed) as info:
                refused.result(timeout=RESULT_S)
            assert info.value.remote_type == "ResourcesUnavailable" and not info.value.retryable
            assert "nodes_per_block" in str(info.value)
    finally:
        client.close()
