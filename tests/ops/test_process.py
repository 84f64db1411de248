"""ManagedProcess: tracked by PID and start time; test-owned processes die with their owner."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from fxstream.ops import ManagedProcess

STARTER = """
import sys
from pathlib import Path
from fxstream.ops import ManagedProcess
home = Path(sys.argv[1])
process = ManagedProcess(
    name="sleeper", argv=["sleep", "120"], pid_file=home / "p.pid",
    log_file=home / "p.log", die_with_parent=sys.argv[2] == "tied",
)
print(process.start(), flush=True)
"""


def _start_from_a_short_lived_parent(home: Path, mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", STARTER, str(home), mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout.strip())


def test_a_tied_process_stops_when_its_starter_exits(tmp_path: Path) -> None:
    pid = _start_from_a_short_lived_parent(tmp_path, "tied")
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_untied_process_outlives_its_starter_and_stops_by_pid(tmp_path: Path) -> None:
    pid = _start_from_a_short_lived_parent(tmp_path, "free")
    process = ManagedProcess(
        name="sleeper", argv=["sleep", "120"], pid_file=tmp_path / "p.pid", log_file=tmp_path / "l"
    )
    try:
        time.sleep(0.3)
        assert process.pid() == pid
        assert process.start() == pid, "start on a running process changes nothing"
    finally:
        assert process.stop(timeout_s=10)
    assert not psutil.pid_exists(pid)
    assert process.pid() is None


def test_a_reused_pid_is_not_mistaken_for_ours(tmp_path: Path) -> None:
    pid_file = tmp_path / "p.pid"
    # Our own PID with a start time that is not ours: a stale file from an earlier life.
    pid_file.write_text(f"{psutil.Process().pid} 12345.0\n")
    process = ManagedProcess(name="x", argv=["true"], pid_file=pid_file, log_file=tmp_path / "l")
    assert process.pid() is None
    assert not pid_file.exists()
