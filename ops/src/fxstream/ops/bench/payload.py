"""Round trip of one task whose argument and result are bytes of 10 kB to 1 GB.

Each system runs :func:`echo` (it returns its argument, so the result is as large as
the argument) on ``bytes`` of each size, one task in flight, ``repeats`` times per
size; the median round trip is reported. A round trip is timed in the caller, from
just before the submit to just after the result is back; checking the result (its
length and bytes) is not timed.

1. fxstream: a private platform (broker, Redis, service, the local endpoint with 2
   warm workers) with the platform's Redis as proxy store, as ``./fx up`` configures
   it: the SDK puts each argument above the 64 kB proxy threshold in Redis and sends a
   reference; the worker puts a result above the endpoint's threshold there too, and
   the SDK fetches it before the future resolves. A thread samples the resident set
   of the agent, its workers, Redis and this process (the client) every 20 ms.
2. Dask distributed: a ``LocalCluster`` of 2 worker processes (1 thread each),
   ``client.submit(echo, data, pure=False).result()``: the argument travels inside
   the task graph through the scheduler (what Dask warns about above a few MB).
3. Parsl's HighThroughputExecutor: 2 workers in one local block on the loopback, the
   same ``echo`` as a python_app.
4. Ray: a local runtime of 2 CPUs (:func:`~fxstream.ops.bench.stack.ray_local`, an
   object store of 4 GiB), ``ray.get(echo.remote(data))``: Ray puts an argument above
   its inline limit (``max_direct_call_object_size``, 100 KiB by default) in its
   shared-memory object store, and the worker's result too; ``ray.get`` copies it back
   into this process.

Dask, HTEX and Ray each get the same warm-up; a thread samples the resident set of
every process the bench started for them (the largest one's peak is reported).

The systems run one after the other, each stopped before the next starts, and the
data of one size is freed before the next size. Each size has a time limit: a size
that fails (an exception, or no result within the limit) is recorded as null with
the reason, and the larger sizes of that system are skipped.

Threshold sweep (fxstream only, on the same platform): round trips at sizes around
the proxy threshold with everything inline (the client's and the endpoint's
thresholds above the largest size) and with everything by reference (both
thresholds 0; the endpoint restarted with each setting), and which is faster where.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fxstream.connectors import StoreSpec, redact_url
from fxstream.ops.bench.stack import (
    WORKERS,
    BenchError,
    Meter,
    PrivatePlatform,
    parsl_htex,
    private_platform,
    progress,
    ray_local,
    sigterm_as_exit,
)
from fxstream.ops.platform import Platform
from fxstream.sdk import Client, ClientSettings, Executor

__all__ = [
    "DEFAULT_SIZES",
    "DEFAULT_SWEEP_SIZES",
    "DEFAULT_TIME_LIMIT_S",
    "DEFAULT_WARMUP_LARGE",
    "DEFAULT_WARMUP_SMALL",
    "TARGET_RATIO_10MB_VS_DASK",
    "PayloadSettings",
    "default_repeats",
    "echo",
    "parse_size",
    "run_payload_bench",
]

DEFAULT_SIZES: Final = ("10kB", "100kB", "1MB", "10MB", "100MB", "1GB")
DEFAULT_SWEEP_SIZES: Final = ("16kB", "32kB", "64kB", "128kB", "256kB", "512kB")
DEFAULT_TIME_LIMIT_S: Final = 300.0
DEFAULT_SWEEP_REPEATS: Final = 15
TARGET_RATIO_10MB_VS_DASK: Final = 0.5
# Untimed round trips on each system before the timed ones: small ones (inline), then some
# large enough to go by reference (connections to Redis opened, the function loaded). A
# fresh platform's first few dozen tasks are slower (consumer groups settling, JIT of the
# broker).
DEFAULT_WARMUP_SMALL: Final = 30
DEFAULT_WARMUP_LARGE: Final = 3
_WARMUP_SMALL_BYTES: Final = 1_000
_WARMUP_LARGE_BYTES: Final = 1_000_000
# Above the largest sweep size: the threshold that keeps every value inline.
_ALL_INLINE: Final = 1 << 30
_SAMPLE_S: Final = 0.02
_UNITS: Final = {"B": 1, "kB": 1_000, "MB": 1_000_000, "GB": 1_000_000_000}
_SIZE_LABEL: Final = re.compile(r"^(\d+)(B|kB|MB|GB)$")
# The agent's warm workers are multiprocessing "spawn" children of the agent.
_WORKER_MARK: Final = "multiprocessing.spawn"
_LOCAL_ENDPOINT: Final = "local"

Figures = dict[str, Any]
Trip = Callable[[bytes, float], Any]


def echo(data: bytes) -> bytes:
    """The task every system runs: return the argument, so the result is as large."""
    return data


def parse_size(label: str) -> int:
    """Bytes in a size label such as ``10kB``, ``1MB`` or ``1GB`` (decimal units)."""
    match = _SIZE_LABEL.match(label.strip())
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(
            f"size {label!r} is not understood: write a positive whole number and a unit "
            f"({', '.join(_UNITS)}), e.g. 10kB or 1GB"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def default_repeats(size: int) -> int:
    """Round trips timed per size: 10 below 10 MB, 5 below 100 MB, 3 below 1 GB, then 2."""
    if size < 10_000_000:
        return 10
    if size < 100_000_000:
        return 5
    if size < 1_000_000_000:
        return 3
    return 2


@dataclass(frozen=True)
class PayloadSettings:
    """What one run measures.

    Args:
        sizes: Size labels of the main run (see :func:`parse_size`).
        repeats: Round trips per size; None picks :func:`default_repeats`.
        time_limit_s: The longest one size may take on one system.
        skip_dask: Leave Dask distributed out.
        skip_parsl: Leave Parsl HTEX out.
        skip_ray: Leave Ray out.
        sweep_sizes: Size labels of the threshold sweep; empty skips it.
        sweep_repeats: Round trips per size and mode in the sweep.
        store_url: The proxy store of the client and the endpoint; None: the private
            platform's Redis (what ``./fx up`` configures).
        warmup_small: Untimed 1 kB round trips per system before the timed ones.
        warmup_large: Untimed 1 MB round trips (by reference on fxstream) after those.
    """

    sizes: tuple[str, ...] = DEFAULT_SIZES
    repeats: int | None = None
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    skip_dask: bool = False
    skip_parsl: bool = False
    skip_ray: bool = False
    sweep_sizes: tuple[str, ...] = DEFAULT_SWEEP_SIZES
    sweep_repeats: int = DEFAULT_SWEEP_REPEATS
    store_url: str | None = None
    warmup_small: int = DEFAULT_WARMUP_SMALL
    warmup_large: int = DEFAULT_WARMUP_LARGE

    def validate(self) -> None:
        """Raise ValueError naming the setting that cannot work."""
        if not self.sizes:
            raise ValueError("give at least one size (--sizes), e.g. 10kB,10MB")
        for label in (*self.sizes, *self.sweep_sizes):
            parse_size(label)
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes repeat: {','.join(self.sizes)}")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError("repeats must be at least 1")
        if self.time_limit_s <= 0:
            raise ValueError("the time limit must be positive")
        if self.sweep_repeats < 1:
            raise ValueError("sweep repeats must be at least 1")
        if self.warmup_small < 0 or self.warmup_large < 0:
            raise ValueError("warm-up round trips cannot be negative")
        if self.store_url is not None:
            StoreSpec.parse(self.store_url)

    def repeats_of(self, size: int) -> int:
        """Round trips timed at ``size`` bytes."""
        return self.repeats if self.repeats is not None else default_repeats(size)

    def warmup_bytes(self) -> tuple[int, ...]:
        """The sizes of the untimed round trips before the timed ones, in order."""
        return (_WARMUP_SMALL_BYTES,) * self.warmup_small + (
            _WARMUP_LARGE_BYTES,
        ) * self.warmup_large


def _payload(size: int) -> bytes:
    """``size`` random bytes (nothing on the way can compress them)."""
    return os.urandom(size)


# --- resident set sampling -----------------------------------------------------------------


class RssSampler:
    """Samples the resident set of groups of processes in a thread; keeps each group's peak.

    ``groups`` maps a name to a function listing the group's PIDs now (looked up again
    every second: a restarted agent has a new PID). A group's peak is the largest
    resident set of any one of its processes. :meth:`phase` names what runs, so the
    peaks are also kept per phase.
    """

    def __init__(self, groups: dict[str, Callable[[], list[int]]]) -> None:
        self._groups = groups
        self._pids: dict[str, list[psutil.Process]] = {name: [] for name in groups}
        self.peaks: dict[str, int] = dict.fromkeys(groups, 0)
        self.by_phase: dict[str, dict[str, int]] = {name: {} for name in groups}
        self._phase = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fxstream-bench-rss", daemon=True)

    def __enter__(self) -> RssSampler:
        self._refresh()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> None:
        """Attribute the samples from now on to ``name``."""
        self._phase = name

    def peak_mb(self, group: str) -> float | None:
        """The group's peak in MB (None when no process of it was ever seen)."""
        peak = self.peaks[group]
        return round(peak / 1e6, 1) if peak else None

    def phase_peaks_mb(self, group: str) -> dict[str, float]:
        """The group's peak per phase in MB."""
        return {phase: round(rss / 1e6, 1) for phase, rss in self.by_phase[group].items()}

    def _refresh(self) -> None:
        for name, lookup in self._groups.items():
            found = []
            with contextlib.suppress(Exception):
                for pid in lookup():
                    with contextlib.suppress(psutil.Error):
                        found.append(psutil.Process(pid))
            self._pids[name] = found

    def _run(self) -> None:
        refreshed = time.monotonic()
        while not self._stop.wait(_SAMPLE_S):
            if time.monotonic() - refreshed > 1.0:
                self._refresh()
                refreshed = time.monotonic()
            phase = self._phase
            for name, processes in self._pids.items():
                rss = 0
                for process in processes:
                    with contextlib.suppress(psutil.Error):
                        rss = max(rss, process.memory_info().rss)
                self.peaks[name] = max(self.peaks[name], rss)
                if phase:
                    phases = self.by_phase[name]
                    phases[phase] = max(phases.get(phase, 0), rss)


def _pid_list(pid: int | None) -> list[int]:
    return [] if pid is None else [pid]


def _workers_of(agent_pid: int | None) -> list[int]:
    """The agent's warm worker processes (not multiprocessing's helpers)."""
    if agent_pid is None:
        return []
    found = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(agent_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any(_WORKER_MARK in part for part in child.cmdline()):
                    found.append(child.pid)
    return found


def _descendants() -> list[int]:
    """Every process this one started (Dask's workers, Parsl's interchange and pool)."""
    with contextlib.suppress(psutil.Error):
        return [child.pid for child in psutil.Process().children(recursive=True)]
    return []


# --- timing one system ---------------------------------------------------------------------


@dataclass
class _SystemRun:
    """One system's medians per size, the repeats done and what went wrong."""

    medians_ms: dict[str, float | None] = field(default_factory=dict)
    trips_ms: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def _check(result: Any, data: bytes) -> None:
    if not isinstance(result, bytes | bytearray) or len(result) != len(data):
        kind = type(result).__name__
        size = len(result) if isinstance(result, bytes | bytearray | memoryview) else "?"
        raise BenchError(f"the result is a {kind} of {size} bytes, not {len(data)} bytes")
    if result != data:
        raise BenchError("the result's bytes differ from the argument's")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _one_size(trip: Trip, data: bytes, repeats: int, limit_s: float, meter: Meter) -> list[float]:
    """Up to ``repeats`` timed round trips of ``data`` within ``limit_s`` seconds.

    Stops repeating early once another round trip would not fit in the limit; raises
    when the first one fails or does not finish in time.
    """
    trips: list[float] = []
    deadline = time.monotonic() + limit_s
    for _ in range(repeats):
        remaining = deadline - time.monotonic()
        if trips and remaining < trips[-1] / 1e3:
            break
        start = time.perf_counter()
        result = trip(data, max(remaining, 1.0))
        trips.append((time.perf_counter() - start) * 1e3)
        _check(result, data)
        del result
        meter.count(len(trips))
    return trips


def _run_sizes(
    display: Progress,
    name: str,
    trip: Trip,
    settings: PayloadSettings,
    sampler: RssSampler | None = None,
    warmup: Sequence[int] | None = None,
) -> _SystemRun:
    """Warm-up round trips of ``warmup`` bytes (None: the settings'), then each size; a
    failure ends the run."""
    run = _SystemRun()
    for size in settings.warmup_bytes() if warmup is None else warmup:
        data = _payload(size)
        _check(trip(data, settings.time_limit_s), data)
    failed_at: str | None = None
    for label in settings.sizes:
        if failed_at is not None:
            run.medians_ms[label] = None
            run.failures[label] = f"skipped: {name} already failed at {failed_at}"
            continue
        size = parse_size(label)
        repeats = settings.repeats_of(size)
        meter = Meter(display, f"{name} {label}", repeats, step=1)
        if sampler is not None:
            sampler.phase(label)
        data = b""
        try:
            data = _payload(size)
            trips = _one_size(trip, data, repeats, settings.time_limit_s, meter)
        except Exception as exc:  # any failure of the system is a finding, not a crash
            run.medians_ms[label] = None
            run.failures[label] = _reason(exc)
            meter.finish(0, f"{name} {label}: [red]failed[/red] ({_reason(exc)[:80]})")
            failed_at = label
            continue
        finally:
            del data
            gc.collect()
        median = round(statistics.median(trips), 3)
        run.medians_ms[label] = median
        run.trips_ms[label] = [round(t, 3) for t in trips]
        meter.finish(len(trips), f"{name} {label}: median [bold]{median:,} ms")
        if len(trips) < repeats:
            run.failures[label] = (
                f"only {len(trips)} of {repeats} round trips fit in {settings.time_limit_s:g} s"
            )
    return run


# --- fxstream ------------------------------------------------------------------------------


def _fxstream_trip(executor: Executor) -> Trip:
    def trip(data: bytes, timeout_s: float) -> Any:
        future = executor.submit(echo, data)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    return trip


@contextmanager
def _executor(
    platform: PrivatePlatform, settings: PayloadSettings, proxy_threshold: int | None = None
) -> Iterator[Executor]:
    """An executor on the local endpoint, its client on the bench's store and threshold."""
    if platform.credentials is None or not platform.endpoint_id:
        raise BenchError("the private platform started without its services")
    env = {"FXSTREAM_CREDENTIALS": str(platform.credentials)}
    client_settings = ClientSettings.from_environment(env)
    if settings.store_url is not None:
        client_settings = dataclasses.replace(client_settings, store_url=settings.store_url)
    if client_settings.store_url is None:
        raise BenchError("the private platform's credentials name no store_url (its Redis)")
    if proxy_threshold is not None:
        client_settings = dataclasses.replace(client_settings, proxy_threshold=proxy_threshold)
    client = Client.from_settings(client_settings)
    executor = Executor(endpoint_id=platform.endpoint_id, client=client)
    try:
        yield executor
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        client.close()


def _sampler(platform: PrivatePlatform) -> RssSampler:
    services = Platform(platform.config).services()
    redis = Platform(platform.config).redis().process

    def agent() -> list[int]:
        return _pid_list(services.endpoint.pid())

    return RssSampler(
        {
            "agent": agent,
            "workers": lambda: _workers_of(services.endpoint.pid()),
            "redis": lambda: _pid_list(redis.pid()),
            "client": lambda: [os.getpid()],
        }
    )


def _configure_endpoint(platform: PrivatePlatform, **changes: Any) -> None:
    """Restart the local endpoint with ``changes`` to its config (store_url, proxy_threshold)."""
    services = Platform(platform.config).services()
    path = services.endpoints_dir / _LOCAL_ENDPOINT / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config |= changes
    # Inline results up to the largest sweep size (the default refuses above 1 MB).
    config["max_result_bytes"] = max(int(config.get("max_result_bytes", 0)), 2_000_000)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    services.endpoint.stop()
    services.endpoint.start()


def _sweep_mode(
    display: Progress, platform: PrivatePlatform, mode: str, settings: PayloadSettings
) -> dict[str, float | None]:
    """Medians of the sweep sizes with every value inline, or every value by reference."""
    threshold = _ALL_INLINE if mode == "inline" else 0
    _configure_endpoint(platform, proxy_threshold=threshold)
    sweep = dataclasses.replace(
        settings, sizes=settings.sweep_sizes, repeats=settings.sweep_repeats
    )
    with _executor(platform, settings, proxy_threshold=threshold) as executor:
        smallest = min(parse_size(label) for label in sweep.sizes)
        trip = _fxstream_trip(executor)
        run = _run_sizes(display, f"sweep {mode}", trip, sweep, warmup=[smallest] * 3)
    return run.medians_ms


def _suggested_threshold(
    sizes: Sequence[str], inline: dict[str, float | None], reference: dict[str, float | None]
) -> tuple[int | None, str]:
    """The largest swept size still faster inline below which nothing is faster by reference."""
    faster_inline = [
        label
        for label in sizes
        if inline.get(label) is not None
        and reference.get(label) is not None
        and inline[label] <= reference[label]  # type: ignore[operator]
    ]
    measured = [label for label in sizes if inline.get(label) and reference.get(label)]
    if not measured:
        return None, "the sweep measured nothing"
    # Sizes ascending: the threshold is the last size of the leading run of inline wins.
    suggestion: str | None = None
    for label in measured:
        if label not in faster_inline:
            break
        suggestion = label
    if suggestion is None:
        return parse_size(measured[0]), (
            f"by reference was faster already at {measured[0]}: a threshold at or below it"
        )
    if suggestion == measured[-1]:
        return parse_size(suggestion), (
            f"inline was faster at every swept size up to {suggestion}: the threshold can "
            "go as high as the inline limits allow"
        )
    return parse_size(suggestion), (
        f"inline was faster up to {suggestion}, by reference from the next size on"
    )


def _fxstream(console: Console, settings: PayloadSettings) -> Figures:
    """fxstream on a private platform that is stopped before returning."""
    with (
        private_platform(console, services=True) as platform,
        _sampler(platform) as sampler,
        progress(console) as display,
    ):
        if settings.store_url is not None:
            _configure_endpoint(platform, store_url=settings.store_url)
        with _executor(platform, settings) as executor:
            run = _run_sizes(display, "fxstream", _fxstream_trip(executor), settings, sampler)
            # Client and endpoint share this node: the node-local tier carries the bytes
            # unless FXSTREAM_NODE_STORE=off (docs/data-plane.md, "The node-local tier").
            node = executor.client.local_node(platform.endpoint_id)
        figures: Figures = {
            "fxstream_data_path": (
                "store" if node is None else f"node-local tier {node.directory} (store as fallback)"
            ),
            "fxstream_ms": run.medians_ms,
            "fxstream_trips_ms": run.trips_ms,
            "agent_peak_rss_mb": sampler.peak_mb("agent"),
            "agent_peak_rss_mb_by_size": sampler.phase_peaks_mb("agent"),
            "worker_peak_rss_mb": sampler.peak_mb("workers"),
            "worker_peak_rss_mb_by_size": sampler.phase_peaks_mb("workers"),
            "redis_peak_rss_mb": sampler.peak_mb("redis"),
            "client_peak_rss_mb": sampler.peak_mb("client"),
            "client_peak_rss_mb_by_size": sampler.phase_peaks_mb("client"),
        }
        figures["peak_rss_x_payload"] = _rss_per_payload(settings.sizes, figures)
        failures = {f"fxstream {label}": why for label, why in run.failures.items()}
        if settings.sweep_sizes:
            sampler.phase("sweep")
            inline = _sweep_mode(display, platform, "inline", settings)
            reference = _sweep_mode(display, platform, "reference", settings)
            threshold, why = _suggested_threshold(settings.sweep_sizes, inline, reference)
            figures |= {
                "sweep_inline_ms": inline,
                "sweep_reference_ms": reference,
                "sweep_faster": {
                    label: _faster(inline.get(label), reference.get(label))
                    for label in settings.sweep_sizes
                },
                "suggested_threshold_bytes": threshold,
                "suggested_threshold_why": why,
                "agent_peak_rss_mb_sweep": sampler.phase_peaks_mb("agent").get("sweep"),
            }
    return figures | {"failures": failures}


_RSS_RATIO_FROM_BYTES: Final = 100_000_000


def _rss_per_payload(sizes: Sequence[str], figures: Figures) -> dict[str, dict[str, float]]:
    """Each fxstream process's peak over the payload, at the sizes of 100 MB and more
    (issue 18's target: at most 2). ``client_holding`` counts what this bench's process
    holds by design, its argument and the result it checks (twice the payload), beside
    the client's peak at the smallest size (the interpreter, the SDK): the client's
    floor."""
    ratios: dict[str, dict[str, float]] = {}
    clients = figures["client_peak_rss_mb_by_size"]
    baseline = clients.get(sizes[0]) if sizes else None
    for label in sizes:
        size_mb = parse_size(label) / 1e6
        if size_mb * 1e6 < _RSS_RATIO_FROM_BYTES:
            continue
        found: dict[str, float] = {}
        for name, key in (("worker", "worker_peak_rss_mb_by_size"), ("client", None)):
            peak = (clients if key is None else figures[key]).get(label)
            if peak is not None:
                found[name] = round(peak / size_mb, 2)
        if baseline is not None:
            found["client_holding"] = round((2 * size_mb + baseline) / size_mb, 2)
        ratios[label] = found
    return ratios


def _faster(inline: float | None, reference: float | None) -> str | None:
    if inline is None or reference is None:
        return None
    return "inline" if inline <= reference else "reference"


# --- Dask and Parsl ------------------------------------------------------------------------


def _dask(console: Console, settings: PayloadSettings) -> Figures:
    """Dask distributed: a LocalCluster of worker processes, closed before returning."""
    from distributed import Client as DaskClient
    from distributed import LocalCluster

    with (
        sigterm_as_exit(),
        warnings.catch_warnings(),
        LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=WORKERS,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        DaskClient(cluster) as client,  # type: ignore[no-untyped-call]
        progress(console) as display,
    ):
        # "Sending large graph": the argument inside the graph is what is measured here.
        warnings.filterwarnings(
            "ignore", message="(?s).*large (graph|object)", category=UserWarning
        )
        sampler = RssSampler({"processes": _descendants})

        def trip(data: bytes, timeout_s: float) -> Any:
            future = client.submit(echo, data, pure=False)
            try:
                return future.result(timeout=timeout_s)
            finally:
                future.release()

        with sampler:
            run = _run_sizes(display, "Dask", trip, settings, sampler)
    return {
        "dask_ms": run.medians_ms,
        "dask_trips_ms": run.trips_ms,
        "dask_worker_peak_rss_mb": sampler.peak_mb("processes"),
        "failures": {f"dask {label}": why for label, why in run.failures.items()},
    }


def _htex(console: Console, settings: PayloadSettings) -> Figures:
    """Parsl's HTEX, its run directory in a temporary directory removed afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix="fxstream-bench-parsl-") as run_dir,
        parsl_htex(Path(run_dir), function=echo) as app,
        progress(console) as display,
    ):
        sampler = RssSampler({"processes": _descendants})

        def trip(data: bytes, timeout_s: float) -> Any:
            future: Future[Any] = app(data)
            return future.result(timeout=timeout_s)

        with sampler:
            run = _run_sizes(display, "Parsl HTEX", trip, settings, sampler)
    return {
        "htex_ms": run.medians_ms,
        "htex_trips_ms": run.trips_ms,
        "htex_process_peak_rss_mb": sampler.peak_mb("processes"),
        "failures": {f"htex {label}": why for label, why in run.failures.items()},
    }


def _ray(console: Console, settings: PayloadSettings) -> Figures:
    """Ray's remote tasks on a local runtime of ``WORKERS`` CPUs, shut down afterwards."""
    import ray
    from ray.exceptions import GetTimeoutError

    with ray_local(), progress(console) as display:
        remote_echo = ray.remote(echo)
        sampler = RssSampler({"processes": _descendants})

        def trip(data: bytes, timeout_s: float) -> Any:
            ref = remote_echo.remote(data)
            try:
                return ray.get(ref, timeout=timeout_s)
            except GetTimeoutError:
                ray.cancel(ref, force=True)
                raise

        with sampler:
            run = _run_sizes(display, "Ray", trip, settings, sampler)
    return {
        "ray_ms": run.medians_ms,
        "ray_trips_ms": run.trips_ms,
        "ray_process_peak_rss_mb": sampler.peak_mb("processes"),
        "failures": {f"ray {label}": why for label, why in run.failures.items()},
    }


# --- report --------------------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def _print_tables(console: Console, figures: Figures) -> None:
    table = Table(
        title="round trip of one echo task, bytes argument and result, median ms "
        f"({figures['workers']} workers each, {figures['cpu_count']} cores)"
    )
    columns = ("size", "repeats", "fxstream", "Dask", "Parsl HTEX", "Ray", "fxstream / Dask")
    for column in columns:
        table.add_column(column, justify="left" if column == "size" else "right")
    for label in figures["sizes"]:
        values = [
            figures[key].get(label) for key in ("fxstream_ms", "dask_ms", "htex_ms", "ray_ms")
        ]
        # One decimal: a 1 GB round trip's ms still fit the console beside four systems.
        cells = ["-" if value is None else f"{value:,.1f}" for value in values]
        ratio = _ratio(values[0], values[1])
        table.add_row(
            label, str(figures["repeats"][label]), *cells, "-" if ratio is None else str(ratio)
        )
    console.print(table)
    console.print(
        f"agent peak RSS {figures['agent_peak_rss_mb']} MB, worker peak "
        f"{figures['worker_peak_rss_mb']} MB, Redis peak {figures['redis_peak_rss_mb']} MB; "
        f"largest process of Dask {figures.get('dask_worker_peak_rss_mb')} MB, "
        f"of HTEX {figures.get('htex_process_peak_rss_mb')} MB, "
        f"of Ray {figures.get('ray_process_peak_rss_mb')} MB"
    )
    for label, ratios in (figures.get("peak_rss_x_payload") or {}).items():
        console.print(
            f"{label}: peak RSS / payload: worker {ratios.get('worker')}, client "
            f"{ratios.get('client')} (it holds its argument and the result: floor "
            f"{ratios.get('client_holding')})"
        )
    if figures.get("sweep_inline_ms"):
        sweep = Table(title="fxstream around the proxy threshold: median ms")
        for column in ("size", "inline", "by reference", "faster"):
            sweep.add_column(column, justify="left" if column == "size" else "right")
        for label in figures["sweep_sizes"]:
            inline = figures["sweep_inline_ms"].get(label)
            reference = figures["sweep_reference_ms"].get(label)
            sweep.add_row(
                label,
                "-" if inline is None else f"{inline:,}",
                "-" if reference is None else f"{reference:,}",
                figures["sweep_faster"].get(label) or "-",
            )
        console.print(sweep)
        console.print(f"suggested threshold: {figures['suggested_threshold_why']}")
    for what, why in figures["failures"].items():
        console.print(f"[yellow]{what}:[/yellow] {why}")
    ratio = figures["ratio_10MB_vs_dask"]
    if ratio is not None:
        met = ratio <= TARGET_RATIO_10MB_VS_DASK
        mark = "[green]met[/green]" if met else "[red]NOT met[/red]"
        console.print(
            f"target 10MB round trip <= {TARGET_RATIO_10MB_VS_DASK:g}x Dask's: {mark} ({ratio}x)"
        )


def _settings_figures(settings: PayloadSettings) -> Figures:
    nothing = dict.fromkeys(settings.sizes)
    return {
        "bench": "payload",
        "sizes": list(settings.sizes),
        "repeats": {label: settings.repeats_of(parse_size(label)) for label in settings.sizes},
        "time_limit_s": settings.time_limit_s,
        "warmup_trips": {"1kB": settings.warmup_small, "1MB": settings.warmup_large},
        "workers": WORKERS,
        "cpu_count": os.cpu_count() or 0,
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "function": "echo (returns its bytes argument)",
        "fxstream_ms": dict(nothing),
        "dask_ms": dict(nothing),
        "htex_ms": dict(nothing),
        "ray_ms": dict(nothing),
        "dask": "skipped" if settings.skip_dask else "LocalCluster(processes=True)",
        "parsl": "skipped" if settings.skip_parsl else "htex",
        "ray": "skipped" if settings.skip_ray else f"local ray.init(num_cpus={WORKERS})",
        "sweep_sizes": list(settings.sweep_sizes),
        "store": (
            "platform redis (AOF)" if settings.store_url is None else redact_url(settings.store_url)
        ),
    }


def run_payload_bench(*, console: Console, settings: PayloadSettings) -> Figures:
    """Time round trips of each size on fxstream, Dask, Parsl HTEX and Ray (unless skipped).

    Prints the tables and, as the last line of stdout, the figures as one JSON object,
    which is also returned. Every process started here is stopped before it returns.
    """
    settings.validate()
    started = time.perf_counter()
    figures = _settings_figures(settings)
    failures: dict[str, str] = {}
    systems = [_fxstream]
    systems += [] if settings.skip_dask else [_dask]
    systems += [] if settings.skip_parsl else [_htex]
    systems += [] if settings.skip_ray else [_ray]
    for system in systems:
        measured = system(console, settings)
        failures |= measured.pop("failures")
        figures |= measured
        gc.collect()
    figures["failures"] = failures
    figures["ratio_10MB_vs_dask"] = _ratio(
        figures["fxstream_ms"].get("10MB"), figures["dask_ms"].get("10MB")
    )
    figures["target_ratio_10MB_vs_dask"] = TARGET_RATIO_10MB_VS_DASK
    ratio = figures["ratio_10MB_vs_dask"]
    figures["target_met"] = None if ratio is None else ratio <= TARGET_RATIO_10MB_VS_DASK
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print_tables(console, figures)
    print(json.dumps(figures), flush=True)
    return figures
