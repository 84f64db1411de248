"""The HPC tests' real single-node Slurm cluster: started at first use, stopped (by PID,
with any job step left) when the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fxstream.ops.slurm import SlurmCluster, single_node_slurm
from tests.hpc.support import slurm_conf_set


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The cluster, with ``SLURM_CONF`` set in this process's environment while it runs
    (the engine's provider, and agents started from here, run sbatch, squeue, scancel)."""
    with single_node_slurm(tmp_path_factory.mktemp("slurm")) as cluster, slurm_conf_set(cluster):
        yield cluster
