"""Benchmarks behind ``./fx bench``: each prints a table and, as its last line, one JSON object.

- :mod:`~fxstream.ops.bench.kafka`: raw Kafka limits on this machine (produce, consume,
  round trip, a 3-hop relay shaped like a task path), measured with plain confluent-kafka.
"""

from fxstream.ops.bench.kafka import run_kafka_bench

__all__ = ["run_kafka_bench"]
