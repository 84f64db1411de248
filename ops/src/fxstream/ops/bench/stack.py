"""What the benches share: private platforms, Parsl HTEX, the no-op task and small helpers.

- :func:`private_platform` starts a platform of its own (:mod:`fxstream.ops.private`, the
  helper the tests use too) in a temporary home on free ports (a broker and Redis; with
  ``services``, also the REST API, the stream processors and the local endpoint with its
  default 2 workers) and stops every process at the end. Its processes are tied to the
  caller (``tie_to_caller``): if the bench dies, the kernel stops them too.
- :func:`secure_and_plain` runs one measurement on the secure platform and then on a plain
  (``insecure``, PLAINTEXT Kafka) one, and adds ``secure_vs_plain``: the cost of security.
- :func:`parsl_htex` loads a Parsl config with one HighThroughputExecutor (a local
  provider, one block of ``workers`` workers, loopback address, run directory in a given
  temp dir) and cleans it up at the end.
- :func:`ray_local` starts a local Ray runtime (``ray.init``: ``workers`` CPUs, no
  dashboard, an object store of :data:`RAY_OBJECT_STORE_BYTES`, its session files in a
  temp dir) and shuts it down at the end; :func:`ray_wait_all` waits for Ray tasks as
  :func:`wait_all` waits for futures.
- :func:`noop` is the task every system runs.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, as_completed
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from fxstream.ops.platform import Platform
from fxstream.ops.private import (
    PrivatePlatform,
    PrivatePlatformError,
    private_config,
    start_private_platform,
)
from fxstream.sdk import Executor

if TYPE_CHECKING:  # parsl and ray are imported only by the benches that run them (slow)
    from parsl.config import Config
    from ray import ObjectRef

__all__ = [
    "IDLE_TIMEOUT_S",
    "RAY_OBJECT_STORE_BYTES",
    "WORKERS",
    "BenchError",
    "Meter",
    "PrivatePlatform",
    "noop",
    "parsl_htex",
    "percentile",
    "print_secure_vs_plain",
    "private_platform",
    "progress",
    "rate",
    "ray_local",
    "ray_wait_all",
    "result_of",
    "run_noop_tasks",
    "secure_and_plain",
    "secure_vs_plain",
    "sigterm_as_exit",
    "stall_guard",
    "wait_all",
]

# The workers of the local endpoint (``fxstream-endpoint configure``'s default) and of
# every system the task-path benches compare it with.
WORKERS = 2
# A bench that sees no result at all for this long has lost tasks: fail, don't hang.
IDLE_TIMEOUT_S = 60.0
# How often a wait for one result looks at how many others arrived meanwhile.
_CHECK_S = 5.0
# Ray's shared-memory object store, set explicitly: by default Ray takes 30 % of the free
# memory, capped by /dev/shm's size (often 64 MB in a container, where it falls back to
# /tmp). 4 GiB holds the payload bench's 1 GB argument and its 1 GB result at once.
RAY_OBJECT_STORE_BYTES = 4 * 1024**3


class BenchError(RuntimeError):
    """A benchmark phase could not complete; the message says which and why."""


def noop(_: int = 0) -> None:
    """The task every benchmarked system runs: nothing, so only the system's cost is timed."""
    return None


def percentile(samples: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile of ``samples``, rounded to microseconds."""
    if not samples:
        raise BenchError("no samples to take a percentile of")
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return round(ordered[rank - 1], 3)


def rate(count: int, seconds: float) -> int:
    """``count`` per second over ``seconds``, rounded to a whole number."""
    return round(count / seconds) if seconds > 0 else 0


# --- progress ------------------------------------------------------------------------------


def progress(console: Console) -> Progress:
    """A progress display with a bar, a count and the elapsed time per line."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


class Meter:
    """One line of a :class:`~rich.progress.Progress`, updated at most every ``step`` counts.

    Updating the display for every task would cost as much as some systems' tasks.
    """

    def __init__(self, display: Progress, description: str, total: int, step: int = 250) -> None:
        self._display = display
        self._task: TaskID = display.add_task(description, total=total)
        self._step = step

    def count(self, done: int) -> None:
        """``done`` items are finished (shown when it is a multiple of the step)."""
        if done % self._step == 0:
            self._display.update(self._task, completed=done)

    def finish(self, done: int, description: str | None = None) -> None:
        """Show the final count (and a new description)."""
        if description is None:
            self._display.update(self._task, completed=done)
        else:
            self._display.update(self._task, completed=done, description=description)


# --- stopping what we started, whatever happens ---------------------------------------------


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the block runs, SIGTERM raises SystemExit, so ``finally`` clauses still run.

    Python's default for SIGTERM is to die at once, which would leave the processes a
    bench started to the kernel's parent-death signal alone. Only the main thread can
    handle signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- a private platform --------------------------------------------------------------------


@contextmanager
def private_platform(
    console: Console,
    *,
    services: bool,
    insecure: bool = False,
    settings: Mapping[str, int] | None = None,
) -> Iterator[PrivatePlatform]:
    """A platform of our own in a temporary home (:mod:`fxstream.ops.private`), started
    under a spinner and stopped (every process) after the block.

    Without ``services`` only the broker and Redis run. It is the secure platform unless
    ``insecure`` (PLAINTEXT Kafka, no credentials: only for the ``secure_vs_plain`` figures).
    ``settings`` are platform settings of ``fxstream.toml`` (e.g. ``task_retention_s``).
    """
    what = (
        "a private platform (broker, Redis, service, local endpoint)"
        if services
        else "a private broker"
    )
    if insecure:
        what = f"{what}, INSECURE for the comparison"
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="fxstream-bench-") as directory:
        home = Path(directory)
        platform = Platform(private_config(home, insecure=insecure, settings=settings))
        started = None
        try:
            with console.status(f"[bold]starting {what}") as status:
                started = start_private_platform(
                    platform, services=services, step=lambda text: status.update(f"[bold]{text}")
                )
            console.print(f"private platform at {started.bootstrap} (home {home})")
            yield started
        except PrivatePlatformError as exc:
            raise BenchError(str(exc)) from exc
        finally:
            with console.status("[bold]stopping the private platform"):
                if started is not None:
                    started.stop_extra_endpoints()
                platform.down()


Figures = dict[str, Any]
Measure = Callable[[Progress, PrivatePlatform], Figures]


def secure_vs_plain(secure: Figures, plain: Figures) -> Figures:
    """Each figure of ``secure`` as ``{"secure", "plain", "ratio"}`` (secure / plain, 2
    decimals; None when either is missing or zero); a nested dict is compared key by key.

    A ratio below 1 on a rate, or above 1 on a time, is what security costs.
    """
    compared: Figures = {}
    for key, value in secure.items():
        other = plain.get(key)
        if isinstance(value, dict) and isinstance(other, dict):
            compared[key] = secure_vs_plain(value, other)
        elif isinstance(value, int | float) and isinstance(other, int | float):
            ratio = round(value / other, 2) if value and other else None
            compared[key] = {"secure": value, "plain": other, "ratio": ratio}
    return compared


def secure_and_plain(console: Console, measure: Measure, *, plain: bool) -> Figures:
    """``measure`` on a secure private platform with its services, then (if ``plain``) on
    an insecure one, each stopped before the next starts.

    Returns the secure figures plus ``secure_vs_plain`` (None without ``plain``).
    """
    with private_platform(console, services=True) as platform, progress(console) as display:
        secure = measure(display, platform)
    if not plain:
        return secure | {"secure_vs_plain": None}
    with (
        private_platform(console, services=True, insecure=True) as platform,
        progress(console) as display,
    ):
        compared = secure_vs_plain(secure, measure(display, platform))
    return secure | {"secure_vs_plain": compared}


def print_secure_vs_plain(console: Console, figures: Figures) -> None:
    """The top-level ``secure_vs_plain`` figures as a table (nothing if not measured)."""
    compared = figures.get("secure_vs_plain")
    if not compared:
        return
    table = Table(title="fxstream secure vs plain (PLAINTEXT Kafka), same run")
    for column in ("figure", "secure", "plain", "secure / plain"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for key, entry in compared.items():
        if "ratio" in entry:
            table.add_row(key, f"{entry['secure']:,}", f"{entry['plain']:,}", str(entry["ratio"]))
    console.print(table)


# --- Parsl ---------------------------------------------------------------------------------


def _htex_config(run_dir: Path, workers: int) -> Config:
    """A Parsl config: one HTEX, one local block of ``workers`` workers, on the loopback."""
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD
    from parsl.providers import LocalProvider

    # The scripts live beside this interpreter; the venv need not be on PATH (./fx runs
    # .venv/bin/fxstream without activating it).
    bindir = Path(sys.executable).parent
    launch_cmd = DEFAULT_LAUNCH_CMD.replace(
        "process_worker_pool.py", f"{sys.executable} {bindir / 'process_worker_pool.py'}", 1
    )
    executor = HighThroughputExecutor(
        label="htex_bench",
        provider=LocalProvider(  # type: ignore[no-untyped-call]
            init_blocks=1, min_blocks=1, max_blocks=1
        ),
        address="127.0.0.1",
        loopback_address="127.0.0.1",
        max_workers_per_node=workers,
        cores_per_worker=1.0,
        launch_cmd=launch_cmd,
        interchange_launch_cmd=[sys.executable, str(bindir / "interchange.py")],
        worker_logdir_root=str(run_dir),
        # fxstream's brokers speak PLAINTEXT on the loopback: compare like with like.
        encrypted=False,
    )
    return Config(
        executors=[executor],
        run_dir=str(run_dir),
        # One fixed block: no scaling decisions during the measurement.
        strategy="none",
        usage_tracking=0,
    )


@contextmanager
def parsl_htex(
    run_dir: Path, workers: int = WORKERS, function: Callable[..., Any] = noop
) -> Iterator[Callable[..., Any]]:
    """Parsl loaded with one HTEX of ``workers`` workers; yields ``function`` as a python_app.

    Everything Parsl starts (the interchange, the worker pool) is stopped after the
    block by ``cleanup()``, and the loaded config is cleared.
    """
    import parsl

    with sigterm_as_exit():
        dfk = parsl.load(_htex_config(run_dir, workers))
        try:
            yield parsl.python_app(function, data_flow_kernel=dfk)
        finally:
            dfk.cleanup()
            parsl.clear()


# --- Ray ----------------------------------------------------------------------------------


@contextmanager
def ray_local(workers: int = WORKERS) -> Iterator[None]:
    """A local Ray runtime for the block: ``ray.init`` with ``workers`` CPUs (so at most
    ``workers`` tasks run at once, in as many worker processes), no dashboard, an object
    store of :data:`RAY_OBJECT_STORE_BYTES`, its session directory (logs, sockets) in a
    temporary directory; ``ray.shutdown()`` after it stops every process Ray started.

    Ray's usage statistics are off for the block; its own logs stay in its session
    directory (nothing is forwarded to this console).
    """
    import ray

    previous_stats = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with (
        sigterm_as_exit(),
        tempfile.TemporaryDirectory(
            prefix="fxstream-bench-ray-", ignore_cleanup_errors=True
        ) as temp_dir,
    ):
        try:
            ray.init(
                num_cpus=workers,
                include_dashboard=False,
                object_store_memory=RAY_OBJECT_STORE_BYTES,
                log_to_driver=False,
                logging_level=logging.ERROR,
                _temp_dir=temp_dir,
            )
            yield
        finally:
            ray.shutdown()
            if previous_stats is None:
                os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
            else:
                os.environ["RAY_USAGE_STATS_ENABLED"] = previous_stats


def ray_wait_all(refs: Sequence[ObjectRef[Any]], meter: Meter) -> None:
    """Wait for every Ray task of ``refs``, counting them on ``meter`` as they finish (in
    any order), then get every result (which re-raises a task's own exception).

    Raises :class:`BenchError` when no task at all finishes for :data:`IDLE_TIMEOUT_S`.
    """
    import ray

    pending = list(refs)
    # Each ray.wait looks at every pending ref: wake for about 20 progress updates.
    step = max(1, len(refs) // 20)
    since = time.monotonic()
    while pending:
        ready, pending = ray.wait(
            pending, num_returns=min(step, len(pending)), timeout=_CHECK_S, fetch_local=False
        )
        now = time.monotonic()
        if ready:
            since = now
            meter.count(len(refs) - len(pending))
        elif now - since > IDLE_TIMEOUT_S:
            raise BenchError(
                f"{len(pending):,} of {len(refs):,} Ray tasks have no result, and none "
                f"arrived in the last {IDLE_TIMEOUT_S:.0f} s"
            )
    ray.get(list(refs))
    meter.finish(len(refs))


def run_noop_tasks(platform: PrivatePlatform, console: Console, what: str, tasks: int) -> float:
    """``tasks`` no-ops through ``Executor.submit`` on the platform's local endpoint, with a
    progress bar named ``what``; the seconds they took. (The benches' warm-up: a broker
    just started runs its TLS and request code interpreted or C1-compiled until the JIT
    has seen enough of it, docs/benchmarks.md.)"""
    with platform.executor() as executor, progress(console) as display:
        meter = Meter(display, f"{what}: {tasks:,} tasks", tasks)
        start = time.perf_counter()
        futures = [executor.submit(noop, i) for i in range(tasks)]
        wait_all(futures, meter)
        wall = time.perf_counter() - start
        meter.finish(tasks, f"{what}: {tasks:,} tasks, [bold]{rate(tasks, wall):,}/s")
    return wall


def wait_all(futures: Sequence[Future[Any]], meter: Meter) -> None:
    """Wait for every future's result, counting them on ``meter`` as they finish (in any
    order: a task that waits behind others must not hide the progress of the rest).

    Raises :class:`BenchError` when no future at all finishes for :data:`IDLE_TIMEOUT_S`
    (a lost task), and re-raises a task's own exception (the first in submission order).
    """
    idle = _IdleWatch(futures)
    pending = set(futures)
    # as_completed installs one waiter on the futures and hands them back as they finish:
    # O(n) for the whole wait. (A loop of wait(FIRST_COMPLETED) walks every pending future
    # on each call, O(n^2): at 20,000 tasks it capped ProcessPoolExecutor near 250-2,900/s
    # and held every system the throughput bench timed below its rate.) Its timeout is
    # for the whole iteration: every _CHECK_S it starts again on what is left.
    while pending:
        try:
            for future in as_completed(pending, timeout=_CHECK_S):
                pending.discard(future)
                meter.count(len(futures) - len(pending))
        except TimeoutError:
            idle.check()
    for future in futures:
        future.result()
    meter.finish(len(futures))


@contextmanager
def stall_guard(executor: Executor) -> Iterator[threading.Event]:
    """Watch ``executor`` during the block; yields an event set if it stalled.

    A stall is no task of the executor finishing for :data:`IDLE_TIMEOUT_S` while some are
    outstanding. The guard then cancels the outstanding futures (and shuts the executor
    down), so a caller blocked on one of them wakes with ``CancelledError`` instead of
    waiting forever; :meth:`Executor.map`'s own timeout bounds the whole iteration, and
    a slow but moving platform must not trip it.
    """
    stop, stalled = threading.Event(), threading.Event()

    def watch() -> None:
        last, since = executor.outstanding, time.monotonic()
        while not stop.wait(_CHECK_S):
            outstanding = executor.outstanding
            if outstanding != last or not outstanding:
                last, since = outstanding, time.monotonic()
            elif time.monotonic() - since > IDLE_TIMEOUT_S:
                stalled.set()
                executor.shutdown(wait=False, cancel_futures=True)
                return

    watcher = threading.Thread(target=watch, name="fxstream-bench-stall-guard", daemon=True)
    watcher.start()
    try:
        yield stalled
    finally:
        stop.set()
        watcher.join()


def result_of(future: Future[Any], what: str) -> Any:
    """The result of ``future``; :class:`BenchError` if none comes in :data:`IDLE_TIMEOUT_S`."""
    try:
        return future.result(timeout=IDLE_TIMEOUT_S)
    except TimeoutError as exc:
        raise BenchError(f"{what}: no result in {IDLE_TIMEOUT_S:.0f} s: the task was lost") from exc


class _IdleWatch:
    """Fails a wait once no future of ``futures`` has finished for :data:`IDLE_TIMEOUT_S`."""

    def __init__(self, futures: Sequence[Future[Any]]) -> None:
        self._futures = futures
        self._done = -1
        self._since = time.monotonic()

    def check(self) -> None:
        """Count the finished futures (O(n): call it only when a wait timed out)."""
        done = sum(1 for future in self._futures if future.done())
        now = time.monotonic()
        if done != self._done:
            self._done, self._since = done, now
        elif now - self._since > IDLE_TIMEOUT_S:
            raise BenchError(
                f"{len(self._futures) - done:,} of {len(self._futures):,} tasks have no result, "
                f"and none arrived in the last {IDLE_TIMEOUT_S:.0f} s: the platform stalled"
            )
