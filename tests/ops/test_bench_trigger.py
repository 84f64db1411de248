"""``fxstream bench trigger``: its settings, and a tiny run end to end ending with valid JSON.

The smoke run starts its own private platform, a file watcher process, a rule and a
subscription, as the full bench does, with a handful of steady files and a small burst;
it checks the JSON's keys, that no file was lost (each file's result came once), and the
burst's CPU accounting per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxstream.ops.bench.trigger import TriggerSettings, analyse

FXSTREAM = Path(sys.executable).parent / "fxstream"


def test_settings_refuse_what_cannot_run() -> None:
    TriggerSettings().validate()
    for settings, option in (
        (TriggerSettings(steady_files=-1), "--steady-files"),
        (TriggerSettings(steady_files=0, burst_files=0), "at least one file"),
        (TriggerSettings(rate=0), "--rate"),
        (TriggerSettings(burst_s=0), "--burst-seconds"),
        (TriggerSettings(file_bytes=0), "--file-bytes"),
        (TriggerSettings(warmup_files=0), "--warmup-files"),
        (TriggerSettings(idle_timeout_s=0), "--idle-timeout"),
        (TriggerSettings(warmup_tasks=-1), "--warmup-tasks"),
    ):
        with pytest.raises(ValueError, match=option):
            settings.validate()


def test_the_analysis_reads_the_file_the_event_names(tmp_path: Path) -> None:
    path = tmp_path / "frame.dat"
    path.write_bytes(bytes([2, 4]))
    answer = analyse({"attributes": {"path": str(path)}, "occurred_at": 5.0})
    assert answer["path"] == str(path) and answer["bytes"] == 2
    assert answer["mean"] == 3.0 and answer["event_at"] == 5.0


def test_cli_refuses_a_bad_setting_before_starting_anything() -> None:
    done = subprocess.run(
        [str(FXSTREAM), "bench", "trigger", "--rate", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--rate" in done.stderr


@pytest.mark.platform
@pytest.mark.timeout(600)
def test_smoke_run_prints_the_figures_as_its_last_line() -> None:
    done = subprocess.run(
        [
            str(FXSTREAM),
            "bench",
            "trigger",
            "--steady-files",
            "10",
            "--rate",
            "10",
            "--burst-files",
            "40",
            "--burst-seconds",
            "0.2",
            "--warmup-files",
            "2",
            "--idle-timeout",
            "30",
            "--warmup-tasks",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "trigger"
    for key in ("p50_ms", "p99_ms", "files", "lost", "burst_files", "burst_drain_s"):
        assert key in figures, key
    assert figures["files"] == 50 and figures["burst_files"] == 40
    assert figures["lost"] == 0 and figures["failed"] == 0, figures["failures"]
    assert figures["received"] == 50
    assert 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert figures["burst_drain_s"] is not None and figures["burst_drain_s"] >= 0
    assert set(figures["hops_p50_ms"]) == {"steady", "burst"}
    assert figures["warmup_tasks"] == 50
    # Each phase's CPU per file, by process: the watcher (its own process, named as an
    # extra root), the broker and this bench's own process each spent some.
    for phase in ("steady", "burst"):
        per_file = figures[f"{phase}_cpu_us_per_file"]
        assert "file watcher" in per_file and "kafka node 1" in per_file, per_file
        assert "sdk (this bench)" in per_file, per_file
        assert figures[f"{phase}_cpu_us_per_file_total"] == sum(per_file.values())
        assert figures[f"{phase}_cap_files_per_s"] > 0
    assert 0 < figures["steady_cpu_busy"] <= 1.0
    assert "CPU per file on" in done.stdout and "burst µs / file" in done.stdout
