"""Executor user guide: globus_compute_client_submit_batch.py (a batch submitted with the
Client, to be reloaded later by executor_reload_batch.py)."""

import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import Client
from fxstream.sdk import Client


def expensive_task(task_arg):
    import time

    time.sleep(0.2)  # test: the guide sleeps 24 hours
    return "All done!"


ep_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
gcc = Client()

print(f"Task Group ID for later reloading: {gcc.session_task_group_id}")
fn_id = gcc.register_function(expensive_task)
batch = gcc.create_batch()
for task_i in range(10):
    batch.add(fn_id, args=(task_i,))  # test: the guide's `ep_id` here is no longer a parameter of add
gcc.batch_run(ep_id, batch)  # test: the guide's one-argument call predates batch_run(endpoint_id, batch)
