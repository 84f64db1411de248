"""Executor user guide: globus_compute_executor_basic_example.py."""

import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import Executor
from fxstream.sdk import Executor


def double(x):
    return x * 2


tutorial_endpoint_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
with Executor(endpoint_id=tutorial_endpoint_id) as gce:
    fut = gce.submit(double, 7)

    print(fut.result())

assert fut.result() == 14  # test
