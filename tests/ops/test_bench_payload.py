"""``fxstream bench payload`` runs end to end on tiny sizes and ends with valid JSON.

The smoke run starts its own private platform (broker, Redis, service, local endpoint),
a Dask LocalCluster, Parsl's HTEX and a local Ray runtime, as the full bench does, with
two sizes (one inline, one by reference), one repeat each, one warm-up trip of each kind
and a two-size threshold sweep, so CI checks the whole bench; its time is mostly the
starts (platform, the endpoint restarted twice by the sweep, Dask's cluster, Parsl's
pool, Ray's runtime).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxstream.ops.bench.payload import PayloadSettings, default_repeats, parse_size

FXSTREAM = Path(sys.executable).parent / "fxstream"


def test_size_labels_are_decimal_units() -> None:
    assert [parse_size(label) for label in ("10kB", "1MB", "1GB", "512B")] == [
        10_000,
        1_000_000,
        1_000_000_000,
        512,
    ]
    for bad in ("10 KB", "1.5MB", "0kB", "MB", "10mb"):
        with pytest.raises(ValueError, match=r"e\.g\. 10kB"):
            parse_size(bad)


def test_repeats_fall_with_size_unless_given() -> None:
    sizes = ("1MB", "10MB", "100MB", "1GB")
    assert [default_repeats(parse_size(s)) for s in sizes] == [10, 5, 3, 2]
    assert PayloadSettings(repeats=4).repeats_of(1_000_000_000) == 4


def test_settings_refuse_what_cannot_run() -> None:
    for settings in (
        PayloadSettings(sizes=()),
        PayloadSettings(sizes=("10kB", "10kB")),
        PayloadSettings(repeats=0),
        PayloadSettings(time_limit_s=0),
        PayloadSettings(sweep_sizes=("64 kB",)),
        PayloadSettings(store_url="s3://bucket"),
    ):
        with pytest.raises(ValueError):
            settings.validate()


def test_cli_refuses_a_bad_size_before_starting_anything() -> None:
    done = subprocess.run(
        [str(FXSTREAM), "bench", "payload", "--sizes", "10KB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "10KB" in done.stderr and "e.g. 10kB" in done.stderr


def test_smoke_run_prints_the_figures_as_its_last_line() -> None:
    done = subprocess.run(
        [
            str(FXSTREAM),
            "bench",
            "payload",
            "--sizes",
            "10kB,1MB",
            "--repeats",
            "1",
            "--sweep-sizes",
            "32kB,256kB",
            "--sweep-repeats",
            "1",
            "--time-limit",
            "60",
            # One untimed trip of each kind (inline, by reference): the warm-up's paths.
            "--warmup-small",
            "1",
            "--warmup-large",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "payload"
    assert figures["failures"] == {}
    assert figures["warmup_trips"] == {"1kB": 1, "1MB": 1}
    for system in ("fxstream_ms", "dask_ms", "htex_ms", "ray_ms"):
        assert set(figures[system]) == {"10kB", "1MB"}
        assert all(ms > 0 for ms in figures[system].values()), (system, figures[system])
    assert figures["ratio_10MB_vs_dask"] is None  # 10MB was not measured
    assert figures["agent_peak_rss_mb"] > 0
    assert figures["worker_peak_rss_mb"] > 0
    assert figures["ray_process_peak_rss_mb"] > 0
    assert set(figures["sweep_faster"]) == {"32kB", "256kB"}
    assert set(figures["sweep_faster"].values()) <= {"inline", "reference"}
    assert figures["suggested_threshold_bytes"] in (32_000, 256_000)
