"""The hardware report a worker runs for :meth:`~fxstream.sdk.Client.get_worker_hardware_details`.

The function is pickled by reference to this module (as ``fxstream.sdk.shell``'s classes
are), so it runs wherever ``fxstream.sdk`` is installed, as on every endpoint of this
workspace.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from pathlib import Path

__all__ = ["hardware_report"]


def _meminfo() -> dict[str, str]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return {key: value.strip() for key, value in fields if key in ("MemTotal", "MemAvailable")}


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the platform module's word for it
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def hardware_report() -> str:
    """The worker's host, OS, CPU (model, count, the ones it may use), memory and Python,
    one ``key: value`` per line."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "cpu model": _cpu_model(),
        "cpu count": str(os.cpu_count()),
        "cpus usable": str(usable),
        **{key.lower(): value for key, value in _meminfo().items()},
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "python executable": sys.executable,
    }
    return "\n".join(f"{key}: {value}" for key, value in lines.items())
