"""A task-state view that lags its topic holds a bounded prefetch, not librdkafka's 64 MiB.

The 1-hour soak saw every process following ``task-state`` (the ingress, the task-state
processor) and the SDK's results listener rise in steps after warm-up: each burst that
left a consumer's thread behind let librdkafka prefetch up to its default 64 MiB, and the
process kept much of it. Here a view catches up with an 80 MB backlog (its thread folds
far slower than the broker serves), and its process's RSS is sampled throughout.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from confluent_kafka import Producer

from fxstream.service.registry import RegistryView
from fxstream.topics import Catalogue, KafkaConnection, TaskState, TaskStateName, encode

BACKLOG = 80_000
VALUE = b"x" * 1_000


def rss_mb() -> float:
    """This process's resident set size in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_lagging_view_prefetches_a_bounded_amount(
    module_kafka: KafkaConnection, catalogue: Catalogue, tmp_path: Path
) -> None:
    producer = Producer({**module_kafka.confluent(), "log_level": 2, "linger.ms": 20})
    for i in range(BACKLOG):
        state = TaskState(
            task_id=f"t-{i}",
            user_id="u-1",
            function_id="fn-1",
            endpoint_id="ep-1",
            state=TaskStateName.SUCCEEDED,
            updated_at=1.0,
            value=VALUE,
        )
        while True:
            try:
                producer.produce(
                    catalogue.task_state, key=state.task_id.encode(), value=encode(state)
                )
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0
    del producer
    view = RegistryView(
        module_kafka, catalogue, follow=("task-state",), task_table_dir=tmp_path / "table"
    )
    peak = before = rss_mb()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.monotonic()
    try:
        view.start()
        assert view.wait_until_current(120), "the view did not read its backlog in 120 s"
        took = time.monotonic() - began
    finally:
        done.set()
        sampler.join()
        view.close()
    grown = peak - before
    print(
        f"\nread {BACKLOG:,} states (~{BACKLOG * len(VALUE) / 1e6:.0f} MB) in {took:.1f} s; "
        f"RSS {before:.1f} -> peak {peak:.1f} MB (+{grown:.1f})"
    )
    # The table's own bound (two 4 MiB write buffers, an 8 MiB block cache) plus a 4 MiB
    # prefetch and the allocator's slack: +20.5 MB measured (2026-11-24). With librdkafka's
    # default prefetch (64 MiB) the same catch-up grew it +40.1 MB.
    assert grown < 32, f"catching up grew the process {grown:.1f} MB (peak {peak:.1f} MB)"
