"""A failed test's report names the processes that took the machine's CPU.

A start-up that times out on a loaded 2-core machine says little by itself: this
plugin adds a "processes by CPU" section to every failed or errored test's report,
the twelve processes with the most CPU time since they started (and their
command lines, shortened), so the next failure shows whether something hogged
the machine.
"""

from __future__ import annotations

from collections.abc import Generator

import psutil
import pytest

__all__ = ["busiest_processes"]

_SHOWN = 12
_COMMAND_CHARS = 140


def busiest_processes(count: int = _SHOWN) -> str:
    """The ``count`` processes with the most CPU seconds, one line each."""
    rows: list[tuple[float, int, str, float]] = []
    for process in psutil.process_iter(["pid", "cmdline", "name", "cpu_times", "create_time"]):
        info = process.info
        times = info.get("cpu_times")
        if times is None:
            continue
        cpu = times.user + times.system
        command = " ".join(info.get("cmdline") or []) or info.get("name") or "?"
        rows.append((cpu, info["pid"], command[:_COMMAND_CHARS], info.get("create_time") or 0))
    rows.sort(reverse=True)
    load = ", ".join(f"{value:.2f}" for value in psutil.getloadavg())
    lines = [f"load average {load}; CPU seconds, pid, command:"]
    lines += [f"{cpu:9.1f}  {pid:>7}  {command}" for cpu, pid, command, _ in rows[:count]]
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, None, None]:
    """Add the busiest processes to a failed test's report (setup, call or teardown)."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed:
        report.sections.append(("processes by CPU", busiest_processes()))
