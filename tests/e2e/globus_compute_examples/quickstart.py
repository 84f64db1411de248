"""Quickstart: the first Executor script (add_func)."""

import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import Executor
from fxstream.sdk import Executor


# First, define the function ...
def add_func(a, b):
    return a + b


tutorial_endpoint_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
# ... then create the executor, ...
with Executor(endpoint_id=tutorial_endpoint_id) as gce:
    # ... then submit for execution, ...
    future = gce.submit(add_func, 5, 10)

    # ... and finally, wait for the result
    print(future.result())

assert future.result() == 15  # test
