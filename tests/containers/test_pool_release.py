"""Image pools are released when idle and evicted least recently used under the worker
budget; a task whose pool cannot get a slot waits for one (real bubblewrap sandboxes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from fxstream.agent.config import ConfigError
from fxstream.agent.containers import Image
from fxstream.agent.engine import POOL_CLOSED, TASK_CANCELLED, WorkOutcome
from fxstream.agent.image_pools import ImagePools
from tests.containers import tasks
from tests.containers.test_container_config import config
from tests.containers.test_runtimes import item

RUNNER = "fxstream.agent.worker_process:load_pickled"
TIMEOUT = 60.0
HOST = Image("host", "bubblewrap", "/")


def built(rootfs: Path) -> Image:
    return Image("worker", "bubblewrap", str(rootfs))


def run(pools: ImagePools, image: str | None, *args: object) -> WorkOutcome:
    done = pools.submit(item(tasks.sleep, *(args or (0.0,)), image=image)).result(TIMEOUT)
    assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
    return done


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) for pid in pids)


def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.mark.usefixtures("leaves_no_process", "runtimes")
def test_an_idle_pool_is_released_and_starts_again_at_its_next_task() -> None:
    pools = ImagePools(1, RUNNER, default=None, images=[HOST], idle_s=1.0)
    try:
        run(pools, "host")
        pids = pools.pools()["host"].worker_pids()
        answered = time.monotonic()
        # Warm, then idle: its worker is advertised with its image and as idle.
        states = [w for w in pools.warm() if w.container == "host"]
        assert len(states) == 1 and states[0].idle
        until(lambda: "host" not in pools.pools())
        assert time.monotonic() - answered >= 1.0 - 0.05
        until(lambda: gone(pids), 5.0)
        assert [w.container for w in pools.warm()] == [None]  # the default pool is kept
        assert pools.counts().workers_total == 1
        # Its next task starts it again, cold, in new workers.
        run(pools, "host")
        assert pools.starts() == {None: 1, "host": 2}
        assert set(pools.pools()["host"].worker_pids()).isdisjoint(pids)
    finally:
        pools.close()


@pytest.mark.usefixtures("leaves_no_process")
def test_under_the_budget_the_least_recently_used_idle_pool_is_evicted(rootfs: Path) -> None:
    pools = ImagePools(1, RUNNER, default=HOST, images=[HOST, built(rootfs)], max_workers=1)
    try:
        assert pools.max_workers == 1
        run(pools, None)
        host_pids = pools.pools()["host"].worker_pids()
        run(pools, "worker")  # no slot left: the idle host pool goes first
        assert list(pools.pools()) == ["worker"]
        assert gone(host_pids)
        worker_pids = pools.pools()["worker"].worker_pids()
        run(pools, "host")  # and starts again, in place of the worker pool
        assert list(pools.pools()) == ["host"]
        assert gone(worker_pids)
        assert pools.starts() == {"host": 2, "worker": 1}
        assert pools.counts().workers_total == 1
    finally:
        pools.close()


@pytest.mark.usefixtures("leaves_no_process")
def test_a_task_waits_for_a_slot_while_no_pool_is_idle(rootfs: Path) -> None:
    pools = ImagePools(1, RUNNER, default=HOST, images=[HOST, built(rootfs)], max_workers=1)
    try:
        assert pools.wait_ready(TIMEOUT)
        busy = pools.submit(item(tasks.sleep, 2.0))
        waiting = pools.submit(item(tasks.sleep, 0.0, image="worker"))
        dropped = pools.submit(item(tasks.sleep, 0.0, task_id="drop-me", image="worker"))
        time.sleep(1.0)
        assert not waiting.done()  # the host pool is busy: not evicted, and no room
        assert pools.waiting() == {"worker": 2}
        assert pools.counts().queued == 2
        assert list(pools.pools()) == ["host"]
        assert pools.cancel("drop-me", "not wanted", kill=False)
        cancelled = dropped.result(TIMEOUT)
        assert cancelled.error_type == TASK_CANCELLED and "not wanted" in cancelled.error_message
        done = waiting.result(TIMEOUT)  # once the host pool's task is answered
        assert done.ok, done
        assert busy.result(0).ok and busy.result(0).finished_at <= done.finished_at
        assert list(pools.pools()) == ["worker"] and pools.waiting() == {}
        # Closing answers what still waits.
        running = pools.submit(item(tasks.sleep, 0.5, image="worker"))
        left = pools.submit(item(tasks.sleep, 0.0))
        time.sleep(0.2)
        pools.close()
        assert running.result(TIMEOUT).ok
        assert left.result(TIMEOUT).error_type == POOL_CLOSED
    finally:
        pools.close()


def test_pool_settings_are_checked_saying_what_to_change() -> None:
    with pytest.raises(ConfigError, match="pool_idle_s must be a positive number"):
        config(pool_idle_s=0).validate()
    with pytest.raises(ConfigError) as caught:
        config(workers=2, max_workers=1, images={"a": "process"}).validate()
    message = str(caught.value)
    assert "max_workers (1) is below workers (2)" in message
    assert "set max_workers to at least 2" in message and "to allow 4" in message
    fine = config(workers=2, max_workers=2, images={"a": "process"})
    fine.validate()
    assert fine.worker_budget() == 2
    assert config(workers=3, images={"a": "process", "b": "process"}).worker_budget() == 9
    with pytest.raises(ValueError, match="set it to 2 or more"):
        ImagePools(2, RUNNER, default=None, images=[], max_workers=1)


@pytest.mark.usefixtures("leaves_no_process")
def test_the_coldstart_bench_prints_figures_per_runtime(rootfs: Path) -> None:
    began = time.monotonic()
    command = [sys.executable, "-m", "fxstream.ops.cli", "bench", "coldstart"]
    command += ["--repetitions", "1", "--warm-tasks", "3"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["repetitions"] == 1 and report["warm_tasks"] == 3
    figures = report["runtimes"]
    assert list(figures) == [
        "multiprocessing-spawn",
        "process",
        "bubblewrap",
        "bubblewrap-host",
        "podman",
    ]
    for name in ("multiprocessing-spawn", "process", "bubblewrap", "bubblewrap-host"):
        runtime = figures[name]
        assert runtime["cold_p50_ms"] > runtime["warm_p50_ms"] > 0, (name, runtime)
        assert runtime["cold_p99_ms"] == runtime["cold_p50_ms"]  # one repetition
    # The project installs podman and runc: a podman that cannot run is a failure here.
    podman = figures["podman"]
    assert podman.get("cold_p50_ms", 0) > podman.get("warm_p50_ms", 0) > 0, podman
    assert any("worker cold and warm start" in line for line in lines)
    print(f"coldstart bench took {time.monotonic() - began:.1f} s")


def test_the_heartbeat_s_pool_slots_say_when_pools_are_fewer_than_images() -> None:
    images = {f"img{n}": "process" for n in range(10)}
    # 10 images and the no-container pool, 3 of them at once: placement reads 3.
    assert config(workers=1, max_workers=3, images=images).pool_slots() == 3
    # Pools are sized to the mix, one worker at least: 7 workers hold 7 pools.
    assert config(workers=2, max_workers=7, images=images).pool_slots() == 7
    # Room for every pool (no max_workers, or one as large): 0, no budget to keep.
    assert config(workers=1, images=images).pool_slots() == 0
    assert config(workers=1, max_workers=11, images=images).pool_slots() == 0
