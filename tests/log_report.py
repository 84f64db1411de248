"""A failed test's report ends with the last lines of its platform's service logs.

A fault test that fails in CI ("500 tasks never completed") says nothing about which
hop stopped: the router, the task-state processor and the agent each log to their own
file under the platform's home, which is deleted with the machine. For a failed or
errored test that holds a platform (a fixture value that is a
:class:`~fxstream.ops.Platform` or has one as ``.platform``), this plugin adds one
section per service and endpoint log of that platform: its distinct warnings and
errors (the last ``_PROBLEM_LINES``, each with how often it was seen) and its last
``_TAIL_LINES`` lines. Kafka's own logs are left out (long, and the broker's state is in
the test's own assertions).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Generator, Iterable
from pathlib import Path

import pluggy
import pytest

from fxstream.ops import Platform

__all__ = ["log_sections"]

_TAIL_LINES = 25
_PROBLEM_LINES = 15
_LINE_CHARS = 300
_LOG_PATTERNS = ("service-*.log", "endpoint-*.log", "supervisor.log")
_DIGITS = re.compile(r"\d+")
_PROBLEM_WORDS = ("ERROR", "WARNING", "CRITICAL", "Traceback", "exited")


def _platform_homes(values: Iterable[object]) -> list[Path]:
    """The homes of the platforms among a test's fixture values (each once)."""
    homes: list[Path] = []
    for value in values:
        platform = value if isinstance(value, Platform) else getattr(value, "platform", None)
        if isinstance(platform, Platform) and platform.config.home not in homes:
            homes.append(platform.config.home)
    return homes


def log_sections(home: Path) -> list[tuple[str, str]]:
    """One report section per service log under ``home``/logs: problems, then the tail."""
    sections: list[tuple[str, str]] = []
    logs = home / "logs"
    paths = sorted({path for pattern in _LOG_PATTERNS for path in logs.glob(pattern)})
    for path in paths:
        # Each distinct warning (digits aside: times, pids, ports) once, with its count.
        problems: dict[str, tuple[int, str]] = {}
        tail: deque[str] = deque(maxlen=_TAIL_LINES)
        try:
            with path.open(encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    line = line.rstrip()[:_LINE_CHARS]
                    tail.append(line)
                    if any(word in line for word in _PROBLEM_WORDS):
                        shape = _DIGITS.sub("#", line)
                        count, _ = problems.pop(shape, (0, line))
                        problems[shape] = (count + 1, line)
        except OSError as error:
            sections.append((f"log {path.name}", f"unreadable: {error}"))
            continue
        latest = list(problems.values())[-_PROBLEM_LINES:]
        text = "\n".join(
            [f"-- last {len(latest)} distinct warnings/errors (x times seen) --"]
            + [f"x{count} {line}" for count, line in latest]
            + [f"-- last {len(tail)} lines --", *tail]
        )
        sections.append((f"log {path.name}", text))
    return sections


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """Add the platform's service logs to a failed test's report (setup, call or teardown)."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    for home in _platform_homes(funcargs.values()):
        report.sections.extend(log_sections(home))
