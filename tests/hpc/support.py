"""Shared helpers of the batch-engine tests: work items, waiting, and the engine's processes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from fxstream.agent import WorkItem
from fxstream.ops.slurm import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
RUNNER = "tests.agent.runners:load_behaviour"
# Workers started by a provider import the test runners from the repository.
WORKER_INIT = f"export PYTHONPATH={REPO}"


def item(code: bytes, payload: bytes = b"", *, walltime_s: float | None = None) -> WorkItem:
    """A work item for the behaviour named ``code`` (tests/agent/runners.py)."""
    sha = hashlib.sha256(code).hexdigest()
    return WorkItem(
        task_id=str(uuid.uuid4()),
        function_id=f"fn-{sha[:16]}",
        code_sha256=sha,
        code=code,
        payload=payload,
        walltime_s=walltime_s,
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"after {timeout_s:.0f} s: {what}")


def engine_processes(run_dir: Path) -> list[psutil.Process]:
    """The live processes of the engine whose run directory is ``run_dir``: its blocks'
    worker pools (their command lines name the directory), their workers (whose
    environment has the block's job name, ``parsl.<label>.block-N``; the tests' engines
    are labelled by their run directory's parent, :func:`label_for`), and its
    interchange (a child of this process)."""
    mine = str(run_dir)
    job_prefix = f"parsl.{label_for(run_dir)}.block-"
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        command = " ".join(proc.info["cmdline"] or ())
        if "parsl.executors.high_throughput" in command and (
            mine in command or proc.pid in children
        ):
            found.append(proc)
        elif "multiprocessing" in command:
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("JOBNAME", "").startswith(job_prefix):
                    found.append(proc)
    return found


def label_for(run_dir: Path) -> str:
    """The executor label a test gives the engine of ``run_dir`` (unique per test)."""
    return f"fx{abs(hash(str(run_dir))) % 10**8}"


@contextlib.contextmanager
def slurm_conf_set(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """``cluster``'s ``SLURM_CONF`` set in this process's environment for the block (the
    engine's provider and agents started from here run sbatch, squeue, scancel), then the
    previous value put back."""
    previous = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
