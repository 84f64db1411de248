"""Fault-injection fixtures: one service stack for the fault tests, on the session broker.

The stack (API, processors, a local endpoint agent) lives under a topic prefix
and a home of its own, so killing its processes never reaches another test
package. Starting it takes tens of seconds on a 2-core machine, so the fault
tests share it; each test gets it back whole (``FaultStack.restore``: killed
processes restarted, stopped ones continued, extra agents stopped) before and
after it runs, whatever it killed and whether it passed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import RunningPlatform
from tests.faults.harness import FaultStack, delete_stack_topics, start_fault_stack


@pytest.fixture(scope="session")
def shared_fault_stack(
    kafka_platform: RunningPlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultStack]:
    """The fault tests' stack, stopped by PID (and its topics deleted) at the end."""
    stack = start_fault_stack(kafka_platform, tmp_path_factory.mktemp("faults"))
    try:
        yield stack
    finally:
        stack.stop()
        delete_stack_topics(kafka_platform.admin(), stack.catalogue)


@pytest.fixture
def fault_stack(shared_fault_stack: FaultStack) -> Iterator[FaultStack]:
    """The stack, whole before the test and made whole again after it."""
    shared_fault_stack.restore()
    try:
        yield shared_fault_stack
    finally:
        shared_fault_stack.restore()
