"""The round trip of one warm no-op task, hop by hop, beside Parsl's HTEX and Ray.

One task in flight at a time: submit, wait for the result, repeat, ``samples`` times
after an untimed warm-up (the function registered and loaded in the workers, every
connection open). A round trip is timed in the caller, from just before ``submit`` to
just after ``result()`` returns.

The fxstream median is broken down by hop with each future's ``timings`` (epoch seconds
stamped by the SDK, the router, the agent and its worker, all on this machine's one
clock), plus the two ends only the caller sees:

- ``call->submitted``: ``submit()`` called, to the task prepared (serialized, stamped);
- ``submitted->routed``: the SDK's queue and producer (linger), the broker, the router's
  batch and checks;
- ``routed->dequeued``: the router writes the state, then the dispatch (acks=all); the
  agent fetches it;
- ``dequeued->started``: the agent hands the task to a warm worker;
- ``started->finished``: the function runs (a no-op);
- ``finished->result_published``: the worker's reply reaches the agent, which builds the
  result record;
- ``result_published->delivered``: the agent's producer (acks=all), the broker, the SDK's
  results listener;
- ``delivered->returned``: the listener resolves the future; ``result()`` wakes and returns.

Each hop's p50 is taken over the samples on its own, so the hop medians need not add
up to the round trip's median exactly.

fxstream runs on the secure platform (SASL_SSL Kafka); then, unless ``plain`` is False,
the same on an insecure (PLAINTEXT) platform, and ``secure_vs_plain`` gives each fxstream
figure (the hops too) on both and their ratio: what security costs.

Parsl's HTEX (2 workers, one local block on the loopback) runs the same no-op as a
python_app, sequentially, after the fxstream platform has been stopped (skipped with
``skip_parsl``). Then Ray (a local runtime of 2 CPUs,
:func:`~fxstream.ops.bench.stack.ray_local`) runs it as a remote task, one
``ray.get(f.remote(i))`` at a time (skipped with ``skip_ray``). Both get the same
warm-up and the same number of samples as fxstream, timed the same way.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

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
    percentile,
    print_secure_vs_plain,
    progress,
    ray_local,
    result_of,
    secure_and_plain,
)
from fxstream.sdk import TIMING_KEYS, Executor, TaskFuture

__all__ = ["HOPS", "run_latency_bench"]

# Untimed round trips before the timed ones.
WARMUP_SAMPLES = 50
# The hops of the breakdown, in path order: the caller's two ends around the SDK's timings.
_STAMPS = ("call", *TIMING_KEYS, "returned")
HOPS = tuple(f"{a}->{b}" for a, b in itertools.pairwise(_STAMPS))

Figures = dict[str, Any]


@dataclass
class _Samples:
    """Round trips (ms) and, for fxstream, each hop's durations (ms)."""

    trips: list[float] = field(default_factory=list)
    hops: dict[str, list[float]] = field(default_factory=lambda: {hop: [] for hop in HOPS})


def _hops_of(called: float, future: TaskFuture, returned: float) -> list[float]:
    """Each hop of one task in ms, from the caller's stamps and the future's timings."""
    reported = [future.timings[key] for key in TIMING_KEYS]
    missing = [key for key, stamp in zip(TIMING_KEYS, reported, strict=True) if stamp is None]
    if missing:
        raise BenchError(f"task {future.task_id} came back without timings for {missing}")
    stamps = [called, *(stamp for stamp in reported if stamp is not None), returned]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def _fxstream_trip(executor: Executor, i: int, samples: _Samples | None) -> None:
    """One round trip on fxstream; recorded in ``samples`` unless it is a warm-up."""
    called = time.time()
    start = time.perf_counter()
    future = executor.submit(noop, i)
    result_of(future, "fxstream round trip")
    trip_ms = (time.perf_counter() - start) * 1e3
    returned = time.time()
    if samples is None:
        return
    samples.trips.append(trip_ms)
    for hop, duration in zip(HOPS, _hops_of(called, future, returned), strict=True):
        samples.hops[hop].append(duration)


def _htex_trip(app: Callable[..., Any], i: int, samples: _Samples | None) -> None:
    """One round trip on Parsl HTEX; recorded in ``samples`` unless it is a warm-up."""
    start = time.perf_counter()
    result_of(app(i), "Parsl HTEX round trip")
    if samples is not None:
        samples.trips.append((time.perf_counter() - start) * 1e3)


def _sequential(
    display: Progress, name: str, trip: Callable[[int, _Samples | None], None], count: int
) -> _Samples:
    """Warm-up round trips, then ``count`` timed ones, each shown as a progress line."""
    warm = Meter(display, f"{name}: warm-up", WARMUP_SAMPLES, step=10)
    for i in range(WARMUP_SAMPLES):
        trip(i, None)
        warm.count(i + 1)
    warm.finish(WARMUP_SAMPLES)
    samples = _Samples()
    meter = Meter(display, f"{name}: {count:,} round trips", count, step=10)
    for i in range(count):
        trip(i, samples)
        meter.count(i + 1)
    p50 = percentile(samples.trips, 50)
    meter.finish(count, f"{name}: {count:,} round trips, p50 [bold]{p50} ms")
    return samples


# --- the systems ---------------------------------------------------------------------------


def _summary(prefix: str, trips: Sequence[float]) -> Figures:
    """p50/p95/p99 and the mean of ``trips``, under keys starting with ``prefix``."""
    return {
        f"{prefix}_p50_ms": percentile(trips, 50),
        f"{prefix}_p95_ms": percentile(trips, 95),
        f"{prefix}_p99_ms": percentile(trips, 99),
        f"{prefix}_mean_ms": round(statistics.fmean(trips), 3),
    }


def _fxstream_on(display: Progress, platform: PrivatePlatform, count: int) -> Figures:
    """Sequential round trips on the platform's local endpoint, with the hop breakdown."""
    with platform.executor() as executor:
        samples = _sequential(
            display,
            "fxstream",
            lambda i, into: _fxstream_trip(executor, i, into),
            count,
        )
    return _summary("fxstream", samples.trips) | {
        "hops_p50_ms": {hop: percentile(d, 50) for hop, d in samples.hops.items()},
        "hops_p99_ms": {hop: percentile(d, 99) for hop, d in samples.hops.items()},
    }


def _htex(console: Console, count: int) -> Figures:
    """Parsl's HTEX, its run directory in a temporary directory removed afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix="fxstream-bench-parsl-") as run_dir,
        parsl_htex(Path(run_dir)) as app,
        progress(console) as display,
    ):
        samples = _sequential(
            display, "Parsl HTEX", lambda i, into: _htex_trip(app, i, into), count
        )
    return _summary("htex", samples.trips)


def _ray(console: Console, count: int) -> Figures:
    """Ray's remote tasks on a local runtime of ``WORKERS`` CPUs, shut down afterwards."""
    import ray
    from ray.exceptions import GetTimeoutError

    with ray_local(), progress(console) as display:
        # noop's argument is optional: typed as taking one, Ray's stubs allow passing it.
        remote_noop = ray.remote(cast("Callable[[int], None]", noop))

        def trip(i: int, samples: _Samples | None) -> None:
            start = time.perf_counter()
            try:
                ray.get(remote_noop.remote(i), timeout=IDLE_TIMEOUT_S)
            except GetTimeoutError as exc:
                raise BenchError(
                    f"Ray round trip: no result in {IDLE_TIMEOUT_S:.0f} s: the task was lost"
                ) from exc
            if samples is not None:
                samples.trips.append((time.perf_counter() - start) * 1e3)

        samples = _sequential(display, "Ray", trip, count)
    return _summary("ray", samples.trips)


# --- report --------------------------------------------------------------------------------


def _print_tables(console: Console, figures: Figures) -> None:
    """The round trips of each system, then fxstream's hop breakdown."""
    table = Table(
        title=f"{figures['samples']:,} sequential round trips of a warm no-op task, "
        f"{figures['workers']} workers, {figures['cpu_count']} cores"
    )
    for column in ("system", "p50 ms", "p95 ms", "p99 ms", "mean ms"):
        table.add_column(column, justify="left" if column == "system" else "right")
    systems = (
        ("fxstream", "fxstream"),
        ("Parsl HTEX (2 workers)", "htex"),
        ("Ray (2 CPUs, remote task)", "ray"),
    )
    for label, prefix in systems:
        values = [figures.get(f"{prefix}_{stat}_ms") for stat in ("p50", "p95", "p99", "mean")]
        table.add_row(label, *("skipped" if v is None else str(v) for v in values))
    console.print(table)
    hops = Table(title="fxstream round trip by hop (each hop's own percentile)")
    for column in ("hop", "p50 ms", "p99 ms", "share of the p50 sum"):
        hops.add_column(column, justify="left" if column == "hop" else "right")
    total = sum(figures["hops_p50_ms"].values()) or 1.0
    for hop in HOPS:
        p50 = figures["hops_p50_ms"][hop]
        hops.add_row(hop, str(p50), str(figures["hops_p99_ms"][hop]), f"{p50 / total:.0%}")
    console.print(hops)


def _settings(samples: int, skip_parsl: bool, skip_ray: bool) -> Figures:
    """What was measured, and how, for the report."""
    return {
        "bench": "latency",
        "samples": samples,
        "warmup_samples": WARMUP_SAMPLES,
        "workers": WORKERS,
        "cpu_count": os.cpu_count() or 0,
        "acks": "all",
        "security": "secure (SASL_SSL Kafka)",
        "parsl": "skipped" if skip_parsl else "htex",
        "htex_p50_ms": None,
        "htex_p95_ms": None,
        "htex_p99_ms": None,
        "htex_mean_ms": None,
        "ray": "skipped" if skip_ray else f"local ray.init(num_cpus={WORKERS})",
        "ray_p50_ms": None,
        "ray_p95_ms": None,
        "ray_p99_ms": None,
        "ray_mean_ms": None,
    }


def run_latency_bench(
    *,
    console: Console,
    samples: int,
    skip_parsl: bool,
    plain: bool = True,
    skip_ray: bool = False,
) -> Figures:
    """Time ``samples`` sequential round trips on fxstream and (unless skipped) Parsl HTEX
    and Ray.

    fxstream runs on the secure platform and, if ``plain``, also on an insecure one
    (``secure_vs_plain``).

    Prints the tables and, as the last line of stdout, the figures as one JSON object,
    which is also returned. Every process started here is stopped before it returns.
    """
    if samples < 1:
        raise ValueError("samples must be at least 1")
    started = time.perf_counter()
    figures = _settings(samples, skip_parsl, skip_ray)
    figures |= secure_and_plain(
        console, lambda display, platform: _fxstream_on(display, platform, samples), plain=plain
    )
    if not skip_parsl:
        figures |= _htex(console, samples)
    if not skip_ray:
        figures |= _ray(console, samples)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    _print_tables(console, figures)
    print_secure_vs_plain(console, figures)
    print(json.dumps(figures), flush=True)
    return figures
