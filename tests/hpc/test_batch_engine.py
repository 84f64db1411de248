"""The batch engine on Parsl's LocalProvider: real interchange, real blocks of real workers.

Each block is a process tree Parsl's LocalProvider starts on this machine (as a
scheduler's job would start one on a node); nothing is mocked. The module's engine
keeps one block (``min_blocks`` 1) so the tests share its warm workers; the scaling
test has its own engine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fxstream.agent import (
    POOL_CLOSED,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    WorkItem,
)
from fxstream.agent.batch_engine import BatchEngine, BlockContainer
from fxstream.agent.batch_settings import BatchSettings
from fxstream.agent.containers import HOST_ROOTFS, BubblewrapRuntime, Image
from tests.agent import runners
from tests.containers import tasks
from tests.hpc.support import RUNNER, WORKER_INIT, engine_processes, item, label_for, wait_until

pytestmark = pytest.mark.hpc

TIMEOUT = 60.0
SECRET = "s3cr3t-store-password-for-the-test"
PICKLE_RUNNER = "fxstream.agent.worker_process:load_pickled"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchEngine]:
    run_dir = tmp_path_factory.mktemp("batch") / "run"
    settings = BatchSettings(
        max_workers_per_node=2,
        init_blocks=1,
        min_blocks=1,
        max_blocks=1,
        worker_init=WORKER_INIT,
        strategy_period_s=1,
    )
    runner = functools.partial(runners.load_behaviour_with, secret=SECRET)
    engine = BatchEngine(settings, runner, run_dir, label=label_for(run_dir))
    try:
        assert engine.wait_ready(timeout=90), "the block's workers never connected"
        yield engine
    finally:
        engine.close()
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")


def test_values_errors_and_warm_functions(engine: BatchEngine) -> None:
    echo = item(b"echo", b"hello")
    echoed = engine.submit(echo).result(TIMEOUT)
    assert echoed.ok and echoed.value == b"hello" and echoed.error_type is None
    host, _, pid = echoed.worker.partition(":")
    assert host and pid.isdigit()
    assert echoed.started_at is not None and echoed.started_at <= echoed.finished_at

    failed = engine.submit(item(b"raise", b"x")).result(TIMEOUT)
    assert not failed.ok and failed.error_type == "ValueError"
    assert failed.error_message == "bad input x" and "ValueError" in failed.traceback
    assert not failed.retryable  # the task's own failure

    # A function is loaded once per worker: the second run on a worker says 1 load.
    answers = [engine.submit(item(b"whoami-batch")).result(TIMEOUT) for _ in range(6)]
    loads = {a.value.decode().split(":")[1] for a in answers if a.value is not None}
    assert loads == {"1"}, loads
    warm = {w.worker_id: w.function_ids for w in engine.warm()}
    assert echo.function_id in warm[echoed.worker]


def test_walltime_interrupts_the_function_and_the_worker_lives_on(engine: BatchEngine) -> None:
    began = time.monotonic()
    over = engine.submit(item(b"sleep", b"30", walltime_s=1.0)).result(TIMEOUT)
    assert over.error_type == WALLTIME_EXCEEDED, over
    assert time.monotonic() - began < 15
    after = engine.submit(item(b"echo", b"still here")).result(TIMEOUT)
    assert after.ok and after.value == b"still here"


def test_cancel_resolves_at_once(engine: BatchEngine, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    work = item(b"mark-then-wait", f"{marker}|3".encode())
    future = engine.submit(work)
    wait_until(marker.exists, TIMEOUT, "the task to start")
    assert not engine.cancel(work.task_id, "by the test", kill=False)
    assert engine.cancel(work.task_id, "by the test")
    outcome = future.result(1)
    assert outcome.error_type == TASK_CANCELLED and "by the test" in outcome.error_message
    assert not engine.cancel(work.task_id, "again")
    # The worker ran it to its end (HTEX cannot stop one task) and takes work again.
    assert engine.submit(item(b"echo", b"next")).result(TIMEOUT).ok


def test_a_killed_worker_is_a_retryable_loss(engine: BatchEngine) -> None:
    lost = engine.submit(item(b"sigkill")).result(TIMEOUT)
    assert lost.error_type == WORKER_LOST and lost.retryable, lost
    # The block's manager starts another worker in its place.
    assert engine.submit(item(b"echo", b"again")).result(TIMEOUT).ok


def test_counts_and_blocks(engine: BatchEngine) -> None:
    counts = engine.counts()
    assert counts.workers_total == 2 and counts.workers_busy + counts.workers_idle == 2
    assert (counts.blocks_running, counts.blocks_pending) == (1, 0)


def test_the_runner_and_its_secret_stay_in_one_owner_only_file(engine: BatchEngine) -> None:
    runner_file = engine.run_dir / "runner.pickle"
    assert stat.S_IMODE(runner_file.stat().st_mode) == 0o600
    for path in engine.run_dir.rglob("*"):
        if path.is_file() and path != runner_file:
            assert SECRET.encode() not in path.read_bytes(), f"the secret is in {path}"
    for proc in engine_processes(engine.run_dir):
        assert SECRET not in " ".join(proc.cmdline())
        assert SECRET not in "".join(proc.environ().values())


def test_blocks_scale_out_under_a_backlog_and_in_when_idle(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = BatchSettings(
        max_workers_per_node=1,
        init_blocks=0,
        min_blocks=0,
        max_blocks=2,
        max_idletime_s=3,
        strategy_period_s=1,
        worker_init=WORKER_INIT,
    )
    engine = BatchEngine(settings, RUNNER, run_dir, label=label_for(run_dir))
    try:
        assert engine.wait_ready(timeout=1)  # min_blocks 0: nothing need be up
        assert engine.counts().blocks_running + engine.counts().blocks_pending == 0
        futures = [engine.submit(item(b"whoami-scale")) for _ in range(2)]
        futures += [engine.submit(item(b"sleep", b"2")) for _ in range(4)]
        outcomes = [f.result(120) for f in futures]
        assert all(o.ok for o in outcomes), [o.error_message for o in outcomes if not o.ok]
        hosts_pids = {o.worker for o in outcomes}
        assert len(hosts_pids) == 2, f"two blocks of one worker each ran them: {hosts_pids}"
        wait_until(
            lambda: engine.counts().blocks_running == 0,
            60,
            "the idle blocks to be released (max_idletime_s 3)",
        )
        wait_until(
            lambda: (
                not any(
                    "process_worker_pool" in " ".join(p.cmdline())
                    for p in engine_processes(run_dir)
                )
            ),
            30,
            "the released blocks' worker pools to exit",
        )
        # A later task starts a block again.
        assert engine.submit(item(b"echo", b"back")).result(120).ok
    finally:
        engine.close()
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")


def test_close_fails_what_is_left_and_stops_every_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = BatchSettings(
        max_workers_per_node=1, init_blocks=1, min_blocks=1, worker_init=WORKER_INIT
    )
    engine = BatchEngine(settings, RUNNER, run_dir, label=label_for(run_dir))
    assert engine.wait_ready(timeout=90)
    running = engine.submit(item(b"sleep", b"30"))
    waiting = engine.submit(item(b"sleep", b"30"))
    engine.close(timeout=10)
    assert running.result(5).error_type == POOL_CLOSED
    assert waiting.result(5).error_type == POOL_CLOSED
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(item(b"echo"))
    engine.close()  # idempotent
    assert os.path.isdir(run_dir)


def _pickled_item(function: Any, *args: Any) -> WorkItem:
    """A work item running ``function(*args)`` with the pickle runner (trusted test code)."""
    code = pickle.dumps(function)
    return WorkItem(
        task_id=str(uuid.uuid4()),
        function_id=f"{function.__module__}.{function.__qualname__}",
        code_sha256=hashlib.sha256(code).hexdigest(),
        code=code,
        payload=pickle.dumps((args, {})),
    )


def test_a_container_wraps_every_blocks_workers(tmp_path: Path) -> None:
    """The endpoint's image wraps the command each block runs (Parsl's worker pool), as
    Globus Compute's engine does: a task runs in new mount, PID, IPC and UTS namespaces
    and may write only where the endpoint lets its workers write."""
    run_dir = tmp_path / "run"
    shared = tmp_path / "shared"
    shared.mkdir()
    settings = BatchSettings(
        max_workers_per_node=1,
        init_blocks=1,
        min_blocks=1,
        max_blocks=1,
        worker_init=WORKER_INIT,
        strategy_period_s=1,
    )
    container = BlockContainer(
        BubblewrapRuntime(), Image("host", "bubblewrap", HOST_ROOTFS), writable=(str(shared),)
    )
    engine = BatchEngine(
        settings, PICKLE_RUNNER, run_dir, label=label_for(run_dir), container=container
    )
    try:
        assert engine.wait_ready(timeout=90), "the contained block's workers never connected"
        done = engine.submit(_pickled_item(tasks.namespaces)).result(TIMEOUT)
        assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
        assert done.value is not None
        inside = pickle.loads(done.value)
        here = tasks.namespaces()
        for namespace in tasks.NAMESPACES:
            assert inside[namespace] != here[namespace], namespace
        assert inside["hostname"] == "fxstream-worker"
        allowed = engine.submit(_pickled_item(tasks.try_write, str(shared / "out"))).result(TIMEOUT)
        assert allowed.value is not None and pickle.loads(allowed.value) == "written"
        # The rootfs is read-only; the sandbox's /tmp is its own (not the host's).
        probe = "/usr/fxstream-batch-probe"
        refused = engine.submit(_pickled_item(tasks.try_write, probe)).result(TIMEOUT)
        assert refused.value is not None and pickle.loads(refused.value) in ("EROFS", "EACCES")
        assert not os.path.exists(probe)
        private = str(tmp_path / "not-shared")
        engine.submit(_pickled_item(tasks.try_write, private)).result(TIMEOUT)
        assert not os.path.exists(private)
    finally:
        engine.close()
    wait_until(lambda: not engine_processes(run_dir), 30, "the engine's processes to end")
