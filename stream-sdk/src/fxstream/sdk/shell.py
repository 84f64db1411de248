"""Shell commands as functions: Globus Compute's ``ShellFunction``, ``MPIFunction`` and
``ShellResult``.

``ShellFunction("wc -l {path}")`` is a callable: calling it with keyword
arguments formats the command with them and runs it through the shell in a
fresh sandbox directory, returning a :class:`ShellResult` with the return code
and the tails of stdout and stderr.

How it travels: the code strategy (dill) pickles a ``ShellFunction``
*instance* by value (its command, walltime, ...) but its *class* by reference
to ``fxstream.sdk.shell``, because that module is importable. So an endpoint
needs ``fxstream.sdk`` installed to load one; endpoints that run from this
workspace (``uv sync``) have it. Loading it where ``fxstream.sdk`` is missing
fails with a :class:`~fxstream.topics.DeserializationError` naming the
missing module (tested).

``MPIFunction("./hello")`` is a ``ShellFunction`` whose command runs under the MPI
launcher the endpoint's MPI engine chose for the task: ``$PARSL_MPI_PREFIX ./hello``,
where Parsl's MPI mode sets ``PARSL_MPI_PREFIX`` (``mpiexec -n 4 -ppn 2 -hosts a,b``
or ``srun --ntasks 4 ...``) from the task's ``resource_specification`` and the nodes
it was given. Submit it with a ``resource_specification`` (``Executor(...,
resource_specification={"num_nodes": 2, "ranks_per_node": 2})``) to an endpoint whose
``batch:`` has ``mpi:`` (docs/hpc.md).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO, Any, Final

__all__ = [
    "MPI_PREFIX_VARIABLE",
    "TASK_DIR_VARIABLE",
    "WALLTIME_RETURNCODE",
    "MPIFunction",
    "ShellFunction",
    "ShellResult",
]

TASK_DIR_VARIABLE: Final = "FXSTREAM_TASK_DIR"
"""Names a staged task's working directory (set by the endpoint's worker, docs/hpc.md)."""

WALLTIME_RETURNCODE: Final = 124
"""The return code of a command killed at its walltime (as GNU ``timeout`` gives)."""
MPI_PREFIX_VARIABLE: Final = "PARSL_MPI_PREFIX"
"""The environment variable holding a task's MPI launcher command (set by Parsl's MPI mode)."""


@dataclass(frozen=True)
class ShellResult:
    """What a shell command did: its return code, the tails of its output, and the command."""

    returncode: int
    stdout: str
    stderr: str
    cmd: str

    def __str__(self) -> str:
        return self.stdout


def _tail(stream: IO[bytes], lines: int) -> str:
    stream.seek(0)
    if lines <= 0:
        return ""
    kept = collections.deque(stream, maxlen=lines)
    return b"".join(kept).decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class ShellFunction:
    """A shell command run as a task: ``ShellFunction("echo {greeting}")(greeting="hi")``.

    ``cmd`` is formatted with the call's keyword arguments (``str.format``),
    then run with ``/bin/sh`` in a new, empty directory made for this call and
    removed after it; a task with staged files (``$FXSTREAM_TASK_DIR`` set by the
    endpoint, docs/hpc.md "Staging") runs it in the task's working directory instead,
    where its inputs are and its outputs are staged out from (left in place). The
    command runs in its own process group. ``walltime``
    (seconds) kills the whole process group when exceeded and gives return
    code 124. ``snippet_lines`` is how many trailing lines of stdout and stderr
    the result keeps. Output is spooled to temporary files, not memory.

    See the module docstring for how instances are serialized (by value, with
    the class by reference to ``fxstream.sdk.shell``).
    """

    def __init__(
        self,
        cmd: str,
        *,
        walltime: float | None = None,
        snippet_lines: int = 1000,
        name: str | None = None,
    ) -> None:
        if walltime is not None and walltime <= 0:
            raise ValueError(f"walltime must be positive seconds, not {walltime}")
        if snippet_lines < 0:
            raise ValueError(f"snippet_lines cannot be negative ({snippet_lines})")
        self.cmd = cmd
        self.walltime = walltime
        self.snippet_lines = snippet_lines
        self.name = name or "ShellFunction"
        self.__name__ = self.name  # what register_function names it by

    def __call__(self, **kwargs: Any) -> ShellResult:
        """Format the command with ``kwargs``, run it in a sandbox, and return the result."""
        return self._execute(self.cmd.format(**kwargs))

    def _execute(self, cmd: str) -> ShellResult:
        task_dir = os.environ.get(TASK_DIR_VARIABLE)
        staged = bool(task_dir) and os.path.isdir(task_dir or "")
        sandbox = task_dir if staged and task_dir else tempfile.mkdtemp(prefix="fxstream-shell-")
        try:
            with (
                tempfile.TemporaryFile() as out,
                tempfile.TemporaryFile() as err,
            ):
                returncode, timed_out = self._run(cmd, sandbox, out, err)
                stdout = _tail(out, self.snippet_lines)
                stderr = _tail(err, self.snippet_lines)
        finally:
            if not staged:
                shutil.rmtree(sandbox, ignore_errors=True)
        if timed_out:
            note = f"fxstream: walltime of {self.walltime} s exceeded; the command was killed\n"
            if stderr and not stderr.endswith("\n"):
                stderr += "\n"
            stderr += note
        return ShellResult(returncode=returncode, stdout=stdout, stderr=stderr, cmd=cmd)

    def _run(self, cmd: str, sandbox: str, out: IO[bytes], err: IO[bytes]) -> tuple[int, bool]:
        process = subprocess.Popen(
            cmd,
            shell=True,
            cwd=sandbox,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, so a kill reaches its children
        )
        try:
            returncode = process.wait(timeout=self.walltime)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            returncode, timed_out = WALLTIME_RETURNCODE, True
        except BaseException:
            _kill_group(process.pid)
            process.wait()
            raise
        # Background children of the command do not outlive the task (or its sandbox).
        _kill_group(process.pid)
        return returncode, timed_out

    def __repr__(self) -> str:
        return (
            f"ShellFunction({self.cmd!r}, walltime={self.walltime!r}, "
            f"snippet_lines={self.snippet_lines!r}, name={self.name!r})"
        )


class MPIFunction(ShellFunction):
    """An MPI program run as a task: ``MPIFunction("./hello {n}")(n=3)`` runs
    ``$PARSL_MPI_PREFIX ./hello 3`` (Globus Compute's ``MPIFunction``).

    Everything else is :class:`ShellFunction`'s (sandbox, walltime, the result's return
    code and output tails). The launcher prefix comes from the endpoint's MPI engine,
    which sets it for the nodes and ranks of the task's ``resource_specification``;
    called where no MPI engine set it, it raises ``RuntimeError`` saying so rather than
    run the program as one process.
    """

    def __init__(
        self,
        cmd: str,
        *,
        walltime: float | None = None,
        snippet_lines: int = 1000,
        name: str | None = None,
    ) -> None:
        super().__init__(
            cmd, walltime=walltime, snippet_lines=snippet_lines, name=name or "MPIFunction"
        )

    def __call__(self, **kwargs: Any) -> ShellResult:
        """Run ``$PARSL_MPI_PREFIX <cmd formatted with kwargs>`` and return the result."""
        if not os.environ.get(MPI_PREFIX_VARIABLE):
            raise RuntimeError(
                f"MPIFunction needs the MPI launcher prefix ${MPI_PREFIX_VARIABLE}, which an "
                "endpoint's MPI engine sets for each task: run it on an endpoint with "
                "engine: htex and batch.mpi, and submit it with a resource_specification"
            )
        return self._execute(f"${MPI_PREFIX_VARIABLE} {self.cmd.format(**kwargs)}")

    def __repr__(self) -> str:
        return (
            f"MPIFunction({self.cmd!r}, walltime={self.walltime!r}, "
            f"snippet_lines={self.snippet_lines!r}, name={self.name!r})"
        )
