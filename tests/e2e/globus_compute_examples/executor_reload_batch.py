"""Executor user guide: globus_compute_executor_reload_batch.py (the task group id is the
script's argument)."""

import concurrent.futures  # test: the guide's snippet leaves this import out
import os  # test: the endpoint id comes from the environment
import sys  # test: the saved task group id is the argument

# from globus_compute_sdk import Executor
from fxstream.sdk import Executor

ep_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
tg_id = sys.argv[1]  # test: "Saved task group id from 'yesterday'"
received = []  # test
with Executor(endpoint_id=ep_id, task_group_id=tg_id) as gce:
    futures = gce.reload_tasks()
    for f in concurrent.futures.as_completed(futures):  # test: the guide has `futs`
        print("Received:", f.result())
        received.append(f.result())  # test

assert received == ["All done!"] * 10, received  # test
