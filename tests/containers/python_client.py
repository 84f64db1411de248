"""A client process for the Python-version tests, run by another Python (its own virtualenv
with the SDK): submits one task per endpoint and reports how each ended.

Run as ``python python_client.py MARK_DIR ENDPOINT_ID...`` with ``FXSTREAM_CREDENTIALS``
set. The task writes ``MARK_DIR/<endpoint id>`` (so a test sees whether it ran) and
returns the worker's Python version and pid. Prints one JSON line: this client's Python
version and, per endpoint, the list of its tasks' outcomes in order, each ``{"value": ...}``
or ``{"type", "message", "retryable"}``.
"""

from __future__ import annotations

import json
import platform
import sys
from typing import Any

from fxstream.sdk import Client, TaskExecutionFailed

RESULT_S = 120.0


def leave_mark(path: str) -> list[Any]:
    """Write ``path`` (proof that the task ran) and return where it ran."""
    import os
    import platform

    with open(path, "w") as mark:
        mark.write(f"ran in Python {platform.python_version()}, pid {os.getpid()}\n")
    return [platform.python_version(), os.getpid()]


def main() -> None:
    """Submit ``leave_mark`` to each endpoint named on the command line; print the outcomes."""
    mark_dir, endpoints = sys.argv[1], sys.argv[2:]
    report: dict[str, Any] = {"client": platform.python_version(), "endpoints": {}}
    with Client.from_environment() as client:
        function = client.register_function(leave_mark)
        for endpoint in endpoints:
            task = client.run(f"{mark_dir}/{endpoint}", endpoint_id=endpoint, function_id=function)
            outcomes = report["endpoints"].setdefault(endpoint, [])
            try:
                value = client.future(task).result(timeout=RESULT_S)
            except TaskExecutionFailed as exc:
                outcomes.append(
                    {
                        "type": exc.remote_type,
                        "message": exc.remote_message,
                        "retryable": exc.retryable,
                    }
                )
            else:
                outcomes.append({"value": value})
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
