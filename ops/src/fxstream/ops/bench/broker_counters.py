"""The broker's request and record counters, for a bench that says what a task costs the
broker in requests (``./fx bench profile``).

Kafka counts every request it serves by API (``RequestMetrics``) and every record written
by topic (``BrokerTopicMetrics``), and exposes the counts over JMX only. The reader here
runs ``BrokerRequests.java`` (beside this module) as a single-file Java program: it attaches
to the broker's JVM through the JDK's attach API, which only the OS user running the broker
may use, so no JMX port is opened and nothing listens on the network. Each
:meth:`BrokerCounters.read` asks it for the counts so far; a bench takes the difference of
two readings.
"""

from __future__ import annotations

import contextlib
import json
import select
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["BrokerCounters", "CounterReading", "per_item"]

_PROBE = Path(__file__).with_name("BrokerRequests.java")
# The first reading compiles the probe and attaches: a few seconds on this machine.
_FIRST_READ_S = 60.0
_READ_S = 30.0


@dataclass(frozen=True)
class CounterReading:
    """The broker's cumulative counts at one moment."""

    requests: dict[str, int]
    """Requests served so far, by API name (``Produce``, ``Fetch``, ``EndTxn``, ...)."""
    records_in: dict[str, int]
    """Records written so far, by topic."""
    bytes_in: dict[str, int]
    """Bytes written so far by producers, by topic."""
    bytes_out: dict[str, int]
    """Bytes read so far by consumers (not by followers: there are none here), by topic."""


class BrokerCounters:
    """Reads one broker's counters until closed (a context manager)."""

    def __init__(self, broker_pid: int, *, java: str | None = None) -> None:
        """``java``: the JDK's launcher (default: ``java`` on PATH, which runs the broker).
        Raises RuntimeError, saying why, if the probe cannot start or attach."""
        launcher = java or shutil.which("java")
        if launcher is None:
            raise RuntimeError("no `java` on PATH: the broker counters need the JDK's launcher")
        self._process = subprocess.Popen(
            [launcher, str(_PROBE), str(broker_pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.read(timeout_s=_FIRST_READ_S)  # fails here, not in the middle of a measurement

    def read(self, *, timeout_s: float = _READ_S) -> CounterReading:
        """The counts so far; RuntimeError if the probe has gone or does not answer."""
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        line = ""  # stays empty if the probe has exited (a broken pipe) or is silent
        with contextlib.suppress(OSError):  # BrokenPipeError included
            process.stdin.write("\n")
            process.stdin.flush()
            # One line answers each request, so nothing is ever left in the buffer.
            if select.select([process.stdout], [], [], timeout_s)[0]:
                line = process.stdout.readline()
        if not line:
            process.kill()
            error = process.stderr.read().strip() if process.stderr is not None else ""
            self.close()
            raise RuntimeError(f"the broker counter probe stopped: {error[-2_000:] or 'no output'}")
        figures = json.loads(line)
        return CounterReading(
            **{
                family: {str(k): int(v) for k, v in figures[family].items()}
                for family in ("requests", "records_in", "bytes_in", "bytes_out")
            }
        )

    def close(self) -> None:
        """Stop the probe (it exits at the end of its input)."""
        process = self._process
        if process.stdin is not None and not process.stdin.closed:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> BrokerCounters:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def per_item(
    before: Mapping[str, int], after: Mapping[str, int], items: int, *, least: float = 0.005
) -> dict[str, float]:
    """Counts per item between two readings of one counter family, largest first; those
    below ``least`` per item left out."""
    found = {name: (count - before.get(name, 0)) / max(items, 1) for name, count in after.items()}
    kept = {name: round(v, 3) for name, v in found.items() if v >= least}
    return dict(sorted(kept.items(), key=lambda item: -item[1]))
