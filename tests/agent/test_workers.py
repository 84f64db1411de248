"""The warm worker pool, with real worker processes: reuse, failures, deaths, walltime, close."""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from fxstream.agent import (
    CODE_HASH_MISMATCH,
    CODE_REQUIRED,
    POOL_CLOSED,
    TASK_CANCELLED,
    WALLTIME_EXCEEDED,
    WORKER_LOST,
    Engine,
    EngineCounts,
    ProcessEngine,
    WarmState,
    WorkerPool,
    WorkItem,
    WorkOutcome,
)
from tests.agent import runners

RUNNER = "tests.agent.runners:load_behaviour"
TIMEOUT = 20.0


def item(
    code: bytes,
    payload: bytes = b"",
    *,
    walltime_s: float | None = None,
    with_code: bool = True,
    function_id: str | None = None,
) -> WorkItem:
    """A work item for the behaviour named ``code`` (see tests/agent/runners.py)."""
    sha = hashlib.sha256(code).hexdigest()
    return WorkItem(
        task_id=str(uuid.uuid4()),
        function_id=function_id or f"fn-{sha[:16]}",
        code_sha256=sha,
        code=code if with_code else None,
        payload=payload,
        walltime_s=walltime_s,
    )


def run(pool: WorkerPool, work: WorkItem) -> WorkOutcome:
    return pool.submit(work).result(TIMEOUT)


def pid_of(outcome: WorkOutcome) -> int:
    host, _, pid = outcome.worker.rpartition(":")
    assert host
    return int(pid)


def whoami(outcome: WorkOutcome) -> tuple[int, int]:
    """(pid, how many times that process loaded the function) from a ``whoami`` task."""
    assert outcome.ok, outcome
    assert outcome.value is not None
    pid, loads = outcome.value.decode().split(":")
    assert int(pid) == pid_of(outcome)
    return int(pid), int(loads)


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    """Two started workers running the test runner."""
    with WorkerPool(2, RUNNER) as pool:
        assert pool.wait_ready(TIMEOUT)
        yield pool


def test_runs_a_task_in_a_worker_process(pool: WorkerPool) -> None:
    outcome = run(pool, item(b"echo", b"hello"))
    assert outcome.ok
    assert outcome.value == b"hello"
    assert outcome.error_type is None
    assert pid_of(outcome) in pool.worker_pids()
    assert outcome.started_at is not None
    assert outcome.started_at <= outcome.finished_at <= time.time()
    assert pool.size == 2


def test_warm_worker_serves_repeated_tasks_and_loads_once(pool: WorkerPool) -> None:
    code = f"whoami-{uuid.uuid4().hex}".encode()
    first = run(pool, item(code))
    # Later submissions may omit the code: the pool remembers it.
    rest = [run(pool, item(code, with_code=False)) for _ in range(10)]
    assert {whoami(o) for o in [first, *rest]} == {(pid_of(first), 1)}
    warm = pool.warm_functions()
    assert item(code).function_id in warm[first.worker]


def test_busy_pool_loads_a_function_at_most_once_per_worker(pool: WorkerPool) -> None:
    code = f"whoami-{uuid.uuid4().hex}".encode()
    futures = [pool.submit(item(code)) for _ in range(300)]
    seen = {whoami(f.result(TIMEOUT)) for f in futures}
    assert {loads for _, loads in seen} == {1}
    assert {pid for pid, _ in seen} <= set(pool.worker_pids())


def test_user_exception_is_an_error_outcome_and_the_worker_survives(pool: WorkerPool) -> None:
    pids = set(pool.worker_pids())
    outcome = run(pool, item(b"raise", b"x=3"))
    assert not outcome.ok
    assert outcome.value is None
    assert outcome.error_type == "ValueError"
    assert outcome.error_message == "bad input x=3"
    assert "Traceback (most recent call last)" in outcome.traceback
    assert "in _raise" in outcome.traceback
    assert not outcome.retryable
    assert pid_of(outcome) in pids
    assert run(pool, item(b"echo", b"after")).value == b"after"
    assert set(pool.worker_pids()) == pids


@pytest.mark.parametrize(
    ("code", "error_type", "message"),
    [
        (b"sys-exit", "SystemExit", "4"),
        (b"not-bytes", "TypeError", "the runner returned int, expected bytes"),
        (b"bad-load", "ImportError", "no module named 'missing_dependency'"),
    ],
)
def test_other_task_failures_keep_the_worker(
    pool: WorkerPool, code: bytes, error_type: str, message: str
) -> None:
    pids = set(pool.worker_pids())
    outcome = run(pool, item(code, b"4"))
    assert (outcome.ok, outcome.error_type, outcome.error_message) == (False, error_type, message)
    assert set(pool.worker_pids()) == pids


def test_a_failed_load_is_retried_by_the_next_task(pool: WorkerPool) -> None:
    outcomes = [run(pool, item(b"bad-load")) for _ in range(2)]
    assert [o.error_type for o in outcomes] == ["ImportError", "ImportError"]
    assert all(item(b"bad-load").function_id not in fns for fns in pool.warm_functions().values())


@pytest.mark.parametrize(
    ("code", "payload", "how"),
    [
        (b"exit", b"3", "exit code 3"),
        (b"sigkill", b"", "SIGKILL"),
        (b"segfault", b"", "SIGSEGV"),
    ],
)
def test_worker_death_is_worker_lost_and_the_worker_is_replaced(
    pool: WorkerPool, code: bytes, payload: bytes, how: str
) -> None:
    before = set(pool.worker_pids())
    bystander = pool.submit(item(b"sleep", b"0.5"))
    crash = item(code, payload)
    outcome = pool.submit(crash).result(TIMEOUT)

    assert not outcome.ok
    assert outcome.error_type == WORKER_LOST
    assert outcome.retryable
    dead = pid_of(outcome)
    assert outcome.error_message == (
        f"worker {dead} died with {how} while running function {crash.function_id}"
    )
    if how == "SIGSEGV":
        assert "Segmentation fault" in outcome.traceback
        assert "_segfault" in outcome.traceback

    # The other worker's task is unaffected.
    assert bystander.result(TIMEOUT).value == b"0.5"
    assert pid_of(bystander.result()) != dead
    # The pool keeps its size with a fresh worker, which serves.
    assert pool.wait_ready(TIMEOUT)
    after = set(pool.worker_pids())
    assert len(after) == 2
    assert dead in before
    assert dead not in after
    assert not psutil.pid_exists(dead) or psutil.Process(dead).status() == "zombie"
    outcomes = [pool.submit(item(b"echo", b"%d" % i)) for i in range(20)]
    assert [f.result(TIMEOUT).value for f in outcomes] == [b"%d" % i for i in range(20)]


def test_a_worker_writing_garbage_on_its_pipe_is_replaced(pool: WorkerPool) -> None:
    garble = item(b"garble")
    outcome = run(pool, garble)
    assert outcome.error_type == WORKER_LOST
    assert outcome.error_message == (
        f"worker {pid_of(outcome)} wrote an unreadable reply while running function "
        f"{garble.function_id} and was killed"
    )
    assert pool.wait_ready(TIMEOUT)
    assert pid_of(outcome) not in pool.worker_pids()
    assert run(pool, item(b"echo", b"fine")).value == b"fine"


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (an orphan's zombie waits for init: that is gone too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(
    ("code", "walltime_s", "error_type"),
    [(b"child-then-sleep", 1.0, WALLTIME_EXCEEDED), (b"child-then-exit", None, WORKER_LOST)],
)
def test_programs_a_task_started_end_with_its_worker(
    pool: WorkerPool, tmp_path: Path, code: bytes, walltime_s: float | None, error_type: str
) -> None:
    # The child inherits the worker's pipes, so only the pidfd tells the worker has died.
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    outcome = run(pool, item(code, str(pid_file).encode(), walltime_s=walltime_s))
    assert time.monotonic() - started < 10
    assert outcome.error_type == error_type
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)


def test_items_queued_behind_a_dying_task_run_on_the_replacement() -> None:
    # One worker, everything batchable, items submitted before the worker is up: the
    # three items reach the worker in one message, and the last two never start.
    with WorkerPool(1, RUNNER, short_task_s=float("inf")) as pool:
        futures = [
            pool.submit(item(b"sigkill")),
            *(pool.submit(item(b"echo", b"%d" % i)) for i in range(2)),
        ]
        lost, *others = (f.result(TIMEOUT) for f in futures)
        assert lost.error_type == WORKER_LOST
        assert [o.value for o in others] == [b"0", b"1"]
        assert {pid_of(o) for o in others} == set(pool.worker_pids())
        assert pid_of(lost) not in pool.worker_pids()


def test_worker_missing_a_function_gets_its_code_again() -> None:
    # "flaky" fails its first load in a process. The second item was sent without code (the
    # pool expected the function to be warm by then); the worker asks again, transparently.
    with WorkerPool(1, RUNNER, short_task_s=float("inf")) as pool:
        futures = [pool.submit(item(b"flaky", b"%d" % i)) for i in range(3)]
        outcomes = [f.result(TIMEOUT) for f in futures]
    assert outcomes[0].error_type == "ImportError"
    assert [o.value for o in outcomes[1:]] == [b"1", b"2"]


def test_walltime_kills_and_replaces_the_worker(pool: WorkerPool) -> None:
    bystander = pool.submit(item(b"sleep", b"0.3"))
    slow = item(b"sleep", b"30", walltime_s=0.5)
    started = time.monotonic()
    outcome = pool.submit(slow).result(TIMEOUT)
    assert time.monotonic() - started < 5
    assert outcome.error_type == WALLTIME_EXCEEDED
    assert "walltime of 0.5 s" in outcome.error_message
    assert slow.function_id in outcome.error_message
    assert not outcome.retryable
    assert bystander.result(TIMEOUT).ok
    assert pool.wait_ready(TIMEOUT)
    assert pid_of(outcome) not in pool.worker_pids()
    assert run(pool, item(b"echo", b"ok")).value == b"ok"


def test_a_task_within_its_walltime_succeeds(pool: WorkerPool) -> None:
    outcome = run(pool, item(b"sleep", b"0.1", walltime_s=5))
    assert outcome.ok


def test_large_payloads_and_results_cross_intact(pool: WorkerPool) -> None:
    payload = bytes(range(256)) * 20_000  # 5 MB, far beyond a pipe's buffer
    futures = [pool.submit(item(b"echo", payload)) for _ in range(3)]
    assert all(f.result(TIMEOUT).value == payload for f in futures)


def test_submit_from_many_threads_and_from_callbacks(pool: WorkerPool) -> None:
    def submit_many(prefix: str) -> list[Future[WorkOutcome]]:
        return [pool.submit(item(b"echo", f"{prefix}{i}".encode())) for i in range(300)]

    with ThreadPoolExecutor(4) as threads:
        batches = list(threads.map(submit_many, "abcd"))
    for prefix, futures in zip("abcd", batches, strict=True):
        assert [f.result(TIMEOUT).value for f in futures] == [
            f"{prefix}{i}".encode() for i in range(300)
        ]

    # A done-callback runs on the pool's thread; submitting from it must not deadlock.
    chain: list[WorkOutcome] = []
    finished = threading.Event()

    def next_link(future: Future[WorkOutcome]) -> None:
        chain.append(future.result())
        if len(chain) < 50:
            pool.submit(item(b"echo", b"link")).add_done_callback(next_link)
        else:
            finished.set()

    pool.submit(item(b"echo", b"link")).add_done_callback(next_link)
    assert finished.wait(TIMEOUT)
    assert all(o.ok for o in chain)


def test_code_is_required_once_and_must_match_its_hash(pool: WorkerPool) -> None:
    unseen = run(pool, item(f"whoami-{uuid.uuid4().hex}".encode(), with_code=False))
    assert unseen.error_type == CODE_REQUIRED
    assert unseen.worker == ""
    assert unseen.started_at is None

    wrong = WorkItem("t-1", "fn-wrong", "0" * 64, b"echo", b"")
    assert run(pool, wrong).error_type == CODE_HASH_MISMATCH


def test_idle_and_busy_counts_follow_the_work(pool: WorkerPool) -> None:
    assert (pool.idle_count, pool.busy_count, pool.queued_count) == (2, 0, 0)
    futures = [pool.submit(item(b"sleep", b"0.4")) for _ in range(3)]
    assert (pool.idle_count, pool.busy_count, pool.queued_count) == (0, 2, 1)
    for future in futures:
        assert future.result(TIMEOUT).ok
    assert (pool.idle_count, pool.busy_count, pool.queued_count) == (2, 0, 0)


def test_the_process_engine_reports_counts_and_warm_state_as_an_engine(pool: WorkerPool) -> None:
    assert pool.name == "process"
    assert isinstance(pool, Engine) and isinstance(pool, ProcessEngine)
    assert pool.counts() == EngineCounts(workers_total=2, workers_idle=2, workers_busy=0, queued=0)
    futures = [pool.submit(item(b"sleep", b"0.4")) for _ in range(3)]
    assert pool.counts() == EngineCounts(workers_total=2, workers_idle=0, workers_busy=2, queued=1)
    outcomes = [future.result(TIMEOUT) for future in futures]
    assert all(o.ok for o in outcomes)
    code = f"whoami-{uuid.uuid4().hex}".encode()
    first = run(pool, item(code))
    warm = {state.worker_id: state for state in pool.warm()}
    host = first.worker.rpartition(":")[0]
    assert set(warm) == {f"{host}:{pid}" for pid in pool.worker_pids()}
    # Loaded functions in LRU order, the one just run last; no container for a process.
    assert warm[first.worker].function_ids[-1] == item(code).function_id
    assert warm[first.worker].container is None
    assert isinstance(warm[first.worker], WarmState)
    assert pool.counts().workers_idle == 2


def test_a_queued_item_can_be_cancelled(pool: WorkerPool) -> None:
    blockers = [pool.submit(item(b"sleep", b"0.3")) for _ in range(2)]
    queued = pool.submit(item(b"echo", b"never"))
    assert queued.cancel()
    assert all(b.result(TIMEOUT).ok for b in blockers)
    assert run(pool, item(b"echo", b"next")).value == b"next"
    assert queued.cancelled()


def test_cancel_drops_a_queued_item_and_answers_on_the_pools_thread(pool: WorkerPool) -> None:
    blockers = [pool.submit(item(b"sleep", b"0.5")) for _ in range(2)]
    queued = item(b"echo", b"never")
    future = pool.submit(queued)
    threads: list[str] = []
    future.add_done_callback(lambda _: threads.append(threading.current_thread().name))
    assert pool.queued_count == 1
    assert pool.cancel(queued.task_id, "not needed")
    outcome = future.result(TIMEOUT)
    assert (outcome.ok, outcome.error_type, outcome.started_at) == (False, TASK_CANCELLED, None)
    assert outcome.error_message == f"task {queued.task_id} was cancelled: not needed"
    assert not outcome.retryable
    assert threads == ["fxstream-worker-pool"]
    assert pool.queued_count == 0
    assert all(b.result(TIMEOUT).ok for b in blockers)
    assert not pool.cancel(queued.task_id), "cancelled twice"


def test_cancel_kills_a_running_item_and_what_it_started(pool: WorkerPool, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    running = item(b"child-then-sleep", str(pid_file).encode())
    future = pool.submit(running)
    deadline = time.monotonic() + TIMEOUT
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.02)
    child = int(pid_file.read_text())
    before = set(pool.worker_pids())
    cancelled_at = time.monotonic()
    assert pool.cancel(running.task_id)
    outcome = future.result(TIMEOUT)
    assert time.monotonic() - cancelled_at < 5
    assert outcome.error_type == TASK_CANCELLED
    assert not outcome.retryable
    assert outcome.started_at is not None
    assert "cancelled while running function" in outcome.error_message
    dead = pid_of(outcome)
    assert dead in before
    deadline = time.monotonic() + 5
    while not (gone(child) and gone(dead)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child) and gone(dead)
    assert pool.wait_ready(TIMEOUT)
    assert dead not in pool.worker_pids() and len(pool.worker_pids()) == 2
    assert run(pool, item(b"echo", b"next")).value == b"next"


def test_a_skip_only_cancel_drops_a_queued_item_and_leaves_a_running_one(
    pool: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    running = item(b"mark-then-sleep", str(marker).encode())
    future = pool.submit(running)
    deadline = time.monotonic() + TIMEOUT
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.02)
    pids = set(pool.worker_pids())
    assert not pool.cancel(running.task_id, "skip", kill=False), "a started item is not dropped"
    outcome = future.result(TIMEOUT)
    assert outcome.ok and outcome.value == b"slept"
    assert set(pool.worker_pids()) == pids, "no worker was killed"
    blockers = [pool.submit(item(b"sleep", b"0.5")) for _ in range(2)]
    queued = item(b"echo", b"never")
    dropped = pool.submit(queued)
    assert pool.cancel(queued.task_id, "skip", kill=False)
    assert dropped.result(TIMEOUT).error_type == TASK_CANCELLED
    assert all(b.result(TIMEOUT).ok for b in blockers)


def test_cancel_of_an_item_batched_behind_another_answers_at_once() -> None:
    # Every function counts as short once run: items queued together go to the one worker
    # in one message, and the second waits behind the first inside the worker, where the
    # pool cannot take it back.
    with WorkerPool(1, RUNNER, short_task_s=float("inf")) as pool:
        assert pool.wait_ready(TIMEOUT)
        assert run(pool, item(b"echo", b"warm")).ok
        blocker = pool.submit(item(b"sleep", b"0.3"))
        first = pool.submit(item(b"sleep", b"0.5"))
        behind = item(b"echo", b"late")
        second = pool.submit(behind)
        assert pool.queued_count == 2
        assert blocker.result(TIMEOUT).ok
        deadline = time.monotonic() + TIMEOUT
        while pool.queued_count:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert pool.busy_count == 1
        assert pool.cancel(behind.task_id)
        outcome = second.result(1.0)  # well before the first item is done
        assert outcome.error_type == TASK_CANCELLED
        assert not first.done()
        assert first.result(TIMEOUT).ok
        assert run(pool, item(b"echo", b"next")).value == b"next"


def test_cancel_of_an_unknown_or_finished_item_is_false(pool: WorkerPool) -> None:
    assert not pool.cancel("no-such-task")
    done = item(b"echo", b"x")
    assert run(pool, done).ok
    assert not pool.cancel(done.task_id)
    assert len(pool.worker_pids()) == 2


def test_default_runner_unpickles_a_function_reference() -> None:
    code = pickle.dumps(runners.add)
    work = WorkItem(
        task_id="t-add",
        function_id="fn-add",
        code_sha256=hashlib.sha256(code).hexdigest(),
        code=code,
        payload=pickle.dumps(((2,), {"b": 3})),
    )
    with WorkerPool(1) as pool:
        outcome = run(pool, work)
    assert outcome.value is not None
    assert pickle.loads(outcome.value) == 5


def test_a_bad_runner_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="no_such_module"):
        WorkerPool(1, "no_such_module:load")
    with pytest.raises(ValueError, match=r"package\.module:function"):
        WorkerPool(1, "no-colon")
    with pytest.raises(ValueError, match="cannot be pickled"):
        WorkerPool(1, lambda code: runners.load_behaviour(code))


def test_close_stops_and_reaps_every_worker() -> None:
    pool = WorkerPool(2, RUNNER)
    assert pool.wait_ready(TIMEOUT)
    pids = pool.worker_pids()
    assert len(pids) == 2
    assert run(pool, item(b"echo")).ok
    pool.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert pool.worker_pids() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(item(b"echo"))
    pool.close()  # idempotent


def test_close_waits_for_running_tasks_then_kills() -> None:
    pool = WorkerPool(1, RUNNER)
    assert pool.wait_ready(TIMEOUT)
    pid = pool.worker_pids()[0]
    running = pool.submit(item(b"sleep", b"30"))
    queued = pool.submit(item(b"echo"))
    time.sleep(0.2)
    started = time.monotonic()
    pool.close(timeout=0.5)
    assert time.monotonic() - started < 5
    assert not psutil.pid_exists(pid)
    for future in (running, queued):
        outcome = future.result(0)
        assert outcome.error_type == POOL_CLOSED
        assert outcome.retryable
    assert "while running function" in running.result().error_message


def test_close_lets_held_tasks_finish_within_the_timeout() -> None:
    pool = WorkerPool(1, RUNNER)
    assert pool.wait_ready(TIMEOUT)
    held = pool.submit(item(b"sleep", b"0.3"))
    time.sleep(0.05)
    pool.close(timeout=10)
    assert held.result(0).ok


def test_forkserver_start_method() -> None:
    # The runner given as a (picklable) callable rather than by name.
    with WorkerPool(2, runners.load_behaviour, start_method="forkserver") as pool:
        assert pool.wait_ready(TIMEOUT)
        crash = run(pool, item(b"sigkill"))
        assert crash.error_type == WORKER_LOST
        assert "SIGKILL" in crash.error_message
        assert run(pool, item(b"echo", b"fs")).value == b"fs"


def test_what_a_function_prints_comes_back_bounded_and_the_worker_keeps_its_streams(
    pool: WorkerPool,
) -> None:
    printed = run(pool, item(b"print", b"hello|2"))
    assert printed.ok and printed.stdout == "hello\nhello\n"
    assert printed.stderr == "a warning\n"
    # A failing function's output comes back with its error.
    failed = run(pool, item(b"print", b"fail"))
    assert not failed.ok and failed.error_type == "RuntimeError"
    assert failed.stdout == "fail\n" and failed.stderr == "a warning\n"
    # A flood keeps its tail and says how much went before it.
    flood = run(pool, item(b"print", b"0123456789|10000"))  # 110,000 characters
    assert flood.ok and flood.stdout.endswith("0123456789\n")
    assert flood.stdout.startswith("[... ") and "characters of output dropped" in flood.stdout
    assert len(flood.stdout) < 17_000
    # The next task on the same workers prints only its own.
    assert run(pool, item(b"echo", b"quiet")).stdout == ""


def until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    """Wait for ``condition``, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_resize_grows_the_pool_with_new_warm_workers() -> None:
    with WorkerPool(1, RUNNER) as pool:
        assert pool.wait_ready(TIMEOUT)
        first = pool.worker_pids()
        pool.resize(3)
        assert pool.size == 3
        assert pool.counts().workers_total == 3  # at once: a budget counts them
        assert pool.wait_ready(TIMEOUT)
        pids = pool.worker_pids()
        assert len(pids) == 3 and set(first) <= set(pids)
        assert len(pool.warm()) == 3
        # Three tasks at once run on three workers.
        futures = [pool.submit(item(b"sleep", b"0.5")) for _ in range(3)]
        outcomes = [future.result(TIMEOUT) for future in futures]
        assert all(o.ok for o in outcomes)
        assert {pid_of(o) for o in outcomes} == set(pids)
        assert pool.counts() == EngineCounts(3, 3, 0, 0)


def test_resize_shrinks_idle_workers_and_never_respawns_them() -> None:
    with WorkerPool(3, RUNNER) as pool:
        assert pool.wait_ready(TIMEOUT)
        pids = pool.worker_pids()
        pool.resize(1)
        assert pool.size == 1
        until(lambda: len(pool.worker_pids()) == 1)
        stopped = set(pids) - set(pool.worker_pids())
        assert len(stopped) == 2
        until(lambda: all(gone(pid) for pid in stopped))
        assert pool.wait_ready(TIMEOUT)
        # Once they are reaped they no longer count.
        until(lambda: pool.counts() == EngineCounts(1, 1, 0, 0))
        assert len(pool.warm()) == 1
        outcomes = [pool.submit(item(b"echo", b"x")).result(TIMEOUT) for _ in range(3)]
        assert all(o.ok for o in outcomes)
        assert {pid_of(o) for o in outcomes} == set(pool.worker_pids())
        assert len(pool.worker_pids()) == 1  # a retired slot is never respawned


def test_resize_retires_a_busy_worker_only_once_its_task_is_answered() -> None:
    with WorkerPool(2, RUNNER) as pool:
        assert pool.wait_ready(TIMEOUT)
        running = [pool.submit(item(b"sleep", b"3")) for _ in range(2)]
        until(lambda: pool.busy_count == 2)
        pool.resize(1)
        assert pool.size == 1
        until(lambda: len(pool.warm()) == 1)  # one is retired: not advertised any more
        # Both are busy: neither is killed; the one retired still counts (busy) until it
        # has answered and ended, and takes no new item.
        assert pool.counts() == EngineCounts(2, 0, 2, 0)
        later = pool.submit(item(b"sleep", b"0.1"))
        outcomes = [future.result(TIMEOUT) for future in running]
        assert all(o.ok for o in outcomes), outcomes  # never killed for the resize
        until(lambda: len(pool.worker_pids()) == 1)
        kept = pool.worker_pids()[0]
        retired = {pid_of(o) for o in outcomes} - {kept}
        assert len(retired) == 1
        until(lambda: all(gone(pid) for pid in retired))
        done = later.result(TIMEOUT)
        assert done.ok and pid_of(done) == kept
        until(lambda: pool.counts() == EngineCounts(1, 1, 0, 0))


def test_growing_again_keeps_a_retired_worker_still_running_its_task() -> None:
    with WorkerPool(2, RUNNER) as pool:
        assert pool.wait_ready(TIMEOUT)
        pids = set(pool.worker_pids())
        running = [pool.submit(item(b"sleep", b"1.0")) for _ in range(2)]
        until(lambda: pool.busy_count == 2)
        pool.resize(1)
        pool.resize(2)
        assert all(future.result(TIMEOUT).ok for future in running)
        assert pool.wait_ready(TIMEOUT)
        # The busy worker was kept again, warm: no new process started.
        assert set(pool.worker_pids()) == pids
        assert pool.counts() == EngineCounts(2, 2, 0, 0)


def test_resize_is_checked() -> None:
    pool = WorkerPool(1, RUNNER)
    with pytest.raises(ValueError, match="at least one worker"):
        pool.resize(0)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.resize(2)
