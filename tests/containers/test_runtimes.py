"""Workers in real containers: bubblewrap and podman run here (installed by the project's
set-up); Docker and Apptainer run only where their binary (and Docker's daemon) exist.

Each test starts a real engine whose workers the runtime starts, runs real tasks in them
and looks from outside and inside: namespaces (``/proc/self/ns`` inode numbers), what the
worker may write, what a killed worker leaves behind.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fxstream.agent.containers import (
    ApptainerRuntime,
    BubblewrapRuntime,
    DockerRuntime,
    Image,
    PodmanRuntime,
    Runtime,
    WorkerLaunch,
)
from fxstream.agent.engine import TASK_CANCELLED, WorkItem, WorkOutcome
from fxstream.agent.process_engine import ProcessEngine
from tests.containers import tasks
from tests.containers.tasks import NAMESPACES

pytestmark = pytest.mark.usefixtures("leaves_no_process")

PROBES = [Path("/usr/fxstream-probe"), Path("/etc/fxstream-probe")]

START_S = 60.0


def item(
    function: Callable[..., Any], *args: Any, task_id: str = "", image: str | None = None
) -> WorkItem:
    """A task running ``function(*args)`` with the default (pickle) runner (in ``image``)."""
    code = pickle.dumps(function)
    return WorkItem(
        task_id=task_id or uuid.uuid4().hex,
        function_id=f"{function.__module__}.{function.__qualname__}",
        code_sha256=hashlib.sha256(code).hexdigest(),
        code=code,
        payload=pickle.dumps((args, {})),
        image=image,
    )


def outcome(engine: ProcessEngine, function: Callable[..., Any], *args: Any) -> WorkOutcome:
    return engine.submit(item(function, *args)).result(timeout=START_S)


def call(engine: ProcessEngine, function: Callable[..., Any], *args: Any) -> Any:
    done = outcome(engine, function, *args)
    assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
    assert done.value is not None
    return pickle.loads(done.value)


def own_namespaces(pid: int | str = "self") -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in NAMESPACES}


@pytest.fixture(params=["bubblewrap-host", "bubblewrap-rootfs", "podman"])
def container(
    request: pytest.FixtureRequest, runtimes: dict[str, str], rootfs: Path
) -> tuple[Runtime, Image]:
    """Each runtime that runs here, with its image: bubblewrap on the host's own rootfs
    and on the built one, podman on the built image (skipped, saying why, where it
    cannot run)."""
    if request.param == "bubblewrap-host":
        return BubblewrapRuntime(), Image("host", "bubblewrap", "/")
    if request.param == "bubblewrap-rootfs":
        return BubblewrapRuntime(), Image("worker", "bubblewrap", str(rootfs))
    return PodmanRuntime(), Image("worker", "podman", request.getfixturevalue("podman_image"))


@pytest.fixture
def engine(container: tuple[Runtime, Image], tmp_path: Path) -> Iterator[ProcessEngine]:
    runtime, image = container
    writable = tmp_path / "writable"
    writable.mkdir()
    with ProcessEngine(1, runtime=runtime, image=image, writable=[str(writable)]) as started:
        assert started.wait_ready(START_S), "the worker did not start"
        yield started


def test_a_container_worker_runs_tasks_in_its_own_namespaces(engine: ProcessEngine) -> None:
    agent = own_namespaces()
    first = call(engine, tasks.namespaces)
    for ns in NAMESPACES:
        assert first[ns] != agent[ns], f"the worker shares the agent's {ns} namespace"
    assert first["hostname"] == "fxstream-worker"
    # Its own PID namespace: it is the first process there (podman) or bwrap's child.
    assert first["pid"] in (1, 2), first
    # The launcher the engine watches lives in the agent's namespaces.
    (launcher,) = engine.worker_pids()
    assert own_namespaces(launcher) == agent
    # Warm: the next task runs in the same container, started once.
    assert call(engine, tasks.namespaces) == first
    assert engine.worker_pids() == [launcher]


def test_a_container_worker_writes_only_its_sandbox_and_writable_dirs(
    engine: ProcessEngine, tmp_path: Path
) -> None:
    writable = tmp_path / "writable"
    outside = tmp_path / "outside"
    outside.mkdir()
    # Bound read-only into the sandbox (the repository is on sys.path): visible, not writable.
    beside_code = Path(tasks.__file__).with_name(f"probe-{uuid.uuid4().hex}.txt")
    try:
        assert call(engine, tasks.try_write, str(writable / "ok.txt")) == "written"
        assert (writable / "ok.txt").read_text() == "written from a worker\n"
        assert call(engine, tasks.try_write, "in-its-sandbox.txt") == "written"  # its cwd
        private = f"/tmp/fxstream-private-{uuid.uuid4().hex}.txt"
        assert call(engine, tasks.try_write, private) == "written"  # its own /tmp
        assert not Path(private).exists()
        assert call(engine, tasks.try_write, str(outside / "no.txt")) == "ENOENT"
        assert call(engine, tasks.try_write, str(beside_code)) == "EROFS"
        for system in PROBES:
            assert call(engine, tasks.try_write, str(system)) in ("EROFS", "EACCES"), system
    finally:
        leaked = [p for p in [*PROBES, beside_code] if p.exists()]
        for probe in leaked:  # written on the host: the sandbox failed
            probe.unlink()
    assert not leaked, f"a worker wrote outside its sandbox: {leaked}"
    assert not (outside / "no.txt").exists()


def test_a_cancelled_container_task_leaves_no_container_or_process(
    engine: ProcessEngine, container: tuple[Runtime, Image]
) -> None:
    runtime, _ = container
    (launcher,) = engine.worker_pids()
    family = [launcher] + [p.pid for p in psutil.Process(launcher).children(recursive=True)]
    names = _podman_names() if runtime.name == "podman" else set()
    sleeping = item(tasks.sleep, 30.0)
    future = engine.submit(sleeping)
    deadline = time.monotonic() + START_S
    while not _task_sent(engine):
        assert time.monotonic() < deadline, "the task never reached the worker"
        time.sleep(0.05)
    time.sleep(0.5)  # the worker is idle but for it: it runs it at once
    assert engine.cancel(sleeping.task_id, "test")
    cancelled = future.result(timeout=START_S)
    assert cancelled.error_type == TASK_CANCELLED, cancelled
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in family):
        assert time.monotonic() < deadline, f"processes of the killed worker live on: {family}"
        time.sleep(0.05)
    if runtime.name == "podman":
        while names & _podman_names():
            assert time.monotonic() < deadline, f"podman still lists {names & _podman_names()}"
            time.sleep(0.2)
    # The engine replaced the worker; the replacement serves.
    assert call(engine, tasks.sleep, 0.0) == 0.0


def _task_sent(engine: ProcessEngine) -> bool:
    return any(w.function_ids for w in engine.warm())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _podman_names() -> set[str]:
    listed = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True
    )
    return {n for n in listed.stdout.split() if n.startswith("fxstream-worker-")}


def test_no_secret_of_the_runner_reaches_a_command_line(
    runtimes: dict[str, str], rootfs: Path
) -> None:
    secret = f"planted-secret-{uuid.uuid4().hex}"
    runner = functools.partial(tasks.load_noting, note=secret)
    with ProcessEngine(
        1, runner, runtime=BubblewrapRuntime(), image=Image("worker", "bubblewrap", str(rootfs))
    ) as engine:
        assert call(engine, tasks.sleep, 0.0) == 0.0  # the runner reached the worker
        (launcher,) = engine.worker_pids()
        processes = [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]
        assert len(processes) >= 2  # bwrap and the worker
        for process in processes:
            assert secret not in " ".join(process.cmdline())
            assert secret not in str(process.environ())


# --- Docker and Apptainer: built here, run only where they exist ---------------------------


def _launch(tmp_path: Path, *, fds: int) -> WorkerLaunch:
    return WorkerLaunch(
        argv=("/usr/bin/python3", "-m", "fxstream.agent.worker_process"),
        env={"PATH": "/usr/bin", "FXSTREAM_PROBE": "value-not-on-the-command-line"},
        sandbox=str(tmp_path),
        name="fxstream-worker-test-0",
        readonly=("/opt/venv", "/opt/venv/lib", "/usr/lib/python3"),
        writable=(str(tmp_path),),
        fds=fds,
    )


def test_the_docker_command_line(tmp_path: Path) -> None:
    runtime = DockerRuntime()
    assert not runtime.passes_fds  # Docker cannot: the pipes are stdin and stdout
    argv = runtime.command(_launch(tmp_path, fds=0), Image("w", "docker", "localhost/w:1"))
    assert argv[1:6] == ["run", "--rm", "-i", "--pull", "never"]
    assert "--preserve-fds" not in argv and "--runtime" not in argv
    volume = argv.index("/opt/venv:/opt/venv:ro")
    assert argv[volume - 1] == "--volume"
    assert "/opt/venv/lib:/opt/venv/lib:ro" not in argv  # inside a bound directory
    assert f"{tmp_path}:{tmp_path}:rw" in argv
    assert "FXSTREAM_PROBE" in argv and "value-not-on-the-command-line" not in " ".join(argv)
    assert argv[argv.index("localhost/w:1") + 1 :] == [
        "/usr/bin/python3",
        "-m",
        "fxstream.agent.worker_process",
    ]
    stop = runtime.stop_command(_launch(tmp_path, fds=0))
    assert stop is not None and stop[1:] == ["kill", "--signal", "KILL", "fxstream-worker-test-0"]


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"no Docker daemon answers here: {done.stderr.strip()[-300:]}"
    return None


@pytest.mark.skipif(_docker_problem() is not None, reason=str(_docker_problem()))
def test_a_docker_worker_runs_in_its_own_namespaces(rootfs: Path) -> None:
    tag = build_docker_image(rootfs)
    with ProcessEngine(1, runtime=DockerRuntime(), image=Image("w", "docker", tag)) as engine:
        seen = call(engine, tasks.namespaces)
    agent = own_namespaces()
    assert all(seen[ns] != agent[ns] for ns in NAMESPACES)


def build_docker_image(rootfs: Path) -> str:
    from fxstream.agent.images import build_podman_image

    return build_podman_image(rootfs, binary="docker")


def test_the_apptainer_command_line(tmp_path: Path) -> None:
    runtime = ApptainerRuntime()
    assert not runtime.passes_fds
    launch = _launch(tmp_path, fds=0)
    argv = runtime.command(launch, Image("w", "apptainer", "/srv/worker.sif"))
    assert argv[1:4] == ["exec", "--containall", "--no-home"]
    binds = argv[argv.index("--bind") + 1].split(",")
    assert binds == ["/opt/venv:/opt/venv:ro", f"{tmp_path}:{tmp_path}:rw"]  # /usr: the image's
    assert argv[argv.index("--pwd") + 1] == str(tmp_path)
    assert argv[argv.index("/srv/worker.sif") + 1 :] == list(launch.argv)
    env = runtime.environment(launch)
    assert env["APPTAINERENV_FXSTREAM_PROBE"] == "value-not-on-the-command-line"
    assert "value-not-on-the-command-line" not in " ".join(argv)


@pytest.mark.skipif(
    ApptainerRuntime().unavailable() is not None,
    reason="Apptainer is not packaged for Debian 12 and is not installed here: its command "
    "line is tested above, a worker in it only where apptainer or singularity exists",
)
def test_an_apptainer_worker_runs_in_its_own_namespaces(rootfs: Path) -> None:
    image = Image("w", "apptainer", str(rootfs))  # a sandbox directory image
    with ProcessEngine(1, runtime=ApptainerRuntime(), image=image) as engine:
        seen = call(engine, tasks.namespaces)
    agent = own_namespaces()
    assert seen["mnt"] != agent["mnt"] and seen["pid"] != agent["pid"]
