"""``./fx bench trigger``: file close to analysis result, through a trigger rule (issue 15).

On a private platform (broker, Redis, API, stream processors with the trigger processor,
the local endpoint with its 2 workers):

- a **file watcher** (``fxstream-source watch``, its own process, ``close`` mode: inotify
  ``IN_CLOSE_WRITE``) on a fresh directory writes one event per complete file to
  ``events.<source>``;
- a **rule** (``Client.register_trigger``) runs :func:`analyse` on the local endpoint for
  each ``file-complete`` event: it reads the file named by the event (the bytes never go
  through Kafka) and returns its size, checksum and mean byte;
- a **subscriber** (``Client.subscribe(rule_id=...)``, started before the first file)
  takes each result and notes when it had it;
- first ``warmup_tasks`` no-op tasks through ``Executor.submit`` (not measured: a broker
  just started runs its TLS and request code interpreted or C1-compiled, and its JIT
  compilers take a third of its CPU while they catch up; ``0`` measures a cold platform);
- this process **writes the files**: ``warmup_files`` first (awaited, not measured: the
  trigger processor's first sight of the new source topic and the workers' first load of
  the function), then ``steady_files`` at ``rate`` files per second, waits for their
  results, then a **burst** of ``burst_files`` spread over ``burst_s`` seconds.

For each file, the latency is the time from its ``close()`` (in the writer) to its result
handed over by the subscription (same host, same clock). Figures: percentiles over every
measured file (``p50_ms``, ``p99_ms``) and per phase; ``lost`` (files with no result at all:
the bench waits until no result arrives for ``idle_timeout_s``), ``failed`` (results that
are errors: the file had a result, not an analysis), ``duplicates`` (repeated results the
subscription dropped); ``burst_write_s`` (first to last close of the burst),
``burst_drain_s`` (last close of the burst to its last result) and ``burst_total_s`` (first
close to last result); and the median of each hop (close -> event written by the watcher
-> task submitted by the trigger processor -> routed -> dequeued -> started -> finished ->
result published -> at the subscriber). For each phase, the CPU every process spent from
its first write to its last result (``/proc``: the platform's processes and their
children, the watcher, this process), per file (``steady_cpu_us_per_file``,
``burst_cpu_us_per_file``, each with its ``..._total``) and what that allows on this
machine's cores (``..._cap_files_per_s`` = cores / CPU per file): a burst faster than
that queues at every hop, whatever the latencies of an idle path; ``steady_cpu_busy`` is
the share of the cores the steady phase kept busy (its CPU over its wall time). A file
of the steady phase costs more than one of the burst: it arrives alone, so every hop's
transaction and fetch carries it alone. The tables are printed, then one JSON line.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.bench.processes import cpu_per_item, cpu_seconds
from fxstream.ops.bench.stack import (
    BenchError,
    PrivatePlatform,
    percentile,
    private_platform,
    run_noop_tasks,
)
from fxstream.ops.process import ManagedProcess
from fxstream.ops.source_process import start_source_process
from fxstream.sdk import ResultSubscription

__all__ = ["HOPS", "TriggerSettings", "analyse", "run_trigger_bench"]

TARGET_P50_MS: Final = 100.0
_WARMUP_WAIT_S: Final = 180.0
HOPS: Final = (
    ("closed", "event"),
    ("event", "submitted"),
    ("submitted", "routed"),
    ("routed", "dequeued"),
    ("dequeued", "started"),
    ("started", "finished"),
    ("finished", "result_published"),
    ("result_published", "received"),
)
"""The hops of a file's path whose medians are reported, in order."""

Figures = dict[str, Any]


def analyse(event: dict[str, Any]) -> dict[str, Any]:
    """The rule's function: read the file the event names and summarise it."""
    import zlib

    path = str(event["attributes"]["path"])
    with open(path, "rb") as handle:
        data = handle.read()
    return {
        "path": path,
        "bytes": len(data),
        "crc32": zlib.crc32(data),
        "mean": sum(data) / len(data) if data else 0.0,
        "event_at": event["occurred_at"],
    }


@dataclass(frozen=True)
class TriggerSettings:
    """What ``./fx bench trigger`` runs (see the module notes)."""

    steady_files: int = 300
    rate: float = 20.0
    burst_files: int = 1_000
    burst_s: float = 1.0
    file_bytes: int = 65_536
    warmup_files: int = 5
    idle_timeout_s: float = 60.0
    warmup_tasks: int = 20_000

    def validate(self) -> None:
        """``ValueError`` naming the first option out of range."""
        if self.steady_files < 0 or self.burst_files < 0:
            raise ValueError("--steady-files and --burst-files must not be negative")
        if self.steady_files + self.burst_files < 1:
            raise ValueError("--steady-files and --burst-files: measure at least one file")
        if self.rate <= 0:
            raise ValueError(f"--rate must be more than 0 files per second, not {self.rate}")
        if self.burst_s <= 0:
            raise ValueError(f"--burst-seconds must be more than 0, not {self.burst_s}")
        if self.file_bytes < 1:
            raise ValueError(f"--file-bytes must be at least 1, not {self.file_bytes}")
        if self.warmup_files < 1:
            raise ValueError("--warmup-files must be at least 1 (the source topic's first use)")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"--idle-timeout must be more than 0 s, not {self.idle_timeout_s}")
        if self.warmup_tasks < 0:
            raise ValueError(f"--warmup-tasks must not be negative, not {self.warmup_tasks}")


@dataclass
class _Ledger:
    """Per file: when it was closed, and what its result said when it came."""

    closed: dict[str, float] = field(default_factory=dict)
    phase: dict[str, str] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    hops: dict[str, dict[str, float | None]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)


class _Collector:
    """Takes results from the subscription in a thread and books them in the ledger."""

    def __init__(self, subscription: ResultSubscription, ledger: _Ledger) -> None:
        self.subscription = subscription
        self.ledger = ledger
        self.unknown = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-trigger-collector")
        self._stop = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                result = self.subscription.get(timeout=0.2)
                if result is None:
                    continue
                received = time.time()
                if not result.ok:
                    with self.ledger.lock:
                        self.ledger.failed.append(f"{result.task_id}: {result.error}")
                    continue
                value = result.value
                path = str(value["path"])
                timings = result.timings
                with self.ledger.arrived:
                    if path not in self.ledger.closed:
                        self.unknown += 1
                        continue
                    self.ledger.received[path] = received
                    self.ledger.hops[path] = {
                        "closed": self.ledger.closed[path],
                        "event": float(value["event_at"]),
                        "submitted": timings["submitted"],
                        "routed": timings["routed"],
                        "dequeued": timings["dequeued"],
                        "started": timings["started"],
                        "finished": timings["finished"],
                        "result_published": timings["result_published"],
                        "received": received,
                    }
                    self.ledger.arrived.notify_all()
        except BaseException as exc:  # reported by the bench
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _write_file(directory: Path, name: str, block: bytes, ledger: _Ledger, phase: str) -> None:
    path = directory / name
    with open(path, "wb") as handle:
        handle.write(name.encode().ljust(64, b" "))
        handle.write(block)
    closed = time.time()
    with ledger.lock:
        ledger.closed[str(path)] = closed
        ledger.phase[str(path)] = phase


def _wait_for(ledger: _Ledger, phase: str, expected: int, idle_timeout_s: float) -> int:
    """Wait until ``expected`` results of ``phase`` came, or none came for the idle
    timeout; returns how many came."""
    last, since = -1, time.monotonic()
    with ledger.arrived:
        while True:
            got = sum(1 for path in ledger.received if ledger.phase.get(path) == phase)
            if got >= expected:
                return got
            if got != last:
                last, since = got, time.monotonic()
            elif time.monotonic() - since > idle_timeout_s:
                return got
            ledger.arrived.wait(0.5)


def _start_watcher(platform: PrivatePlatform, directory: Path, source: str) -> ManagedProcess:
    return start_source_process(
        "file watcher",
        ["watch", str(directory), "--source", source, "--mode", "close"],
        kafka=platform.kafka,
        credentials_file=platform.platform.credentials_file("admin"),
        prefix=platform.prefix,
        run_dir=platform.home / "bench-trigger",
    )


def _ms(samples: Sequence[float], pct: float) -> float | None:
    return round(percentile(samples, pct) * 1000, 1) if samples else None


def _hop_medians(ledger: _Ledger, paths: Sequence[str]) -> dict[str, float | None]:
    medians: dict[str, float | None] = {}
    for start, end in HOPS:
        samples = []
        for path in paths:
            hops = ledger.hops.get(path, {})
            a, b = hops.get(start), hops.get(end)
            if a is not None and b is not None:
                samples.append(b - a)
        medians[f"{start}->{end}"] = _ms(samples, 50)
    return medians


def _measure(console: Console, platform: PrivatePlatform, settings: TriggerSettings) -> Figures:
    source = f"bench-{uuid.uuid4().hex[:8]}"
    ensure_event_topic(platform.kafka, platform.catalogue, source)
    directory = platform.home / "bench-trigger" / "files"
    directory.mkdir(parents=True)
    directory = directory.resolve()  # as the watcher names the files (symlinks resolved)
    block = os.urandom(max(0, settings.file_bytes - 64))
    ledger = _Ledger()
    if settings.warmup_tasks:
        run_noop_tasks(platform, console, "warm-up", settings.warmup_tasks)
    watcher = _start_watcher(platform, directory, source)

    def cpu() -> dict[str, tuple[int, float]]:
        pid = watcher.pid()
        return cpu_seconds(platform.platform, {"file watcher": pid} if pid else None)

    client = platform.client()
    try:
        function_id = client.register_function(analyse, name="bench-trigger-analyse")
        rule_id = client.register_trigger(
            source=source,
            function_id=function_id,
            endpoint_id=platform.endpoint_id,
            event_type="file-complete",
            name="bench-trigger",
        )
        with client.subscribe(rule_id=rule_id) as subscription:
            collector = _Collector(subscription, ledger)
            collector.start()
            try:
                figures = _phases(console, directory, block, ledger, settings, cpu)
            finally:
                collector.stop()
            if collector.error is not None:
                raise BenchError(f"the subscriber failed: {collector.error}")
            figures["duplicates"] = subscription.duplicates
            figures["unknown_results"] = collector.unknown
        client.delete_trigger(rule_id)
    finally:
        client.close()
        watcher.stop()
    return figures


def _phases(
    console: Console,
    directory: Path,
    block: bytes,
    ledger: _Ledger,
    settings: TriggerSettings,
    cpu: Callable[[], dict[str, tuple[int, float]]],
) -> Figures:
    with console.status("[bold]warm-up: the first files (source topic, workers)"):
        for i in range(settings.warmup_files):
            _write_file(directory, f"warmup-{i:05d}.dat", block, ledger, "warmup")
        got = _wait_for(ledger, "warmup", settings.warmup_files, _WARMUP_WAIT_S)
    if got < settings.warmup_files:
        failed = ledger.failed[:3]
        raise BenchError(
            f"only {got} of {settings.warmup_files} warm-up files had a result within "
            f"{_WARMUP_WAIT_S:.0f} s (failed: {failed}); is the trigger processor running?"
        )
    period = 1.0 / settings.rate
    with console.status(f"[bold]steady: {settings.steady_files} files at {settings.rate:g}/s"):
        steady_before = cpu()
        began = time.monotonic()
        for i in range(settings.steady_files):
            delay = began + i * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            _write_file(directory, f"steady-{i:05d}.dat", block, ledger, "steady")
        steady_write_s = time.monotonic() - began
        _wait_for(ledger, "steady", settings.steady_files, settings.idle_timeout_s)
        steady_after = cpu()
        steady_wall_s = time.monotonic() - began
    with console.status(
        f"[bold]burst: {settings.burst_files} files over {settings.burst_s:g} s, then drain"
    ):
        gap = settings.burst_s / settings.burst_files if settings.burst_files else 0.0
        before = cpu()
        began = time.monotonic()
        for i in range(settings.burst_files):
            delay = began + i * gap - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            _write_file(directory, f"burst-{i:05d}.dat", block, ledger, "burst")
        _wait_for(ledger, "burst", settings.burst_files, settings.idle_timeout_s)
        after = cpu()
    figures = _figures(ledger, settings, steady_write_s)
    figures.update(_phase_cpu("steady", steady_before, steady_after, settings.steady_files))
    steady_total = figures["steady_cpu_us_per_file_total"]
    figures["steady_cpu_busy"] = (
        round(steady_total * settings.steady_files / 1e6 / steady_wall_s / (os.cpu_count() or 1), 3)
        if steady_total
        else None
    )
    figures.update(_phase_cpu("burst", before, after, settings.burst_files))
    return figures


def _phase_cpu(
    phase: str,
    before: dict[str, tuple[int, float]],
    after: dict[str, tuple[int, float]],
    files: int,
) -> Figures:
    """A phase's CPU per file per process (those of at least 1 µs), its total, and the
    files per second this machine's cores allow at that cost."""
    if not files:
        return {
            f"{phase}_cpu_us_per_file": {},
            f"{phase}_cpu_us_per_file_total": None,
            f"{phase}_cap_files_per_s": None,
        }
    per_file = {
        label: round(us) for label, us in cpu_per_item(before, after, files).items() if us >= 1
    }
    total = sum(per_file.values())
    return {
        f"{phase}_cpu_us_per_file": per_file,
        f"{phase}_cpu_us_per_file_total": total,
        f"{phase}_cap_files_per_s": round((os.cpu_count() or 1) * 1e6 / total) if total else None,
    }


def _figures(ledger: _Ledger, settings: TriggerSettings, steady_write_s: float) -> Figures:
    with ledger.lock:
        by_phase: dict[str, list[str]] = {"steady": [], "burst": []}
        for path, phase in ledger.phase.items():
            if phase in by_phase:
                by_phase[phase].append(path)
        latency = {
            phase: [ledger.received[p] - ledger.closed[p] for p in paths if p in ledger.received]
            for phase, paths in by_phase.items()
        }
        measured = by_phase["steady"] + by_phase["burst"]
        every = latency["steady"] + latency["burst"]
        burst = by_phase["burst"]
        burst_closed = [ledger.closed[p] for p in burst]
        burst_received = [ledger.received[p] for p in burst if p in ledger.received]
        figures: Figures = {
            "bench": "trigger",
            "files": len(measured),
            "received": len(every),
            # No result at all (an error result names no file: counted in "failed").
            "lost": max(0, len(measured) - len(every) - len(ledger.failed)),
            "failed": len(ledger.failed),
            "p50_ms": _ms(every, 50),
            "p99_ms": _ms(every, 99),
            "max_ms": _ms(every, 100),
            "steady_files": settings.steady_files,
            "steady_rate": settings.rate,
            "steady_write_s": round(steady_write_s, 2),
            "steady_p50_ms": _ms(latency["steady"], 50),
            "steady_p99_ms": _ms(latency["steady"], 99),
            "burst_files": settings.burst_files,
            "burst_s": settings.burst_s,
            "burst_write_s": (
                round(max(burst_closed) - min(burst_closed), 3) if burst_closed else None
            ),
            "burst_drain_s": (
                round(max(burst_received) - max(burst_closed), 3)
                if burst_received and len(burst_received) == len(burst)
                else None
            ),
            "burst_total_s": (
                round(max(burst_received) - min(burst_closed), 3)
                if burst_received and len(burst_received) == len(burst)
                else None
            ),
            "burst_p50_ms": _ms(latency["burst"], 50),
            "burst_p99_ms": _ms(latency["burst"], 99),
            "file_bytes": settings.file_bytes,
            "warmup_files": settings.warmup_files,
            "warmup_tasks": settings.warmup_tasks,
            "hops_p50_ms": {
                phase: _hop_medians(ledger, paths) for phase, paths in by_phase.items()
            },
            "failures": ledger.failed[:5],
        }
    p50 = figures["p50_ms"]
    figures["target_p50_ms"] = TARGET_P50_MS
    figures["target_met"] = bool(p50 is not None and p50 <= TARGET_P50_MS and not figures["lost"])
    return figures


def _print(console: Console, figures: Figures) -> None:
    table = Table(title="fxstream trigger: file close -> analysis result at a subscriber")
    for column in ("phase", "files", "received", "p50 ms", "p99 ms", "notes"):
        table.add_column(column, justify="left" if column in ("phase", "notes") else "right")
    table.add_row(
        "steady",
        str(figures["steady_files"]),
        "",
        str(figures["steady_p50_ms"]),
        str(figures["steady_p99_ms"]),
        f"{figures['steady_rate']:g} files/s",
    )
    table.add_row(
        "burst",
        str(figures["burst_files"]),
        "",
        str(figures["burst_p50_ms"]),
        str(figures["burst_p99_ms"]),
        f"written in {figures['burst_write_s']} s, drained {figures['burst_drain_s']} s "
        "after its last close",
    )
    table.add_row(
        "all",
        str(figures["files"]),
        str(figures["received"]),
        str(figures["p50_ms"]),
        str(figures["p99_ms"]),
        f"lost {figures['lost']}, failed {figures['failed']}, duplicates dropped "
        f"{figures.get('duplicates', 0)}",
    )
    console.print(table)
    hops = Table(title="median per hop, ms")
    hops.add_column("hop")
    for phase in figures["hops_p50_ms"]:
        hops.add_column(phase, justify="right")
    for start, end in HOPS:
        name = f"{start}->{end}"
        hops.add_row(name, *(str(figures["hops_p50_ms"][p][name]) for p in figures["hops_p50_ms"]))
    console.print(hops)
    steady = figures.get("steady_cpu_us_per_file_total")
    burst = figures.get("burst_cpu_us_per_file_total")
    if not steady and not burst:
        return
    titles = []
    for phase, total in (("steady", steady), ("burst", burst)):
        if total:
            titles.append(
                f"{phase} {total:,} µs (at most {figures[f'{phase}_cap_files_per_s']:,} files/s)"
            )
    busy = figures.get("steady_cpu_busy")
    if busy is not None:
        titles.append(f"the steady phase kept {100 * busy:.0f} % of the cores busy")
    spent = Table(title=f"CPU per file on {os.cpu_count()} cores: " + "; ".join(titles))
    spent.add_column("process")
    for phase, total in (("steady", steady), ("burst", burst)):
        if total:
            spent.add_column(f"{phase} µs / file", justify="right")
            spent.add_column("share", justify="right")
    labels = list(figures.get("burst_cpu_us_per_file") or figures["steady_cpu_us_per_file"])
    for label in labels[:15]:
        row = [label]
        for phase, total in (("steady", steady), ("burst", burst)):
            if total:
                us = figures[f"{phase}_cpu_us_per_file"].get(label, 0)
                row += [f"{us:,}", f"{100 * us / total:.0f} %"]
        spent.add_row(*row)
    console.print(spent)


def run_trigger_bench(console: Console, settings: TriggerSettings) -> Figures:
    """Run the bench on a private platform; print the tables and, last, one JSON line."""
    settings.validate()
    began = time.monotonic()
    with private_platform(console, services=True) as platform:
        figures = _measure(console, platform, settings)
    figures["wall_s"] = round(time.monotonic() - began, 1)
    _print(console, figures)
    print(json.dumps(figures), flush=True)
    return figures
