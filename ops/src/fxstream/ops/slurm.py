"""A real single-node Slurm cluster in a directory: munge, slurmctld and slurmd, stopped by PID.

For the batch-scheduler engine's tests and benchmarks (and for anyone who wants to try
an endpoint whose blocks are Slurm jobs on one machine). Debian's ``slurm-wlm`` 22.05
and ``munge`` are installed when missing (:func:`ensure_slurm`, as root). Everything the
cluster writes (its configuration, munge key and socket, state, spool, logs, PID files)
stays in its directory; its ports are free ones picked at start, so it never touches a
site's Slurm or another test's. Clients (``sbatch``, ``squeue``, Parsl's
``SlurmProvider``) find it through the ``SLURM_CONF`` variable in :attr:`SlurmCluster.env`.

``extra_nodes`` adds more nodes on the same machine (one more ``slurmd`` each, with its
own port, spool directory, PID and log file): ``SlurmCluster(d, extra_nodes=("localhost",))``
is a two-node cluster of ``vm`` and ``localhost``, where ``sbatch -N 2`` gets both and
MPICH's ``mpiexec -hosts localhost,vm`` starts ranks "on" each (through ``srun``, as on a
real cluster), for the MPI engine's tests. The nodes share this machine's cores: what is
tested is how work is placed, not how fast it runs.

The configuration is the one that runs on these machines: slurmctld and slurmd as root,
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none`` and a ``cgroup.conf``
with every ``Constrain*`` off (22.05 has no ``disabled`` cgroup plugin). The node
offers every core of the machine to jobs, and shares them (``OverSubscribe``), since
the tests' blocks are small.

Stopping cancels every job first and waits for its steps to end, then stops the
daemons by PID (SIGTERM, then SIGKILL), and kills any job step (``slurmstepd``) of
this cluster still alive (one that holds a file of the cluster's directory open).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fxstream.ops.install import InstallError, apt_install
from fxstream.ops.process import ManagedProcess, ProcessStartError, free_ports, tail

__all__ = [
    "SLURM_PACKAGES",
    "SlurmCluster",
    "SlurmError",
    "ensure_slurm",
    "single_node_slurm",
]

SLURM_PACKAGES: dict[str, str] = {
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "munged": "munge",
}
"""The binaries the cluster needs and the Debian packages that provide them."""


class SlurmError(RuntimeError):
    """The cluster could not start or answer; the message carries its daemons' logs."""


def _which(binary: str) -> str | None:
    found = shutil.which(binary)
    if found is not None:
        return found
    for directory in ("/usr/sbin", "/usr/bin"):
        candidate = Path(directory) / binary
        if candidate.exists():
            return str(candidate)
    return None


def ensure_slurm() -> dict[str, str]:
    """Return the Slurm and munge binaries, installing Debian's packages for those missing."""
    found: dict[str, str] = {}
    for binary, package in SLURM_PACKAGES.items():
        path = _which(binary)
        if path is None:
            apt_install(package, binary)
            path = _which(binary)
        if path is None:
            raise InstallError(f"{package!r} was installed, yet {binary} is not on PATH")
        found[binary] = path
    return found


@dataclass
class SlurmCluster:
    """One Slurm controller and one node (or more: ``extra_nodes``) on this machine, living
    in ``directory``."""

    directory: Path
    cluster_name: str = "fxstream"
    partition: str = "debug"
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory_mb: int = 4096
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    extra_nodes: tuple[str, ...] = ()
    _ports: tuple[int, ...] | None = None
    _binaries: dict[str, str] | None = None

    @property
    def conf_file(self) -> Path:
        """The cluster's ``slurm.conf`` (what ``SLURM_CONF`` names)."""
        return self.directory / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment variables a client needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf_file)}

    @property
    def log_dir(self) -> Path:
        """Where the daemons log."""
        return self.directory / "log"

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node's name: :attr:`node` first, then :attr:`extra_nodes`."""
        return (self.node, *self.extra_nodes)

    def _munge_socket(self) -> Path:
        return self.directory / "munge" / "socket"

    def _processes(self) -> list[ManagedProcess]:
        if self._binaries is None:
            self._binaries = ensure_slurm()
        binaries = self._binaries
        env = {**os.environ, **self.env}
        munge = self.directory / "munge"
        return [
            ManagedProcess(
                name="munged",
                argv=[
                    binaries["munged"],
                    "--foreground",
                    "--force",
                    f"--socket={self._munge_socket()}",
                    f"--key-file={munge / 'munge.key'}",
                    f"--log-file={self.log_dir / 'munged.log'}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--seed-file={munge / 'seed'}",
                ],
                pid_file=self.directory / "munged.managed.pid",
                log_file=self.log_dir / "munged.out",
                env=env,
            ),
            ManagedProcess(
                name="slurmctld",
                argv=[binaries["slurmctld"], "-D", "-f", str(self.conf_file)],
                pid_file=self.directory / "slurmctld.managed.pid",
                log_file=self.log_dir / "slurmctld.out",
                env=env,
            ),
            *(
                ManagedProcess(
                    name="slurmd" if node == self.node else f"slurmd-{node}",
                    argv=[binaries["slurmd"], "-D", "-f", str(self.conf_file), "-N", node],
                    pid_file=self.directory
                    / ("slurmd.managed.pid" if node == self.node else f"slurmd-{node}.managed.pid"),
                    log_file=self.log_dir
                    / ("slurmd.out" if node == self.node else f"slurmd-{node}.out"),
                    env=env,
                )
                for node in self.nodes
            ),
        ]

    def _write_config(self) -> None:
        if self._ports is None:
            self._ports = tuple(free_ports(1 + len(self.nodes)))
        controller_port, node_port, *extra_ports = self._ports
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        # munged wants its key owner-only, and refuses a world-writable key directory.
        key = self.directory / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
            key.chmod(0o400)
        d = self.directory
        many = bool(self.extra_nodes)
        for node in self.nodes if many else ():
            (d / "spool" / node).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.conf_file.write_text(
            "\n".join(
                [
                    f"ClusterName={self.cluster_name}",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={controller_port}",
                    f"SlurmdPort={node_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self._munge_socket()}",
                    f"StateSaveLocation={d / 'state'}",
                    # Several slurmd on one machine: each its own spool, PID and log (%n).
                    f"SlurmdSpoolDir={d / 'spool' / '%n' if many else d / 'spool'}",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / ('slurmd-%n.pid' if many else 'slurmd.pid')}",
                    f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.log_dir / ('slurmd-%n.log' if many else 'slurmd.log')}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    # A node that was down (the previous run's) comes back by itself.
                    "ReturnToService=2",
                    "MpiDefault=none",
                    # Jobs are small here: find new ones quickly. An ended job stays listed
                    # (squeue) for MinJobAge's default 300 s: without accounting, that is
                    # how Parsl's SlurmProvider learns a block was cancelled.
                    "SchedulerParameters=sched_interval=2",
                    "KillWait=5",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} "
                    f"RealMemory={self.memory_mb} State=UNKNOWN",
                    *(
                        f"NodeName={node} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                        f"RealMemory={self.memory_mb} State=UNKNOWN"
                        for node, port in zip(self.extra_nodes, extra_ports, strict=True)
                    ),
                    f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE "
                    "State=UP OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        (self.directory / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\n"
            "ConstrainSwapSpace=no\nConstrainDevices=no\n"
        )

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the configuration, start munge, the controller and the node, and wait
        until the node is idle; :class:`SlurmError` with the daemons' logs if not."""
        if os.geteuid() != 0:
            raise SlurmError(
                "a single-node Slurm cluster needs root here (slurmd runs each job as its "
                "user): run as root, or point the engine at your site's Slurm instead"
            )
        self._write_config()
        processes = self._processes()
        try:
            processes[0].start()
            self._wait_for(
                processes[:1], lambda: self._munge_socket().exists(), timeout_s, "munged's socket"
            )
            for process in processes[1:]:
                process.start()
            self._wait_for(processes, self._node_ready, timeout_s, "the node to be idle")
        except (ProcessStartError, SlurmError):
            self.stop()
            raise

    def _wait_for(
        self,
        started: list[ManagedProcess],
        ready: Callable[[], bool],
        timeout_s: float,
        what: str,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in started:
                if not process.is_running():
                    raise SlurmError(
                        f"{process.name} exited while waiting for {what}:\n{self.logs()}"
                    )
            if ready():
                return
            time.sleep(0.3)
        raise SlurmError(f"Slurm: no {what} after {timeout_s:.0f} s:\n{self.logs()}")

    def _client(self, *argv: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def _node_ready(self) -> bool:
        done = self._client(
            "sinfo", "--noheader", "--Node", "--format=%T", "--nodes", ",".join(self.nodes)
        )
        states = [line.strip().rstrip("*") for line in done.stdout.splitlines() if line.strip()]
        return (
            done.returncode == 0
            and len(states) == len(self.nodes)
            and all(state in {"idle", "mixed"} for state in states)
        )

    def jobs(self) -> dict[str, str]:
        """Job id -> state (``PENDING``, ``RUNNING``, ...) of every job the controller holds."""
        done = self._client("squeue", "--noheader", "--format=%i %T")
        if done.returncode != 0:
            raise SlurmError(f"squeue failed: {done.stderr.strip()}")
        jobs: dict[str, str] = {}
        for line in done.stdout.splitlines():
            job_id, _, state = line.strip().partition(" ")
            if job_id:
                jobs[job_id] = state.strip()
        return jobs

    def cancel(self, job_id: str) -> None:
        """``scancel`` one job (as a site's scheduler or an operator would)."""
        done = self._client("scancel", job_id)
        if done.returncode != 0:
            raise SlurmError(f"scancel {job_id} failed: {done.stderr.strip()}")

    def logs(self, lines: int = 15) -> str:
        """The tail of every daemon's log, for error messages."""
        parts = []
        names = ["munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"]
        names += [f"slurmd-{node}.log" for node in self.nodes]
        names += [f"slurmd-{node}.out" for node in self.extra_nodes]
        for name in names:
            path = self.log_dir / name
            if path.exists():
                parts.append(f"--- {path}\n{tail(path, lines)}")
        return "\n".join(parts)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel every job, wait for its steps to end, then stop the daemons and kill any
        job step left, by PID; idempotent."""
        processes = self._processes() if self.conf_file.exists() else []
        steps = self._job_steps()  # before the cancel: a step closes its files as it ends
        if len(processes) > 1 and processes[1].is_running():
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._client("scancel", "--full", "--user", "root", timeout_s=10)
            _, steps = psutil.wait_procs(steps, timeout=timeout_s)
        for process in reversed(processes):
            process.stop(timeout_s=10)
        steps = [s for s in steps if s.is_running()] + self._job_steps()
        for step in steps:
            with contextlib.suppress(psutil.Error):
                for child in step.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                step.kill()
        psutil.wait_procs(steps, timeout=10)

    def _job_steps(self) -> list[psutil.Process]:
        """This cluster's live job steps: ``slurmstepd`` processes holding a file of its
        directory open (their node's log; their environment names no cluster)."""
        mine = str(self.directory.resolve()) + os.sep
        steps = []
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] != "slurmstepd":
                continue
            with contextlib.suppress(psutil.Error):
                if any(f.path.startswith(mine) for f in proc.open_files()):
                    steps.append(proc)
        return steps


@contextlib.contextmanager
def single_node_slurm(directory: Path, **options: object) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster` in ``directory`` for the block; stopped after it."""
    cluster = SlurmCluster(directory, **options)  # type: ignore[arg-type]
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
