"""Executor user guide: globus_compute_executor_reload_tasks.py.

Run it once: it submits 5 tasks, prints their task group id and kills itself with
SIGKILL; run it again with that id as its argument: it reloads the 5 tasks and prints
their results.
"""

# execute initially as:
# $ python globus_compute_executor_reload_tasks.py
#  ... this Task Group ID: <TG_UUID_STR>
#  ...
# Then run with the Task Group ID as an argument:
# $ python globus_compute_executor_reload_tasks.py <TG_UUID_STR>

import os, signal, sys, time, typing as t

# from globus_compute_sdk import Executor
# from globus_compute_sdk.sdk.executor import ComputeFuture
from fxstream.sdk import Executor
from fxstream.sdk import TaskFuture as ComputeFuture

task_group_id = sys.argv[1] if len(sys.argv) > 1 else None


def task_kernel(num):
    return f"your Globus Compute logic result, from task: {num}"


ep_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
with Executor(endpoint_id=ep_id) as gce:
    futures: t.Iterable[ComputeFuture]
    if task_group_id:
        print(f"Reloading tasks from Task Group ID: {task_group_id}")
        gce.task_group_id = task_group_id
        futures = gce.reload_tasks()

    else:
        # Save the task_group_id somewhere.  Perhaps in a file, or less
        # robustly "as mere text" on your console:
        print(
            "New session; creating Globus Compute tasks; if this script dies, rehydrate"
            f" futures with this Task Group ID: {gce.task_group_id}"
        )
        num_tasks = 5
        futures = [gce.submit(task_kernel, i + 1) for i in range(num_tasks)]

        # Ensure all tasks have been sent upstream ...
        while gce.task_count_submitted < num_tasks:
            time.sleep(1)
            print(f"Tasks submitted upstream: {gce.task_count_submitted}")

        # ... before script death for [silly reason; did you lose power!?]
        bname = sys.argv[0]
        if sys.argv[0] != sys.orig_argv[0]:
            bname = f"{sys.orig_argv[0]} {bname}"

        print("Simulating unexpected process death!  Now reload the session")
        print("by rerunning this script with the task_group_id:\n")
        print(f"  {bname} {gce.task_group_id}\n", flush=True)  # test: flushed before KILL
        os.kill(os.getpid(), signal.SIGKILL)
        exit(1)  # In case KILL takes split-second to process

# Get results:
results, exceptions = [], []
for f in futures:
    try:
        results.append(f.result(timeout=10))
    except Exception as exc:
        exceptions.append(exc)
print("Results:\n ", "\n  ".join(results))

expected = [f"your Globus Compute logic result, from task: {n}" for n in range(1, 6)]  # test
assert sorted(results) == expected and not exceptions, (results, exceptions)  # test
