"""The supervisor with real child processes: restarts with backoff, crash loops, holds, stop by PID.

The children are small Python programs (no broker needed); the supervisor runs as
``./fx up`` runs it, a process of its own started from a spec file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from fxstream.ops.process import ManagedProcess
from fxstream.ops.supervisor import ChildSpec, SupervisedProcess, SupervisorSpec, read_states

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
CRASHER = [sys.executable, "-c", "import sys; sys.exit(3)"]


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not true within {timeout_s:.0f} s: {what}"
        time.sleep(0.05)


class Supervised:
    """A supervisor started from a spec in ``home``, with handles on its children."""

    def __init__(self, home: Path, children: list[ChildSpec], **settings: float) -> None:
        self.state_dir = home / "services"
        self.state_dir.mkdir(parents=True)
        spec_file = home / "spec.json"
        SupervisorSpec(str(self.state_dir), children, **settings).save(spec_file)  # type: ignore[arg-type]
        self.supervisor = ManagedProcess(
            name="supervisor",
            argv=[sys.executable, "-m", "fxstream.ops.supervisor", str(spec_file)],
            pid_file=self.state_dir / "supervisor.pid",
            log_file=home / "supervisor.log",
            die_with_parent=True,
        )
        self.children = {
            c.key: SupervisedProcess(
                c.name, c.key, c.argv, Path(c.log_file), self.state_dir, self.supervisor
            )
            for c in children
        }

    def child(self, key: str) -> SupervisedProcess:
        return self.children[key]


def _child(home: Path, key: str, argv: list[str], wave: int = 0) -> ChildSpec:
    return ChildSpec(
        name=key, key=key, argv=argv, log_file=str(home / f"{key}.log"), stop_wave=wave
    )


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[Callable[..., Supervised]]:
    made: list[Supervised] = []

    def make(children: list[ChildSpec], **settings: float) -> Supervised:
        s = Supervised(tmp_path, children, **settings)
        s.supervisor.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.supervisor.stop(timeout_s=30)
        for child in s.children.values():
            child.stop(timeout_s=5)


def test_a_child_killed_with_sigkill_is_restarted_and_the_restart_recorded(
    tmp_path: Path, supervised: Callable[..., Supervised]
) -> None:
    s = supervised([_child(tmp_path, "sleeper", SLEEPER)], backoff_s=0.2)
    child = s.child("sleeper")
    wait_until(lambda: child.pid() is not None, "the child started")
    first = child.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: child.pid() not in (None, first), "the child was restarted")
    wait_until(lambda: (child.state() or _NO).restarts == 1, "the restart was recorded")
    state = child.state()
    assert state is not None
    assert state.last_exit_code == -signal.SIGKILL
    assert state.last_restart_at is not None and state.last_restart_at > time.time() - 30
    assert state.state == "running" and not state.crash_looping


def test_a_child_that_keeps_crashing_backs_off_and_is_crash_looping(
    tmp_path: Path, supervised: Callable[..., Supervised]
) -> None:
    s = supervised(
        [_child(tmp_path, "crasher", CRASHER), _child(tmp_path, "sleeper", SLEEPER)],
        backoff_s=0.2,
        backoff_max_s=0.8,
        crash_loop_after=3,
    )
    crasher, sleeper = s.child("crasher"), s.child("sleeper")
    wait_until(lambda: sleeper.pid() is not None, "the healthy child started")
    healthy_pid = sleeper.pid()
    started = time.monotonic()
    wait_until(lambda: (crasher.state() or _NO).restarts >= 4, "four restarts")
    elapsed = time.monotonic() - started
    state = crasher.state()
    assert state is not None
    assert state.crash_looping and state.last_exit_code == 3
    # Backoff 0.2 + 0.4 + 0.8 (+ 0.8, bounded) s: neither immediate nor unbounded.
    assert elapsed >= 1.2, elapsed
    assert state.next_start_in_s is None or state.next_start_in_s <= 0.8
    # The crashing child never disturbed the other one.
    assert sleeper.pid() == healthy_pid
    assert not (sleeper.state() or _NO).crash_looping


def test_the_backoff_resets_after_a_stable_run(
    tmp_path: Path, supervised: Callable[..., Supervised]
) -> None:
    s = supervised([_child(tmp_path, "sleeper", SLEEPER)], backoff_s=0.2, stable_s=1.0)
    child = s.child("sleeper")
    for _ in range(3):
        wait_until(lambda: child.pid() is not None, "the child runs")
        assert child.kill()
    wait_until(lambda: (child.state() or _NO).crash_looping, "three exits in a row")
    wait_until(lambda: not (child.state() or _NO).crash_looping, "stable again after 1 s")
    state = child.state()
    assert state is not None and state.exits_in_a_row == 0 and state.restarts == 3


def test_a_held_child_stays_stopped_until_started_and_sigterm_stops_every_child(
    tmp_path: Path, supervised: Callable[..., Supervised]
) -> None:
    s = supervised(
        [_child(tmp_path, "first", SLEEPER), _child(tmp_path, "last", SLEEPER, wave=1)],
        backoff_s=0.2,
    )
    first, last = s.child("first"), s.child("last")
    wait_until(lambda: first.pid() is not None and last.pid() is not None, "both started")
    assert first.stop(timeout_s=10)
    time.sleep(1.0)
    assert first.pid() is None, "a child held stopped was restarted"
    assert (first.state() or _NO).state == "held"
    assert (first.state() or _NO).restarts == 0
    pid = first.start(timeout_s=10)
    assert first.pid() == pid
    assert (first.state() or _NO).restarts == 0, "a start asked for is not a restart"

    pids = [first.pid(), last.pid()]
    assert s.supervisor.stop(timeout_s=30)
    assert not any(p is not None and psutil.pid_exists(p) for p in pids), "a child survived"
    states = read_states(s.state_dir)
    assert {k: v.state for k, v in states.items()} == {"first": "held", "last": "held"}


def test_start_says_what_to_do_when_the_supervisor_is_not_running(tmp_path: Path) -> None:
    from fxstream.ops.process import ProcessStartError

    s = Supervised(tmp_path, [_child(tmp_path, "sleeper", SLEEPER)])
    with pytest.raises(ProcessStartError, match=r"supervisor is not running.*\./fx up"):
        s.child("sleeper").start(timeout_s=1)


class _NoState:
    restarts = 0
    crash_looping = False
    state = ""
    exits_in_a_row = 0


_NO = _NoState()


def test_status_flags_a_crash_looping_service_process_as_unhealthy(tmp_path: Path) -> None:
    """What ``./fx status`` shows from the supervisor's record of a crash-looping router."""
    from fxstream.ops.private import private_config
    from fxstream.ops.services import ServiceSet

    services = ServiceSet(private_config(tmp_path))
    services.state_dir.mkdir(parents=True)
    services.credentials_file.write_text("{}")
    looping = {
        "name": "router",
        "state": "backoff",
        "restarts": 7,
        "exits_in_a_row": 4,
        "crash_looping": True,
        "last_exit_code": 75,
        "last_restart_at": 1_700_000_000.0,
    }
    (services.state_dir / "supervisor.json").write_text(
        json.dumps({"supervisor_pid": 0, "children": {"router": looping}})
    )
    found = {c.name: c for c in services.status(expected=True)}
    router = found["router"]
    assert not router.healthy and router.crash_looping
    assert (router.restarts, router.last_exit_code) == (7, 75)
    assert "crash-looping: exited 4 times in a row, last exit code 75" in router.detail
    assert str(services.router.log_file) in router.detail
    assert not found["supervisor"].healthy and found["supervisor"].detail == "not running"


def test_each_instance_of_a_scaled_out_processor_is_its_own_supervised_process(
    tmp_path: Path,
) -> None:
    """``router_instances = 2`` (and the like): one child per instance, each with its own
    ``--instance``, log and PID file, and ``./fx status`` lists each."""
    from fxstream.ops.private import private_config
    from fxstream.ops.services import ServiceSet

    config = private_config(tmp_path).with_overrides(router_instances=2, task_state_instances=3)
    services = ServiceSet(config)
    children = {c.key: c for c in services.supervisor_spec().children}
    routers = [children["router"], children["router-1"]]
    assert "--instance" not in routers[0].argv
    assert routers[1].argv[-3:] == ["router", "--instance", "1"]
    assert children["task-state-2"].argv[-3:] == ["task-state", "--instance", "2"]
    assert "router-2" not in children and "ingress-1" not in children
    assert len({c.log_file for c in children.values()}) == len(children)
    assert [p.name for p in services.instances["router"]] == ["router", "router-1"]
    assert services.router is services.instances["router"][0]
    assert (
        len(services.processors()) == 2 + 1 + 3 + 1 + 1 + 1 + 1
    )  # ... trigger, dependencies, analytics
    services.state_dir.mkdir(parents=True)
    services.credentials_file.write_text("{}")
    names = [c.name for c in services.status(expected=True)]
    assert [n for n in names if n.startswith(("router", "ingress", "task-state"))] == [
        "router",
        "router-1",
        "ingress",
        "task-state",
        "task-state-1",
        "task-state-2",
    ]
