"""The real `fxstream` CLI (what ./fx runs) against the session platform."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from fxstream.ops.private import private_config
from tests.conftest import RunningPlatform

FXSTREAM = Path(sys.executable).parent / "fxstream"
# A finished task's time in task-state on the platform `up` starts here.
RETENTION_S = 2


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXSTREAM_")}
    env["FXSTREAM_HOME"] = str(home)
    return subprocess.run(
        [str(FXSTREAM), *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_status_json_reports_a_healthy_platform(kafka_platform: RunningPlatform) -> None:
    done = _cli(kafka_platform.config.home, "status", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    status = json.loads(done.stdout)
    assert status["healthy"] is True
    assert status["mode"] == "single"
    assert {c["name"] for c in status["components"]} == {"redis", "kafka node 1"}
    assert sorted(status["topics"]["present"]) == sorted(
        kafka_platform.connection.catalogue().static_topics()
    )


def test_status_of_a_stopped_platform_exits_nonzero(tmp_path: Path) -> None:
    home = tmp_path / "stopped"
    private_config(home)
    done = _cli(home, "status")
    assert done.returncode == 1
    assert "not running" in done.stdout


def test_bad_configuration_is_reported_without_a_traceback(tmp_path: Path) -> None:
    home = tmp_path / "bad"
    home.mkdir()
    (home / "fxstream.toml").write_text("redis_port = 'x'\n")
    done = _cli(home, "status")
    assert done.returncode == 2
    assert "redis_port (FXSTREAM_REDIS_PORT) must be an integer" in done.stderr
    assert "Traceback" not in done.stderr


def test_up_and_down_through_the_cli(tmp_path: Path) -> None:
    """`fxstream up` starts everything and runs the quickstart (smaller than its default:
    20 tasks and a 1 MiB round trip, still above the proxy threshold, so by reference,
    through the node-local tier: client and endpoint share this node).

    With ``task_retention_s`` set in the platform's config file, the quickstart's finished
    tasks leave task-state that long after they finished: the setting reaches the
    task-state processor through the supervisor and the processors' CLI."""
    home = tmp_path / "cli"
    private_config(home)
    with (home / "fxstream.toml").open("a") as config:
        config.write(f"task_retention_s = {RETENTION_S}\n")
    try:
        up = _cli(home, "up", "--quickstart-tasks", "20", "--quickstart-mb", "1")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "./fx down" in up.stdout
        assert "healthy" in up.stdout
        assert "20 tasks in" in up.stdout and "square(7) = 49" in up.stdout
        # `fxstream up` runs without the suite's FXSTREAM_* settings, as a user's: its
        # local endpoint shares this node, so the node-local tier carries the bytes.
        assert "1 MB argument and result by reference through the node-local tier" in up.stdout, (
            up.stdout
        )
        assert "verified" in up.stdout
        # Past the retention period, and a poll or two of the expiry after it.
        time.sleep(RETENTION_S + 4)
    finally:
        down = _cli(home, "down")
    assert down.returncode == 0
    # The task-state processor logs what its expiry did as it stops.
    log = (home / "logs" / "service-task-state.log").read_text()
    expired = [int(n) for n in re.findall(r"ExpiryStats\(looked_at=\d+, expired=(\d+)", log)]
    assert expired and expired[-1] >= 20, f"the quickstart's tasks did not expire: {expired}"
    assert "stopped kafka node 1" in down.stdout
    assert "stopped redis" in down.stdout
    assert _cli(home, "status").returncode == 1
