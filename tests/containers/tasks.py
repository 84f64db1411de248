"""Functions the container tests run inside workers (importable there: the repository is
bound read-only into every sandbox, being on the test process's ``sys.path``)."""

from __future__ import annotations

import errno
import os
from typing import Any

from fxstream.agent.worker_process import Call, load_pickled

__all__ = ["NAMESPACES", "load_noting", "namespaces", "sleep", "try_write"]

NAMESPACES = ("mnt", "pid", "ipc", "uts")


def namespaces() -> dict[str, Any]:
    """This process's namespaces (``/proc/self/ns`` links), pid, hostname and cwd."""
    seen: dict[str, Any] = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in NAMESPACES}
    seen["pid"] = os.getpid()
    seen["hostname"] = os.uname().nodename
    seen["cwd"] = os.getcwd()
    return seen


def try_write(path: str) -> str:
    """``"written"`` if ``path`` could be created and written, else the errno's name."""
    try:
        with open(path, "w") as out:
            out.write("written from a worker\n")
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return "written"


def sleep(seconds: float) -> float:
    """Sleep, for tests that kill what runs."""
    import time

    time.sleep(seconds)
    return seconds


def load_noting(code: bytes, *, note: str) -> Call:
    """A runner carrying a value that must never reach a command line (``note``)."""
    del note
    return load_pickled(code)
