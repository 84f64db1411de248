"""Cold and warm start of a worker per container runtime (issue 14's ``bench coldstart``).

Per runtime an engine of one worker (:class:`~fxstream.agent.process_engine.ProcessEngine`)
is started ``repetitions`` times. *Cold* is from the engine's start to its first task's
result: container start + interpreter + worker import + function load (the function is
``time.sleep``, pickled by reference, so its load is an import the worker has done; a real
function adds its own imports). *Warm* is the round trip of each of the next
``warm_tasks`` tasks in the same, warm worker (code cached, ``time.sleep(0)``).

The runtimes: ``multiprocessing-spawn`` (no runtime: the endpoint default),
``process`` (the command-line launch, no container), ``bubblewrap`` on the built worker
rootfs and ``bubblewrap-host`` on the host's own (``bubblewrap:/``), ``podman`` on the
built rootfs imported as a local image. The rootfs and image are built once and cached
(:mod:`fxstream.agent.images`, under ``$XDG_CACHE_HOME/fxstream``; not timed). A
runtime that cannot run here (its binary is missing, its image cannot be built, its
worker does not start) is reported as skipped with the reason, never as a figure. Each
runtime is measured in a ``python -c`` child process, whose workers (spawned) re-import
no command line of their own.
Nothing is installed: ``./fx test`` installs bubblewrap and podman.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from fxstream.agent.containers import (
    HOST_ROOTFS,
    BubblewrapRuntime,
    ContainerError,
    Image,
    PodmanRuntime,
    ProcessRuntime,
    Runtime,
)
from fxstream.agent.engine import WorkItem
from fxstream.agent.images import build_podman_image, build_rootfs
from fxstream.agent.process_engine import ProcessEngine

__all__ = ["RUNTIMES", "child", "run_coldstart_bench"]

RUNTIMES: Final = ("multiprocessing-spawn", "process", "bubblewrap", "bubblewrap-host", "podman")
"""What the bench measures, in order (``--runtimes`` picks some)."""

_CODE: Final = pickle.dumps(time.sleep)
_SHA: Final = hashlib.sha256(_CODE).hexdigest()
_PAYLOAD: Final = pickle.dumps(((0.0,), {}))
_COLD_TIMEOUT_S: Final = 120.0
_WARM_TIMEOUT_S: Final = 30.0

Figures = dict[str, Any]
_Setup = tuple[Runtime | None, Image | None]


class _Skip(Exception):
    """This runtime cannot run here; the message says why."""


def _percentile(samples: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile of ``samples`` in ms, to 0.01 ms."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return round(1000 * ordered[rank - 1], 2)


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fxstream"


def _rootfs() -> Path:
    try:
        return build_rootfs(_cache() / "worker-rootfs")
    except (ContainerError, OSError) as exc:
        raise _Skip(f"the worker rootfs cannot be built: {exc}") from exc


def _setup(name: str) -> _Setup:
    """The runtime and image of ``name``; :class:`_Skip` saying why it cannot run here."""
    if name == "multiprocessing-spawn":
        return None, None
    if name == "process":
        return ProcessRuntime(), None
    runtime: Runtime = PodmanRuntime() if name == "podman" else BubblewrapRuntime()
    problem = runtime.unavailable()
    if problem is not None:
        raise _Skip(problem)
    if name == "bubblewrap-host":
        return runtime, Image("host", "bubblewrap", HOST_ROOTFS)
    if name == "bubblewrap":
        return runtime, Image("worker", "bubblewrap", str(_rootfs()))
    try:
        tag = build_podman_image(_rootfs())
    except (ContainerError, OSError) as exc:
        raise _Skip(f"the worker image cannot be built: {exc}") from exc
    return runtime, Image("worker", "podman", tag)


def _item(task_id: str, *, code: bool) -> WorkItem:
    return WorkItem(task_id, "time.sleep", _SHA, _CODE if code else None, _PAYLOAD)


def _measure(
    runtime: Runtime | None, image: Image | None, repetitions: int, warm_tasks: int
) -> Figures:
    """Cold and warm p50/p99 (ms) of one runtime; :class:`_Skip` if its worker cannot run."""
    cold: list[float] = []
    warm: list[float] = []
    for repetition in range(repetitions):
        started = time.perf_counter()
        try:
            engine = ProcessEngine(1, runtime=runtime, image=image)
        except (ContainerError, OSError) as exc:
            raise _Skip(str(exc)) from exc
        with engine:
            done = engine.submit(_item(f"cold-{repetition}", code=True)).result(_COLD_TIMEOUT_S)
            if not done.ok:
                raise _Skip(
                    f"its worker did not run a task: {done.error_type}: {done.error_message}"
                )
            cold.append(time.perf_counter() - started)
            for task in range(warm_tasks):
                at = time.perf_counter()
                done = engine.submit(_item(f"warm-{task}", code=False)).result(_WARM_TIMEOUT_S)
                if not done.ok:
                    raise _Skip(f"a warm task failed: {done.error_type}: {done.error_message}")
                warm.append(time.perf_counter() - at)
    figures: Figures = {
        "cold_p50_ms": round(1000 * statistics.median(cold), 2),
        "cold_p99_ms": _percentile(cold, 99),
    }
    if warm:
        figures["warm_p50_ms"] = round(1000 * statistics.median(warm), 2)
        figures["warm_p99_ms"] = _percentile(warm, 99)
    return figures


def _measure_apart(name: str, repetitions: int, warm_tasks: int) -> Figures:
    """Measure ``name`` in a ``python -c`` child: multiprocessing's spawn re-imports the
    parent's main module in every worker, and this command line's (``fxstream``) would
    add its own imports to the cold start."""
    script = "import sys; from fxstream.ops.bench.coldstart import child; child(sys.argv[1:])"
    argv = [sys.executable, "-c", script, name, str(repetitions), str(warm_tasks)]
    timeout = 60 + repetitions * (_COLD_TIMEOUT_S + warm_tasks * _WARM_TIMEOUT_S)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"measuring {name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    figures: Figures = json.loads(lines[-1])
    return figures


def child(args: Sequence[str]) -> None:
    """The measuring child: ``RUNTIME REPETITIONS WARM_TASKS``; prints one JSON line."""
    name, repetitions, warm_tasks = args[0], int(args[1]), int(args[2])
    try:
        runtime, image = _setup(name)
        figures = _measure(runtime, image, repetitions, warm_tasks)
    except _Skip as exc:
        figures = {"skipped": str(exc)}
    print(json.dumps(figures), flush=True)


def run_coldstart_bench(
    *,
    console: Console,
    repetitions: int = 5,
    warm_tasks: int = 20,
    runtimes: Sequence[str] = RUNTIMES,
    print_line: Callable[[str], None] = print,
) -> Figures:
    """Measure each of ``runtimes``; print a table and, last, one JSON line; return it."""
    unknown = [name for name in runtimes if name not in RUNTIMES]
    if unknown or not runtimes:
        raise ValueError(
            f"unknown runtime(s) {unknown or runtimes!r}: choose from {', '.join(RUNTIMES)}"
        )
    results: dict[str, Figures] = {}
    for name in runtimes:
        console.print(f"{name}: {repetitions} cold start(s), {warm_tasks} warm task(s) each ...")
        results[name] = _measure_apart(name, repetitions, warm_tasks)
    table = Table(title=f"worker cold and warm start ({repetitions} cold starts per runtime)")
    for column in ("runtime", "cold p50 ms", "cold p99 ms", "warm p50 ms", "warm p99 ms"):
        table.add_column(column, justify="left" if column == "runtime" else "right")
    for name, figures in results.items():
        if "skipped" in figures:
            table.add_row(name, f"[yellow]skipped: {figures['skipped']}[/yellow]", "", "", "")
            continue
        cells = [
            figures.get(key) for key in ("cold_p50_ms", "cold_p99_ms", "warm_p50_ms", "warm_p99_ms")
        ]
        table.add_row(name, *("-" if cell is None else f"{cell:.2f}" for cell in cells))
    console.print(table)
    report: Figures = {"repetitions": repetitions, "warm_tasks": warm_tasks, "runtimes": results}
    print_line(json.dumps(report))
    return report
