"""Agent test fixtures: every test must leave no process of its own behind.

multiprocessing runs one resource tracker (and, for the forkserver start
method, one fork server) per interpreter, shared by every pool and alive until
the interpreter exits. They are not workers: the per-test check ignores them,
and they are stopped when the session ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import multiprocessing.resource_tracker
from collections.abc import Iterator

import psutil
import pytest

_HELPER_MODULES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _is_multiprocessing_helper(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        command = " ".join(process.cmdline())
        return any(f"from {module} import main" in command for module in _HELPER_MODULES)
    return False


def _children() -> set[psutil.Process]:
    return {
        p for p in psutil.Process().children(recursive=True) if not _is_multiprocessing_helper(p)
    }


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail a test that leaves a child process running (and kill what it left)."""
    before = _children()
    yield
    left = [p for p in _children() - before if p.is_running() and p.status() != "zombie"]
    for process in left:
        process.kill()
    psutil.wait_procs(left, timeout=5)
    assert not left, f"processes left behind: {[p.pid for p in left]}"


@pytest.fixture(autouse=True, scope="session")
def stop_multiprocessing_helpers() -> Iterator[None]:
    """Stop multiprocessing's per-interpreter helpers once the agent tests are done."""
    yield
    # Private but stable since Python 3.8; multiprocessing itself only stops them at exit.
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
