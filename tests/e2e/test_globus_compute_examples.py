"""Globus Compute's documentation examples, each run as a user's script on the session's
shared platform (``tests/e2e/globus_compute_examples``: what each was changed in is
marked there), changed only in their import lines and endpoint ids but for the marked
typos, sleeps and added checks. A script passes when it exits 0: each ends with checks
of the example's outcome (``assert``), so a wrong value fails it as a crash would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.platform

EXAMPLES = Path(__file__).parent / "globus_compute_examples"
SCRIPT_S = 180.0


def _run(stack: Stack, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python script args`` as a user runs it after `./fx up`: only the platform's home
    and the endpoint id set (no credentials passed), from a directory of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXSTREAM_")}
    env["FXSTREAM_HOME"] = str(stack.platform.config.home)
    env["FXSTREAM_EXAMPLE_ENDPOINT"] = stack.endpoint_id
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        env=env,
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=SCRIPT_S,
    )


def _wait_for_group(stack: Stack, task_group_id: str, count: int) -> None:
    """Wait (bounded) until the service lists ``count`` tasks of the group."""
    with stack.client() as client:
        deadline = time.monotonic() + 60
        while True:
            tasks = client.get_tasks(task_group_id=task_group_id).tasks
            if len(tasks) >= count:
                return
            assert time.monotonic() < deadline, f"the service lists {len(tasks)} of {count}"
            time.sleep(0.2)


def _passed(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.parametrize(
    ("script", "printed"),
    [
        ("quickstart.py", "15\n"),
        ("executor_basic.py", "14\n"),
        ("executor_collatz.py", "All sequences generated (from 1 to 100)"),
        ("executor_exceptions.py", "ValueError: Sequence not terminated in 100 steps"),
        ("executor_results_as_arrived.py", "Received: "),
        ("shell_functions.py", "hello\n\nhola\n\nbonjour\n\n124\n"),
        ("client_guide.py", "Hello Bob Smith\n"),
    ],
)
def test_a_documentation_example_runs(shared_platform: Stack, script: str, printed: str) -> None:
    assert printed in _passed(_run(shared_platform, script))


def test_the_reload_example_survives_its_own_sigkill(shared_platform: Stack) -> None:
    first = _run(shared_platform, "executor_reload_tasks.py")
    assert first.returncode == -9, first.stdout + first.stderr  # killed itself, as written
    found = re.search(r"Task Group ID: ([0-9a-f-]{36})", first.stdout)
    assert found is not None, first.stdout
    # Its 5 tasks were acknowledged by Kafka before the kill (task_count_submitted): the
    # service learns of them as the router and task-state fold them, a moment later.
    _wait_for_group(shared_platform, found.group(1), 5)
    again = _passed(_run(shared_platform, "executor_reload_tasks.py", found.group(1)))
    assert f"Reloading tasks from Task Group ID: {found.group(1)}" in again
    assert "from task: 5" in again


def test_a_client_batch_is_reloaded_by_a_later_executor(shared_platform: Stack) -> None:
    submitted = _passed(_run(shared_platform, "client_submit_batch.py"))
    found = re.search(r"Task Group ID for later reloading: ([0-9a-f-]{36})", submitted)
    assert found is not None, submitted
    reloaded = _passed(_run(shared_platform, "executor_reload_batch.py", found.group(1)))
    assert reloaded.count("Received: All done!") == 10
