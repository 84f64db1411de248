"""Test-only runners for the worker pool, run inside real worker processes.

``load_behaviour`` reads the code bytes as the name of a behaviour below, so a
test says what a task does without any serialization library. Every load is
counted per process, which lets tests prove a function is loaded once per worker.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing import resource_tracker

__all__ = ["add", "load_behaviour", "load_behaviour_with", "load_failing"]

LOADS: Counter[bytes] = Counter()


def _echo(payload: bytes) -> bytes:
    return payload


def _whoami_for(code: bytes) -> Callable[[bytes], bytes]:
    def whoami(payload: bytes) -> bytes:
        return f"{os.getpid()}:{LOADS[code]}".encode()

    return whoami


def _raise(payload: bytes) -> bytes:
    raise ValueError(f"bad input {payload.decode()}")


def _print(payload: bytes) -> bytes:
    """Print ``payload`` (``b"<text>|<times>"``: the text that many times) to stdout, a
    warning to stderr, then fail if the text is ``fail``."""
    text, _, times = payload.decode().partition("|")
    for _ in range(int(times or 1)):
        print(text)
    print("a warning", file=sys.stderr)
    if text == "fail":
        raise RuntimeError("failed after printing")
    return b"printed"


def _exit(payload: bytes) -> bytes:
    os._exit(int(payload))


def _sigkill(payload: bytes) -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)
    return b"unreachable"


def _segfault(payload: bytes) -> bytes:
    return ctypes.string_at(0)


def _sleep(payload: bytes) -> bytes:
    time.sleep(float(payload))
    return payload


def _sys_exit(payload: bytes) -> bytes:
    sys.exit(int(payload))


def _garble(payload: bytes) -> bytes:
    """Write a well-framed but unpicklable message to every write-only pipe the worker has."""
    tracker = getattr(resource_tracker._resource_tracker, "_fd", None)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == tracker:
            continue
        try:
            is_pipe = os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
        except OSError:
            continue
        if is_pipe and writable:
            os.write(fd, struct.pack("!i", 5) + b"junk!")
    time.sleep(10)
    return b"unreachable"


def _start_child(pid_file: bytes) -> None:
    """Start a long ``sleep`` that inherits every descriptor, and note its pid."""
    child = subprocess.Popen(["sleep", "60"], close_fds=False)
    with open(pid_file, "w") as out:
        out.write(str(child.pid))


def _child_then_sleep(payload: bytes) -> bytes:
    _start_child(payload)
    time.sleep(30)
    return b"unreachable"


def _mark_then_sleep(payload: bytes) -> bytes:
    with open(payload, "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(1.0)
    return b"slept"


def _mark_then_wait(payload: bytes) -> bytes:
    """``payload`` is ``b"<path>|<seconds>"``: write this pid to the path, then sleep."""
    path, _, seconds = payload.decode().partition("|")
    with open(path, "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(float(seconds))
    return b"waited"


def _child_then_exit(payload: bytes) -> bytes:
    _start_child(payload)
    os._exit(7)


def _not_bytes(payload: bytes) -> bytes:
    result: object = len(payload)
    return result  # type: ignore[return-value]  # the pool must reject it


BEHAVIOURS: dict[bytes, Callable[[bytes], bytes]] = {
    b"echo": _echo,
    b"raise": _raise,
    b"print": _print,
    b"exit": _exit,
    b"sigkill": _sigkill,
    b"segfault": _segfault,
    b"sleep": _sleep,
    b"sys-exit": _sys_exit,
    b"not-bytes": _not_bytes,
    b"garble": _garble,
    b"child-then-sleep": _child_then_sleep,
    b"child-then-exit": _child_then_exit,
    b"mark-then-sleep": _mark_then_sleep,
    b"mark-then-wait": _mark_then_wait,
}


def load_behaviour(code: bytes) -> Callable[[bytes], bytes]:
    """Runner: ``code`` names a behaviour.

    ``whoami[-anything]`` answers ``"<pid>:<loads of this code in this process>"``;
    ``bad-load`` always fails to load, ``flaky`` fails its first load in a process.
    """
    LOADS[code] += 1
    if code.startswith(b"whoami"):
        return _whoami_for(code)
    if code == b"bad-load":
        raise ImportError("no module named 'missing_dependency'")
    if code == b"flaky":
        if LOADS[code] == 1:
            raise ImportError("the first load of 'flaky' in a process fails")
        return _echo
    return BEHAVIOURS[code]


def load_behaviour_with(code: bytes, *, secret: str) -> Callable[[bytes], bytes]:
    """:func:`load_behaviour`, as a runner that holds a secret (as the agent's runner holds
    its store's URL): a test checks the secret stays out of what the engine writes."""
    if not secret:
        raise ValueError("no secret")
    return load_behaviour(code)


def load_failing(code: bytes) -> Callable[[bytes], bytes]:
    """Runner whose every load fails, as when the serializer library is missing."""
    raise ModuleNotFoundError("No module named 'dill'")


def add(a: int, b: int = 0) -> int:
    """A plain function for the default pickle runner."""
    return a + b
