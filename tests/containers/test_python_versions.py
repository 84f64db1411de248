"""A submission's Python version picks the worker environment that runs it, through the
whole platform: a client running Python 3.12 (a real one: pyenv's, in a virtualenv with
this workspace's SDK) submits to an endpoint whose workers run only the agent's Python
(refused before the task runs, naming both versions) and to one that also lists a
Python 3.12 interpreter (runs there, in a worker of that Python, warm for the next task),
while a task from this Python goes to that endpoint's default workers.

Real broker, service and agents (the session's shared private platform; this module's
endpoint is its own, stopped after it). Also: an interpreter of an endpoint whose
workers run in bubblewrap runs inside the sandbox; the image pools run a task in
another Python's workers.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fxstream.agent.containers import Image
from fxstream.agent.image_pools import ImagePools
from fxstream.agent.python_envs import probe_environments, probe_interpreter
from fxstream.agent.runner import RUNNER
from fxstream.ops.private import ExtraEndpoint
from fxstream.topics import Heartbeat, decode
from tests.containers.python_client import leave_mark
from tests.containers.test_container_config import config
from tests.containers.test_runtimes import item
from tests.e2e.stack import Stack, added_endpoint, committed_records
from tests.python_venvs import other_python, workspace_venv

CLIENT = Path(__file__).with_name("python_client.py")
RESULT_S = 120.0
OWN_MINOR = ".".join(platform.python_version_tuple()[:2])


@pytest.fixture(scope="module")
def py312() -> str:
    """The python of a Python 3.12 virtualenv with this workspace's agent and SDK."""
    venv, took = workspace_venv(other_python("3.12"))
    print(f"python 3.12 virtualenv {venv}: " + (f"built in {took:.1f} s" if took else "cached"))
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    return shared_platform


@pytest.fixture(scope="module")
def two_pythons(stack: Stack, py312: str) -> Iterator[ExtraEndpoint]:
    """An endpoint whose workers run the agent's Python and, for tasks from 3.12, py312."""
    with added_endpoint(stack, "pythons", store_url=None, interpreters=[py312]) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("python-marks")


@pytest.fixture(scope="module")
def from_312(stack: Stack, two_pythons: ExtraEndpoint, py312: str, marks: Path) -> dict[str, Any]:
    """What a Python 3.12 client's tasks came to: on the platform's own endpoint (only
    the agent's Python) and on ``two_pythons`` (twice: warm the second time)."""
    endpoints = [stack.endpoint_id, two_pythons.endpoint_id, two_pythons.endpoint_id]
    env = {**os.environ, "FXSTREAM_CREDENTIALS": str(stack.credentials)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [py312, str(CLIENT), str(marks), *endpoints],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_a_python_version_mismatch_is_refused_before_running(
    stack: Stack, from_312: dict[str, Any], marks: Path
) -> None:
    assert from_312["client"].startswith("3.12.")
    [refused] = from_312["endpoints"][stack.endpoint_id]
    assert refused.get("type") == "PythonVersionMismatch", refused
    assert not refused["retryable"]
    message = refused["message"]
    # Both versions named, and what to do.
    assert f"was serialized by Python {from_312['client']} (the submitting client's)" in message
    assert f"runs Python {OWN_MINOR} for functions without a container" in message
    assert f"Python {platform.python_version()} (the agent's own interpreter)" in message
    assert "refused before it ran" in message
    assert f"submit from Python {OWN_MINOR}" in message
    assert "adds a Python 3.12 interpreter to interpreters in" in message
    # It never ran: it would have written its mark.
    assert not (marks / stack.endpoint_id).exists()


def test_a_task_runs_in_the_interpreter_of_its_python_version(
    two_pythons: ExtraEndpoint, from_312: dict[str, Any], marks: Path, stack: Stack
) -> None:
    ran, again = from_312["endpoints"][two_pythons.endpoint_id]
    assert "value" in ran and "value" in again, (ran, again)
    version, pid = ran["value"]
    assert version == from_312["client"]  # the 3.12 interpreter's worker ran it
    assert (marks / two_pythons.endpoint_id).read_text() == (
        f"ran in Python {version}, pid {pid}\n"
    )
    agent_pid = two_pythons.process.pid()
    assert agent_pid is not None and pid != agent_pid
    # Warm: the interpreter's one worker (workers: 1) served the next task too.
    assert again["value"] == [version, pid]
    # This Python's task goes to the endpoint's default workers, of this Python.
    with stack.client() as client:
        function = client.register_function(leave_mark)
        mine = marks / "from-this-python"
        task = client.run(str(mine), endpoint_id=two_pythons.endpoint_id, function_id=function)
        here_version, here_pid = client.future(task).result(timeout=RESULT_S)
    assert here_version == platform.python_version()
    assert here_pid != pid


def test_the_heartbeat_lists_the_python_versions(
    stack: Stack, two_pythons: ExtraEndpoint, from_312: dict[str, Any]
) -> None:
    key = two_pythons.endpoint_id
    beats = [
        decode(m.value(), Heartbeat)
        for m in committed_records(stack.kafka, stack.catalogue.heartbeats, key)
        if m.value() is not None
    ]
    assert beats, f"no heartbeat of {key} on {stack.catalogue.heartbeats}"
    assert beats[-1].python_versions == sorted({OWN_MINOR, "3.12"})


@pytest.mark.usefixtures("leaves_no_process")
def test_an_interpreter_runs_tasks_in_its_own_pool(py312: str) -> None:
    interpreter = probe_interpreter(py312, modules=("fxstream.agent.worker_process",))
    pools = ImagePools(
        1,
        "fxstream.agent.worker_process:load_pickled",
        default=None,
        images=[],
        interpreters={py312: interpreter},
    )
    try:
        # A stdlib function, pickled by reference: importable in either Python.
        done = pools.submit(item(platform.python_version, image=py312)).result(RESULT_S)
        assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
        assert done.value is not None
        assert pickle.loads(done.value) == ".".join(map(str, interpreter.version))
        default = pools.submit(item(platform.python_version)).result(RESULT_S)
        assert default.value is not None
        assert pickle.loads(default.value) == platform.python_version()
        assert set(pools.pools()) == {None, py312}
    finally:
        pools.close()


@pytest.mark.usefixtures("leaves_no_process")
def test_an_interpreter_of_a_sandboxed_endpoint_runs_in_its_image(
    runtimes: dict[str, str], rootfs: Path, py312: str
) -> None:
    sandboxed = config(
        runtime="bubblewrap",
        images={"worker": f"bubblewrap:{rootfs}", "host": "bubblewrap:/"},
        image="worker",
        interpreters=(py312,),
    )
    pythons = probe_environments(sandboxed, RUNNER)
    assert pythons.versions() == sorted({OWN_MINOR, "3.12"})
    by_pool = {e.pool: e for e in pythons.environments}
    assert by_pool[None].image == "worker" and by_pool["host"].image == "host"
    assert by_pool[py312].image == "worker"  # the interpreter runs in the default image
    assert by_pool[None].version == sys.version_info[:3]
    pools = ImagePools(
        1,
        "fxstream.agent.worker_process:load_pickled",
        default=Image("worker", "bubblewrap", str(rootfs)),
        images=[Image("host", "bubblewrap", "/")],
        interpreters=pythons.interpreters,
    )
    try:
        # Stdlib functions, pickled by reference: the worker cannot import the tests.
        done = pools.submit(item(os.readlink, "/proc/self/ns/mnt", image=py312)).result(RESULT_S)
        assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
        assert done.value is not None
        assert pickle.loads(done.value) != os.readlink("/proc/self/ns/mnt")  # in the sandbox
        version = pools.submit(item(platform.python_version, image=py312)).result(RESULT_S)
        assert version.value is not None
        assert pickle.loads(version.value).startswith("3.12.")
        assert [w.container for w in pools.warm() if w.function_ids] == ["worker"]
    finally:
        pools.close()
