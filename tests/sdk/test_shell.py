"""ShellFunction: output, return codes, walltime, sandboxes, and how it serializes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fxstream.sdk import MPIFunction, ShellFunction, ShellResult
from fxstream.topics import Serializer


def test_stdout_stderr_returncode_and_formatting() -> None:
    fn = ShellFunction("echo {word}; echo oops >&2; exit 3")
    result = fn(word="hello")
    assert result == ShellResult(
        cmd="echo hello; echo oops >&2; exit 3",
        stdout="hello\n",
        stderr="oops\n",
        returncode=3,
        exception_name="subprocess.CalledProcessError",
    )
    # Globus Compute's str(): the exit code, stdout's last lines, and on failure stderr's.
    assert str(result) == (
        "exit code: 3\n   stdout:\nhello\n\n   stderr:\noops\n\n"
        "exception: subprocess.CalledProcessError"
    )
    ok = ShellFunction("seq 1 20")()
    assert ok.exception_name is None
    assert str(
        ok
    ) == "exit code: 0\n   stdout:\n[... truncated; see .stdout for full output ...]\n" + (
        "\n".join(str(n) for n in range(11, 21))
    )


def test_bash_syntax_runs_as_in_globus_compute() -> None:
    # Arrays, [[ ]] and pipefail are bash's: under /bin/sh (dash) each of these fails.
    # (Braces are doubled: the command is a format string.)
    script = (
        "set -o pipefail; names=(a b c); [[ ${{#names[@]}} -eq 3 ]] && echo ${{names[1]}}; "
        "false | true"
    )
    result = ShellFunction(script)()
    assert result.stdout == "b\n"
    assert result.returncode == 1, result  # pipefail: the pipeline fails with false


def test_output_files_positional_parameters_and_return_dict(tmp_path: Path) -> None:
    out, err = tmp_path / "logs" / "run.out", tmp_path / "logs" / "run.err"
    # Globus Compute's order: cmd, stdout, stderr, walltime, snippet_lines, name, return_dict.
    fn = ShellFunction("echo {n}; echo warn >&2", str(out), str(err), 10, 5, "echo_n", True)
    first, second = fn(n=1), fn(n=2)
    assert first == {
        "cmd": "echo 1; echo warn >&2",
        "stdout": "1\n",
        "stderr": "warn\n",
        "returncode": 0,
        "exception_name": None,
    }
    # The files are appended to, and the snippet is their tail.
    assert out.read_text() == "1\n2\n" and second["stdout"] == "1\n2\n"
    assert err.read_text() == "warn\nwarn\n"
    assert fn.__name__ == "echo_n" and fn.walltime == 10 and fn.snippet_lines == 5


def test_a_walltime_kill_names_its_exception() -> None:
    result = ShellFunction("sleep 30", walltime=0.3)()
    assert result.returncode == 124
    assert result.exception_name == "subprocess.TimeoutExpired"


@pytest.mark.parametrize("name", ["has space", "1st", "class", ""])
def test_a_name_that_is_not_an_identifier_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="valid Python identifier"):
        ShellFunction("true", name=name)


def test_only_the_last_snippet_lines_are_kept() -> None:
    result = ShellFunction("seq 1 100000", snippet_lines=3)()
    assert result.returncode == 0
    assert result.stdout == "99998\n99999\n100000\n"
    assert ShellFunction("seq 1 5", snippet_lines=0)().stdout == ""


def test_walltime_kills_the_process_group_and_returns_124(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    fn = ShellFunction("sleep 60 & echo $! > {pidfile}; echo started; sleep 60", walltime=0.5)
    started = time.monotonic()
    result = fn(pidfile=pidfile)
    assert time.monotonic() - started < 10
    assert result.returncode == 124
    assert result.stdout == "started\n"
    assert "walltime of 0.5 s exceeded" in result.stderr
    child = int(pidfile.read_text())
    # The background child got the kill too (a zombie until its new parent reaps it).
    deadline = time.monotonic() + 5
    while True:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, f"pid {child} survived the walltime kill"
        time.sleep(0.05)


def test_each_call_runs_in_a_fresh_sandbox_that_is_removed() -> None:
    fn = ShellFunction("pwd; ls -A; touch left-behind")
    first, second = fn(), fn()
    for result in (first, second):
        sandbox = result.stdout.splitlines()[0]
        assert Path(sandbox).name.startswith("fxstream-shell-")
        assert result.stdout.splitlines()[1:] == []  # it started empty
        assert not os.path.exists(sandbox)
    assert first.stdout != second.stdout


def test_a_staged_task_runs_in_its_working_directory_which_is_left_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The endpoint sets FXSTREAM_TASK_DIR for a task with staged files (docs/hpc.md).
    (tmp_path / "in.txt").write_text("staged input\n")
    monkeypatch.setenv("FXSTREAM_TASK_DIR", str(tmp_path))
    result = ShellFunction("tr a-z A-Z < in.txt > out.txt; pwd")()
    assert result.returncode == 0 and result.stdout == f"{tmp_path}\n"
    assert (tmp_path / "out.txt").read_text() == "STAGED INPUT\n"
    assert (tmp_path / "in.txt").exists()
    # A variable naming no directory: the usual fresh sandbox.
    monkeypatch.setenv("FXSTREAM_TASK_DIR", str(tmp_path / "absent"))
    assert ShellFunction("pwd")().stdout.strip() != str(tmp_path / "absent")


def test_arguments_are_keywords_only() -> None:
    with pytest.raises(TypeError):
        ShellFunction("echo {0}")("positional")  # type: ignore[call-arg]
    with pytest.raises(KeyError):
        ShellFunction("echo {missing}")()
    with pytest.raises(ValueError, match="walltime"):
        ShellFunction("true", walltime=0)


_LOAD_AND_RUN = """
import sys
from fxstream.topics import Serializer
fn = Serializer().deserialize_function(sys.stdin.buffer.read())
print(fn(name="remote").stdout, end="")
"""

_BLOCK_SDK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fxstream.sdk" or name.startswith("fxstream.sdk."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from fxstream.topics import DeserializationError, Serializer
try:
    Serializer().deserialize_function(sys.stdin.buffer.read())
except DeserializationError as exc:
    print("refused:", exc)
else:
    print("loaded")
"""


def test_it_serializes_with_the_code_strategy_and_its_class_by_reference() -> None:
    payload = Serializer().serialize_function(ShellFunction("echo hi {name}", name="hi"))
    # A fresh interpreter with the workspace installed (as endpoints are) runs it.
    ran = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN], input=payload, capture_output=True, check=True
    )
    assert ran.stdout == b"hi remote\n"
    # Without fxstream.sdk importable it does not load: the class travels by reference.
    blocked = subprocess.run(
        [sys.executable, "-c", _BLOCK_SDK], input=payload, capture_output=True, check=True
    )
    assert blocked.stdout.startswith(b"refused:")
    assert b"fxstream.sdk" in blocked.stdout


def test_an_mpi_function_runs_under_the_launcher_prefix_of_its_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The prefix Parsl's MPI mode would set for a 1-node, 3-rank task on this host; the
    # real mpiexec (MPICH) starts 3 ranks, each with its PMI_RANK.
    monkeypatch.setenv("PARSL_MPI_PREFIX", "mpiexec -n 3 -ppn 3 -hosts localhost")
    result = MPIFunction("sh -c 'echo rank=$PMI_RANK of $PMI_SIZE; echo {word} >&2'")(word="hi")
    assert result.returncode == 0, result
    assert sorted(result.stdout.splitlines()) == [f"rank={r} of 3" for r in range(3)]
    assert result.stderr == "hi\nhi\nhi\n"
    assert result.cmd.startswith("$PARSL_MPI_PREFIX sh -c")
    failing = MPIFunction("sh -c 'exit 7'")()
    assert failing.returncode == 7


def test_an_mpi_function_without_an_mpi_engine_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PARSL_MPI_PREFIX", raising=False)
    with pytest.raises(RuntimeError, match=r"engine: htex and batch\.mpi"):
        MPIFunction("hostname")()
    fn = MPIFunction("./hello {n}", walltime=5)
    assert fn.name == fn.__name__ == "MPIFunction"
    assert isinstance(fn, ShellFunction)
    assert "MPIFunction('./hello {n}'" in repr(fn)
    restored = Serializer().deserialize_function(Serializer().serialize_function(fn))
    assert isinstance(restored, MPIFunction) and restored.cmd == fn.cmd
