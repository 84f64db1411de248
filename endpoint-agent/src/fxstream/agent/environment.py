"""Keeping the agent's secrets from the tasks it runs: environment, command line, memory.

Tasks run in worker processes the agent spawns as its own OS user. A task could otherwise
find the agent's (or its owner's) secrets in three places, closed here:

* **The environment.** Workers inherit the agent's environment. The agent starts with every
  variable whose name looks secret (:data:`SECRET_NAME`: ``FXSTREAM_TOKEN``,
  ``FXSTREAM_CREDENTIALS``, anything with TOKEN, PASSWORD, SECRET, CREDENTIAL or API_KEY in
  its name) removed: ``fxstream-endpoint start`` re-executes itself without them
  (:func:`reexec_without_secrets`), so they are not even in ``/proc/<agent pid>/environ``.
* **The command line.** Nothing secret is ever an argument: the agent reads its credential
  from the 0600 file ``config.yaml`` names (:mod:`fxstream.agent.credentials`).
* **The agent's memory.** The agent marks itself non-dumpable (:func:`protect_memory`), so
  a process of the same user (a task) can neither ptrace it nor read ``/proc/<pid>/mem``,
  ``environ`` or its open files' descriptors; workers are spawned (fork and exec), so they
  hold none of the agent's memory.

What this does not close: a task runs as the agent's OS user, so it can read any file that
user can, the credentials file included (see docs/security.md, shared endpoints).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = [
    "SECRET_NAME",
    "protect_memory",
    "reexec_without_secrets",
    "scrubbed",
    "secret_names",
]

SECRET_NAME: Final = re.compile(
    r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.IGNORECASE
)
"""Environment variable names the agent and its workers never keep."""

_PR_SET_DUMPABLE: Final = 4


def secret_names(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that look like they hold a secret (or name a file of secrets)."""
    return sorted(name for name in env if SECRET_NAME.search(name))


def scrubbed(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables :func:`secret_names` lists."""
    return {name: value for name, value in env.items() if not SECRET_NAME.search(name)}


def reexec_without_secrets(argv: Sequence[str]) -> None:
    """Replace this process (same PID) with ``argv`` run without secret variables.

    Returns (does nothing) when the environment holds none; otherwise does not return.
    Removing them from ``os.environ`` would not do: ``/proc/<pid>/environ`` shows the
    environment the process was started with.
    """
    if not secret_names(os.environ):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), scrubbed(os.environ))


def protect_memory() -> bool:
    """Make this process non-dumpable (Linux): processes of the same user can no longer
    ptrace it or read its ``/proc/<pid>/mem``, ``environ`` and ``fd``. Children started
    with exec (the workers) are dumpable again. Returns False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
