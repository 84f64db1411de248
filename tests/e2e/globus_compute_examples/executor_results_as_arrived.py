"""Executor user guide: globus_compute_executor_results_as_arrived.py."""

import concurrent.futures
import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import Executor
from fxstream.sdk import Executor  # test: the guide's snippet leaves this import out

endpoint_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]


def double(x):
    return f"{x} -> {x * 2}"


def slow_double(x):
    import random, time

    time.sleep(x * random.random() / 20)  # test: the guide sleeps up to 19 s; scaled down
    return f"{x} -> {x * 2}"


received = []  # test
with Executor(endpoint_id=endpoint_id) as gce:
    futs = [gce.submit(double, i) for i in range(10)]

    # The futures were appended to the `futs` list in order, so one could
    # wait for each result in turn to get an ordered set:
    print("Results:", [f.result() for f in futs])

    # But often acting on the results *as they arrive* is more desirable
    # as results are NOT guaranteed to arrive in the order they were
    # submitted.
    futs = [gce.submit(slow_double, i) for i in range(10, 20)]
    for f in concurrent.futures.as_completed(futs):
        print("Received:", f.result())
        received.append(f.result())  # test

assert sorted(received) == [f"{i} -> {i * 2}" for i in range(10, 20)]  # test
