"""funcX's scaling experiments through the batch engine (issue 16's ``bench scaling``).

*Weak scaling* (funcX's Figure 6 method): for each worker count W, one block of W
workers (Parsl's HighThroughputExecutor on the LocalProvider, through
:class:`~fxstream.agent.batch_engine.BatchEngine`, as an ``engine: htex`` endpoint
runs it) gets ``tasks_per_worker`` x W tasks of ``time.sleep(task_s)``; the figure is
the time from the first submit to the last result, and the efficiency the ideal time
(``tasks_per_worker`` x ``task_s``) over it. *Strong scaling*: a fixed batch of
``strong_tasks`` sleeps over the same worker counts (speed-up against the smallest).

The block is started, all its workers connected and each warmed by a round of short
sleeps before the clock starts: the figures are of scheduling and running, not of
starting processes (that is the cold start, ``bench coldstart``). With ``--slurm`` the
smallest size is run again with its block as a job of a real single-node Slurm
(``fxstream.ops.slurm``; root only).
Workers are processes: 256 of them use several GB of memory and, on 2 cores, take
minutes to start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from fxstream.agent.batch_engine import BatchEngine
from fxstream.agent.batch_settings import BatchSettings
from fxstream.agent.engine import WorkItem
from fxstream.agent.worker_process import DEFAULT_RUNNER

__all__ = ["DEFAULT_WORKERS", "run_scaling_bench"]

DEFAULT_WORKERS: Final = (8, 16, 32, 64, 128, 256)
"""The worker counts measured by default (funcX measured up to 131,072 on Theta)."""

_CODE: Final = pickle.dumps(time.sleep)
_SHA: Final = hashlib.sha256(_CODE).hexdigest()
_READY_S_PER_WORKER: Final = 2.0

Figures = dict[str, Any]


def _item(task_s: float) -> WorkItem:
    return WorkItem(
        task_id=str(uuid.uuid4()),
        function_id="sleep",
        code_sha256=_SHA,
        code=_CODE,
        payload=pickle.dumps(((task_s,), {})),
    )


@contextlib.contextmanager
def _engine(workers: int, run_dir: Path, provider: dict[str, Any]) -> Iterator[BatchEngine]:
    settings = BatchSettings(
        max_workers_per_node=workers,
        # Sleeping tasks: as many workers as asked, whatever the cores (Parsl's manager
        # otherwise starts one per cores_per_worker cores: 2 here).
        cores_per_worker=0.001,
        init_blocks=1,
        min_blocks=1,
        max_blocks=1,
        strategy="none",
        **provider,
    )
    engine = BatchEngine(settings, DEFAULT_RUNNER, run_dir, label=f"scaling{workers}")
    try:
        deadline = time.monotonic() + 60 + _READY_S_PER_WORKER * workers
        while engine.counts().workers_total < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {engine.counts().workers_total} of {workers} workers connected "
                    f"in {60 + _READY_S_PER_WORKER * workers:.0f} s (see {run_dir})"
                )
            time.sleep(0.5)
        yield engine
    finally:
        engine.close()


def _run(engine: BatchEngine, tasks: int, task_s: float) -> float:
    began = time.perf_counter()
    futures = [engine.submit(_item(task_s)) for _ in range(tasks)]
    failed = [o for o in (f.result(timeout=600) for f in futures) if not o.ok]
    elapsed = time.perf_counter() - began
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {tasks} tasks failed: {failed[0].error_type}: "
            f"{failed[0].error_message}"
        )
    return elapsed


def run_scaling_bench(
    *,
    console: Console,
    workers: Sequence[int] = DEFAULT_WORKERS,
    tasks_per_worker: int = 10,
    task_s: float = 1.0,
    strong_tasks: int = 512,
    slurm: bool = False,
    print_line: Callable[[str], None] = print,
) -> Figures:
    """Weak and strong scaling over ``workers``; print a table, then one JSON line."""
    if not workers or any(w < 1 for w in workers):
        raise ValueError(f"worker counts must be at least 1, not {list(workers)}")
    sizes = sorted(set(workers))
    weak_s: list[float] = []
    strong_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fxstream-scaling-") as scratch:
        for size in sizes:
            console.print(f"{size} workers: starting a block ...")
            with _engine(size, Path(scratch) / f"w{size}", {"provider": "local"}) as engine:
                _run(engine, 2 * size, 0.1)  # every worker started and warm: not timed
                weak_s.append(round(_run(engine, tasks_per_worker * size, task_s), 3))
                strong_s.append(round(_run(engine, strong_tasks, task_s), 3))
            console.print(f"  weak {weak_s[-1]:.2f} s, strong {strong_s[-1]:.2f} s")
        slurm_figures: Figures | None = None
        if slurm:
            slurm_figures = _slurm_run(console, Path(scratch), sizes[0], tasks_per_worker, task_s)
    ideal = tasks_per_worker * task_s
    efficiency = [round(ideal / s, 3) for s in weak_s]
    speedup = [round(strong_s[0] / s, 3) for s in strong_s]
    table = Table(title=f"scaling through the batch engine (sleep {task_s} s tasks)")
    for column in ("workers", "weak s", "weak efficiency", "strong s", "strong speed-up"):
        table.add_column(column, justify="right")
    for row in zip(sizes, weak_s, efficiency, strong_s, speedup, strict=True):
        table.add_row(*(str(cell) for cell in row))
    console.print(table)
    report: Figures = {
        "workers": sizes,
        "completion_s": weak_s,
        "efficiency": efficiency,
        "tasks_per_worker": tasks_per_worker,
        "task_s": task_s,
        "strong": {"tasks": strong_tasks, "completion_s": strong_s, "speedup": speedup},
        "slurm": slurm_figures is not None,
    }
    if slurm_figures is not None:
        report["slurm_run"] = slurm_figures
    print_line(json.dumps(report))
    return report


def _slurm_run(
    console: Console, scratch: Path, size: int, tasks_per_worker: int, task_s: float
) -> Figures:
    from fxstream.ops.slurm import single_node_slurm

    console.print(f"{size} workers in a Slurm job: starting a single-node Slurm ...")
    with single_node_slurm(scratch / "slurm") as cluster:
        previous = os.environ.get("SLURM_CONF")
        os.environ.update(cluster.env)
        try:
            provider = {"provider": "slurm", "partition": cluster.partition, "exclusive": False}
            with _engine(size, scratch / "slurm-run", provider) as engine:
                _run(engine, 2 * size, 0.1)
                elapsed = round(_run(engine, tasks_per_worker * size, task_s), 3)
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
    console.print(f"  Slurm: weak {elapsed:.2f} s")
    return {
        "workers": size,
        "completion_s": elapsed,
        "efficiency": round(tasks_per_worker * task_s / elapsed, 3),
    }
