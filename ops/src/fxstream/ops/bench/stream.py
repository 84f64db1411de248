"""``./fx bench stream``: a producer streams arrays to a consumer process, three ways.

(a) ProxyStore ``StreamProducer``/``StreamConsumer`` over fxstream's Kafka
publisher and subscriber, arrays in the platform's Redis; (b) ADIOS2 SST (and
BP5 read-while-writing, the fallback engine); (c) inline Kafka records where an
array fits the stream topic's ``max.message.bytes``. Items/s and MB/s (10^6
bytes) for 1 MB and 10 MB arrays; the last line is JSON.
"""

from __future__ import annotations

import json
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.stack import private_platform
from fxstream.ops.bench.stream_adios import measure_adios_stream
from fxstream.ops.bench.stream_kafka import measure_kafka_stream

__all__ = ["DEFAULT_STREAM_ITEMS", "run_stream_bench"]

DEFAULT_STREAM_ITEMS: Final = {1_000_000: 200, 10_000_000: 40}
"""Arrays sent per size: about 200-400 MB per mode, a few seconds each here."""

MODES: Final = ("kafka+redis", "adios2-sst", "adios2-bp5", "kafka-inline")


def run_stream_bench(
    *, console: Console, items: dict[int, int] | None = None, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """Run each mode at each array size; print a table and the JSON line; return the figures."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown stream modes {unknown}; known: {', '.join(MODES)}")
    plan = items or DEFAULT_STREAM_ITEMS
    runs: list[dict[str, Any]] = []
    with private_platform(console, services=False) as platform:
        connection = platform.connection
        for array_bytes, count in plan.items():
            for mode in modes:
                with console.status(f"[bold]{mode}: {count} arrays of {array_bytes:,} bytes"):
                    if mode.startswith("adios2-"):
                        # float64 arrays: round the size to whole elements.
                        figures = measure_adios_stream(
                            array_bytes - array_bytes % 8, count, engine=mode.split("-")[1]
                        )
                        figures["mode"] = mode
                    else:
                        figures = measure_kafka_stream(
                            platform.kafka,
                            connection.redis_url,
                            array_bytes,
                            count,
                            inline=mode == "kafka-inline",
                        )
                runs.append(figures)
    table = Table(title="stream: producer -> consumer process")
    for column in ("mode", "array", "items", "items/s", "MB/s", "note"):
        table.add_column(column)
    for run in runs:
        table.add_row(
            str(run["mode"]),
            f"{run['array_bytes'] / 1e6:g} MB",
            str(run["items"]),
            "-" if run.get("items_per_s") is None else f"{run['items_per_s']:,.1f}",
            "-" if run.get("mb_per_s") is None else f"{run['mb_per_s']:,.1f}",
            str(run.get("skipped", "")),
        )
    console.print(table)
    summary: dict[str, Any] = {
        "bench": "stream",
        "mb_per_s": {run["mode"]: {} for run in runs},
        "items_per_s": {run["mode"]: {} for run in runs},
        "runs": runs,
    }
    for run in runs:
        label = f"{run['array_bytes'] // 1_000_000}MB"
        summary["mb_per_s"][run["mode"]][label] = run.get("mb_per_s")
        summary["items_per_s"][run["mode"]][label] = run.get("items_per_s")
    console.print(json.dumps(summary), soft_wrap=True, highlight=False)
    return summary
