"""Executor user guide: "Shell Functions" (globus_compute_shell_function.py), "Shell
Results" (``return_dict``) and "Walltime"."""

import os  # test: the endpoint id comes from the environment

# from globus_compute_sdk import ShellFunction, Executor
from fxstream.sdk import Executor, ShellFunction

ep_id = os.environ["FXSTREAM_EXAMPLE_ENDPOINT"]
# The cmd will be formatted with kwargs at invocation time
bf = ShellFunction("echo '{message}'")
outputs = []  # test
with Executor(endpoint_id=ep_id) as ex:
    for msg in ("hello", "hola", "bonjour"):
        future = ex.submit(bf, message=msg)
        shell_result = future.result()  # ShellFunctions return ShellResults
        print(shell_result.stdout)
        outputs.append(shell_result.stdout)  # test

assert outputs == ["hello\n", "hola\n", "bonjour\n"], outputs  # test

func = ShellFunction("echo '{message}'", return_dict=True)
with Executor(endpoint_id=ep_id) as ex:
    for msg in ("hello", "hola", "bonjour"):
        fut = ex.submit(func, message=msg)
        res = fut.result()  # test: the guide has `future.result()`, the previous loop's
        assert isinstance(res, dict)
        assert msg in res["stdout"]

# Limit execution to 1s
with Executor(endpoint_id=ep_id) as executor:  # test: the section's "executor"
    bf = ShellFunction("sleep 2", walltime=1)
    future = executor.submit(bf)
    print(future.result().returncode)  # test: the guide prints `future.returncode`

assert future.result().returncode == 124  # test
