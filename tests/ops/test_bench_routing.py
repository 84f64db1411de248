"""``fxstream bench routing``: its settings and workload, without a platform.

The bench itself starts four private platforms (one per placement policy) and runs
thousands of tasks: it is run by hand and its figures are recorded in
docs/benchmarks.md; here only what it refuses and the workload it draws.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fxstream.ops.bench.routing import (
    DURATIONS_S,
    RoutingSettings,
    cold_start_sources,
    draw_workload,
    sleep_for,
)

FXSTREAM = Path(sys.executable).parent / "fxstream"


def test_settings_refuse_what_cannot_run() -> None:
    RoutingSettings().validate()
    for settings in (
        RoutingSettings(tasks=0),
        RoutingSettings(group_tasks=0),
        RoutingSettings(endpoints=1),
        RoutingSettings(group_endpoints=17),
        RoutingSettings(images=0),
        RoutingSettings(pool_slots=0),
    ):
        with pytest.raises(ValueError):
            settings.validate()


def test_the_workload_is_the_same_for_a_seed_and_mixes_images_and_durations() -> None:
    first = draw_workload(3_000, 10, seed=7)
    assert first == draw_workload(3_000, 10, seed=7)
    assert first != draw_workload(3_000, 10, seed=8)
    kinds = Counter(kind for kind, _ in first)
    assert sorted(kinds) == list(range(10))
    assert min(kinds.values()) > 200  # every image gets a fair share of the 3,000
    durations = Counter(duration for _, duration in first)
    assert set(durations) == set(DURATIONS_S)
    assert durations[0.01] > durations[0.05] > durations[0.2]
    assert sleep_for(0.0) == 0.0


def test_cli_refuses_a_bad_setting_before_starting_anything() -> None:
    done = subprocess.run(
        [str(FXSTREAM), "bench", "routing", "--endpoints", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--endpoints" in done.stderr


def test_cold_starts_are_split_into_placement_spread_and_restarts() -> None:
    ran = [
        # img0 lives on a (one worker), img1 on a and b (placement sent it to two).
        ("a", "img0", "h:1"),
        ("a", "img0", "h:1"),
        ("a", "img1", "h:2"),
        ("b", "img1", "h:3"),
        # img2 on b, its pool started twice there (released and started again).
        ("b", "img2", "h:4"),
        ("b", "img2", "h:5"),
        ("b", "img2", "h:5"),
    ]
    figures = cold_start_sources(ran, ["a", "b", "c"])
    assert figures["cold_starts"] == 5
    assert figures["placement_spread"] == 1  # 4 (endpoint, image) pairs for 3 images
    assert figures["restarts"] == 1  # img2's second worker on b
    assert figures["tasks_per_endpoint"] == [3, 4]
    assert figures["per_endpoint"] == [
        {"endpoint": 0, "tasks": {"img0": 2, "img1": 1}, "pool_starts": {"img0": 1, "img1": 1}},
        {"endpoint": 1, "tasks": {"img1": 1, "img2": 3}, "pool_starts": {"img1": 1, "img2": 2}},
        {"endpoint": 2, "tasks": {}, "pool_starts": {}},
    ]
