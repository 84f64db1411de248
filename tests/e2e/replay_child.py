"""A client process for the replay test: submits a task group, reports, then waits to be killed.

Run as ``python replay_child.py ENDPOINT_ID TASK_GROUP_ID GATE_DIR`` with
``FXSTREAM_CREDENTIALS`` set. It submits twenty quick tasks and waits for
their results, then two tasks that block until a gate file appears in
GATE_DIR (``a``, ``b``), waits until the service lists all 22 tasks of the
group, prints one JSON line ``{"quick": [...], "a": id, "b": id}`` and sleeps
until it is killed.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from fxstream.sdk import Client, Executor, NotFound

QUICK = 20


def double(x: int) -> int:
    """A quick task."""
    return 2 * x


def wait_for_gate(path: str, answer: str) -> str:
    """Block until the file ``path`` exists (at most two minutes), then return ``answer``."""
    import os
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {path} never opened")
        time.sleep(0.05)
    return answer


def main(endpoint_id: str, task_group_id: str, gate_dir: str) -> None:
    """Submit, report, wait."""
    client = Client.from_environment()
    executor = Executor(endpoint_id=endpoint_id, client=client, task_group_id=task_group_id)
    quick = [executor.submit(double, i) for i in range(QUICK)]
    assert [f.result(timeout=120) for f in quick] == [2 * i for i in range(QUICK)]
    gate_a = executor.submit(wait_for_gate, f"{gate_dir}/a", "A")
    gate_b = executor.submit(wait_for_gate, f"{gate_dir}/b", "B")
    deadline = time.monotonic() + 120
    listed = 0
    while listed != QUICK + 2:
        with contextlib.suppress(NotFound):  # until the router has seen the tasks
            listed = len(client.get_taskgroup_tasks(task_group_id))
        if time.monotonic() > deadline:
            raise SystemExit("the service did not list the whole group within 120 s")
        time.sleep(0.1)
    report = {"quick": [f.task_id for f in quick], "a": gate_a.task_id, "b": gate_b.task_id}
    print(json.dumps(report), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
