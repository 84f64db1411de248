"""Memory of a task-state view under a million tasks, in one process, without a broker.

The 1-hour soak showed the ingress and the task-state processor creeping ~3 MB per
10 minutes after warm-up. Both hold a :class:`~fxstream.service.task_table.TaskStateTable`
fed by a view's follower thread and read from the processor's loop thread. This driver
does the same with synthetic states: a writer thread puts each task's ``routed`` state,
the main thread reads it back (the ingress's check of a result), then the writer puts
its ``succeeded`` state (with a small value), in batches of 500 like the view's.

Every ``--every`` tasks it prints the process's RSS (``VmRSS``), RocksDB's own figures
(memtables, table readers, block cache, live SST files) and, with ``--tracemalloc``, the
Python heap; at the end, the top growths of the Python heap between 30 % of the run and
its end, which separates Python-level growth from native growth (RocksDB, glibc).

Run: ``python -m fxstream.ops.bench.table_memory --tasks 1000000`` (last line: JSON).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxstream.service.lifecycle import KnownTask, TaskMemory, known_from_state
from fxstream.service.task_state import TaskStatePlanner
from fxstream.service.task_table import TaskStateTable
from fxstream.topics import (
    Catalogue,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    decode,
    encode,
)

__all__ = ["main", "run", "vm_rss_mb"]

BATCH = 500


def vm_rss_mb() -> float:
    """This process's resident set size in MB (``VmRSS`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (not Linux?)")


def _state(task_id: str, name: TaskStateName, now: float) -> TaskState:
    return TaskState(
        task_id=task_id,
        user_id="0b7c1e9a-54f3-4f51-9b40-1c7f3f0ad0a1",
        function_id="5d6a1f0e-2f7b-4c0e-8f0e-9b2f3b4d6c7a",
        endpoint_id="e2a9c1d4-7b3f-4e6a-a1c2-3d4e5f6a7b8c",
        state=name,
        updated_at=now,
        timings=TaskTimings(started_at=now, finished_at=now),
        value=b"\x80\x05N." * 8 if name == TaskStateName.SUCCEEDED else None,
    )


@dataclass(frozen=True)
class _Record:
    """A consumed record, as the planner sees one."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: object = None


def _result(task_id: str, now: float) -> TaskResult:
    routed = _state(task_id, TaskStateName.ROUTED, now)
    return TaskResult(
        task_id=task_id,
        user_id=routed.user_id,
        function_id=routed.function_id,
        endpoint_id=routed.endpoint_id,
        outcome="success",
        value=b"\x80\x05N." * 8,
        worker="host:1234",
        timings=TaskTimings(started_at=now, finished_at=now),
    )


def _rocks(table: TaskStateTable) -> dict[str, float]:
    figures = table.memory_figures()
    return {
        (name if name == "sst_files" else f"{name}_mb"): (
            value if name == "sst_files" else round(value / 2**20, 1)
        )
        for name, value in figures.items()
    }


def run(
    tasks: int,
    every: int,
    *,
    trace: bool,
    planner: bool = False,
    directory: Path | None = None,
) -> dict[str, Any]:
    """Drive a table with ``tasks`` tasks; the samples and (with ``trace``) heap growths.

    With ``planner``, each task's ``succeeded`` state is what the task-state planner
    folds from a result record (its memory recalling from the table, as in the
    processor), rather than made here.
    """
    if trace:
        tracemalloc.start(10)
    table = TaskStateTable(directory)
    catalogue = Catalogue(prefix="fx.")

    def recall(task_id: str) -> KnownTask | None:
        state = table.get(task_id)
        return None if state is None else known_from_state(state)

    folder = TaskStatePlanner(catalogue, memory=TaskMemory(recall=recall))
    work: queue.Queue[list[tuple[str, TaskState, bytes]] | None] = queue.Queue(maxsize=2)
    done: queue.Queue[int] = queue.Queue()

    def writer() -> None:
        while (batch := work.get()) is not None:
            for key, state, encoded in batch:
                table.put(key, state, encoded)
            done.put(len(batch))

    thread = threading.Thread(target=writer, name="registry-view", daemon=True)
    thread.start()
    samples: list[dict[str, Any]] = []
    early: tracemalloc.Snapshot | None = None
    began = time.monotonic()
    try:
        for start in range(0, tasks, BATCH):
            now = time.time()
            ids = [str(uuid.uuid4()) for _ in range(min(BATCH, tasks - start))]
            routed = [_state(i, TaskStateName.ROUTED, now) for i in ids]
            work.put([(s.task_id, s, encode(s)) for s in routed])
            done.get()
            for task_id in ids:  # the ingress checks each result's task
                if table.get(task_id) is None:
                    raise RuntimeError(f"task {task_id} written but not read back")
            if planner:
                topic = catalogue.results(routed[0].user_id)
                records = [
                    _Record(topic, 0, start + n, i.encode(), encode(_result(i, now)))
                    for n, i in enumerate(ids)
                ]
                out = folder.plan(records)
                if len(out) != len(ids):
                    raise RuntimeError(f"the planner wrote {len(out)} states for {len(ids)}")
                ended = [decode(o.value, TaskState) for o in out]
                work.put([(s.task_id, s, o.value) for s, o in zip(ended, out, strict=True)])
            else:
                ended = [_state(i, TaskStateName.SUCCEEDED, now) for i in ids]
                work.put([(s.task_id, s, encode(s)) for s in ended])
            done.get()
            count = start + len(ids)
            if count % every == 0 or count == tasks:
                sample: dict[str, Any] = {
                    "tasks": count,
                    "s": round(time.monotonic() - began, 1),
                    "rss_mb": round(vm_rss_mb(), 1),
                    **_rocks(table),
                }
                if trace:
                    sample["python_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                if trace and early is None and count >= tasks * 3 // 10:
                    early = tracemalloc.take_snapshot()
        growths: list[str] = []
        if trace and early is not None:
            late = tracemalloc.take_snapshot()
            for stat in late.compare_to(early, "traceback")[:15]:
                growths.append(f"{stat.size_diff / 1024:+.0f} KiB {stat.count_diff:+d} blocks")
                growths.extend(f"    {line}" for line in stat.traceback.format()[-3:])
    finally:
        work.put(None)
        thread.join()
        table.close()
    return {"samples": samples, "python_growths": growths}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--tasks``, ``--every``, ``--tracemalloc``, ``--dir``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument(
        "--planner", action="store_true", help="fold results with the task-state planner"
    )
    parser.add_argument("--dir", type=Path, default=None, help="the table's directory")
    args = parser.parse_args(argv)
    directory = args.dir
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="fx-table-memory-")) / "table"
    report = run(
        args.tasks, args.every, trace=args.tracemalloc, planner=args.planner, directory=directory
    )
    for line in report["python_growths"]:
        print(line)
    first, last = report["samples"][0], report["samples"][-1]
    print(
        json.dumps(
            {
                "tasks": last["tasks"],
                "rss_first_mb": first["rss_mb"],
                "rss_last_mb": last["rss_mb"],
                "rss_max_mb": max(s["rss_mb"] for s in report["samples"]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
