"""Benchmarks behind ``./fx bench``: each prints a table and, as its last line, one JSON object.

- :mod:`~fxstream.ops.bench.kafka`: raw Kafka limits on this machine (produce, consume,
  round trip, a 3-hop relay shaped like a task path), measured with plain confluent-kafka.
- :mod:`~fxstream.ops.bench.throughput`: no-op tasks/s through the whole task path
  (``Executor.submit`` and ``Executor.map``), beside ``ProcessPoolExecutor(2)`` and Parsl's
  HighThroughputExecutor with 2 workers.
- :mod:`~fxstream.ops.bench.latency`: sequential round trips of a warm no-op task
  (p50/p95/p99 and a hop-by-hop breakdown), beside Parsl's HTEX.
- :mod:`~fxstream.ops.bench.payload`: round trips of one task with a bytes argument and
  result of 10 kB to 1 GB (by reference through Redis), beside Dask distributed and Parsl's
  HTEX; and the inline vs by-reference sweep around the proxy threshold.
- :mod:`~fxstream.ops.bench.coldstart`: a worker's cold start (container, interpreter,
  function load) and a warm task's round trip, per container runtime.
- :mod:`~fxstream.ops.bench.trigger`: a file watcher, a trigger rule and a result
  subscription: each file's close to its analysis result, steady and in a burst.
- :mod:`~fxstream.ops.bench.pipeline`: a chain of tasks passing 10 MB along, one after
  the other, as a DAG, and pipelined with proxy futures (makespans).
- :mod:`~fxstream.ops.bench.stack`: what they share (a private platform, Parsl HTEX, the
  no-op task).

Parsl is imported only when a bench runs it, and each bench's module only when its name
is first used (so ``bench coldstart``'s measuring children import no other bench).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxstream.ops.bench.coldstart import run_coldstart_bench
    from fxstream.ops.bench.kafka import run_kafka_bench
    from fxstream.ops.bench.latency import run_latency_bench
    from fxstream.ops.bench.payload import run_payload_bench
    from fxstream.ops.bench.pipeline import run_pipeline_bench
    from fxstream.ops.bench.throughput import run_throughput_bench
    from fxstream.ops.bench.trigger import run_trigger_bench

_MODULES = {
    "run_coldstart_bench": "fxstream.ops.bench.coldstart",
    "run_kafka_bench": "fxstream.ops.bench.kafka",
    "run_latency_bench": "fxstream.ops.bench.latency",
    "run_payload_bench": "fxstream.ops.bench.payload",
    "run_pipeline_bench": "fxstream.ops.bench.pipeline",
    "run_throughput_bench": "fxstream.ops.bench.throughput",
    "run_trigger_bench": "fxstream.ops.bench.trigger",
}

__all__ = [
    "run_coldstart_bench",
    "run_kafka_bench",
    "run_latency_bench",
    "run_payload_bench",
    "run_pipeline_bench",
    "run_throughput_bench",
    "run_trigger_bench",
]


def __getattr__(name: str) -> Any:
    """Import one of the package's names from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
