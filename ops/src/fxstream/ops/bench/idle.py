"""What an idle platform costs: CPU seconds per process over a window with no tasks.

A private platform (broker, Redis, service API, stream processors, one local endpoint
with its workers) is started, left to settle, then the CPU time of every process on the
machine is sampled at the start and the end of the window; the table lists the
platform's processes (and anything else that used CPU meanwhile), and the last line is
one JSON object. A platform that spins (a consumer fetching in a tight loop) shows here.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from fxstream.ops.private import private_platform

__all__ = ["IdleSettings", "run_idle_bench"]

_SHOWN = 12
_COMMAND_CHARS = 90


@dataclass(frozen=True)
class IdleSettings:
    """How long the platform settles after start, and how long CPU is measured."""

    settle_s: float = 15.0
    window_s: float = 30.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming what to change."""
        if self.settle_s < 0:
            raise ValueError(f"--settle must be 0 or more seconds, not {self.settle_s}")
        if self.window_s <= 0:
            raise ValueError(f"--window must be more than 0 seconds, not {self.window_s}")


def _cpu_seconds(processes: dict[int, psutil.Process]) -> dict[int, float]:
    seconds: dict[int, float] = {}
    for pid, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[pid] = times.user + times.system
    return seconds


def run_idle_bench(*, console: Console, settings: IdleSettings) -> dict[str, object]:
    """Start a private platform, let it settle, measure its CPU while idle; print and return
    the figures (the last printed line is their JSON)."""
    settings.validate()
    with (
        tempfile.TemporaryDirectory(prefix="fxstream-bench-") as home,
        private_platform(Path(home), step=lambda text: console.print(text)),
    ):
        time.sleep(settings.settle_s)
        processes = {p.pid: p for p in psutil.process_iter(["cmdline", "name"])}
        before = _cpu_seconds(processes)
        time.sleep(settings.window_s)
        after = _cpu_seconds(processes)
    used = sorted(((after[pid] - before.get(pid, 0.0), pid) for pid in after), reverse=True)
    total = sum(seconds for seconds, _ in used)
    table = Table(title=f"CPU seconds over {settings.window_s:g} s of an idle platform")
    table.add_column("CPU s", justify="right")
    table.add_column("process")
    for seconds, pid in used[:_SHOWN]:
        info = processes[pid].info
        command = " ".join(info.get("cmdline") or []) or info.get("name") or "?"
        table.add_row(f"{seconds:.2f}", command[:_COMMAND_CHARS])
    console.print(table)
    figures: dict[str, object] = {
        "bench": "idle",
        "settle_s": settings.settle_s,
        "window_s": settings.window_s,
        "cpu_s": round(total, 2),
        "share_of_one_core": round(total / settings.window_s, 3),
    }
    console.print(json.dumps(figures), soft_wrap=True)
    return figures
