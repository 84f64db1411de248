"""ADIOS2 array streaming between two processes: items/s and MB/s (for ``./fx bench stream``).

:func:`measure_adios_stream` runs one producer (this process) and one consumer (a
process of its own, started with ``multiprocessing`` spawn) on an
:class:`~fxstream.connectors.adios_stream.Adios2Stream`:

- ``engine="sst"``: memory to memory over TCP on 127.0.0.1 (SST, WAN data transport);
- ``engine="bp5"``: the producer appends steps to a BP5 file that the consumer reads
  while it is written (through the page cache on one machine).

The producer sends ``items`` float64 arrays of ``array_bytes`` bytes each (the same
buffer, its first element set to the step's number, which the consumer checks) and
then its end-of-stream step. The clock starts once both sides are open (SST's
rendezvous and the consumer's start-up are not timed) and stops when the consumer has
received the end of the stream; both stamps are this machine's wall clock. MB are
10^6 bytes of array payload.
"""

from __future__ import annotations

import multiprocessing
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fxstream.connectors.adios_stream import ADIOS_STREAM_ENGINES, Adios2Stream
from fxstream.ops.bench.stack import BenchError

__all__ = ["measure_adios_stream"]

# Spawn, not fork: a forked child would share the parent's ADIOS2 state.
_SPAWN = multiprocessing.get_context("spawn")
STARTUP_TIMEOUT_S = 60.0
# A stream that makes no progress for this long has failed: report it, don't hang.
IDLE_TIMEOUT_S = 120.0


def _consume(stream: Adios2Stream, reports: Any) -> None:
    """The consumer process: read every step, check it, report when the stream ends."""
    try:
        with stream.reader() as reader:
            reports.put(("ready", time.time()))
            received = received_bytes = 0
            for step in reader:
                if step.seq != received or step.array[0] != float(step.seq):
                    raise BenchError(
                        f"step {received} arrived as seq {step.seq} with first element "
                        f"{step.array[0]}"
                    )
                received += 1
                received_bytes += step.array.nbytes
            reports.put(("done", time.time(), received, received_bytes))
    except BaseException as error:
        reports.put(("failed", repr(error)))


def _report(reports: Any, consumer: Any, what: str, timeout: float) -> tuple[Any, ...]:
    try:
        report: tuple[Any, ...] = reports.get(timeout=timeout)
    except queue.Empty:
        raise BenchError(
            f"the ADIOS2 consumer process sent nothing within {timeout:.0f} s while {what} "
            f"(alive: {consumer.is_alive()}, exit code {consumer.exitcode})"
        ) from None
    if report[0] == "failed":
        raise BenchError(f"the ADIOS2 consumer failed while {what}: {report[1]}")
    return report


def measure_adios_stream(
    array_bytes: int, items: int, engine: str = "sst", directory: str | None = None
) -> dict[str, Any]:
    """Stream ``items`` float64 arrays of ``array_bytes`` bytes to a consumer process.

    Args:
        array_bytes: bytes per array (a positive multiple of 8).
        items: arrays to send (at least 1).
        engine: ``"sst"`` or ``"bp5"``.
        directory: where the stream's files go (a temporary directory by default,
            removed at the end).

    Returns:
        ``engine``, ``transport``, ``items``, ``array_bytes``, ``seconds``,
        ``items_per_s`` and ``mb_per_s`` (10^6 bytes of payload per second).

    Raises:
        ValueError: bad arguments.
        BenchError: the consumer failed, or stopped making progress.
    """
    if array_bytes < 8 or array_bytes % 8:
        raise ValueError(f"array_bytes must be a positive multiple of 8, got {array_bytes}")
    if items < 1:
        raise ValueError(f"items must be at least 1, got {items}")
    if engine not in ADIOS_STREAM_ENGINES:
        raise ValueError(f"engine must be one of {ADIOS_STREAM_ENGINES}, got {engine!r}")
    workdir = Path(tempfile.mkdtemp(prefix="fxstream-bench-adios-", dir=directory))
    stream = Adios2Stream(
        str(workdir / "stream"),
        engine=engine,
        open_timeout=STARTUP_TIMEOUT_S,
    )
    reports = _SPAWN.Queue()
    consumer = _SPAWN.Process(target=_consume, args=(stream, reports), daemon=True)
    array = np.zeros(array_bytes // 8, dtype=np.float64)
    try:
        if engine == "bp5":
            # BP5: the file must exist before the consumer can open it.
            writer = stream.writer()
            consumer.start()
        else:
            # SST: the writer's open waits for the consumer to connect.
            consumer.start()
            writer = stream.writer()
        with writer:
            _report(reports, consumer, "opening the stream", STARTUP_TIMEOUT_S)
            started = time.time()
            for index in range(items):
                array[0] = index
                writer.send(array)
        done = _report(reports, consumer, "receiving the stream", IDLE_TIMEOUT_S)
        _, finished, received, received_bytes = done
        if received != items or received_bytes != items * array_bytes:
            raise BenchError(
                f"the consumer received {received} arrays ({received_bytes} bytes), "
                f"not {items} ({items * array_bytes} bytes)"
            )
        consumer.join(STARTUP_TIMEOUT_S)
    finally:
        if consumer.is_alive():
            consumer.kill()
            consumer.join(STARTUP_TIMEOUT_S)
        reports.close()
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = max(finished - started, 1e-9)
    return {
        "engine": engine,
        "transport": "SST WAN sockets on lo (127.0.0.1)" if engine == "sst" else "BP5 file",
        "items": items,
        "array_bytes": array_bytes,
        "seconds": round(seconds, 4),
        "items_per_s": round(items / seconds, 2),
        "mb_per_s": round(items * array_bytes / seconds / 1e6, 2),
    }
