"""The quickstart `./fx up` runs: register a function, run 1,000 tasks, show the rate."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from fxstream.sdk import Client, ClientSettings, Executor

__all__ = ["QUICKSTART_TASKS", "run_quickstart", "snippet"]

QUICKSTART_TASKS = 1_000


def square(x: int) -> int:
    """The quickstart's function: it runs on the endpoint, not here."""
    return x * x


def run_quickstart(
    console: Console, credentials_file: Path, endpoint_id: str, tasks: int = QUICKSTART_TASKS
) -> float:
    """Run ``tasks`` tasks on the local endpoint with a progress bar; returns tasks/s."""
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
