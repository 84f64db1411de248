"""A worker started by a runtime's command line keeps every guarantee of a multiprocessing
one (fxstream.agent.worker_process): warm reuse, a death seen and replaced (with
faulthandler's dump after a segfault), walltimes, its task's programs killed with it, and
no worker outliving the agent. Run without a container (the ``process`` runtime) and in
bubblewrap, with the test runners of tests/agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fxstream.agent.containers import BubblewrapRuntime, Image, ProcessRuntime, Runtime
from fxstream.agent.engine import WALLTIME_EXCEEDED, WORKER_LOST, WorkItem, WorkOutcome
from fxstream.agent.process_engine import ProcessEngine
from tests.agent import runners

pytestmark = pytest.mark.usefixtures("leaves_no_process")

TIMEOUT = 60.0


def item(code: bytes, payload: bytes = b"", walltime_s: float | None = None) -> WorkItem:
    import hashlib
    import uuid

    return WorkItem(
        task_id=uuid.uuid4().hex,
        function_id=code.decode(),
        code_sha256=hashlib.sha256(code).hexdigest(),
        code=code,
        payload=payload,
        walltime_s=walltime_s,
    )


def run(engine: ProcessEngine, work: WorkItem) -> WorkOutcome:
    return engine.submit(work).result(TIMEOUT)


@pytest.fixture(params=["process", "bubblewrap"])
def launched(request: pytest.FixtureRequest) -> tuple[Runtime, Image | None]:
    if request.param == "process":
        return ProcessRuntime(), None
    request.getfixturevalue("runtimes")
    return BubblewrapRuntime(), Image("host", "bubblewrap", "/")


@pytest.fixture
def engine(launched: tuple[Runtime, Image | None], tmp_path: Path) -> Iterator[ProcessEngine]:
    runtime, image = launched
    with ProcessEngine(
        2, runners.load_behaviour, runtime=runtime, image=image, writable=[str(tmp_path)]
    ) as started:
        assert started.wait_ready(TIMEOUT)
        yield started


def test_a_launched_worker_loads_a_function_once_and_stays_warm(engine: ProcessEngine) -> None:
    first = run(engine, item(b"whoami-a"))
    assert first.ok, first
    for _ in range(5):
        again = run(engine, item(b"whoami-a"))
        assert again.ok
        # Same worker process (its pid in its own namespace), one load of the function.
        assert again.value is not None and again.value.endswith(b":1")
    assert run(engine, item(b"echo", b"x")).value == b"x"
    assert run(engine, item(b"raise", b"y")).error_type == "ValueError"


@pytest.mark.parametrize(
    ("code", "payload", "how"),
    [(b"exit", b"3", "exit code 3"), (b"sigkill", b"", ""), (b"segfault", b"", "")],
)
def test_a_launched_worker_death_is_worker_lost_and_it_is_replaced(
    engine: ProcessEngine, code: bytes, payload: bytes, how: str
) -> None:
    before = set(engine.worker_pids())
    lost = run(engine, item(code, payload))
    assert lost.error_type == WORKER_LOST, lost
    assert how in lost.error_message
    if code == b"segfault":
        # faulthandler's dump, written in the worker's sandbox (or crash file) and read back.
        assert "Segmentation fault" in lost.traceback
        assert "_segfault" in lost.traceback
    assert engine.wait_ready(TIMEOUT)
    after = set(engine.worker_pids())
    assert len(after) == 2 and after != before
    assert all(run(engine, item(b"echo", b"%d" % i)).ok for i in range(4))


@pytest.mark.parametrize(
    ("code", "walltime_s", "error_type"),
    [(b"child-then-sleep", 1.0, WALLTIME_EXCEEDED), (b"child-then-exit", None, WORKER_LOST)],
)
def test_programs_a_launched_task_started_end_with_its_worker(
    engine: ProcessEngine, tmp_path: Path, code: bytes, walltime_s: float | None, error_type: str
) -> None:
    before = _sleepers()
    pid_file = tmp_path / "child.pid"  # the sandbox may write tmp_path (see the fixture)
    started = time.monotonic()
    outcome = run(engine, item(code, str(pid_file).encode(), walltime_s))
    assert time.monotonic() - started < 15
    assert outcome.error_type == error_type, outcome
    assert pid_file.read_text().isdigit()  # the child started (its pid in the worker's view)
    deadline = time.monotonic() + 5
    while left := _sleepers() - before:
        assert time.monotonic() < deadline, f"the task's child outlived its worker: {left}"
        time.sleep(0.05)


def _sleepers() -> set[int]:
    """Live ``sleep 60`` processes on this machine (what the task starts)."""
    return {
        p.pid for p in psutil.process_iter() if _cmdline(p) == ["sleep", "60"] and _alive(p.pid)
    }


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


_AGENT = """
import sys, time
from fxstream.agent.containers import runtime_for, Image
from fxstream.agent.process_engine import ProcessEngine
runtime = runtime_for(sys.argv[1])
image = Image("host", "bubblewrap", "/") if sys.argv[1] == "bubblewrap" else None
engine = ProcessEngine(2, runtime=runtime, image=image)
assert engine.wait_ready(60)
print(" ".join(map(str, engine.worker_pids())), flush=True)
time.sleep(600)
"""


def test_launched_workers_die_with_a_killed_agent(launched: tuple[Runtime, Image | None]) -> None:
    runtime, _ = launched
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, runtime.name],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    try:
        assert agent.stdout is not None
        launchers = [int(p) for p in agent.stdout.readline().split()]
        assert len(launchers) == 2
        family = [
            p.pid for pid in launchers for p in psutil.Process(pid).children(recursive=True)
        ] + launchers
        agent.send_signal(signal.SIGKILL)
        agent.wait(TIMEOUT)
        deadline = time.monotonic() + 10
        while alive := [p for p in family if _alive(p)]:
            assert time.monotonic() < deadline, f"workers outlived the agent: {alive}"
            time.sleep(0.05)
    finally:
        agent.kill()
        agent.wait()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
