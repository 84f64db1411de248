"""``./fx demo beamline``: a simulated XPCS detector, analysed file by file as it writes.

On the platform ``./fx up`` started (:func:`attach_running_platform` finds it as ``./fx up``
and its quickstart do: the config's home, its ``platform.json``, the local user's
credentials and the local endpoint), :func:`run_beamline_demo`:

1. starts a **file watcher** (``fxstream-source watch``, its own process, ``close`` mode)
   on a fresh directory ``<home>/demo-beamline/<run>/frames``, writing one event per
   complete file to ``events.<source>`` (``--source``, default ``beamline``);
2. registers the analysis :func:`fxstream.ops.xpcs.analyse_frames_file` (by value, numpy
   only) and a **rule**: every ``file-complete`` event of that source whose relative path
   matches ``*.npy`` runs it on the local endpoint;
3. **subscribes** to the rule's results (``Client.subscribe(rule_id=...)``) and prints
   each as it arrives: the file, its mean counts, ``g2`` of the innermost q-ring at a few
   lags, the relaxation time fitted per ring, and the time from the file's close to its
   result here;
4. acts as the **detector**: writes ``scan.json`` (the scan's metadata: the rule's filter
   skips it), then ``--files`` stacks of ``--frames`` 64 x 64 speckle frames
   (:func:`fxstream.ops.xpcs.simulate_frames`, ``uint16`` ``.npy``, about 0.8 MB per 100
   frames) at ``--rate`` files per second, and waits for every result;
5. deletes the rule, stops the watcher, then runs the **Parquet sink**
   (``fxstream-source sink``, its own process, as the service principal, in a consumer
   group of this run's) into ``<run>/archive`` until this run's events and results are
   archived, stops it (SIGTERM: it flushes and commits), and reads the archive back with
   pyarrow: rows per kind, and this run's.

Every process it starts (the watcher, the sink) is stopped by PID, also when it fails or
is interrupted. The function, the event topic and the archive stay.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.dataset as ds  # type: ignore[import-untyped]
from rich.console import Console

from fxstream.connectors.event_writer import ensure_event_topic
from fxstream.ops.bench.stack import percentile, sigterm_as_exit
from fxstream.ops.config import PlatformConfig
from fxstream.ops.platform import Platform, PlatformError
from fxstream.ops.private import PrivatePlatform
from fxstream.ops.process import ManagedProcess
from fxstream.ops.source_process import start_source_process
from fxstream.ops.xpcs import RINGS, SimulatedSample, analyse_frames_file, simulate_frames
from fxstream.sdk import Client, ResultSubscription
from fxstream.topics.acls import SERVICE_GROUP_PREFIX

__all__ = [
    "BeamlineSettings",
    "DemoError",
    "attach_running_platform",
    "read_archive",
    "run_beamline_demo",
]

G2_LAGS: Final = (1, 2, 5, 10, 20)
"""The lags (frames) of ``g2`` printed per file."""
_ARCHIVE_WAIT_S: Final = 120.0
_MAX_FILES: Final = 10_000
_MAX_FRAMES: Final = 1_000
_ALL_KINDS: Final = ("results", "events", "task_state")

Summary = dict[str, Any]


class DemoError(RuntimeError):
    """The demo cannot run or did not complete; the message says why and what to do."""


@dataclass(frozen=True)
class BeamlineSettings:
    """What ``./fx demo beamline`` runs (see the module notes)."""

    files: int = 10
    rate: float = 2.0
    frames: int = 100
    source: str = "beamline"
    seed: int = 0
    idle_timeout_s: float = 120.0

    def validate(self) -> None:
        """``ValueError`` naming the first option out of range."""
        if not 1 <= self.files <= _MAX_FILES:
            raise ValueError(f"--files must be 1 to {_MAX_FILES:,}, not {self.files}")
        if not self.rate > 0:
            raise ValueError(f"--rate must be more than 0 files per second, not {self.rate}")
        if not 4 <= self.frames <= _MAX_FRAMES:
            raise ValueError(f"--frames must be 4 to {_MAX_FRAMES:,}, not {self.frames}")
        if not self.source or not all(c.isalnum() or c == "-" for c in self.source):
            raise ValueError(f"--source takes letters, digits and '-', not {self.source!r}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"--timeout must be more than 0 s, not {self.idle_timeout_s}")


def attach_running_platform(config: PlatformConfig) -> PrivatePlatform:
    """The platform ``./fx up`` started in ``config.home``, as its local user (nothing is
    started); :class:`DemoError` saying how to start it when it does not run whole."""
    platform = Platform(config)
    home = config.home
    if platform.running_mode() is None:
        raise DemoError(f"no platform runs in {home}: start it with ./fx up")
    try:
        connection = Platform.read_connection(home)
    except PlatformError as exc:
        raise DemoError(str(exc)) from exc
    services = platform.services()
    endpoint_id = services.local_endpoint_id()
    if endpoint_id is None or not services.credentials_file.is_file():
        raise DemoError(
            f"the platform in {home} runs without its services (no local endpoint or user): "
            "start them with ./fx up"
        )
    unhealthy = [
        f"{c.name} ({c.detail or 'unhealthy'})"
        for c in services.status(expected=True)
        if not c.healthy
    ]
    if unhealthy:
        raise DemoError(
            f"the platform in {home} is not healthy: {', '.join(unhealthy)}; see ./fx status, "
            "or restart it with ./fx down && ./fx up"
        )
    return PrivatePlatform(platform, connection, services.credentials_file, endpoint_id)


@dataclass
class _Run:
    """One demo run: where its files go, what was written and what came back."""

    directory: Path
    frames_dir: Path
    archive_dir: Path
    closed: dict[str, float] = field(default_factory=dict)
    results: dict[str, Summary] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    unknown: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)

    def done(self) -> int:
        return len(self.results) + len(self.failures)


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


class _Printer:
    """Takes the rule's results from the subscription in a thread and prints each."""

    def __init__(self, console: Console, subscription: ResultSubscription, run: _Run) -> None:
        self.console = console
        self.subscription = subscription
        self.run = run
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-beamline-subscriber")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                result = self.subscription.get(timeout=0.2)
                if result is None:
                    continue
                received = time.time()
                if not result.ok:
                    with self.run.arrived:
                        self.run.failures.append(f"task {result.task_id}: {result.error}")
                        self.run.arrived.notify_all()
                    self.console.print(
                        f"task {result.task_id} failed: {result.error}",
                        style="red",
                        markup=False,
                        highlight=False,
                    )
                    continue
                self._take(result.value, received, result.timings)
        except BaseException as exc:  # reported by the demo
            self.error = exc

    def _take(self, value: Summary, received: float, timings: Any) -> None:
        path = str(value["path"])
        with self.run.arrived:
            closed = self.run.closed.get(path)
            if closed is None:
                self.run.unknown += 1
                return
            latency_ms = (received - closed) * 1000
            name = Path(path).name
            self.run.results[name] = {
                **value,
                "latency_ms": round(latency_ms, 1),
                "timings": dict(timings),
            }
            self.run.arrived.notify_all()
        inner = value["rings"][0]["g2"]
        g2 = " ".join(_fmt(inner[lag] if lag < len(inner) else None, 6, 3) for lag in G2_LAGS)
        taus = " ".join(_fmt(ring["tau_frames"], 5, 1) for ring in value["rings"])
        self.console.print(
            f"{name:<16} {value['mean_intensity']:>6.1f}  {g2}   {taus}  {latency_ms:>8.0f}",
            highlight=False,
        )


def _header(console: Console, sample: SimulatedSample) -> None:
    rings = ", ".join(f"{lo}-{hi}" for lo, hi in RINGS)
    lags = " ".join(f"{f'g2({lag})':>6}" for lag in G2_LAGS)
    console.print(
        f"q-rings: {rings} pixels from the beam; g2 is the innermost ring's, tau (the "
        "relaxation time, frames) is fitted per ring",
        highlight=False,
    )
    console.print(
        f"{'file':<16} {'<I>':>6}  {lags}   {'tau per ring (frames)':<23}  close->result ms",
        highlight=False,
    )
    curve = sample.expected_g2(max(G2_LAGS))[0]
    g2 = " ".join(_fmt(float(curve[lag]), 6, 3) for lag in G2_LAGS)
    taus = " ".join(_fmt(tau, 5, 1) for _, tau in sample.expected_fit())
    console.print(
        f"{'(the sample)':<16} {sample.expected_mean_intensity():>6.1f}  {g2}   {taus}",
        highlight=False,
    )


def _write_stack(run: _Run, name: str, stack: np.ndarray[Any, Any]) -> None:
    """Write one stack through one ``open()`` (its close is the watcher's cue) and note
    when it closed; under the run's lock, so its result cannot be taken before the note."""
    path = run.frames_dir / name
    with run.lock:
        with open(path, "wb") as handle:
            np.save(handle, stack, allow_pickle=False)
        run.closed[str(path)] = time.time()


def _detector(
    console: Console, run: _Run, settings: BeamlineSettings, sample: SimulatedSample
) -> float:
    """Write the scan's metadata, then the frame stacks at the rate; returns seconds taken."""
    scan = {
        "detector": f"simulated {sample.size}x{sample.size} area detector",
        "files": settings.files,
        "frames_per_file": settings.frames,
        "seed": settings.seed,
        "sample": {
            "tau_ref_frames": sample.tau_ref,
            "r_ref_px": sample.r_ref,
            "speckle_contrast": sample.beta,
        },
    }
    (run.frames_dir / "scan.json").write_text(json.dumps(scan, indent=2) + "\n")
    period = 1.0 / settings.rate
    began = time.monotonic()
    behind = 0
    for i in range(settings.files):
        rng = np.random.default_rng([settings.seed, i])
        stack = simulate_frames(settings.frames, sample, rng)
        delay = began + i * period - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -period:
            behind += 1
        _write_stack(run, f"frame-{i:04d}.npy", stack)
    taken = time.monotonic() - began
    if behind:
        console.print(
            f"[yellow]the detector fell behind --rate {settings.rate:g} for {behind} file(s): "
            "simulating a stack took longer than the period[/yellow]"
        )
    return taken


def _wait_for_results(run: _Run, expected: int, idle_timeout_s: float) -> None:
    """Until ``expected`` results (or failures) came, or none came for the idle timeout."""
    last, since = -1, time.monotonic()
    with run.arrived:
        while True:
            got = run.done()
            if got >= expected:
                return
            if got != last:
                last, since = got, time.monotonic()
            elif time.monotonic() - since > idle_timeout_s:
                return
            run.arrived.wait(0.5)


def _table(directory: Path, kind: str) -> Any:
    """The archive's rows of ``kind`` as a pyarrow table (None before its first file)."""
    root = directory / kind
    if not root.is_dir():
        return None
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    return table if table.num_rows else None


def read_archive(directory: Path, *, rule_id: str, frames_dir: Path) -> Summary:
    """Rows per kind in the Parquet archive at ``directory`` (read back with pyarrow), and
    this run's: results and task-state changes of the rule's task group, events of files
    in ``frames_dir``; with the tasks that have a ``succeeded`` row."""
    counts: Summary = {
        "directory": str(directory),
        "run_results_success": 0,
        "run_tasks_succeeded": 0,
    }
    for kind in _ALL_KINDS:
        table = _table(directory, kind)
        counts[f"{kind}_rows"] = 0 if table is None else table.num_rows
        if table is None:
            counts[f"run_{kind}_rows"] = 0
            continue
        if kind == "events":
            mine = table.filter(pc.starts_with(table["event_key"], pattern=f"{frames_dir}/"))
        else:
            mine = table.filter(pc.equal(table["task_group_id"], rule_id))
        counts[f"run_{kind}_rows"] = mine.num_rows
        if kind == "results":
            counts["run_results_success"] = mine.filter(
                pc.equal(mine["outcome"], "success")
            ).num_rows
        if kind == "task_state":
            succeeded = mine.filter(pc.equal(mine["state"], "succeeded"))
            counts["run_tasks_succeeded"] = len(set(succeeded["task_id"].to_pylist()))
    return counts


def _archive(
    console: Console,
    platform: PrivatePlatform,
    run: _Run,
    rule_id: str,
    expected_events: int,
    expected_results: int,
    expected_succeeded: int,
    started: list[ManagedProcess],
) -> Summary:
    """Run the Parquet sink until this run's events, results and its tasks' ``succeeded``
    states are archived (or :data:`_ARCHIVE_WAIT_S` passed), stop it, and read the archive
    back."""
    services = platform.platform.services()
    group = f"{SERVICE_GROUP_PREFIX}-demo-beamline-{run.directory.name}"
    with console.status("[bold]the Parquet sink archives the platform's records"):
        sink = start_source_process(
            "parquet sink",
            ["sink", str(run.archive_dir), "--group", group, "--max-age-s", "1"],
            kafka=platform.kafka,
            credentials_file=services.service_credentials_file,
            prefix=platform.prefix,
            run_dir=run.directory,
        )
        started.append(sink)
        sink_pid = sink.pid()
        deadline = time.monotonic() + _ARCHIVE_WAIT_S
        while True:
            try:
                counts = read_archive(run.archive_dir, rule_id=rule_id, frames_dir=run.frames_dir)
            except OSError:  # a file went away between listing and reading: look again
                counts = {"run_events_rows": 0, "run_results_rows": 0, "run_tasks_succeeded": 0}
            complete = (
                counts["run_events_rows"] >= expected_events
                and counts["run_results_rows"] >= expected_results
                and counts["run_tasks_succeeded"] >= expected_succeeded
            )
            if complete or time.monotonic() > deadline:
                break
            sink.check_alive()
            time.sleep(0.5)
        sink.stop()
    counts = read_archive(run.archive_dir, rule_id=rule_id, frames_dir=run.frames_dir)
    counts["sink_pid"] = sink_pid
    counts["complete"] = (
        counts["run_events_rows"] == expected_events
        and counts["run_results_rows"] == expected_results
        and counts["run_tasks_succeeded"] == expected_succeeded
    )
    return counts


def _latencies(run: _Run) -> list[float]:
    return [float(r["latency_ms"]) for r in run.results.values()]


def run_beamline_demo(
    console: Console,
    platform: PrivatePlatform,
    settings: BeamlineSettings,
) -> Summary:
    """Run the demo on ``platform`` (module notes); print as it goes; return the summary
    (``ok`` False when a file had no result, a result was an error, or the archive lacks
    rows). Every process it started is stopped before it returns or raises."""
    settings.validate()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    directory = platform.home / "demo-beamline" / run_id
    frames_dir = directory / "frames"
    frames_dir.mkdir(parents=True)
    # As the watcher names files (symlinks resolved).
    run = _Run(directory.resolve(), frames_dir.resolve(), (directory / "archive").resolve())
    sample = SimulatedSample()
    started: list[ManagedProcess] = []
    client: Client | None = None
    rule_id: str | None = None
    summary: Summary = {"demo": "beamline", "directory": str(run.directory)}
    with sigterm_as_exit():
        try:
            client = platform.client()
            state = client.get_endpoint_status(platform.endpoint_id)["state"]
            if state != "online":
                raise DemoError(
                    f"the local endpoint {platform.endpoint_id} is {state}: see ./fx status"
                )
            ensure_event_topic(platform.kafka, platform.connection.catalogue(), settings.source)
            with console.status("[bold]starting the file watcher"):
                watcher = start_source_process(
                    "file watcher",
                    ["watch", str(run.frames_dir), "--source", settings.source, "--mode", "close"],
                    kafka=platform.kafka,
                    credentials_file=platform.platform.credentials_file("admin"),
                    prefix=platform.prefix,
                    run_dir=run.directory,
                )
            started.append(watcher)
            function_id = client.register_function(analyse_frames_file, name="xpcs-two-time")
            rule_id = client.register_trigger(
                source=settings.source,
                function_id=function_id,
                endpoint_id=platform.endpoint_id,
                event_type="file-complete",
                predicates=[("relative_path", "glob", "*.npy")],
                name="beamline-xpcs",
            )
            summary |= {
                "source": settings.source,
                "function_id": function_id,
                "rule_id": rule_id,
                "watcher_pid": watcher.pid(),
            }
            console.print(
                f"file watcher (pid {watcher.pid()}) on {run.frames_dir} -> events."
                f"{settings.source}; rule {rule_id}: *.npy -> xpcs-two-time on the local "
                f"endpoint {platform.endpoint_id}",
                highlight=False,
            )
            console.print(
                f"detector: {settings.files} files of {settings.frames} frames "
                f"({sample.size}x{sample.size}, uint16) at {settings.rate:g} files/s",
                highlight=False,
            )
            _header(console, sample)
            with client.subscribe(rule_id=rule_id) as subscription:
                printer = _Printer(console, subscription, run)
                printer.start()
                try:
                    write_s = _detector(console, run, settings, sample)
                    _wait_for_results(run, settings.files, settings.idle_timeout_s)
                finally:
                    printer.stop()
                if printer.error is not None:
                    raise DemoError(f"the subscriber failed: {printer.error}")
                summary["duplicates_dropped"] = subscription.duplicates
            client.delete_trigger(rule_id)
            rule_id_deleted = rule_id
            rule_id = None
            watcher.stop()
            latencies = _latencies(run)
            summary |= {
                "files": settings.files,
                "frames": settings.frames,
                "rate": settings.rate,
                "write_s": round(write_s, 2),
                "received": len(run.results),
                "failed": len(run.failures),
                "lost": settings.files - run.done(),
                "failures": run.failures[:5],
                "latency_p50_ms": round(percentile(latencies, 50), 1) if latencies else None,
                "latency_max_ms": round(max(latencies), 1) if latencies else None,
                "expected": {
                    "mean_intensity": round(sample.expected_mean_intensity(), 3),
                    "rings": [
                        {"r_px": list(ring), "beta": beta, "tau_frames": tau}
                        for ring, (beta, tau) in zip(RINGS, sample.expected_fit(), strict=True)
                    ],
                },
                "results": {name: run.results[name] for name in sorted(run.results)},
            }
            console.print(
                f"{len(run.results)} of {settings.files} files analysed "
                f"({len(run.failures)} failed, {summary['lost']} without a result); close -> "
                f"result p50 {summary['latency_p50_ms']} ms, max {summary['latency_max_ms']} ms",
                highlight=False,
            )
            archive = _archive(
                console,
                platform,
                run,
                rule_id_deleted,
                expected_events=settings.files + 1,
                expected_results=len(run.results) + len(run.failures),
                expected_succeeded=len(run.results),
                started=started,
            )
            summary["archive"] = archive
            _print_archive(console, archive, settings.files)
        finally:
            for process in reversed(started):
                process.stop()
            if client is not None:
                if rule_id is not None:
                    try:
                        client.delete_trigger(rule_id)
                    except Exception as exc:  # the run's own failure is the one reported
                        console.print(
                            f"could not delete rule {rule_id}: {exc}", style="yellow", markup=False
                        )
                client.close()
    summary["all_stopped"] = all(process.pid() is None for process in started)
    summary["ok"] = (
        summary["received"] == settings.files
        and summary["failed"] == 0
        and bool(summary["archive"]["complete"])
    )
    return summary


def _print_archive(console: Console, archive: Summary, files: int) -> None:
    console.print(f"Parquet archive: [bold]{archive['directory']}[/bold]")
    console.print(
        f"  results: {archive['results_rows']} rows ({archive['run_results_rows']} of this run, "
        f"{archive['run_results_success']} successes)\n"
        f"  events: {archive['events_rows']} rows ({archive['run_events_rows']} of this run: "
        f"{files} frame files and scan.json, which the rule's filter skipped)\n"
        f"  task_state: {archive['task_state_rows']} rows ({archive['run_task_state_rows']} of "
        f"this run; {archive['run_tasks_succeeded']} tasks succeeded)",
        highlight=False,
    )
    console.print(
        "  read it with pandas.read_parquet(DIR/'results'), pyarrow.dataset or DuckDB "
        "(docs/triggers.md, The Parquet sink)",
        highlight=False,
    )
