"""``./fx bench pipeline`` without a platform: its settings, its ideals, and its two stage
functions chained in this process through a proxy future on a file store."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fxstream.connectors import ProxyFuture, open_store
from fxstream.ops.bench.pipeline import PipelineSettings, stage_to_future, stage_value


def test_settings_are_checked_and_the_ideals_follow_the_shape() -> None:
    settings = PipelineSettings(stages=4, seconds=2.0, overhead=0.5)
    settings.validate()
    assert settings.ideal_sequential_s() == 8.0
    assert settings.ideal_pipelined_s() == 2.0 + 3 * 1.0
    assert PipelineSettings(megabytes=10).nbytes == 10_000_000
    for bad, flag in (
        (PipelineSettings(stages=1), "--stages"),
        (PipelineSettings(seconds=0), "--seconds"),
        (PipelineSettings(overhead=1.0), "--overhead"),
        (PipelineSettings(megabytes=0), "--megabytes"),
        (PipelineSettings(repeats=0), "--repeats"),
    ):
        with pytest.raises(ValueError, match=flag):
            bad.validate()


def test_a_stage_overlaps_its_start_up_with_the_stage_before(tmp_path: Path) -> None:
    future = ProxyFuture.create(open_store(f"file://{tmp_path}/store"), timeout_s=30)
    ended: dict[str, float] = {}

    def run(name: str, *args: Any) -> None:
        stage_to_future(*args)
        ended[name] = time.monotonic()

    started = time.monotonic()
    first = threading.Thread(target=run, args=("first", None, 2.0, 0.5, 800, future))
    second = threading.Thread(target=run, args=("second", future.proxy(), 2.0, 0.5, 800, None))
    second.start()
    first.start()
    first.join(30)
    second.join(30)
    # Two stages of 2 s, half of it start-up: 3 s pipelined, not 4 s one after the other.
    assert 2.9 < ended["second"] - started < 3.6
    assert ended["second"] > ended["first"]
    assert float(stage_value(np.ones(4), 0.01, 0.5, 80).sum()) == 10.0
