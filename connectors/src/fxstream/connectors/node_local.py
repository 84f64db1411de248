"""The node-local tier: by-reference data in shared memory when client and worker share a node.

A client and an endpoint on one machine (a laptop, a workstation, a login node running
both) need not send bulk data through Redis: the client writes a large argument to a
directory in ``/dev/shm`` (memory, no socket, no append-only file), the worker reads it
from there, and writes a large result there for the client. Ray's object store and
ProxyStore's shared-memory connectors take the same shortcut.

Which node: :func:`find_node_local` gives the tier of the calling process, a
:class:`NodeLocal` with its directory and its *node key*, a digest of the machine's
``/etc/machine-id``, the kernel's boot id, the OS user and the directory. Two processes
with the same key can read each other's objects there: same machine, same boot (a
reboot empties ``/dev/shm``), same user (the directory is ``0700``). The key is what an
agent advertises in its heartbeats (``Heartbeat.node_key``) and what a client puts in a
task it sends to such an endpoint (``TaskSubmission.client_node``); a digest, so the
machine id itself never leaves the machine.

The directory (``/dev/shm/fxstream-<uid>`` unless ``FXSTREAM_NODE_STORE_DIR`` names
another) is refused, and the tier is off, unless it is a real directory (not a symlink)
owned by this user with no access for group or others: another user could otherwise
read the objects or place files for this one to read (every object is still checked
against its SHA-256 before loading, :mod:`fxstream.connectors.integrity`).
``FXSTREAM_NODE_STORE=off`` turns the tier off.

Room: :meth:`NodeLocal.has_room` is asked before each object is written; a value that
would leave less than :data:`RESERVE_FRACTION` of the file system free goes to the usual
store instead (Redis), so a large value never fails for want of shared memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from proxystore.store.base import Store

from fxstream.connectors.stores import open_store

__all__ = [
    "NODE_KEY_PATTERN",
    "NODE_STORE_DIR_ENV",
    "NODE_STORE_ENV",
    "RESERVE_FRACTION",
    "NodeLocal",
    "check_node_directory",
    "find_node_local",
]

log = logging.getLogger(__name__)

NODE_STORE_ENV: Final = "FXSTREAM_NODE_STORE"
"""``off`` (or ``0``, ``false``, ``no``) turns the node-local tier off in this process."""

NODE_STORE_DIR_ENV: Final = "FXSTREAM_NODE_STORE_DIR"
"""The tier's directory, instead of ``/dev/shm/fxstream-<uid>``."""

NODE_KEY_PATTERN: Final = r"^[0-9a-f]{32}$"
"""A node key as heartbeats and submissions carry it: 32 lowercase hex digits."""

RESERVE_FRACTION: Final = 0.25
"""The share of the tier's file system a write must leave free (else the value goes to
the usual store)."""

_OFF: Final = frozenset({"off", "0", "false", "no"})
_MACHINE_ID_FILES: Final = ("/etc/machine-id", "/var/lib/dbus/machine-id")
_BOOT_ID_FILE: Final = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class NodeLocal:
    """This process's node-local tier: its directory and its node key."""

    directory: Path
    key: str

    @property
    def store_url(self) -> str:
        """The store URL of the tier (a ``file://`` store, ``tier=ephemeral``)."""
        return f"file://{self.directory}?tier=ephemeral"

    def store(self) -> Store[Any]:
        """The process-wide ProxyStore store on the directory (the same name in every
        process with the same directory, so a reference names it in both)."""
        return open_store(self.store_url)

    def has_room(self, size_bytes: int) -> bool:
        """Whether ``size_bytes`` more would leave :data:`RESERVE_FRACTION` of the file
        system free."""
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return False
        total = fs.f_blocks * fs.f_frsize
        free = fs.f_bavail * fs.f_frsize
        return free - size_bytes >= total * RESERVE_FRACTION


def find_node_local(env: Mapping[str, str] | None = None) -> NodeLocal | None:
    """The node-local tier of this process, or None when it is off or cannot be used
    safely here (the reason is logged once at info level)."""
    env = os.environ if env is None else env
    if env.get(NODE_STORE_ENV, "").strip().lower() in _OFF:
        return None
    uid = os.geteuid()
    configured = env.get(NODE_STORE_DIR_ENV)
    if configured:
        directory = Path(configured)
    elif Path("/dev/shm").is_dir():
        directory = Path("/dev/shm") / f"fxstream-{uid}"
    else:
        return None
    problem = check_node_directory(directory, uid)
    if problem is not None:
        log.info("node-local store off: %s", problem)
        return None
    machine = _machine_id()
    boot = _read(_BOOT_ID_FILE)
    if not machine or not boot:
        log.info("node-local store off: no machine id or boot id to recognise this node by")
        return None
    material = "\0".join(("fxstream-node-v1", machine, boot, str(uid), str(directory)))
    return NodeLocal(directory, hashlib.sha256(material.encode()).hexdigest()[:32])


def check_node_directory(directory: Path, uid: int | None = None) -> str | None:
    """Make the tier's directory (0700) if missing; why it cannot be used by ``uid``
    (default: this process's user) and what to do, or None when it can."""
    uid = os.geteuid() if uid is None else uid
    if not directory.is_absolute():
        return f"{NODE_STORE_DIR_ENV} must be an absolute directory, not {str(directory)!r}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        return f"cannot make {directory}: {exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory (a symlink or a file): remove it"
    if info.st_uid != uid:
        return f"{directory} belongs to uid {info.st_uid}, not this user ({uid}): remove it"
    if info.st_mode & 0o077:
        return (
            f"{directory} is open to group or others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"chmod 700 {directory}"
        )
    return None


def _machine_id() -> str:
    for path in _MACHINE_ID_FILES:
        found = _read(path)
        if found:
            return found
    return ""


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read(128).strip()
    except OSError:
        return ""
