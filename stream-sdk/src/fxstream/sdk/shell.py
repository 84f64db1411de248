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
import keyword
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


_SHELL: Final = "/bin/bash"
"""What runs a command, as in Globus Compute (arrays, ``set -o pipefail``, ``[[ ]]``)."""
_FALLBACK_SHELL: Final = "/bin/sh"
_CALLED_PROCESS_ERROR: Final = "subprocess.CalledProcessError"
_TIMEOUT_EXPIRED: Final = "subprocess.TimeoutExpired"
# What str(ShellResult) and str(ShellFunction) show of a long text (Globus Compute's cut).
_SHOWN_CHARS: Final = 1024
_SHOWN_LINES: Final = 10


def _shown_tail(text: str, attribute: str) -> str:
    whole = text.lstrip("\n").rstrip()
    shown = "\n".join(whole[-_SHOWN_CHARS:].splitlines()[-_SHOWN_LINES:])
    if shown != whole:
        shown = f"[... truncated; see .{attribute} for full output ...]\n{shown}"
    return shown


@dataclass(frozen=True)
class ShellResult:
    """What a shell command did (Globus Compute's ``ShellResult``): the command as run, the
    tails of its stdout and stderr, its return code, and ``exception_name`` (``None`` on
    success, ``"subprocess.CalledProcessError"`` for a non-zero return code,
    ``"subprocess.TimeoutExpired"`` when its walltime killed it).

    ``str()`` gives the exit code and the last lines of stdout (and, on failure, of
    stderr and the exception name), as Globus Compute prints it; read ``.stdout`` for the
    whole snippet.
    """

    cmd: str
    stdout: str
    stderr: str
    returncode: int
    exception_name: str | None = None

    def __str__(self) -> str:
        text = f"exit code: {self.returncode}\n   stdout:\n{_shown_tail(self.stdout, 'stdout')}"
        if self.returncode != 0:
            text += f"\n\n   stderr:\n{_shown_tail(self.stderr, 'stderr')}"
            if self.exception_name:
                text += f"\n\nexception: {self.exception_name}"
        return text

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-compatible dict (what ``return_dict=True`` returns)."""
        return {
            "cmd": self.cmd,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "returncode": self.returncode,
            "exception_name": self.exception_name,
        }


def _tail(stream: IO[bytes], lines: int) -> str:
    stream.seek(0)
    if lines <= 0:
        return ""
    kept = collections.deque(stream, maxlen=lines)
    return b"".join(kept).decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _function_name(name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(
            f"a ShellFunction's name must be a valid Python identifier (it names the "
            f"registered function), not {name!r}: e.g. name='count_lines'"
        )
    return name


def _output_file(path: str | None, sandbox: str) -> IO[bytes]:
    """The file a stream goes to: ``path`` (appended to) or an anonymous temporary file."""
    if not path:
        return tempfile.TemporaryFile()
    target = os.path.join(sandbox, os.path.expanduser(path))
    parent = os.path.dirname(target)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return open(target, "a+b")


class ShellFunction:
    """A shell command run as a task: ``ShellFunction("echo {greeting}")(greeting="hi")``,
    Globus Compute's ``ShellFunction`` (same parameters, in the same order).

    ``cmd`` is formatted with the call's keyword arguments (``str.format``), then run
    with ``/bin/bash`` (``/bin/sh``, with a note in stderr, where an image has no bash)
    in a new, empty directory made for this call and removed after it; a task with
    staged files (``$FXSTREAM_TASK_DIR`` set by the endpoint, docs/hpc.md "Staging") runs
    it in the task's working directory instead, where its inputs are and its outputs are
    staged out from (left in place). The command runs in its own process group.

    - ``stdout`` / ``stderr``: files the output is appended to (a relative path is
      inside the command's directory: give an absolute path, or stage it out, to keep
      it past a fresh sandbox); by default temporary files, never memory.
    - ``walltime`` (seconds): the whole process group is killed when exceeded, return
      code 124.
    - ``snippet_lines``: how many trailing lines of stdout and stderr the result keeps.
    - ``name``: the name it is registered by (a Python identifier; default the class
      name).
    - ``return_dict``: return :meth:`ShellResult.as_dict` instead of a
      :class:`ShellResult` (for a caller without ``fxstream.sdk``).

    See the module docstring for how instances are serialized (by value, with
    the class by reference to ``fxstream.sdk.shell``).
    """

    def __init__(
        self,
        cmd: str,
        stdout: str | None = None,
        stderr: str | None = None,
        walltime: float | None = None,
        snippet_lines: int = 1000,
        name: str | None = None,
        return_dict: bool = False,
    ) -> None:
        if walltime is not None and walltime <= 0:
            raise ValueError(f"walltime must be positive seconds, not {walltime}")
        if snippet_lines < 0:
            raise ValueError(f"snippet_lines cannot be negative ({snippet_lines})")
        self.cmd = cmd
        self.stdout = stdout
        self.stderr = stderr
        self.walltime = walltime
        self.snippet_lines = snippet_lines
        self.name = _function_name(name if name is not None else type(self).__name__)
        self.__name__ = self.name  # what register_function names it by
        self.return_dict = return_dict

    def __call__(self, **kwargs: Any) -> ShellResult | dict[str, Any]:
        """Format the command with ``kwargs``, run it in a sandbox, and return the result."""
        return self._execute(self.cmd.format(**kwargs))

    def _execute(self, cmd: str) -> ShellResult | dict[str, Any]:
        task_dir = os.environ.get(TASK_DIR_VARIABLE)
        staged = bool(task_dir) and os.path.isdir(task_dir or "")
        sandbox = task_dir if staged and task_dir else tempfile.mkdtemp(prefix="fxstream-shell-")
        shell = _SHELL if os.access(_SHELL, os.X_OK) else _FALLBACK_SHELL
        try:
            with contextlib.ExitStack() as files:
                out = files.enter_context(_output_file(self.stdout, sandbox))
                err = files.enter_context(_output_file(self.stderr, sandbox))
                returncode, timed_out = self._run(cmd, shell, sandbox, out, err)
                stdout = _tail(out, self.snippet_lines)
                stderr = _tail(err, self.snippet_lines)
        finally:
            if not staged:
                shutil.rmtree(sandbox, ignore_errors=True)
        notes = []
        if shell != _SHELL:
            notes.append(f"fxstream: {_SHELL} is not in this environment; ran with {shell}")
        if timed_out:
            notes.append(
                f"fxstream: walltime of {self.walltime} s exceeded; the command was killed"
            )
        for note in notes:
            if stderr and not stderr.endswith("\n"):
                stderr += "\n"
            stderr += note + "\n"
        exception_name = (
            _TIMEOUT_EXPIRED if timed_out else _CALLED_PROCESS_ERROR if returncode else None
        )
        result = ShellResult(
            cmd=cmd,
            stdout=stdout,
            stderr=stderr,
            returncode=returncode,
            exception_name=exception_name,
        )
        return result.as_dict() if self.return_dict else result

    def _run(
        self, cmd: str, shell: str, sandbox: str, out: IO[bytes], err: IO[bytes]
    ) -> tuple[int, bool]:
        process = subprocess.Popen(
            cmd,
            shell=True,
            executable=shell,
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
            f"{type(self).__name__}({self.cmd!r}, stdout={self.stdout!r}, "
            f"stderr={self.stderr!r}, walltime={self.walltime!r}, "
            f"snippet_lines={self.snippet_lines!r}, name={self.name!r}, "
            f"return_dict={self.return_dict!r})"
        )


class MPIFunction(ShellFunction):
    """An MPI program run as a task: ``MPIFunction("./hello {n}")(n=3)`` runs
    ``$PARSL_MPI_PREFIX ./hello 3`` (Globus Compute's ``MPIFunction``).

    Everything else is :class:`ShellFunction`'s (parameters, sandbox, walltime, the
    result). The launcher prefix comes from the endpoint's MPI engine, which sets it for
    the nodes and ranks of the task's ``resource_specification``; called where no MPI
    engine set it, it raises ``RuntimeError`` saying so rather than run the program as
    one process.
    """

    def __call__(self, **kwargs: Any) -> ShellResult | dict[str, Any]:
        """Run ``$PARSL_MPI_PREFIX <cmd formatted with kwargs>`` and return the result."""
        if not os.environ.get(MPI_PREFIX_VARIABLE):
            raise RuntimeError(
                f"MPIFunction needs the MPI launcher prefix ${MPI_PREFIX_VARIABLE}, which an "
                "endpoint's MPI engine sets for each task: run it on an endpoint with "
                "engine: htex and batch.mpi, and submit it with a resource_specification"
            )
        return self._execute(f"${MPI_PREFIX_VARIABLE} {self.cmd.format(**kwargs)}")
