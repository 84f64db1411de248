"""The quickstart `./fx up` runs: 1,000 small tasks and their rate, then one 100 MB round trip.

The large round trip shows pass-by-reference: the argument and the result
travel through the platform's Redis, Kafka carries only references. Both sizes can be
made smaller (``./fx up --quickstart-tasks 20 --quickstart-mb 1``: still above the 64 KiB
proxy threshold, so still by reference).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from fxstream.connectors import redact_url
from fxstream.sdk import Client, ClientSettings, Executor

__all__ = ["QUICKSTART_MB", "QUICKSTART_TASKS", "run_quickstart", "snippet"]

QUICKSTART_TASKS = 1_000
# The large round trip's argument (and result), in MiB.
QUICKSTART_MB = 100


def square(x: int) -> int:
    """The quickstart's function: it runs on the endpoint, not here."""
    return x * x


def reverse(data: bytes) -> bytes:
    """The quickstart's large task: its bytes reversed (as many out as in)."""
    return data[::-1]


def run_quickstart(
    console: Console,
    credentials_file: Path,
    endpoint_id: str,
    tasks: int = QUICKSTART_TASKS,
    large_mb: int = QUICKSTART_MB,
) -> float:
    """Run ``tasks`` tasks on the local endpoint with a progress bar, then (with a proxy
    store and ``large_mb`` > 0) one round trip of ``large_mb`` MiB; returns tasks/s."""
    settings = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(credentials_file)})
    client = Client.from_settings(settings)
    try:
        with Executor(endpoint_id=endpoint_id, client=client) as executor:
            started = time.perf_counter()
            futures = [executor.submit(square, i) for i in range(tasks)]
            columns = (
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console) as progress:
                bar = progress.add_task("quickstart: square(i) on the local endpoint", total=tasks)
                for future in concurrent.futures.as_completed(futures, timeout=300):
                    future.result()
                    progress.advance(bar)
            elapsed = time.perf_counter() - started
            sample = futures[7]
            console.print(
                f"{tasks:,} tasks in {elapsed:.2f} s: [bold]{tasks / elapsed:,.0f} tasks/s"
            )
            console.print(f"sample: square(7) = {sample.result()}; timings: {sample.timings}")
            if settings.store_url is not None and large_mb > 0:
                data = os.urandom(large_mb * 1024 * 1024)
                large_started = time.perf_counter()
                back = executor.submit(reverse, data).result(timeout=300)
                seconds = time.perf_counter() - large_started
                if hashlib.sha256(back[::-1]).digest() != hashlib.sha256(data).digest():
                    raise RuntimeError(
                        f"the {large_mb} MB quickstart task returned the wrong bytes"
                    )
                node = client.local_node(endpoint_id)
                path = (
                    redact_url(settings.store_url)
                    if node is None
                    else f"the node-local tier {node.directory} (shared memory)"
                )
                console.print(
                    f"{large_mb} MB argument and result by reference through {path}: "
                    f"round trip {seconds:.2f} s, verified"
                )
    finally:
        client.close()
    return tasks / elapsed


def snippet(credentials_file: Path, endpoint_id: str) -> str:
    """How to submit from Python to this platform."""
    return f"""\
export FXSTREAM_CREDENTIALS={credentials_file}
.venv/bin/python - <<'PY'
from fxstream.sdk import Executor

def double(x):
    return 2 * x

with Executor(endpoint_id="{endpoint_id}") as ex:
    print(list(ex.map(double, range(10))))
PY"""
