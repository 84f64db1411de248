"""``./fx bench scaling`` at a tiny size: real blocks of real workers, figures that add up."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from fxstream.ops.bench.scaling import run_scaling_bench

pytestmark = pytest.mark.hpc


def test_weak_and_strong_scaling_report_what_they_measured() -> None:
    lines: list[str] = []
    report = run_scaling_bench(
        console=Console(quiet=True),
        workers=[2, 1],
        tasks_per_worker=2,
        task_s=0.5,
        strong_tasks=4,
        print_line=lines.append,
    )
    assert json.loads(lines[-1]) == report
    assert report["workers"] == [1, 2] and report["slurm"] is False
    # Two sleeps of 0.5 s per worker cannot take less than 1 s; efficiency is ideal / actual.
    assert all(s >= 1.0 for s in report["completion_s"])
    assert report["efficiency"] == [round(1.0 / s, 3) for s in report["completion_s"]]
    strong = report["strong"]
    # Four sleeps: 2 s on one worker, 1 s on two at best.
    assert strong["completion_s"][0] >= 2.0 and strong["completion_s"][1] >= 1.0
    assert strong["speedup"][0] == 1.0 and strong["speedup"][1] > 1.2


def test_a_worker_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        run_scaling_bench(console=Console(quiet=True), workers=[0])
