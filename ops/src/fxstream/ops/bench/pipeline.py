"""A pipeline of tasks, each feeding the next: sequential, as a DAG, and with proxy futures.

The synthetic benchmark of the ProxyFutures evaluation (Pauloski's dissertation, section
4.4.1): ``stages`` tasks in a chain, each taking ``seconds``, of which the first
``overhead`` fraction is start-up work that does not need the input (loading a model,
say); then it uses its input, computes for the rest, and produces ``megabytes`` of output
for the next stage (a float64 array: by reference through the platform's Redis, as any
value above the proxy threshold).

Three ways to run the chain on the platform's local endpoint (2 workers):

- ``sequential``: the client submits a stage once the previous one's result is back, with
  that result as its argument (the data goes through the client);
- ``dag``: every stage submitted at once, each with the previous stage's ``TaskFuture`` as
  its argument; the service holds a stage until its parent succeeded and passes the
  parent's result by reference (the data stays in the store);
- ``proxy-futures``: each stage given a proxy future's proxy as its input and the next
  future to set with its output, submitted as soon as fewer than ``WORKERS`` (2) stages
  are in flight (so the producer of every waiting stage has a worker: the endpoint runs
  tasks in the order it reads them, not in the order they wait for each other); a stage
  starts at once, does its start-up work, and blocks only where it uses its input.

The makespan is timed in the caller, from the first submission to the last result, and
its median over ``repeats`` runs is reported for each mode, with the pipelined ideal
(``seconds + (stages - 1) * (1 - overhead) * seconds``: every start-up overlapped with
the stage before) and the sequential ideal (``stages * seconds``). The last printed line
is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.stack import (
    WORKERS,
    BenchError,
    PrivatePlatform,
    private_platform,
    result_of,
)
from fxstream.sdk import Executor

__all__ = ["MODES", "PipelineSettings", "run_pipeline_bench", "stage_to_future", "stage_value"]

MODES = ("sequential", "dag", "proxy-futures")
"""How the chain runs (see the module notes), in the order they are measured."""


def stage_value(data: Any, seconds: float, overhead: float, nbytes: int) -> Any:
    """One stage that returns its output: start-up, use the input, compute, produce."""
    import time

    import numpy as np

    time.sleep(seconds * overhead)
    if data is not None:
        float(data[:1].sum())  # the first use of the input
    time.sleep(seconds * (1 - overhead))
    return np.ones(max(1, nbytes // 8), dtype=np.float64)


def stage_to_future(data: Any, seconds: float, overhead: float, nbytes: int, out: Any) -> int:
    """One stage that sets its output in the proxy future ``out`` (None for the last)."""
    import time

    import numpy as np

    time.sleep(seconds * overhead)
    if data is not None:
        float(data[:1].sum())  # the first use of the input: waits for the previous stage
    time.sleep(seconds * (1 - overhead))
    output = np.ones(max(1, nbytes // 8), dtype=np.float64)
    if out is not None:
        out.set_result(output)
    return int(output.nbytes)


@dataclass(frozen=True)
class PipelineSettings:
    """The chain's shape and how often each mode runs."""

    stages: int = 4
    seconds: float = 2.0
    overhead: float = 0.5
    megabytes: float = 10.0
    repeats: int = 3

    def validate(self) -> None:
        """Raise ``ValueError`` naming what to change."""
        if self.stages < 2:
            raise ValueError(f"--stages must be at least 2, not {self.stages}")
        if self.seconds <= 0:
            raise ValueError(f"--seconds must be more than 0, not {self.seconds}")
        if not 0 <= self.overhead < 1:
            raise ValueError(f"--overhead must be in [0, 1), not {self.overhead}")
        if self.megabytes <= 0:
            raise ValueError(f"--megabytes must be more than 0, not {self.megabytes}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, not {self.repeats}")

    @property
    def nbytes(self) -> int:
        """Each stage's output in bytes."""
        return int(self.megabytes * 1_000_000)

    def ideal_pipelined_s(self) -> float:
        """Every stage's start-up overlapped with the stage before."""
        return self.seconds + (self.stages - 1) * (1 - self.overhead) * self.seconds

    def ideal_sequential_s(self) -> float:
        """One stage after the other."""
        return self.stages * self.seconds


def _sequential(executor: Executor, settings: PipelineSettings) -> None:
    data: Any = None
    for _ in range(settings.stages):
        future = executor.submit(
            stage_value, data, settings.seconds, settings.overhead, settings.nbytes
        )
        data = result_of(future, "a sequential stage")


def _dag(executor: Executor, settings: PipelineSettings) -> None:
    previous: Any = None
    for _ in range(settings.stages):
        previous = executor.submit(
            stage_value, previous, settings.seconds, settings.overhead, settings.nbytes
        )
    result_of(previous, "the last stage of the DAG")


def _proxy_futures(executor: Executor, settings: PipelineSettings) -> None:
    pairs = [
        executor.proxy_future(timeout_s=settings.stages * settings.seconds * 10)
        for _ in range(settings.stages - 1)
    ]
    inputs: list[Any] = [None, *(proxy for _, proxy in pairs)]
    outputs: list[Any] = [*(future for future, _ in pairs), None]
    # At most WORKERS stages in flight, each window's first stage the producer of the next:
    # the endpoint does not order its tasks by what they wait for (a queue's partitions are
    # read in any order), so a later stage could take every worker and wait for a producer
    # that has none, until its timeout.
    in_flight: list[Any] = []
    for data, out in zip(inputs, outputs, strict=True):
        if len(in_flight) == WORKERS:
            result_of(in_flight.pop(0), "a pipelined stage")
        in_flight.append(
            executor.submit(
                stage_to_future, data, settings.seconds, settings.overhead, settings.nbytes, out
            )
        )
    for future in in_flight:
        result_of(future, "a pipelined stage")


_RUNS: dict[str, Callable[[Executor, PipelineSettings], None]] = {
    "sequential": _sequential,
    "dag": _dag,
    "proxy-futures": _proxy_futures,
}


def _warm(executor: Executor) -> None:
    """Both functions loaded in both workers, every connection open (untimed)."""
    future, proxy = executor.proxy_future(timeout_s=60)
    futures = [
        executor.submit(stage_value, None, 0.2, 0.0, 8),
        executor.submit(stage_value, None, 0.2, 0.0, 8),
        executor.submit(stage_to_future, proxy, 0.2, 0.0, 8, None),
        executor.submit(stage_to_future, None, 0.2, 0.0, 8, future),
    ]
    for warming in futures:
        result_of(warming, "a warm-up stage")


def measure(platform: PrivatePlatform, settings: PipelineSettings) -> dict[str, list[float]]:
    """Each mode's makespans (s), ``repeats`` runs each, on ``platform``'s local endpoint."""
    makespans: dict[str, list[float]] = {mode: [] for mode in MODES}
    with platform.executor() as executor:
        if executor.client.store is None:
            raise BenchError("the platform's client has no store_url: nothing to pipeline by")
        _warm(executor)
        for _ in range(settings.repeats):
            for mode in MODES:
                start = time.perf_counter()
                _RUNS[mode](executor, settings)
                makespans[mode].append(time.perf_counter() - start)
    return makespans


def run_pipeline_bench(*, console: Console, settings: PipelineSettings) -> dict[str, Any]:
    """Start a private platform, time the chain in each mode; print and return the figures
    (the last printed line is their JSON)."""
    settings.validate()
    with (
        private_platform(console, services=True) as platform,
        console.status("[bold]running the pipelines"),
    ):
        makespans = measure(platform, settings)
    medians = {mode: statistics.median(values) for mode, values in makespans.items()}
    table = Table(
        title=(
            f"{settings.stages} stages of {settings.seconds:g} s ({settings.overhead:.0%} "
            f"start-up), {settings.megabytes:g} MB between stages: makespan, median of "
            f"{settings.repeats}"
        )
    )
    table.add_column("mode")
    table.add_column("makespan s", justify="right")
    table.add_column("runs s", justify="right")
    for mode in MODES:
        runs = ", ".join(f"{value:.2f}" for value in makespans[mode])
        table.add_row(mode, f"{medians[mode]:.2f}", runs)
    table.add_row("ideal, one after the other", f"{settings.ideal_sequential_s():.2f}", "")
    table.add_row("ideal, pipelined", f"{settings.ideal_pipelined_s():.2f}", "")
    console.print(table)
    figures: dict[str, Any] = {
        "bench": "pipeline",
        "stages": settings.stages,
        "seconds": settings.seconds,
        "overhead": settings.overhead,
        "megabytes": settings.megabytes,
        "repeats": settings.repeats,
        "sequential_s": round(medians["sequential"], 3),
        "dag_s": round(medians["dag"], 3),
        "proxy_futures_s": round(medians["proxy-futures"], 3),
        "ideal_sequential_s": round(settings.ideal_sequential_s(), 3),
        "ideal_pipelined_s": round(settings.ideal_pipelined_s(), 3),
        "proxy_futures_vs_dag": round(medians["proxy-futures"] / medians["dag"], 3),
    }
    console.print(json.dumps(figures), soft_wrap=True)
    return figures
