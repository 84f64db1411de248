"""The platform's supervisor: runs the service processes, restarts a crashed one with backoff.

``./fx up`` starts one supervisor per platform home (itself a process tracked
by PID, like the broker); the supervisor starts the REST API, the router, the
task-state processor, the liveness processor and the local endpoint as its
children, each its own OS process, so one crash cannot take the others down.

- A child that exits without being asked to (a crash, a SIGKILL, exit 75 when
  the broker failed) is restarted after an exponential backoff: 1 s, 2 s,
  4 s, ... up to ``backoff_max_s``; once a child has run ``stable_s`` seconds
  the backoff starts again from 1 s. ``crash_loop_after`` exits in a row
  without such a stable run make the child *crash-looping* (``./fx status``
  reports it unhealthy).
- Files in the state dir (``<home>/services``): ``<key>.pid`` (PID and start
  time, as :class:`~fxstream.ops.process.ManagedProcess` writes them) for each
  running child; ``<key>.hold`` while a child is held stopped (by
  :meth:`SupervisedProcess.stop`), so its exit is not a crash;
  ``supervisor.json``: per child its state, restarts, last exit code and the
  time of the last restart.
- Metrics (docs/metrics.md): with ``metrics`` on (the default), the supervisor serves its
  own ``/metrics`` on a free port of 127.0.0.1 (``fxstream_process_restarts_total{role}``,
  ``fxstream_process_up{role}``, ``fxstream_process_crash_looping{role}``), and gives
  each child whose spec asks for it (the processors, the local endpoint) a free port in
  ``FXSTREAM_METRICS_PORT``, chosen once and kept across restarts; ``supervisor.json``
  records every port (``metrics_port``), which ``./fx status`` lists and reads.
- SIGUSR1 makes it start at once every child that is neither running nor
  held (``SupervisedProcess.start``). SIGTERM or SIGINT stops the children by
  PID (the endpoint first, then the processors, then the API: SIGTERM, then
  SIGKILL after ``stop_timeout_s``) and then the supervisor. Children get
  SIGTERM from the kernel if the supervisor itself dies.

Run: ``python -m fxstream.ops.supervisor <home>/services/supervisor-spec.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import FrameType

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fxstream.ops.process import ManagedProcess, ProcessStartError, tail, terminate_with_parent

__all__ = [
    "STATE_FILE",
    "ChildSpec",
    "ChildState",
    "ChildrenCollector",
    "SupervisedProcess",
    "Supervisor",
    "SupervisorSpec",
    "free_port",
    "main",
    "read_metrics_port",
    "read_states",
]

log = logging.getLogger("fxstream.supervisor")

STATE_FILE = "supervisor.json"
METRICS_PORT_ENV = "FXSTREAM_METRICS_PORT"
_TICK_S = 0.1


@dataclass(frozen=True)
class ChildSpec:
    """One supervised process: what to run and where its files are."""

    name: str
    key: str
    argv: list[str]
    log_file: str
    # Added to the supervisor's own environment.
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    # Higher waves are stopped first (the endpoint before the processors before the API).
    stop_wave: int = 0
    # Give it a metrics port (FXSTREAM_METRICS_PORT) when the supervisor's metrics are on.
    metrics: bool = False


@dataclass(frozen=True)
class SupervisorSpec:
    """What the supervisor runs and how it restarts (written by ``ServiceSet``)."""

    state_dir: str
    children: list[ChildSpec]
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_s: float = 60.0
    stop_timeout_s: float = 60.0
    crash_loop_after: int = 3
    # Serve the supervisor's metrics and give the children that ask a metrics port.
    metrics: bool = True

    def save(self, path: Path) -> None:
        """Write the spec as JSON."""
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> SupervisorSpec:
        """Read a spec written by :meth:`save`."""
        raw = json.loads(path.read_text())
        children = [ChildSpec(**child) for child in raw.pop("children")]
        return cls(children=children, **raw)


@dataclass
class ChildState:
    """What the supervisor knows of one child (``supervisor.json``)."""

    name: str
    state: str = "starting"  # running | backoff | held | starting
    pid: int | None = None
    restarts: int = 0
    exits_in_a_row: int = 0
    crash_looping: bool = False
    last_exit_code: int | None = None
    last_exit_at: float | None = None
    last_restart_at: float | None = None
    next_start_in_s: float | None = None
    metrics_port: int | None = None


def read_metrics_port(state_dir: Path) -> int | None:
    """The port of the supervisor's own ``/metrics`` (None if it serves none)."""
    try:
        raw = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    port = raw.get("metrics_port") if isinstance(raw, dict) else None
    return port if isinstance(port, int) else None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ChildrenCollector(Collector):
    """The supervisor's series: per child its restarts, whether it runs, crash-looping."""

    def __init__(self, children: list[_Child]) -> None:
        """Read ``children`` (the supervisor's own list) at each scrape."""
        self._children = children

    def collect(self) -> Iterable[Metric]:
        """The children's series as they are now."""
        restarts = CounterMetricFamily(
            "fxstream_process_restarts",
            "Times the supervisor restarted a service process after it exited unasked",
            labels=["role"],
        )
        up = GaugeMetricFamily(
            "fxstream_process_up", "1 while the service process runs", labels=["role"]
        )
        looping = GaugeMetricFamily(
            "fxstream_process_crash_looping",
            "1 while the process keeps exiting without a stable run",
            labels=["role"],
        )
        for child in list(self._children):
            key = child.spec.key
            restarts.add_metric([key], child.status.restarts)
            up.add_metric([key], 1.0 if child.status.state == "running" else 0.0)
            looping.add_metric([key], 1.0 if child.status.crash_looping else 0.0)
        yield from (restarts, up, looping)


def read_states(state_dir: Path) -> dict[str, ChildState]:
    """The children's states as the supervisor last wrote them (empty if it never ran)."""
    try:
        raw = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    children = raw.get("children", {}) if isinstance(raw, dict) else {}
    known = {f.name for f in fields(ChildState)}
    return {
        key: ChildState(**{k: v for k, v in value.items() if k in known})
        for key, value in children.items()
    }


@dataclass
class _Child:
    spec: ChildSpec
    status: ChildState
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    next_start_at: float | None = None


class Supervisor:
    """Starts the children, restarts crashed ones with backoff, stops them all on SIGTERM."""

    def __init__(self, spec: SupervisorSpec) -> None:
        self.spec = spec
        self.state_dir = Path(spec.state_dir)
        self._children = [_Child(c, ChildState(name=c.name)) for c in spec.children]
        self._stopping = False
        self._wake = False
        self._metrics_port: int | None = None

    # --- files -----------------------------------------------------------------------

    def _pid_file(self, child: _Child) -> Path:
        return self.state_dir / f"{child.spec.key}.pid"

    def _held(self, child: _Child) -> bool:
        return (self.state_dir / f"{child.spec.key}.hold").exists()

    def _save(self) -> None:
        now = time.monotonic()
        for child in self._children:
            at = child.next_start_at
            child.status.next_start_in_s = None if at is None else round(max(0.0, at - now), 1)
            child.status.crash_looping = child.status.exits_in_a_row >= self.spec.crash_loop_after
        body = {
            "supervisor_pid": os.getpid(),
            "updated_at": time.time(),
            "metrics_port": self._metrics_port,
            "children": {c.spec.key: asdict(c.status) for c in self._children},
        }
        target = self.state_dir / STATE_FILE
        temporary = target.with_suffix(".tmp")
        temporary.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(temporary, target)

    # --- running ---------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until SIGTERM or SIGINT; returns the exit status."""
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_wake)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.metrics:
            self._serve_metrics()
        for child in self._children:
            if self._held(child):
                child.status.state = "held"
            else:
                self._start(child, restart=False)
        self._save()
        while not self._stopping:
            changed = False
            wake, self._wake = self._wake, False
            for child in self._children:
                changed |= self._check(child, wake)
            if changed:
                self._save()
            time.sleep(_TICK_S)
        self._stop_all()
        self._save()
        return 0

    def _serve_metrics(self) -> None:
        """Serve the supervisor's series on a free port; pick each child's port."""
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(ChildrenCollector(self._children))
        try:
            port = free_port()
            start_http_server(port, addr="127.0.0.1", registry=registry)
            self._metrics_port = port
        except OSError as exc:
            log.warning("no metrics server for the supervisor: %s", exc)
        for child in self._children:
            if child.spec.metrics:
                child.status.metrics_port = free_port()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def _on_wake(self, signum: int, frame: FrameType | None) -> None:
        self._wake = True

    def _check(self, child: _Child, wake: bool) -> bool:
        """Look at one child; True if its state changed."""
        now = time.monotonic()
        if child.popen is not None:
            code = child.popen.poll()
            if code is None:
                stable = now - child.started_at >= self.spec.stable_s
                if child.status.exits_in_a_row and stable:
                    log.info("%s: ran %.0f s; backoff reset", child.spec.name, self.spec.stable_s)
                    child.status.exits_in_a_row = 0
                    return True
                return False
            self._exited(child, code, now)
            return True
        if self._held(child):
            if child.status.state != "held":
                child.status.state, child.next_start_at = "held", None
                return True
            return False
        if child.status.state == "held":  # released: start now, not a restart
            self._start(child, restart=False)
            return True
        due = child.next_start_at is not None and now >= child.next_start_at
        if wake or due:
            self._start(child, restart=True)
            return True
        return False

    def _exited(self, child: _Child, code: int, now: float) -> None:
        child.popen = None
        self._pid_file(child).unlink(missing_ok=True)
        status = child.status
        status.pid, status.last_exit_code, status.last_exit_at = None, code, time.time()
        if self._held(child):
            log.info("%s exited (code %d) as asked; held stopped", child.spec.name, code)
            status.state, child.next_start_at = "held", None
            return
        status.exits_in_a_row += 1
        delay = min(self.spec.backoff_max_s, self.spec.backoff_s * 2 ** (status.exits_in_a_row - 1))
        status.state, child.next_start_at = "backoff", now + delay
        log.warning(
            "%s exited unexpectedly (%s), %d in a row; restarting in %.1f s",
            child.spec.name,
            _describe_exit(code),
            status.exits_in_a_row,
            delay,
        )

    def _start(self, child: _Child, *, restart: bool) -> None:
        spec = child.spec
        log_file = Path(spec.log_file)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        why = "restarting" if restart else "starting"
        with log_file.open("ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"\n=== {stamp} {why} {spec.name} (supervised)\n".encode())
            out.flush()
            try:
                popen = subprocess.Popen(
                    spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=spec.cwd,
                    env={**os.environ, **spec.env, **self._metrics_env(child)},
                    start_new_session=True,
                    # Stopped by the kernel if the supervisor dies: never an orphan.
                    preexec_fn=terminate_with_parent,
                )
            except OSError as exc:
                log.error("cannot start %s: %s", spec.name, exc)
                self._exited(child, 127, time.monotonic())
                return
        child.popen, child.started_at, child.next_start_at = popen, time.monotonic(), None
        with contextlib.suppress(psutil.NoSuchProcess):
            started = psutil.Process(popen.pid).create_time()
            self._pid_file(child).write_text(f"{popen.pid} {started!r}\n")
        child.status.state, child.status.pid = "running", popen.pid
        if restart:
            child.status.restarts += 1
            child.status.last_restart_at = time.time()
        log.info("%s %s (pid %d)", why, spec.name, popen.pid)

    @staticmethod
    def _metrics_env(child: _Child) -> dict[str, str]:
        port = child.status.metrics_port
        return {METRICS_PORT_ENV: str(port)} if port else {}

    def _stop_all(self) -> None:
        """Stop the children by PID, wave by wave (highest first)."""
        for wave in sorted({c.spec.stop_wave for c in self._children}, reverse=True):
            running = [c for c in self._children if c.spec.stop_wave == wave and c.popen]
            for child in running:
                assert child.popen is not None
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_timeout_s
            for child in running:
                assert child.popen is not None
                try:
                    child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s ignored SIGTERM; killing it", child.spec.name)
                    child.popen.kill()
                    child.popen.wait(timeout=10)
                log.info("stopped %s (exit code %s)", child.spec.name, child.popen.returncode)
                child.status.last_exit_code = child.popen.returncode
                child.status.pid, child.status.state, child.popen = None, "held", None
                self._pid_file(child).unlink(missing_ok=True)


@dataclass
class SupervisedProcess:
    """A handle on one supervised child, with :class:`ManagedProcess`'s methods.

    The supervisor owns the child's PID file; this handle only reads it.
    ``stop`` holds the child stopped (its exit is not a crash), ``start``
    releases it and asks the supervisor to start it now, ``kill`` SIGKILLs it
    without a hold (fault injection: the supervisor restarts it).
    """

    name: str
    key: str
    argv: list[str]
    log_file: Path
    state_dir: Path
    supervisor: ManagedProcess
    env_overrides: dict[str, str] = field(default_factory=dict)

    @property
    def pid_file(self) -> Path:
        """Where the supervisor records the child's PID and start time."""
        return self.state_dir / f"{self.key}.pid"

    @property
    def hold_file(self) -> Path:
        """Present while the child is held stopped."""
        return self.state_dir / f"{self.key}.hold"

    @property
    def env(self) -> dict[str, str]:
        """The child's environment (the caller's plus the overrides)."""
        return {**os.environ, **self.env_overrides}

    def pid(self) -> int | None:
        """The PID if the child runs, else None."""
        try:
            pid_text, started_text = self.pid_file.read_text().split()
            pid, started = int(pid_text), float(started_text)
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                return pid
        except (OSError, ValueError, psutil.Error):
            return None
        return None

    def is_running(self) -> bool:
        """True while the child is alive."""
        return self.pid() is not None

    def state(self) -> ChildState | None:
        """What the supervisor last recorded of the child."""
        return read_states(self.state_dir).get(self.key)

    def start(self, timeout_s: float = 60.0) -> int:
        """Release the hold and have the supervisor start the child now; return its PID."""
        self.hold_file.unlink(missing_ok=True)
        existing = self.pid()
        if existing is not None:
            return existing
        supervisor = self.supervisor.pid()
        if supervisor is None:
            raise ProcessStartError(
                f"cannot start {self.name}: its supervisor is not running; start the platform "
                "with ./fx up"
            )
        os.kill(supervisor, signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.pid()
            if pid is not None:
                return pid
            time.sleep(0.05)
        raise ProcessStartError(f"the supervisor did not start {self.name} in {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Hold the child stopped and stop it by PID (SIGTERM, then SIGKILL after
        ``timeout_s``). True if it was running."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.hold_file.touch()
        return _signal_and_wait(self.pid(), timeout_s)

    def kill(self) -> bool:
        """SIGKILL without a hold (fault injection); True if it was running."""
        return _signal_and_wait(self.pid(), 0.0)

    def check_alive(self) -> None:
        """Raise :class:`ProcessStartError` with the log's tail if the child cannot run:
        its supervisor is gone, or it is crash-looping."""
        state = self.state()
        if self.supervisor.pid() is None:
            problem = "its supervisor is not running"
        elif state is not None and state.crash_looping:
            problem = f"it is crash-looping ({_describe_exit(state.last_exit_code or 0)})"
        else:
            return
        raise ProcessStartError(
            f"{self.name} cannot run: {problem}; last lines of {self.log_file}:\n"
            f"{tail(self.log_file)}"
        )


def _signal_and_wait(pid: int | None, timeout_s: float) -> bool:
    """SIGTERM ``pid`` and wait ``timeout_s`` (0: SIGKILL at once), then SIGKILL; True if
    it was running."""
    if pid is None:
        return False
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        if timeout_s > 0:
            proc.send_signal(signal.SIGTERM)
            # Still running after the grace period: killed below.
            with contextlib.suppress(psutil.TimeoutExpired):
                proc.wait(timeout=timeout_s)
                return True
        proc.kill()
        proc.wait(timeout=10)
    return True


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m fxstream.ops.supervisor SPEC.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fxstream.ops.supervisor SPEC.json", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s supervisor[%(process)d] %(levelname)s %(message)s"
    )
    return Supervisor(SupervisorSpec.load(Path(args[0]))).run()


if __name__ == "__main__":
    sys.exit(main())
