"""Executor user guide: globus_compute_executor_handle_result_exceptions.py."""

import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import Executor
from fxstream.sdk import Executor

ep_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]  # test: the guide set it earlier


def generate_collatz_sequence(N: int, sequence_limit=100):
    seq = [N]
    while N != 1 and len(seq) < sequence_limit:
        if N % 2:
            N = 3 * N + 1
        else:
            N //= 2  # okay because guaranteed integer result
        seq.append(N)
    if N != 1:
        raise ValueError(f"Sequence not terminated in {sequence_limit} steps")
    return seq


with Executor(endpoint_id=ep_id) as gce:
    future = gce.submit(generate_collatz_sequence, 1234567890)

try:
    print(future.result())
except Exception as exc:
    # test: the guide's line lacks the f-string's closing quote (a SyntaxError as printed)
    print(f"Oh no!  The task raised an exception: {exc}")

assert isinstance(future.exception(), ValueError)  # test: the remote type, re-raised
assert "Sequence not terminated in 100 steps" in str(future.exception())  # test
