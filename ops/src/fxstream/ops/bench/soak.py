"""Memory under steady load: does every process's RSS stay flat once warmed up?

A private platform (broker, Redis, REST API, stream processors, one local endpoint with
its 2 workers) on free ports in a temporary home gets no-op tasks through
``Executor.submit`` at a steady ``rate`` for ``minutes``. Every ``interval_s`` seconds
the resident set size (RSS) of every process is sampled: each broker node, Redis, each
service process and every process below it (the processors, the agent, its workers),
and the SDK itself (this process). Futures are not kept: a done callback counts them.

Flatness is judged per process on the samples after ``warmup_minutes``:

- ``slope``: the least-squares slope of RSS over the second half of the run, in MB per
  10 minutes (what a process that grows with every task shows);
- ``ratio``: the last sample over the first one after the warm-up.

A process is flat when ``slope <= max_slope_mb`` and ``ratio <= 1 + max_growth``. At the
end, the first task of the run is read back from the service (``get_task``): a view that
bounds its memory must still answer for a task long evicted from its cache.

Disk is sampled beside memory (``disk``): the size of each process's on-disk task
tables (RocksDB, :mod:`fxstream.service.task_table`) and of the broker's ``task-state``
partitions. With ``task_retention_s`` (the platform's task retention, default a week)
set shorter than the run, finished tasks expire during it (docs/lifecycle.md
"Retention"): the tables should then stop growing once the first tasks expire, and the
first task of the run is expected to be gone when it is read back (``expired``). The
broker's log shrinks only when a segment rolls and its cleaner compacts it.

To tell a leak from memory the allocator keeps, the report also holds the SDK's own heap
figures at each sample (``sdk_heap``: Python's allocated blocks, the objects the
collector tracks, glibc's heap in use and free) and every service's ``memory:`` log
lines (``memory_lines``, :mod:`fxstream.service.memory_report`; set
``FXSTREAM_MEMORY_REPORT_S`` for their interval, default 120 s, and
``FXSTREAM_MALLOC_TRIM=0`` to stop each report returning the allocator's free heap
first: the platform's processes inherit both from this one).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.processes import platform_processes
from fxstream.ops.bench.stack import (
    IDLE_TIMEOUT_S,
    WORKERS,
    BenchError,
    PrivatePlatform,
    noop,
    private_platform,
)
from fxstream.ops.platform import Platform
from fxstream.sdk import Client, Executor, NotFound, TaskFuture
from fxstream.sdk.heap import trim_count
from fxstream.service.memory_report import MemoryReport
from fxstream.service.task_table import TABLE_DIR_PREFIX

__all__ = ["ProcessFigures", "SoakSettings", "judge", "run_soak_bench", "slope_per_10min"]

MB = 1_000_000
# How often the pacing loop wakes to submit what is due.
_TICK_S = 0.02


@dataclass(frozen=True)
class SoakSettings:
    """What ``./fx bench soak`` runs."""

    rate: int = 500
    minutes: float = 10.0
    warmup_minutes: float = 2.0
    interval_s: float = 10.0
    max_slope_mb: float = 5.0
    max_growth: float = 0.10
    task_retention_s: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the option that is out of range."""
        if self.rate < 1:
            raise ValueError("--rate must be at least 1 task/s")
        if self.minutes <= 0:
            raise ValueError("--minutes must be positive")
        if not 0 <= self.warmup_minutes < self.minutes / 2:
            raise ValueError(
                "--warmup-minutes must be under half of --minutes: flatness is judged on "
                "the second half of the run, after the warm-up"
            )
        if self.interval_s <= 0:
            raise ValueError("--interval must be positive")
        if self.minutes * 60 / self.interval_s < 6:
            raise ValueError("--interval too long for --minutes: fewer than 6 samples")
        if self.task_retention_s is not None and self.task_retention_s < 1:
            raise ValueError("--task-retention-s must be at least 1 second")

    def platform_settings(self) -> dict[str, int]:
        """The private platform's settings this run asks for (``fxstream.toml``)."""
        if self.task_retention_s is None:
            return {}
        return {"task_retention_s": self.task_retention_s}


@dataclass
class ProcessFigures:
    """One process's RSS over the run and the verdict on it."""

    label: str
    pids: list[int]
    first_mb: float
    post_warmup_mb: float
    end_mb: float
    max_mb: float
    slope_mb_per_10min: float
    ratio: float
    flat: bool
    series_mb: list[float | None] = field(default_factory=list)


def slope_per_10min(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of ``(seconds, MB)`` points, in MB per 10 minutes."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 600.0


def judge(
    label: str,
    pids: list[int],
    series: Sequence[tuple[float, float | None]],
    settings: SoakSettings,
) -> ProcessFigures | None:
    """The figures of one process from its ``(seconds, MB or None)`` samples.

    None when the process was never sampled after the warm-up.
    """
    warmup_s = settings.warmup_minutes * 60
    half_s = settings.minutes * 60 / 2
    present = [(t, v) for t, v in series if v is not None]
    after = [(t, v) for t, v in present if t >= warmup_s]
    if not present or not after:
        return None
    post, end = after[0][1], after[-1][1]
    slope = slope_per_10min([(t, v) for t, v in after if t >= half_s])
    ratio = end / post if post > 0 else 1.0
    return ProcessFigures(
        label=label,
        pids=pids,
        first_mb=round(present[0][1], 1),
        post_warmup_mb=round(post, 1),
        end_mb=round(end, 1),
        max_mb=round(max(v for _, v in present), 1),
        slope_mb_per_10min=round(slope, 2),
        ratio=round(ratio, 3),
        flat=slope <= settings.max_slope_mb and ratio <= 1 + settings.max_growth,
        series_mb=[None if v is None else round(v, 1) for _, v in series],
    )


# --- which processes -----------------------------------------------------------------------


def _walk(platform: Platform) -> Iterator[tuple[str, int, int]]:
    """``(label, pid, rss)`` of every platform process and its descendants, and this one."""
    for label, process in platform_processes(platform):
        try:
            yield label, process.pid, process.memory_info().rss
        except psutil.NoSuchProcess:
            continue


def _tree_bytes(directory: Path) -> int:
    """Bytes of disk the regular files below ``directory`` take (blocks allocated, so
    Kafka's preallocated, sparse index files count what they use; files vanishing
    meanwhile skipped)."""
    total = 0
    for path in directory.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_blocks * 512
        except OSError:
            continue
    return total


def _disk(platform: Platform) -> Iterator[tuple[str, int]]:
    """``(label, bytes)``: the on-disk task tables of every platform process, and the
    broker's ``task-state`` partitions."""
    temp = Path(tempfile.gettempdir())
    for label, process in platform_processes(platform):
        tables = list(temp.glob(f"{TABLE_DIR_PREFIX}{process.pid}-*"))
        if tables:
            yield f"{label}: task tables", sum(_tree_bytes(table) for table in tables)
    prefix = platform.config.topic_prefix + "task-state-"
    for node in platform.nodes(cluster=False):
        partitions = [d for d in node.data_dir.glob(f"{prefix}*") if d.is_dir()]
        if partitions:
            yield f"broker: {prefix}* logs", sum(_tree_bytes(d) for d in partitions)


# --- the run -------------------------------------------------------------------------------


@dataclass
class _Counts:
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    first_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, future: Any) -> None:
        error = None if future.cancelled() else future.exception()
        with self.lock:
            if error is None and not future.cancelled():
                self.succeeded += 1
            else:
                self.failed += 1
                self.first_error = self.first_error or repr(error or "cancelled")

    @property
    def finished(self) -> int:
        with self.lock:
            return self.succeeded + self.failed


@dataclass
class _Samples:
    times: list[float] = field(default_factory=list)
    rss: dict[str, dict[int, float]] = field(default_factory=dict)  # label -> index -> MB
    pids: dict[str, list[int]] = field(default_factory=dict)
    backlog: list[int] = field(default_factory=list)
    disk: dict[str, dict[int, float]] = field(default_factory=dict)  # label -> index -> MB
    # This process's (the SDK's) heap figures at each sample (fxstream.service.memory_report).
    sdk_heap: list[dict[str, int]] = field(default_factory=list)
    _report: MemoryReport = field(default_factory=lambda: MemoryReport(trim=False))

    def take(self, platform: Platform, at: float, backlog: int) -> None:
        index = len(self.times)
        self.times.append(round(at, 1))
        self.backlog.append(backlog)
        heap = self._report.figures()
        heap.pop("rss", None)
        self.sdk_heap.append(heap)
        for label, pid, rss in _walk(platform):
            self.rss.setdefault(label, {})[index] = rss / MB
            pids = self.pids.setdefault(label, [])
            if pid not in pids:
                pids.append(pid)
        for label, size in _disk(platform):
            self.disk.setdefault(label, {})[index] = size / MB

    def series(self, label: str) -> list[tuple[float, float | None]]:
        values = self.rss[label]
        return [(t, values.get(i)) for i, t in enumerate(self.times)]

    def disk_figures(self) -> list[dict[str, Any]]:
        """Per disk label: first, max and end MB, the slope over the run's second half,
        and every sample (None where absent)."""
        half_s = self.times[-1] / 2 if self.times else 0.0
        figures = []
        for label, values in self.disk.items():
            present = [(t, values[i]) for i, t in enumerate(self.times) if i in values]
            if not present:
                continue
            figures.append(
                {
                    "label": label,
                    "first_mb": round(present[0][1], 1),
                    "max_mb": round(max(v for _, v in present), 1),
                    "end_mb": round(present[-1][1], 1),
                    "slope_mb_per_10min": round(
                        slope_per_10min([(t, v) for t, v in present if t >= half_s]), 2
                    ),
                    "series_mb": [
                        None if (v := values.get(i)) is None else round(v, 1)
                        for i in range(len(self.times))
                    ],
                }
            )
        return figures


def _load(
    console: Console,
    private: PrivatePlatform,
    platform: Platform,
    settings: SoakSettings,
    samples: _Samples,
) -> dict[str, Any]:
    """Submit at ``rate`` for ``minutes``, sampling; then drain and read the first task back."""
    counts = _Counts()
    duration = settings.minutes * 60
    first_task: TaskFuture | None = None
    with private.executor() as executor:
        executor.submit(noop).result(timeout=IDLE_TIMEOUT_S)  # registered, warm
        start = time.monotonic()
        next_sample = start
        while (now := time.monotonic()) - start < duration:
            due = int(settings.rate * (now - start))
            while counts.submitted < due:
                future = executor.submit(noop, counts.submitted)
                if first_task is None:
                    first_task = future
                counts.submitted += 1
                future.add_done_callback(counts.done)
            if now >= next_sample:
                backlog = counts.submitted - counts.finished
                samples.take(platform, now - start, backlog)
                _progress(console, samples, now - start, counts)
                if backlog > settings.rate * IDLE_TIMEOUT_S:
                    raise BenchError(
                        f"{backlog:,} tasks behind after {now - start:.0f} s: the platform "
                        f"does not keep up with {settings.rate:,} tasks/s on this machine; "
                        "run with a lower --rate"
                    )
                next_sample += settings.interval_s
            time.sleep(_TICK_S)
        load_s = time.monotonic() - start
        samples.take(platform, load_s, counts.submitted - counts.finished)
        drained = _drain(executor, counts)
        first_state = _read_back(private, first_task, expect_expired=_expired(settings, start))
    return {
        "submitted": counts.submitted,
        "succeeded": counts.succeeded,
        "failed": counts.failed,
        "first_error": counts.first_error,
        "achieved_rate": round(counts.submitted / load_s) if load_s > 0 else 0,
        "drained_in_s": drained,
        "first_task_state": first_state,
        # Times the SDK gave a drained backlog's free heap back (fxstream.sdk.heap).
        "sdk_heap_trims": trim_count(),
    }


def _drain(executor: Executor, counts: _Counts) -> float:
    """Wait for the outstanding tasks; seconds it took. Raises if none finishes for a while."""
    start = last_change = time.monotonic()
    last = counts.finished
    while executor.outstanding:
        time.sleep(0.2)
        finished = counts.finished
        if finished != last:
            last, last_change = finished, time.monotonic()
        elif time.monotonic() - last_change > IDLE_TIMEOUT_S:
            raise BenchError(
                f"{executor.outstanding:,} tasks still without a result {IDLE_TIMEOUT_S:.0f} s "
                "after the load stopped: the platform stalled or lost them"
            )
    return round(time.monotonic() - start, 1)


def _expired(settings: SoakSettings, start: float) -> bool:
    """Whether the run's first task should have expired by now (with a margin of a
    minute for the expiry's own schedule)."""
    retention = settings.task_retention_s
    return retention is not None and time.monotonic() - start > retention + 60


def _read_back(private: PrivatePlatform, first: TaskFuture | None, *, expect_expired: bool) -> str:
    """The service's state of the run's first task (asked over REST, not the future):
    its state, or ``expired`` when the service no longer knows it."""
    if first is None:
        return "none submitted"
    client: Client = private.client()
    wanted = "expired" if expect_expired else "succeeded"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                state = str(client.get_task(first.task_id).get("state"))
            except NotFound:
                state = "expired"
            if state == wanted or time.monotonic() > deadline:
                return state
            time.sleep(0.5)
    finally:
        client.close()


def _progress(console: Console, samples: _Samples, at: float, counts: _Counts) -> None:
    total = sum(values.get(len(samples.times) - 1, 0.0) for values in samples.rss.values())
    console.print(
        f"  {at:6.0f} s  submitted {counts.submitted:,}  done {counts.finished:,}  "
        f"backlog {samples.backlog[-1]:,}  RSS of all processes {total:,.0f} MB",
        highlight=False,
    )


# --- report --------------------------------------------------------------------------------


def _wide(console: Console) -> Console:
    """``console``, or one 150 columns wide on its file when it is not a terminal (rich then
    assumes 80 columns): one line per table row in a log."""
    return console if console.is_terminal else Console(file=console.file, width=150)


def _print_table(console: Console, figures: list[ProcessFigures], settings: SoakSettings) -> None:
    table = Table(
        title=f"RSS under {settings.rate:,} no-op tasks/s for {settings.minutes:g} min "
        f"(warm-up {settings.warmup_minutes:g} min; flat: slope <= {settings.max_slope_mb:g} "
        f"MB/10 min and end/post-warm-up <= {1 + settings.max_growth:g})"
    )
    for column in ("process", "first MB", "post-warm-up MB", "end MB", "max MB"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for column in ("slope MB/10 min", "end/post", "flat"):
        table.add_column(column, justify="right")
    for f in figures:
        restarts = f" (restarted x{len(f.pids) - 1})" if len(f.pids) > 1 else ""
        table.add_row(
            f.label + restarts,
            f"{f.first_mb:,.1f}",
            f"{f.post_warmup_mb:,.1f}",
            f"{f.end_mb:,.1f}",
            f"{f.max_mb:,.1f}",
            f"{f.slope_mb_per_10min:+.1f}",
            f"{f.ratio:.3f}",
            "[green]yes[/green]" if f.flat else "[red]NO[/red]",
        )
    _wide(console).print(table)


def _print_disk(console: Console, disk: list[dict[str, Any]]) -> None:
    table = Table(title="Disk: on-disk task tables and the broker's task-state log (MB)")
    for column in ("where", "first", "max", "end", "slope MB/10 min (2nd half)"):
        table.add_column(column, justify="left" if column == "where" else "right")
    for d in disk:
        table.add_row(
            d["label"],
            f"{d['first_mb']:,.1f}",
            f"{d['max_mb']:,.1f}",
            f"{d['end_mb']:,.1f}",
            f"{d['slope_mb_per_10min']:+.1f}",
        )
    _wide(console).print(table)


def _memory_lines(platform: Platform) -> dict[str, list[str]]:
    """Each service's ``memory:`` log lines (:mod:`fxstream.service.memory_report`), read
    before the platform's home goes: where its RSS went, Python's heap or the allocator's
    or RocksDB's."""
    found: dict[str, list[str]] = {}
    for path in sorted((platform.config.home / "logs").glob("service-*.log")):
        with path.open(encoding="utf-8", errors="replace") as lines:
            kept = [line.strip() for line in lines if "memory: " in line]
        if kept:
            found[path.stem.removeprefix("service-")] = kept
    return found


def run_soak_bench(*, console: Console, settings: SoakSettings) -> dict[str, Any]:
    """Run the soak; print a table and, as the last line of stdout, one JSON object.

    Every process started here is stopped before it returns.
    """
    settings.validate()
    started = time.perf_counter()
    samples = _Samples()
    with private_platform(console, services=True, settings=settings.platform_settings()) as private:
        platform = Platform(private.config)
        retention = (
            f", task retention {settings.task_retention_s:,} s"
            if settings.task_retention_s is not None
            else ""
        )
        console.print(
            f"soak: {settings.rate:,} tasks/s for {settings.minutes:g} min, RSS and disk "
            f"every {settings.interval_s:g} s{retention}"
        )
        load = _load(console, private, platform, settings, samples)
        memory_lines = _memory_lines(platform)
    figures = [
        judged
        for label in samples.rss
        if (judged := judge(label, samples.pids[label], samples.series(label), settings))
        is not None
    ]
    _print_table(console, figures, settings)
    disk = samples.disk_figures()
    _print_disk(console, disk)
    flat = all(f.flat for f in figures)
    report: dict[str, Any] = {
        "bench": "soak",
        **asdict(settings),
        "workers": WORKERS,
        "cpu_count": os.cpu_count() or 0,
        **load,
        "flat": flat,
        "not_flat": [f.label for f in figures if not f.flat],
        "sample_times_s": samples.times,
        "backlog": samples.backlog,
        "processes": [asdict(f) for f in figures],
        "disk": disk,
        "sdk_heap": samples.sdk_heap,
        "memory_lines": memory_lines,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    verdict = (
        "[green]flat[/green]" if flat else "[red]NOT flat[/red]: " + ", ".join(report["not_flat"])
    )
    console.print(
        f"{load['submitted']:,} tasks ({load['achieved_rate']:,}/s), {load['failed']:,} failed; "
        f"first task read back: {load['first_task_state']}; "
        f"SDK heap trims: {load['sdk_heap_trims']}; memory after warm-up: {verdict}"
    )
    print(json.dumps(report), flush=True)
    return report
