"""Where a task's CPU goes: CPU time per task in every process of the secure platform, then
where each Python process spends it (py-spy).

One run, on a private secure platform (broker, Redis, API, stream processors, the local
endpoint with 2 warm workers):

1. an untimed warm-up of ``warmup_tasks`` no-op tasks (connections, worker start-up, code
   loading);
2. *accounting*: ``tasks`` no-op tasks through ``Executor.submit``, first submit to last
   result, with each process's CPU time (user + system, from ``/proc``) read before and
   after: per process, microseconds of CPU per task, and the sum; and each process's by
   thread name (the broker's network threads and JIT compiler, librdkafka's ``rdk:``
   threads, RocksDB's ``rocksdb:`` compaction threads, Python's own). Nothing else is
   attached to the processes while this is measured. ``cap_tasks_per_s`` is the rate the
   machine's cores would allow if every core did only this work (cores / CPU per task).
   Over the same window, the broker's own counters (read over the JDK's attach API by
   :mod:`fxstream.ops.bench.broker_counters`): requests served per task by API
   (``Produce``, ``Fetch``, ``EndTxn``, ...), and records written and bytes written and read
   per task by topic;
3. *sampling* (unless ``py_spy`` is False): the same number of tasks again while
   ``py-spy record`` samples every Python process of the platform (and this one) at
   ``rate_hz``. Per process, the functions with the most samples on top of the stack
   (self time) and the share of its samples in each part of the code (fxstream's own
   packages, aiokafka, confluent-kafka, faust/mode, msgspec, asyncio, ...). py-spy costs
   CPU, so these shares say where a process spends its time, while the figures of step 2
   say how much. Only the thread holding the GIL is sampled (``--gil``): Python running,
   not threads waiting in ``select`` or working in a C library without the GIL
   (librdkafka's, RocksDB's). The raw stacks (``py-spy --format raw``, one flame graph's input per
   process) stay in ``profile_dir`` when it is given.

Prints tables and, as the last line, the figures as one JSON object.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.broker_counters import BrokerCounters, CounterReading, per_item
from fxstream.ops.bench.broker_jfr import BrokerRecording
from fxstream.ops.bench.processes import cpu_per_item, cpu_seconds, platform_processes
from fxstream.ops.bench.stack import (
    BenchError,
    PrivatePlatform,
    private_platform,
    rate,
    run_noop_tasks,
)

__all__ = ["ProfileSettings", "run_profile_bench"]

Figures = dict[str, Any]

# What a frame's file says about which part of the code it is, first match wins.
_AREAS: tuple[tuple[str, str], ...] = (
    ("/fxstream/", "fxstream"),
    ("/aiokafka/", "aiokafka"),
    ("/confluent_kafka/", "confluent-kafka"),
    ("/faust/", "faust"),
    ("/mode/", "faust"),
    ("/msgspec/", "msgspec"),
    ("/asyncio/", "asyncio"),
    ("/rocksdict/", "rocksdb"),
    ("/redis/", "redis"),
    ("/proxystore/", "proxystore"),
    ("/cloudpickle/", "pickle"),
    ("/pickle.py", "pickle"),
    ("/ssl.py", "ssl"),
    ("/selectors.py", "selectors"),
    ("/threading.py", "threading"),
    ("/concurrent/", "concurrent"),
    ("/logging/", "logging"),
    ("/site-packages/", "other libraries"),
    ("/lib/python3", "python stdlib"),
)
# A raw line: "frame;frame;...;frame count"; a frame: "function (file:line)".
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*)(?::\d+)?\)$")
_TOP_FUNCTIONS = 8
# Kafka's request counters by API: these two count fetches already counted as Fetch.
_FETCH_SUBCOUNTS = frozenset({"FetchConsumer", "FetchFollower"})
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProfileSettings:
    """What ``./fx bench profile`` runs."""

    tasks: int = 10_000
    warmup_tasks: int = 2_000
    py_spy: bool = True
    rate_hz: int = 250
    profile_dir: Path | None = None
    broker_jfr: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        if self.tasks < 100:
            raise ValueError("--tasks must be at least 100 (CPU per task of fewer is noise)")
        if self.warmup_tasks < 0:
            raise ValueError("--warmup-tasks must not be negative")
        if not 1 <= self.rate_hz <= 1_000:
            raise ValueError("--rate-hz must be between 1 and 1000")
        if self.py_spy and _py_spy() is None:
            raise ValueError(
                "py-spy is not installed: `./fx up` or `./fx test` installs it with the "
                "bench dependency group; or pass --no-py-spy"
            )


def _py_spy() -> str | None:
    """py-spy beside this interpreter (the project's environment), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


# --- CPU accounting ------------------------------------------------------------------------


def _thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s threads, summed by thread name with its numbers
    dropped (a JVM names its threads: ``data-plane-kafka-request-handler-3``, ...)."""
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime and stime: fields 14 and 15 of stat, 12 and 13 after "pid (comm)".
        ticks = int(fields[11]) + int(fields[12])
        group = re.sub(r"\d+", "N", name)
        found[group] = found.get(group, 0.0) + ticks / _TICKS_PER_S
    return found


def _all_thread_seconds(platform: PrivatePlatform) -> dict[str, tuple[int, dict[str, float]]]:
    """``label -> (pid, thread name -> CPU seconds)`` of every process of the platform."""
    return {
        label: (process.pid, _thread_seconds(process.pid))
        for label, process in platform_processes(platform.platform)
    }


def _threads_per_task(
    before: dict[str, tuple[int, dict[str, float]]],
    after: dict[str, tuple[int, dict[str, float]]],
    tasks: int,
) -> dict[str, dict[str, float]]:
    """Per process, microseconds of CPU per task by thread name (at least 1), largest
    first: which of a process's threads (Python's own, librdkafka's ``rdk:``, RocksDB's
    ``rocksdb:``, a JVM's) spends it."""
    found: dict[str, dict[str, float]] = {}
    for label, (pid, threads) in after.items():
        pid_before, earlier = before.get(label, (pid, {}))
        if pid_before != pid:
            earlier = {}
        spent = {
            name: round((seconds - earlier.get(name, 0.0)) * 1e6 / tasks, 1)
            for name, seconds in threads.items()
        }
        found[label] = {
            name: us for name, us in sorted(spent.items(), key=lambda item: -item[1]) if us >= 1
        }
    return found


# --- sampling ------------------------------------------------------------------------------


def _python_processes(platform: PrivatePlatform) -> dict[str, int]:
    """``label -> pid`` of the platform's Python processes and this one."""
    found: dict[str, int] = {}
    for label, process in platform_processes(platform.platform):
        try:
            name = process.name()
            argv = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "python" in name or any("python" in part for part in argv[:1]) or "Faust" in name:
            found[label] = process.pid
    return found


@contextmanager
def _sampled(pids: dict[str, int], directory: Path, rate_hz: int) -> Iterator[dict[str, Path]]:
    """py-spy records each of ``pids`` for the block; yields ``label -> raw output file``."""
    outputs: dict[str, Path] = {}
    recorders: list[subprocess.Popen[bytes]] = []
    try:
        for label, pid in pids.items():
            output = directory / (re.sub(r"[^\w.-]+", "_", label) + ".txt")
            outputs[label] = output
            recorders.append(
                subprocess.Popen(
                    [
                        _py_spy() or "py-spy",
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        str(rate_hz),
                        "--format",
                        "raw",
                        "--output",
                        str(output),
                        "--nonblocking",
                        # Only the thread holding the GIL: time running Python, not
                        # threads waiting in select() or in a C library.
                        "--gil",
                        "--full-filenames",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        time.sleep(1.0)  # py-spy attaching
        yield outputs
    finally:
        for recorder in recorders:
            recorder.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for recorder in recorders:
            try:
                recorder.wait(30)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()


def _area(file: str) -> str:
    for needle, area in _AREAS:
        if needle in file:
            return area
    return "other"


def _short_file(file: str) -> str:
    """A frame's file from its package on (``fxstream/service/router.py``)."""
    for marker in ("/site-packages/", "/src/"):
        if marker in file:
            return file.rsplit(marker, 1)[-1]
    found = re.search(r"/lib/python3[.\d]*/(.*)$", file)
    return found.group(1) if found else file


def _frame(text: str) -> tuple[str, str]:
    """``(function, file)`` of one raw frame."""
    found = _FRAME.match(text.strip())
    if found is None:
        return text.strip(), ""
    return found.group("function"), found.group("file")


def summarise_raw(text: str) -> Figures:
    """Samples, the top functions by self samples and the share of samples per area, from
    py-spy's raw output (``frame;...;frame count`` per line, innermost frame last)."""
    functions: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        innermost = stack.rsplit(";", 1)[-1]
        function, file = _frame(innermost)
        short_file = _short_file(file)
        functions[f"{function} ({short_file})"] += count
        areas[_area(file)] += count
        total += count
    if total == 0:
        return {"samples": 0, "top_self": [], "areas": {}}
    return {
        "samples": total,
        "top_self": [
            [name, round(100 * count / total, 1)]
            for name, count in functions.most_common(_TOP_FUNCTIONS)
        ],
        "areas": {area: round(100 * count / total, 1) for area, count in areas.most_common()},
    }


# --- the run -------------------------------------------------------------------------------


def _broker_pids(platform: PrivatePlatform) -> list[int]:
    return [
        process.pid
        for label, process in platform_processes(platform.platform)
        if label.startswith("kafka node ") and " / " not in label
    ]


def _broker_counters(
    console: Console, platform: PrivatePlatform
) -> tuple[BrokerCounters | None, str]:
    """The broker's request counters (the bench's platform has one broker), or None and
    why not: the figures are then left out, the rest of the bench runs."""
    pids = _broker_pids(platform)
    if len(pids) != 1:
        return None, f"{len(pids)} brokers (the counters read one)"
    try:
        return BrokerCounters(pids[0]), ""
    except (RuntimeError, OSError) as exc:
        console.print(f"[yellow]the broker's request counters are left out: {exc}")
        return None, str(exc)


def _broker_recording(
    console: Console, platform: PrivatePlatform, directory: Path, settings: ProfileSettings
) -> BrokerRecording | None:
    """A started JFR recording of the broker for the sampling phase, if asked for."""
    if not settings.broker_jfr:
        return None
    pids = _broker_pids(platform)
    if len(pids) != 1:
        raise BenchError(f"--broker-jfr records one broker; this platform has {len(pids)}")
    recording = BrokerRecording(pids[0], directory / "broker.jfr")
    recording.start()
    console.print("broker: JFR recording the sampling phase")
    return recording


def _broker_figures(
    why_not: str, before: CounterReading | None, after: CounterReading | None, tasks: int
) -> Figures:
    """Broker requests per task by API; records written, bytes written and bytes read per
    task by topic."""
    if before is None or after is None:
        return {"broker_counters": why_not or "not read"}
    figures: Figures = {}
    for family in ("requests", "records_in", "bytes_in", "bytes_out"):
        counted = per_item(getattr(before, family), getattr(after, family), tasks, least=0.005)
        if family.startswith("bytes"):
            counted = {topic: round(n) for topic, n in counted.items() if n >= 1}
        figures[f"broker_{family}_per_task"] = counted
        # Kafka counts a fetch once as Fetch and again as FetchConsumer or FetchFollower.
        summed = {n: v for n, v in counted.items() if n not in _FETCH_SUBCOUNTS}
        figures[f"broker_{family}_per_task_total"] = round(sum(summed.values()), 2)
    return figures


def _measure(console: Console, platform: PrivatePlatform, settings: ProfileSettings) -> Figures:
    if settings.warmup_tasks:
        run_noop_tasks(platform, console, "warm-up", settings.warmup_tasks)
    counters, counted = _broker_counters(console, platform)
    try:
        counts_before = counters.read() if counters is not None else None
        threads_before = _all_thread_seconds(platform)
        before = cpu_seconds(platform.platform)
        wall = run_noop_tasks(platform, console, "accounting", settings.tasks)
        after = cpu_seconds(platform.platform)
        threads_after = _all_thread_seconds(platform)
        counts_after = counters.read() if counters is not None else None
    finally:
        if counters is not None:
            counters.close()
    per_task = cpu_per_item(before, after, settings.tasks)
    threads = _threads_per_task(threads_before, threads_after, settings.tasks)
    total_us = sum(per_task.values())
    figures: Figures = {
        "bench": "profile",
        "tasks": settings.tasks,
        "warmup_tasks": settings.warmup_tasks,
        "cpu_count": os.cpu_count() or 0,
        "tasks_per_s": rate(settings.tasks, wall),
        "cpu_us_per_task": {label: round(us, 1) for label, us in per_task.items()},
        "cpu_us_per_task_total": round(total_us, 1),
        "cap_tasks_per_s": round((os.cpu_count() or 1) * 1e6 / total_us) if total_us else None,
        "threads_us_per_task": threads,
        "profiles": {},
    }
    figures.update(_broker_figures(counted, counts_before, counts_after, settings.tasks))
    if settings.py_spy or settings.broker_jfr:
        keep = settings.profile_dir
        with tempfile.TemporaryDirectory(prefix="fxstream-profile-") as scratch:
            directory = keep or Path(scratch)
            directory.mkdir(parents=True, exist_ok=True)
            recording = _broker_recording(console, platform, directory, settings)
            pids = _python_processes(platform) if settings.py_spy else {}
            with _sampled(pids, directory, settings.rate_hz) as outputs:
                sampled_wall = run_noop_tasks(platform, console, "sampling", settings.tasks)
            figures["sampled_tasks_per_s"] = rate(settings.tasks, sampled_wall)
            for label, output in outputs.items():
                text = output.read_text() if output.exists() else ""
                figures["profiles"][label] = summarise_raw(text)
            if recording is not None:
                figures["broker_jfr"] = recording.stop()
                if keep is not None:
                    figures["broker_jfr"]["recording"] = str(recording.path)
    return figures


def _print(console: Console, figures: Figures) -> None:
    table = Table(
        title=f"CPU per task, {figures['tasks']:,} no-op tasks at {figures['tasks_per_s']:,}/s "
        f"on {figures['cpu_count']} cores"
    )
    for column in ("process", "µs CPU / task", "share"):
        table.add_column(column, justify="left" if column == "process" else "right")
    total = figures["cpu_us_per_task_total"] or 1.0
    for label, us in figures["cpu_us_per_task"].items():
        if us >= 0.5:
            table.add_row(label, f"{us:,.1f}", f"{100 * us / total:.1f} %")
    table.add_row(
        "[bold]all", f"[bold]{figures['cpu_us_per_task_total']:,.1f}", "100 %", end_section=True
    )
    console.print(table)
    console.print(
        f"the cores would allow at most {figures['cap_tasks_per_s']:,} tasks/s at this cost"
    )
    threads = Table(title="CPU per task by thread name (numbers in names as N), top 4")
    threads.add_column("process")
    threads.add_column("threads: µs CPU / task")
    for label, by_thread in figures["threads_us_per_task"].items():
        top = list(by_thread.items())[:4]
        if top:
            threads.add_row(label, ", ".join(f"{name} {us:,.0f}" for name, us in top))
    console.print(threads)
    for kind, unit in (
        ("requests", "requests"),
        ("records_in", "records written"),
        ("bytes_in", "bytes written"),
        ("bytes_out", "bytes read"),
    ):
        counted = figures.get(f"broker_{kind}_per_task")
        if counted:
            table = Table(
                title=f"Broker {unit} per task: "
                f"{figures[f'broker_{kind}_per_task_total']:,.2f} in all"
            )
            table.add_column("API" if kind == "requests" else "topic")
            table.add_column("per task", justify="right")
            for name, count in counted.items():
                table.add_row(name, f"{count:,.3f}" if kind == "requests" else f"{count:,}")
            console.print(table)
    jfr = figures.get("broker_jfr")
    if jfr:
        table = Table(title=f"broker (JFR): {jfr['samples']:,} samples of running Java threads")
        table.add_column("what")
        table.add_column("% of samples")
        for part, title in (
            ("threads", "by thread"),
            ("apis", "by request handler on the stack"),
            ("areas", "anywhere on the stack"),
            ("top_self", "on top (self)"),
        ):
            table.add_row(
                title, ", ".join(f"{name} {share:g}" for name, share in jfr[part].items())
            )
        console.print(table)
    for label, profile in figures["profiles"].items():
        if not profile["samples"]:
            continue
        table = Table(title=f"{label}: {profile['samples']:,} samples, self time")
        table.add_column("function")
        table.add_column("%", justify="right")
        for name, share in profile["top_self"]:
            table.add_row(name, f"{share:.1f}")
        table.add_row(
            "[dim]by area",
            "[dim]" + ", ".join(f"{area} {share:g}" for area, share in profile["areas"].items()),
        )
        console.print(table)


def run_profile_bench(*, console: Console, settings: ProfileSettings) -> Figures:
    """Measure CPU per task per process on a private secure platform, then sample where
    each Python process spends it; print tables and the JSON line, and return the figures."""
    settings.validate()
    started = time.perf_counter()
    with private_platform(console, services=True) as platform:
        figures = _measure(console, platform, settings)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print(console, figures)
    if not figures["cpu_us_per_task"]:
        raise BenchError("no process of the platform was found to account for")
    print(json.dumps(figures), flush=True)
    return figures
