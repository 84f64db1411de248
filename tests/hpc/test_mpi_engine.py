"""MPI functions on the batch engine's MPI mode: real MPICH ranks in a real 2-node Slurm job.

The cluster is Debian's slurm-wlm with two ``slurmd`` on this machine (``vm`` and
``localhost``, ``fxstream.ops.slurm`` with ``extra_nodes``), started for this module and
stopped after it, by PID. The engine's settings are the MPI example of docs/hpc.md, with
the site's values replaced by the test cluster's; its one block is a 2-node Slurm job
kept for the module's tests. Each task is an :class:`~fxstream.sdk.MPIFunction` running a
program compiled here with ``mpicc``: Parsl's MPI mode gives it nodes and sets
``$PARSL_MPI_PREFIX``, MPICH's ``mpiexec -hosts <those nodes>`` starts its ranks (both
"nodes" being this machine, Hydra starts every rank here itself, not through ``srun``:
checked by hand, each rank's ``SLURMD_NODENAME`` is the batch host's), and each rank
prints its rank, the world size and the nodes Parsl gave its task (``PARSL_MPI_NODELIST``).

"Sharing 4 slots correctly" on one machine means placement as Parsl and mpiexec are told
it: which nodes each task was given (no node to two tasks at once), how many ranks it
got, and that a task waits for nodes while another holds them; never where the ranks
physically ran, speed or CPU binding (the two nodes are this machine's 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fxstream.agent import RESOURCES_UNAVAILABLE, WorkItem, WorkOutcome
from fxstream.agent.batch_engine import BatchEngine
from fxstream.agent.batch_settings import BatchSettings
from fxstream.agent.worker_process import DEFAULT_RUNNER
from fxstream.ops.install import ensure_mpi
from fxstream.ops.slurm import SlurmCluster, single_node_slurm
from fxstream.sdk import MPIFunction, ShellResult
from tests.hpc.support import (
    REPO,
    WORKER_INIT,
    engine_processes,
    label_for,
    slurm_conf_set,
    wait_until,
)

pytestmark = [
    pytest.mark.hpc,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a Slurm test cluster needs root (slurmd runs jobs)"
    ),
]

TIMEOUT = 120.0
SECOND_NODE = "localhost"

HELLO_C = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *node = getenv("PARSL_MPI_NODELIST");
    const char *prefix = getenv("PARSL_MPI_PREFIX");
    printf("tag=%s rank=%d size=%d node=%s\n", argc > 1 ? argv[1] : "-", rank, size,
           node ? node : "-");
    if (rank == 0) printf("prefix=%s\n", prefix ? prefix : "-");
    MPI_Finalize();
    return 0;
}
"""

# Each rank notes when it started, optionally waits for another task's first rank
# (proof both ran at once) and for a release file, then becomes the MPI program.
RANK_SH = r"""#!/bin/sh
dir=$(dirname "$0")
date +%s.%N > "$dir/$1.started.$PMI_RANK"
wait_for() {
    i=0
    while [ ! -e "$1" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    [ -e "$1" ]
}
if [ "$2" != - ]; then wait_for "$dir/$2.started.0" || { echo "no $2" >&2; exit 9; }; fi
if [ "$3" != - ]; then wait_for "$dir/$3" || { echo "no $3" >&2; exit 10; }; fi
exec "$dir/hello" "$1"
"""


def documented_mpi_endpoint() -> dict[str, Any]:
    """The MPI endpoint YAML of docs/hpc.md."""
    text = (REPO / "docs" / "hpc.md").read_text()
    section = text.split("### An MPI endpoint on a Slurm cluster", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "docs/hpc.md lost its MPI example"
    loaded: dict[str, Any] = yaml.safe_load(block.group(1))
    return loaded


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``hello`` (built with MPICH's mpicc) and ``rank.sh``."""
    mpicc = ensure_mpi()["mpicc"]
    directory = tmp_path_factory.mktemp("mpi")
    (directory / "hello.c").write_text(HELLO_C)
    subprocess.run(
        [mpicc, "-o", str(directory / "hello"), str(directory / "hello.c")],
        check=True,
        capture_output=True,
    )
    script = directory / "rank.sh"
    script.write_text(RANK_SH)
    script.chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A Slurm cluster of two nodes on this machine, ``SLURM_CONF`` set while it runs."""
    directory = tmp_path_factory.mktemp("slurm2")
    with (
        single_node_slurm(directory, extra_nodes=(SECOND_NODE,)) as cluster,
        slurm_conf_set(cluster),
    ):
        yield cluster


@pytest.fixture(scope="module")
def engine(
    two_nodes: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BatchEngine]:
    batch = dict(documented_mpi_endpoint()["batch"])
    batch.update(
        partition=two_nodes.partition,
        account=None,  # no accounting on the test cluster
        address="127.0.0.1",
        worker_init=WORKER_INIT,
        init_blocks=1,
        min_blocks=1,  # one block, kept for the module's tests
        strategy_period_s=1,
        status_period_s=2,
    )
    settings = BatchSettings(**batch)
    settings.validate()
    run_dir = tmp_path_factory.mktemp("mpi-engine") / "run"
    engine = BatchEngine(settings, DEFAULT_RUNNER, run_dir, label=label_for(run_dir))
    try:
        assert engine.wait_ready(timeout=TIMEOUT), "the 2-node block's workers never connected"
        yield engine
    finally:
        engine.close()
    wait_until(lambda: not two_nodes.jobs(), 60, "the engine's Slurm job to end")
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")


def mpi_item(command: str, resources: dict[str, int] | None, **kwargs: str) -> WorkItem:
    """A work item running ``MPIFunction(command)(**kwargs)`` (the trusted pickle runner)."""
    code = pickle.dumps(MPIFunction(command, walltime=TIMEOUT))
    sha = hashlib.sha256(code).hexdigest()
    return WorkItem(
        task_id=str(uuid.uuid4()),
        function_id=f"fn-{sha[:16]}",
        code_sha256=sha,
        code=code,
        payload=pickle.dumps(((), kwargs)),
        resources=resources,
    )


def shell_result(outcome: WorkOutcome) -> ShellResult:
    assert outcome.ok and outcome.value is not None, outcome
    result = pickle.loads(outcome.value)
    assert isinstance(result, ShellResult)
    assert result.returncode == 0, result
    return result


def ranks(result: ShellResult) -> list[tuple[str, int, int, str]]:
    """``(tag, rank, size, node)`` of each rank's line."""
    found = re.findall(r"^tag=(\S+) rank=(\d+) size=(\d+) node=(\S+)$", result.stdout, re.M)
    return [(tag, int(rank), int(size), node) for tag, rank, size, node in found]


def started(programs: Path, tag: str) -> list[float]:
    return [float(p.read_text()) for p in programs.glob(f"{tag}.started.*")]


def test_a_4_rank_task_on_2_nodes_reports_4_distinct_ranks(
    engine: BatchEngine, programs: Path, two_nodes: SlurmCluster
) -> None:
    spec = {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4}
    result = shell_result(engine.submit(mpi_item(f"{programs}/hello four", spec)).result(TIMEOUT))
    found = ranks(result)
    assert sorted(rank for _, rank, _, _ in found) == [0, 1, 2, 3], result
    assert {size for _, _, size, _ in found} == {4}
    # Each rank's task was given both nodes.
    assert {tuple(sorted(n.split(","))) for _, _, _, n in found} == {tuple(sorted(two_nodes.nodes))}
    prefix = re.search(r"^prefix=(.*)$", result.stdout, re.M)
    assert prefix is not None and prefix.group(1).startswith("mpiexec -n 4 -ppn 2 -hosts ")
    hosts = prefix.group(1).split("-hosts ", 1)[1].split()[0].split(",")
    assert sorted(hosts) == sorted(two_nodes.nodes)
    assert result.cmd == f"$PARSL_MPI_PREFIX {programs}/hello four"


def test_two_concurrent_2_rank_tasks_share_the_blocks_4_slots(
    engine: BatchEngine, programs: Path, two_nodes: SlurmCluster
) -> None:
    spec = {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2}
    # Each task's ranks wait for the other task's first rank: both end well only if they
    # ran at the same time.
    first = engine.submit(mpi_item(f"{programs}/rank.sh a b -", spec))
    second = engine.submit(mpi_item(f"{programs}/rank.sh b a -", spec))
    results = {tag: shell_result(f.result(TIMEOUT)) for tag, f in (("a", first), ("b", second))}
    nodes = {}
    for tag, result in results.items():
        found = ranks(result)
        assert sorted(rank for _, rank, _, _ in found) == [0, 1], result
        assert {(t, size) for t, _, size, _ in found} == {(tag, 2)}
        given = {node for _, _, _, node in found}
        assert len(given) == 1 and "," not in next(iter(given)), (tag, given)
        nodes[tag] = given.pop()
    assert {nodes["a"], nodes["b"]} == set(two_nodes.nodes), nodes  # one node each


def test_a_task_waits_for_nodes_another_task_holds(engine: BatchEngine, programs: Path) -> None:
    release = programs / "release-c"
    whole = {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4}
    holder = engine.submit(mpi_item(f"{programs}/rank.sh c - release-c", whole))
    wait_until(lambda: len(started(programs, "c")) == 4, TIMEOUT, "the 2-node task to start")
    # One of the block's two workers is free, but no node is: the 1-node task must wait.
    one = {"num_nodes": 1, "ranks_per_node": 1, "num_ranks": 1}
    waiting = engine.submit(mpi_item(f"{programs}/rank.sh d - -", one))
    time.sleep(5)
    assert not started(programs, "d"), "a task started on nodes another task holds"
    released_at = time.time()
    release.touch()
    shell_result(holder.result(TIMEOUT))
    result = shell_result(waiting.result(TIMEOUT))
    assert [rank for _, rank, _, _ in ranks(result)] == [0]
    assert min(started(programs, "d")) >= released_at


def test_what_a_block_cannot_give_is_refused_at_once(engine: BatchEngine, programs: Path) -> None:
    too_many = engine.submit(mpi_item(f"{programs}/hello", {"num_nodes": 3})).result(10)
    assert too_many.error_type == RESOURCES_UNAVAILABLE and not too_many.retryable
    assert "asks for 3 nodes" in too_many.error_message
    assert "nodes_per_block" in too_many.error_message
    none = engine.submit(mpi_item(f"{programs}/hello", None)).result(10)
    assert none.error_type == RESOURCES_UNAVAILABLE
    assert "resource_specification" in none.error_message
