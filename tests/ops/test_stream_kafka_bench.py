"""The stream bench's measuring function, on small arrays against the session broker and Redis."""

from __future__ import annotations

import pytest

from fxstream.ops.bench.stream_kafka import measure_kafka_stream
from tests.conftest import RunningPlatform


@pytest.mark.parametrize("inline", [False, True])
def test_stream_bench_measures_both_modes(kafka_platform: RunningPlatform, inline: bool) -> None:
    connection = kafka_platform.connection
    figures = measure_kafka_stream(
        kafka_platform.kafka, connection.redis_url, 64 * 1024, 20, inline=inline
    )
    assert figures["mode"] == ("kafka-inline" if inline else "kafka+redis")
    assert figures["items_per_s"] > 0 and figures["mb_per_s"] > 0
    assert "skipped" not in figures


def test_stream_bench_skips_inline_arrays_above_the_topic_limit(
    kafka_platform: RunningPlatform,
) -> None:
    connection = kafka_platform.connection
    figures = measure_kafka_stream(
        kafka_platform.kafka, connection.redis_url, 10_000_000, 3, inline=True
    )
    assert figures["items_per_s"] is None and figures["mb_per_s"] is None
    assert "max.message.bytes" in figures["skipped"]
    assert figures["record_bytes"] > figures["max_message_bytes"]
