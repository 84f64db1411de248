"""Container test fixtures: the runtimes installed by the project's set-up, the worker
images built once (cached across sessions by fingerprint), and what cannot run here."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fxstream.agent.containers import Image, PodmanRuntime, WorkerLaunch
from fxstream.agent.images import build_podman_image, build_rootfs
from fxstream.ops.install import ensure_container_runtimes

_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _children() -> set[psutil.Process]:
    found = set()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline())
            if not any(f"from {helper} import main" in command for helper in _HELPERS):
                found.add(process)
    return found


@pytest.fixture
def leaves_no_process() -> Iterator[None]:
    """Fail a test that leaves a process of its own running (and kill what it left):
    a container's processes are the test's descendants (bwrap) or gone (podman)."""
    before = _children()
    yield
    left = []
    for process in _children() - before:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(left, timeout=5)
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fxstream"


@pytest.fixture(scope="session")
def runtimes() -> dict[str, str]:
    """bwrap, podman and runc, installed through the project's own set-up if missing."""
    return ensure_container_runtimes()


@pytest.fixture(scope="session")
def rootfs(runtimes: dict[str, str]) -> Iterator[Path]:
    """The minimal worker rootfs (fxstream.agent.images), built once per fingerprint."""
    yield build_rootfs(_cache() / "worker-rootfs")


@pytest.fixture(scope="session")
def podman_image(rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The rootfs imported as a local podman image; skips (saying why) where podman
    cannot run a container here."""
    tag = build_podman_image(rootfs)
    sandbox = tmp_path_factory.mktemp("podman-probe")
    launch = WorkerLaunch(
        argv=("/bin/sh", "-c", "true"),
        env={"PATH": "/usr/bin:/bin"},
        sandbox=str(sandbox),
        name=f"fxstream-probe-{os.getpid()}",
        writable=(str(sandbox),),
        fds=0,
    )
    runtime = PodmanRuntime()
    done = subprocess.run(
        runtime.command(launch, Image("probe", "podman", tag)),
        env=runtime.environment(launch),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # `./fx test` installs podman and runc: a podman that cannot run a container is a
    # failure to see, not a skip that hides it.
    assert done.returncode == 0, (
        f"podman cannot run a container here (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    )
    return tag
