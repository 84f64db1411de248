"""Cold and warm start of one worker per runtime (a script, not a test).

Run from the repository root, under the test lock:
``.venv/bin/python -m tests.containers.bench_coldstart [rounds]``. Per runtime
(multiprocessing spawn, the ``process`` runtime's command line, bubblewrap on the host's
rootfs and on the built one, podman on the built image) it starts an engine of one worker
``rounds`` times and measures the *cold start*: from the engine's start to the first
task's result (container start + interpreter + worker import + function load); then the
*warm* latency of the next tasks in the same worker. Prints p50/p99 in ms per runtime and,
last, one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

from fxstream.agent.containers import (
    BubblewrapRuntime,
    Image,
    PodmanRuntime,
    ProcessRuntime,
    Runtime,
)
from fxstream.agent.engine import WorkItem
from fxstream.agent.images import build_podman_image, build_rootfs
from fxstream.agent.process_engine import ProcessEngine
from tests.containers import tasks

CODE = pickle.dumps(tasks.sleep)
SHA = hashlib.sha256(CODE).hexdigest()
PAYLOAD = pickle.dumps(((0.0,), {}))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def measure(runtime: Runtime | None, image: Image | None, rounds: int) -> dict[str, float]:
    cold: list[float] = []
    warm: list[float] = []
    for round_ in range(rounds):
        started = time.perf_counter()
        with ProcessEngine(1, runtime=runtime, image=image) as engine:
            done = engine.submit(WorkItem(f"c{round_}", "sleep", SHA, CODE, PAYLOAD)).result(120)
            assert done.ok, done
            cold.append(time.perf_counter() - started)
            for i in range(20):
                at = time.perf_counter()
                engine.submit(WorkItem(f"w{i}", "sleep", SHA, None, PAYLOAD)).result(30)
                warm.append(time.perf_counter() - at)
    return {
        "cold_p50_ms": 1000 * statistics.median(cold),
        "cold_p99_ms": 1000 * percentile(cold, 0.99),
        "warm_p50_ms": 1000 * statistics.median(warm),
        "warm_p99_ms": 1000 * percentile(warm, 0.99),
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    rootfs = build_rootfs(cache / "fxstream" / "worker-rootfs")
    setups: dict[str, tuple[Runtime | None, Image | None]] = {
        "multiprocessing-spawn": (None, None),
        "process": (ProcessRuntime(), None),
        "bubblewrap-host": (BubblewrapRuntime(), Image("host", "bubblewrap", "/")),
        "bubblewrap-rootfs": (BubblewrapRuntime(), Image("w", "bubblewrap", str(rootfs))),
        "podman": (PodmanRuntime(), Image("w", "podman", build_podman_image(rootfs))),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (runtime, image) in setups.items():
        results[name] = measure(runtime, image, rounds)
        figures = results[name]
        print(
            f"{name:22s} cold p50 {figures['cold_p50_ms']:8.1f} ms  p99 "
            f"{figures['cold_p99_ms']:8.1f} ms   warm p50 {figures['warm_p50_ms']:6.2f} ms  "
            f"p99 {figures['warm_p99_ms']:6.2f} ms",
            flush=True,
        )
    print(json.dumps({"rounds": rounds, **results}))


if __name__ == "__main__":
    main()
