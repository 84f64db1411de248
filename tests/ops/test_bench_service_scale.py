"""``fxstream bench service-scale``: its settings, and a small run end to end ending with
valid JSON.

The smoke run registers 50 endpoints on its own private platform, heartbeats them every
2 s from the simulator process and queues 500 tasks on 4 of them; it checks the JSON's
keys, that every endpoint came online, that every task was routed and is counted on the
queues (and none ran: the simulated endpoints never pull), and that the lag and RSS
figures are measured ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxstream.ops.bench.client_costs import client_costs
from fxstream.ops.bench.service_scale import (
    ServiceScaleSettings,
    broker_open_files,
    check_open_files,
)
from fxstream.ops.bench.stack import BenchError

FXSTREAM = Path(sys.executable).parent / "fxstream"


def test_settings_refuse_what_cannot_run() -> None:
    ServiceScaleSettings().validate()
    for settings, option in (
        (ServiceScaleSettings(endpoints=0), "--endpoints"),
        (ServiceScaleSettings(tasks=-1), "--tasks"),
        (ServiceScaleSettings(minutes=0), "--minutes"),
        (ServiceScaleSettings(period_s=0), "--period"),
        (ServiceScaleSettings(endpoints=4, task_endpoints=5), "--task-endpoints"),
        (
            ServiceScaleSettings(endpoints=4, task_endpoints=1, sample_endpoints=5),
            "--sample-endpoints",
        ),
        (ServiceScaleSettings(interval_s=0), "--interval"),
    ):
        with pytest.raises(ValueError, match=option):
            settings.validate()


def test_cli_refuses_a_bad_setting_before_starting_anything() -> None:
    done = subprocess.run(
        [str(FXSTREAM), "bench", "service-scale", "--endpoints", "3", "--task-endpoints", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--task-endpoints" in done.stderr


@pytest.mark.platform
@pytest.mark.timeout(600)
def test_smoke_run_prints_the_figures_as_its_last_line() -> None:
    done = subprocess.run(
        [
            str(FXSTREAM),
            "bench",
            "service-scale",
            "--endpoints",
            "50",
            "--tasks",
            "500",
            "--minutes",
            "0.5",
            "--period",
            "2",
            "--task-endpoints",
            "4",
            "--sample-endpoints",
            "5",
            "--interval",
            "2",
            "--batch",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "service-scale"
    for key in ("endpoints", "queued_tasks", "service_rss_mb", "status_lag_p99_s"):
        assert key in figures, key
    assert figures["endpoints"] == 50
    assert figures["online_at_end"] == 50
    # Every task routed and still queued: counted on the queues, none ran.
    assert figures["queued_tasks"] == 500
    assert set(figures["sampled_task_states"]) == {"routed"}, figures["sampled_task_states"]
    # The lag is measured: many observed heartbeats, each seen after it was sent.
    assert figures["status_lag_samples"] >= 20
    assert 0 < figures["status_lag_p50_s"] <= figures["status_lag_p99_s"] < 30
    assert figures["heartbeats_sent"] >= 50 and figures["heartbeat_errors"] == 0
    # RSS is sampled: the service's processes use memory, the broker is apart from it.
    assert 50 < figures["service_rss_mb"] < 10_000
    assert figures["rss_peak_mb"]["service api"] > 0
    assert any(label.startswith("kafka node") for label in figures["rss_peak_mb"])


def test_client_costs_count_the_partitions_each_round_carries() -> None:
    small, large = client_costs(50, repeats=1), client_costs(500, repeats=1)
    # tasks.ep has 4 partitions, from.ep (all the ingress reads) 1.
    assert small["cluster_partitions"] == 50 * 5 and small["ingress_partitions"] == 50
    assert large["ingress_partitions"] == 500
    # Ten times the endpoints: about ten times the bytes of each message.
    assert 9 < large["metadata_bytes"] / small["metadata_bytes"] < 11
    assert 9 < large["fetch_request_bytes"] / small["fetch_request_bytes"] < 11
    assert small["metadata_s"] > 0 and small["fetch_round_s"] > 0
    # The pattern's metadata covers every topic at 4 partitions each: 8 times the
    # partitions and twice the topic names of the ingress's subscribed from.ep topics,
    # about 4 times the bytes (the names are most of them). Bytes, not seconds: a timing
    # comparison fails whenever the machine is busy.
    assert 3 < large["pattern_metadata_bytes"] / large["metadata_bytes"] < 6
    assert large["pattern_metadata_s"] > 0


def test_the_bench_refuses_more_endpoints_than_the_brokers_open_files_allow() -> None:
    """A broker past its open-file limit dies with "Too many open files" mid-registration
    (seen at 20,000 here): the bench says so first, with a remedy that fits the limit."""
    check_open_files(1_000, broker_open_files(1_000))  # enough: nothing raised
    with pytest.raises(BenchError) as refused:
        check_open_files(10_000, 20_000)
    message = str(refused.value)
    assert "ulimit -Hn" in message and "20,000" in message
    most = int(message.rsplit("--endpoints ", 1)[1].split()[0])
    check_open_files(most, 20_000)  # the remedy it names fits
    with pytest.raises(BenchError):
        check_open_files(most + 1, 20_000)
