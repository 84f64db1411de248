"""Tasks per second through the whole task path, beside a process pool, Parsl's HTEX
and Ray, and how fxstream's rate changes with more agents and more workers.

One run measures, each after an untimed warm-up of its own (first tasks pay for
connections, worker start-up and code loading):

1. fxstream: a private platform (broker, Redis, REST API, stream processors, one local
   endpoint with 2 warm workers) on free ports in a temporary home. ``tasks`` no-op
   tasks through ``Executor.submit`` (timed from the first ``submit`` to the last
   result), then the same through ``Executor.map``. Every record on the way is written
   with ``acks=all`` (the SDK's producer, the router's and the agent's). The platform
   is stopped before the next systems run, so they do not share the cores with it.
   The platform is the secure one (SASL_SSL Kafka); then, unless ``plain`` is False, the
   same is measured on an insecure (PLAINTEXT) platform, and ``secure_vs_plain`` gives
   each fxstream figure on both and their ratio: what security costs.
2. The scale curve (unless ``skip_curve``): on a fresh secure private platform, for each
   point of :data:`CURVE_POINTS` (1, 2 and 4 agents of 2 workers; 1 agent of 4 and of 8
   workers) that many endpoints are added, each its own agent process with ``workers``
   warm workers (prefetch 16, the local endpoint's); ``curve_tasks`` no-op tasks are
   submitted round robin through one ``Executor`` per endpoint (one client shared by
   all), timed from the first submit to the last result, after an untimed warm-up; the
   endpoints are stopped before the next point. ``scale_curve`` lists
   ``{agents, workers, tasks_per_s}``: on 2 cores, what each more agent or worker costs.
3. ``concurrent.futures.ProcessPoolExecutor(2)``: the same tasks, submitted then awaited.
4. Parsl's HighThroughputExecutor: 2 workers in one local block on the loopback,
   ``tasks`` no-op python_apps submitted then awaited (skipped with ``skip_parsl``).
5. Ray: a local runtime of 2 CPUs (:func:`~fxstream.ops.bench.stack.ray_local`),
   ``tasks`` no-op remote tasks submitted then awaited (``ray.wait``, then ``ray.get``);
   skipped with ``skip_ray``.

The target (from the issue): at least 5,000 tasks/s and at least 10 times HTEX's rate
in the same run. The report says whether both were met.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, cast

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fxstream.ops.bench.stack import (
    IDLE_TIMEOUT_S,
    WORKERS,
    BenchError,
    Meter,
    PrivatePlatform,
    noop,
    parsl_htex,
    print_secure_vs_plain,
    private_platform,
    progress,
    rate,
    ray_local,
    ray_wait_all,
    secure_and_plain,
    stall_guard,
    wait_all,
)
from fxstream.sdk import Executor

__all__ = [
    "CURVE_POINTS",
    "DEFAULT_CURVE_TASKS",
    "TARGET_RATIO_VS_HTEX",
    "TARGET_TASKS_PER_S",
    "run_throughput_bench",
]

TARGET_TASKS_PER_S = 5_000
TARGET_RATIO_VS_HTEX = 10.0
# Untimed tasks before each system's timed run.
MAX_WARMUP_TASKS = 2_000
# The scale curve's points: (agents, workers per agent), each agent its own endpoint.
CURVE_POINTS: Final = ((1, 2), (2, 2), (4, 2), (1, 4), (1, 8))
DEFAULT_CURVE_TASKS: Final = 5_000
# The curve's endpoints are configured as the local one is (fxstream-endpoint's defaults).
_CURVE_PREFETCH: Final = 16
_CURVE_HEARTBEAT_S: Final = 5.0

Figures = dict[str, Any]
Submit = Callable[[int], Any]
# Waits for every task of a list (futures, or Ray's object refs), counting on a meter.
Wait = Callable[[Sequence[Any], Meter], None]


def _warmup_tasks(tasks: int) -> int:
    return min(tasks, MAX_WARMUP_TASKS)


# --- timing one system ---------------------------------------------------------------------


def _submit_and_wait(
    submit: Submit, tasks: int, meter: Meter, wait: Wait = wait_all
) -> tuple[float, float]:
    """Submit ``tasks`` no-op tasks, then wait for every result (with ``wait``).

    Returns the seconds spent in the submit calls and from the first submit to the last
    result.
    """
    start = time.perf_counter()
    futures = [submit(i) for i in range(tasks)]
    submitted = time.perf_counter()
    wait(futures, meter)
    return submitted - start, time.perf_counter() - start


def _warm_up(
    display: Progress, name: str, submit: Submit, tasks: int, wait: Wait = wait_all
) -> None:
    """An untimed run of ``tasks`` tasks, shown as a progress line."""
    meter = Meter(display, f"{name}: warm-up", tasks)
    _submit_and_wait(submit, tasks, meter, wait)


def _timed(
    display: Progress, name: str, submit: Submit, tasks: int, wait: Wait = wait_all
) -> tuple[float, float]:
    """The timed run, shown as a progress line that ends with the rate."""
    meter = Meter(display, f"{name}: {tasks:,} tasks", tasks)
    submit_s, wall_s = _submit_and_wait(submit, tasks, meter, wait)
    meter.finish(tasks, f"{name}: {tasks:,} tasks, [bold]{rate(tasks, wall_s):,}/s")
    return submit_s, wall_s


def _timed_map(display: Progress, executor: Executor, tasks: int) -> float:
    """``Executor.map`` over ``tasks`` inputs, consumed in order; seconds it took."""
    meter = Meter(display, f"fxstream map: {tasks:,} tasks", tasks)
    done = 0
    with stall_guard(executor) as stalled:
        start = time.perf_counter()
        try:
            for done, _ in enumerate(executor.map(noop, range(tasks)), start=1):
                meter.count(done)
        # The guard cancels the outstanding futures when nothing moves for too long.
        except concurrent.futures.CancelledError as exc:
            if not stalled.is_set():
                raise
            raise BenchError(
                f"Executor.map: {tasks - done:,} of {tasks:,} results not yet iterated, and "
                f"no task finished for {IDLE_TIMEOUT_S:.0f} s: the platform stalled"
            ) from exc
        wall_s = time.perf_counter() - start
    meter.finish(done, f"fxstream map: {tasks:,} tasks, [bold]{rate(tasks, wall_s):,}/s")
    return wall_s


# --- the systems ---------------------------------------------------------------------------


def _fxstream_on(display: Progress, platform: PrivatePlatform, tasks: int) -> Figures:
    """``submit`` then ``map`` on the platform's local endpoint."""
    with platform.executor() as executor:

        def submit(i: int) -> Any:
            return executor.submit(noop, i)

        _warm_up(display, "fxstream", submit, _warmup_tasks(tasks))
        submit_s, submit_wall_s = _timed(display, "fxstream submit", submit, tasks)
        map_wall_s = _timed_map(display, executor, tasks)
    return {
        "fxstream_tasks_per_s": rate(tasks, submit_wall_s),
        "fxstream_map_tasks_per_s": rate(tasks, map_wall_s),
        "fxstream_submit_calls_per_s": rate(tasks, submit_s),
        "fxstream_s": round(submit_wall_s, 2),
        "fxstream_map_s": round(map_wall_s, 2),
    }


def _curve_point(
    display: Progress, platform: PrivatePlatform, agents: int, workers: int, tasks: int
) -> Figures:
    """``tasks`` no-op tasks round robin over ``agents`` new endpoints of ``workers``
    workers each (one agent process per endpoint), stopped again before returning."""
    name = f"curve {agents} agent{'s' if agents > 1 else ''} x {workers} workers"
    try:
        endpoints = [
            platform.add_endpoint(
                f"curve-{agents}x{workers}-{n}",
                workers=workers,
                prefetch=_CURVE_PREFETCH,
                heartbeat_period_s=_CURVE_HEARTBEAT_S,
            )
            for n in range(agents)
        ]
        with platform.client() as client:
            executors = [Executor(endpoint_id=e.endpoint_id, client=client) for e in endpoints]
            failed = True
            try:

                def submit(i: int) -> Any:
                    return executors[i % agents].submit(noop, i)

                _warm_up(display, name, submit, _warmup_tasks(tasks))
                _, wall_s = _timed(display, name, submit, tasks)
                failed = False
            finally:
                # A lost task must not keep the shutdown waiting forever.
                for executor in executors:
                    executor.shutdown(wait=not failed, cancel_futures=failed)
    finally:
        platform.stop_extra_endpoints()
    return {
        "agents": agents,
        "workers": workers,
        "tasks": tasks,
        "tasks_per_s": rate(tasks, wall_s),
        "s": round(wall_s, 2),
    }


def _scale_curve(console: Console, tasks: int) -> list[Figures]:
    """Each point of :data:`CURVE_POINTS` on one fresh secure private platform."""
    with private_platform(console, services=True) as platform, progress(console) as display:
        return [
            _curve_point(display, platform, agents, workers, tasks)
            for agents, workers in CURVE_POINTS
        ]


def _processpool(console: Console, tasks: int) -> Figures:
    """``concurrent.futures.ProcessPoolExecutor`` with the same number of workers."""
    with (
        concurrent.futures.ProcessPoolExecutor(WORKERS) as pool,
        progress(console) as display,
    ):

        def submit(i: int) -> Any:
            return pool.submit(noop, i)

        _warm_up(display, "ProcessPool", submit, _warmup_tasks(tasks))
        _, wall_s = _timed(display, "ProcessPool", submit, tasks)
    return {"processpool_tasks_per_s": rate(tasks, wall_s), "processpool_s": round(wall_s, 2)}


def _htex(console: Console, tasks: int) -> Figures:
    """Parsl's HTEX, its run directory in a temporary directory removed afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix="fxstream-bench-parsl-") as run_dir,
        parsl_htex(Path(run_dir)) as app,
        progress(console) as display,
    ):
        _warm_up(display, "Parsl HTEX", app, _warmup_tasks(tasks))
        _, wall_s = _timed(display, "Parsl HTEX", app, tasks)
    return {"htex_tasks_per_s": rate(tasks, wall_s), "htex_s": round(wall_s, 2)}


def _ray(console: Console, tasks: int) -> Figures:
    """Ray's remote tasks on a local runtime of ``WORKERS`` CPUs, shut down afterwards."""
    import ray

    with ray_local(), progress(console) as display:
        # noop's argument is optional: typed as taking one, Ray's stubs allow passing it.
        remote_noop = ray.remote(cast("Callable[[int], None]", noop))

        def submit(i: int) -> Any:
            return remote_noop.remote(i)

        _warm_up(display, "Ray", submit, _warmup_tasks(tasks), wait=ray_wait_all)
        _, wall_s = _timed(display, "Ray", submit, tasks, wait=ray_wait_all)
    return {"ray_tasks_per_s": rate(tasks, wall_s), "ray_s": round(wall_s, 2)}


# --- report --------------------------------------------------------------------------------


def _ratio(numerator: Any, denominator: Any) -> float | None:
    """``numerator / denominator`` to 2 decimals, or None when either is missing or zero."""
    if not numerator or not denominator:
        return None
    return round(float(numerator) / float(denominator), 2)


def _verdict(figures: Figures) -> Figures:
    """The ratios and whether the issue's targets were met (None: not measured)."""
    ratio = _ratio(figures["fxstream_tasks_per_s"], figures["htex_tasks_per_s"])
    rate_met = figures["fxstream_tasks_per_s"] >= TARGET_TASKS_PER_S
    return {
        "ratio_vs_htex": ratio,
        "map_ratio_vs_htex": _ratio(
            figures["fxstream_map_tasks_per_s"], figures["htex_tasks_per_s"]
        ),
        "ratio_vs_processpool": _ratio(
            figures["fxstream_tasks_per_s"], figures["processpool_tasks_per_s"]
        ),
        "ratio_vs_ray": _ratio(figures["fxstream_tasks_per_s"], figures["ray_tasks_per_s"]),
        "target_tasks_per_s": TARGET_TASKS_PER_S,
        "target_ratio_vs_htex": TARGET_RATIO_VS_HTEX,
        "target_rate_met": rate_met,
        "target_ratio_met": None if ratio is None else ratio >= TARGET_RATIO_VS_HTEX,
        "target_met": rate_met and ratio is not None and ratio >= TARGET_RATIO_VS_HTEX,
    }


def _print_table(console: Console, figures: Figures) -> None:
    """Each system's rate, its time and how fxstream compares with it."""
    table = Table(
        title=f"{figures['tasks']:,} no-op tasks, {figures['workers']} workers each, "
        f"{figures['cpu_count']} cores (every fxstream record acks=all)"
    )
    for column in ("system", "tasks/s", "time, s", "fxstream submit is x times"):
        table.add_column(column, justify="left" if column == "system" else "right")
    rows = (
        ("fxstream Executor.submit", "fxstream_tasks_per_s", "fxstream_s"),
        ("fxstream Executor.map", "fxstream_map_tasks_per_s", "fxstream_map_s"),
        ("ProcessPoolExecutor(2)", "processpool_tasks_per_s", "processpool_s"),
        ("Parsl HTEX (2 workers)", "htex_tasks_per_s", "htex_s"),
        ("Ray (2 CPUs, remote tasks)", "ray_tasks_per_s", "ray_s"),
    )
    for label, key, seconds in rows:
        value = figures.get(key)
        ratio = _ratio(figures["fxstream_tasks_per_s"], value)
        table.add_row(
            label,
            "skipped" if value is None else f"{value:,}",
            "-" if value is None else str(figures[seconds]),
            "-" if ratio is None else f"{ratio}",
        )
    console.print(table)
    _print_curve(console, figures)
    _print_targets(console, figures)


def _print_curve(console: Console, figures: Figures) -> None:
    """The scale curve, each point beside the first (1 agent, 2 workers); nothing if skipped."""
    curve = figures.get("scale_curve")
    if not curve:
        return
    table = Table(
        title=f"fxstream scale curve: {figures['curve_tasks']:,} no-op tasks per point, "
        "round robin over the agents"
    )
    for column in ("agents", "workers each", "workers in all", "tasks/s", "time, s", "x first"):
        table.add_column(column, justify="right")
    first = curve[0]["tasks_per_s"]
    for point in curve:
        ratio = _ratio(point["tasks_per_s"], first)
        table.add_row(
            str(point["agents"]),
            str(point["workers"]),
            str(point["agents"] * point["workers"]),
            f"{point['tasks_per_s']:,}",
            str(point["s"]),
            "-" if ratio is None else str(ratio),
        )
    console.print(table)


def _print_targets(console: Console, figures: Figures) -> None:
    """Whether the issue's two targets were met, in words."""

    def mark(met: bool | None) -> str:
        return (
            "[yellow]not measured[/yellow]"
            if met is None
            else ("[green]met[/green]" if met else "[red]NOT met[/red]")
        )

    console.print(
        f"target >= {TARGET_TASKS_PER_S:,} tasks/s: {mark(figures['target_rate_met'])} "
        f"({figures['fxstream_tasks_per_s']:,}/s); "
        f"target >= {TARGET_RATIO_VS_HTEX:g}x Parsl HTEX: {mark(figures['target_ratio_met'])} "
        f"({figures['ratio_vs_htex']}x)"
    )


def _settings(tasks: int, skip_parsl: bool, skip_ray: bool, curve_tasks: int | None) -> Figures:
    """What was measured, and how, for the report (``curve_tasks`` None: no curve)."""
    return {
        "bench": "throughput",
        "tasks": tasks,
        "warmup_tasks": _warmup_tasks(tasks),
        "workers": WORKERS,
        "cpu_count": os.cpu_count() or 0,
        "acks": "all",
        "security": "secure (SASL_SSL Kafka)",
        "htex_tasks_per_s": None,
        "htex_s": None,
        "parsl": "skipped" if skip_parsl else "htex",
        "ray_tasks_per_s": None,
        "ray_s": None,
        "ray": "skipped" if skip_ray else f"local ray.init(num_cpus={WORKERS})",
        "curve_tasks": curve_tasks,
        "scale_curve": None,
        "scale_curve_wall_s": None,
    }


def run_throughput_bench(
    *,
    console: Console,
    tasks: int,
    skip_parsl: bool,
    plain: bool = True,
    skip_ray: bool = False,
    curve_tasks: int = DEFAULT_CURVE_TASKS,
    skip_curve: bool = False,
) -> Figures:
    """Measure no-op tasks/s on fxstream, a process pool and (unless skipped) Parsl HTEX
    and Ray, and (unless ``skip_curve``) fxstream's scale curve of ``curve_tasks`` per point.

    fxstream runs on the secure platform and, if ``plain``, also on an insecure one
    (``secure_vs_plain``).

    Prints a table and, as the last line of stdout, the figures as one JSON object, which
    is also returned. Every process started here is stopped before it returns.
    """
    if tasks < 1:
        raise ValueError("tasks must be at least 1")
    if not skip_curve and curve_tasks < 1:
        raise ValueError("curve tasks must be at least 1")
    started = time.perf_counter()
    figures = _settings(tasks, skip_parsl, skip_ray, None if skip_curve else curve_tasks)
    figures |= secure_and_plain(
        console, lambda display, platform: _fxstream_on(display, platform, tasks), plain=plain
    )
    if not skip_curve:
        curve_started = time.perf_counter()
        figures["scale_curve"] = _scale_curve(console, curve_tasks)
        figures["scale_curve_wall_s"] = round(time.perf_counter() - curve_started, 1)
    figures |= _processpool(console, tasks)
    if not skip_parsl:
        figures |= _htex(console, tasks)
    if not skip_ray:
        figures |= _ray(console, tasks)
    figures |= _verdict(figures)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print_table(console, figures)
    print_secure_vs_plain(console, figures)
    print(json.dumps(figures), flush=True)
    return figures
