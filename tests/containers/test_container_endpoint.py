"""A function registered with a container runs inside it, through the whole platform:
SDK -> router -> an endpoint agent whose workers run in bubblewrap -> the worker -> result.

Real broker, service and agent processes (the session's shared private platform; the
contained endpoint is this module's own, stopped after it).
The endpoint allows one image, the minimal worker rootfs (fxstream.agent.images); a
function registered with another container is refused before it runs, with the setting
that would run it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fxstream.ops.private import ExtraEndpoint
from fxstream.sdk import TaskExecutionFailed
from tests.e2e.stack import Stack, added_endpoint

pytestmark = pytest.mark.platform

RESULT_S = 90.0
NAMESPACES = ("mnt", "pid", "ipc", "uts")


def inside() -> dict[str, Any]:
    """Where the task runs: its namespaces, pid, and what it may write."""
    import errno
    import os

    def attempt(path: str) -> str:
        try:
            with open(path, "w") as out:
                out.write("x")
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, "?")
        return "written"

    namespaces = ("mnt", "pid", "ipc", "uts")
    seen: dict[str, Any] = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in namespaces}
    seen["pid"] = os.getpid()
    seen["sandbox"] = attempt("written-in-sandbox.txt")
    seen["code"] = attempt(os.path.join(os.path.dirname(os.__file__), "fxstream-probe.txt"))
    seen["etc"] = attempt("/etc/fxstream-probe")
    seen["root"] = os.listdir("/")
    seen["os-release"] = os.path.exists("/etc/os-release")  # the host's /etc has it
    return seen


def mount_namespace() -> str:
    """The task's mount namespace (and nothing written anywhere)."""
    import os

    return os.readlink("/proc/self/ns/mnt")


def mount_and_release() -> tuple[str, bool]:
    """The task's mount namespace and whether its /etc is the host's (writes nothing)."""
    import os

    return os.readlink("/proc/self/ns/mnt"), os.path.exists("/etc/os-release")


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    return shared_platform


@pytest.fixture(scope="module")
def contained(stack: Stack, rootfs: Path) -> Iterator[ExtraEndpoint]:
    with added_endpoint(
        stack,
        "contained",
        store_url=None,
        runtime="bubblewrap",
        images={"worker": f"bubblewrap:{rootfs}", "host": "bubblewrap:/"},
        image="worker",
    ) as endpoint:
        yield endpoint


def test_a_function_registered_with_its_container_runs_inside_it(
    stack: Stack, contained: ExtraEndpoint
) -> None:
    code_probe = Path(os.path.dirname(os.__file__), "fxstream-probe.txt")
    try:
        with stack.client() as owner:
            function = owner.register_function(inside, container="worker")
            task = owner.run(endpoint_id=contained.endpoint_id, function_id=function)
            seen = owner.future(task).result(timeout=RESULT_S)
    finally:
        # Had they been written, they would be on the host (the paths are the same).
        leaked = [p for p in (code_probe, Path("/etc/fxstream-probe")) if p.exists()]
        for probe in leaked:
            probe.unlink()
    assert not leaked, f"the task wrote outside its sandbox: {leaked}"
    agent_pid = contained.process.pid()
    assert agent_pid is not None
    for ns in NAMESPACES:
        agent_ns = os.readlink(f"/proc/{agent_pid}/ns/{ns}")
        assert seen[ns] != agent_ns, f"the task shares the agent's {ns} namespace"
    assert seen["pid"] in (1, 2)
    assert seen["sandbox"] == "written"
    assert seen["code"] == "EROFS" and seen["etc"] == "EROFS"
    # The minimal rootfs, not the host's: no /opt, /boot, /etc/os-release of the host.
    assert "opt" not in seen["root"] and "boot" not in seen["root"]
    assert not seen["os-release"]


def test_a_function_without_a_container_runs_in_the_endpoints_image(
    stack: Stack, contained: ExtraEndpoint
) -> None:
    with stack.client() as owner:
        function = owner.register_function(mount_and_release)
        task = owner.run(endpoint_id=contained.endpoint_id, function_id=function)
        mount, release = owner.future(task).result(timeout=RESULT_S)
    assert mount != os.readlink("/proc/self/ns/mnt")
    assert not release  # the endpoint's image: the built rootfs


def test_a_function_pinned_to_another_allowed_image_runs_in_that_one(
    stack: Stack, contained: ExtraEndpoint
) -> None:
    with stack.client() as owner:
        function = owner.register_function(mount_and_release, container="host")
        by_spec = owner.register_function(mount_and_release, container="bubblewrap:/")
        task = owner.run(endpoint_id=contained.endpoint_id, function_id=function)
        mount, release = owner.future(task).result(timeout=RESULT_S)
        again = owner.run(endpoint_id=contained.endpoint_id, function_id=by_spec)
        mount_again, _ = owner.future(again).result(timeout=RESULT_S)
    assert mount != os.readlink("/proc/self/ns/mnt")
    assert release  # the host's rootfs image, in its own pool
    assert mount_again == mount  # the same warm sandbox serves the image's next task


def test_a_container_the_endpoint_does_not_allow_is_refused_before_it_runs(
    stack: Stack, contained: ExtraEndpoint
) -> None:
    with stack.client() as owner:
        function = owner.register_function(inside, container="gpu-image")
        task = owner.run(endpoint_id=contained.endpoint_id, function_id=function)
        with pytest.raises(TaskExecutionFailed) as caught:
            owner.future(task).result(timeout=RESULT_S)
    refused = caught.value
    assert refused.remote_type == "NotAllowedOnEndpoint", refused
    assert not refused.retryable
    message = refused.remote_message
    assert f"function {function} runs only in container 'gpu-image'" in message
    assert "adds images: {gpu-image: '<runtime>:<reference>'}" in message
    assert f"extra-endpoints/{contained.name}/config.yaml" in message
    assert "its workers run in image 'worker'" in message


def test_an_endpoint_without_containers_refuses_a_function_pinned_to_one(stack: Stack) -> None:
    with stack.client() as owner:
        pinned = owner.register_function(mount_namespace, container="worker")
        task = owner.run(endpoint_id=stack.endpoint_id, function_id=pinned)
        with pytest.raises(TaskExecutionFailed) as caught:
            owner.future(task).result(timeout=RESULT_S)
        # Control: the same function, not pinned, runs there (outside any container).
        free = owner.register_function(mount_namespace)
        seen = owner.future(owner.run(endpoint_id=stack.endpoint_id, function_id=free)).result(
            timeout=RESULT_S
        )
    assert caught.value.remote_type == "NotAllowedOnEndpoint"
    assert "its workers run in no container (runtime: process)" in caught.value.remote_message
    assert seen == os.readlink("/proc/self/ns/mnt")
