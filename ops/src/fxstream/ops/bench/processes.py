"""The processes of a running platform, labelled: what the benches that read memory or CPU
per process (``soak``, ``profile``) walk."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import psutil

from fxstream.ops.platform import Platform

__all__ = ["platform_processes", "short_name"]


def short_name(process: psutil.Process) -> str:
    """A short name for a child process: its module (``-m x.y``) or its program's name."""
    try:
        argv = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    if "-c" in argv and argv.index("-c") + 1 < len(argv):
        # multiprocessing's children: "from multiprocessing.spawn import spawn_main; ..."
        found = re.search(r"(?:from|import)\s+([\w.]+)", argv[argv.index("-c") + 1])
        module = found.group(1).rsplit(".", 1)[-1] if found else "python -c"
        return "worker" if module == "spawn" else module
    for arg in argv[1:]:
        if not arg.startswith("-"):
            return os.path.basename(arg)
    return os.path.basename(argv[0]) if argv else process.name()


def _roots(platform: Platform) -> list[tuple[str, int]]:
    """The platform's own processes, by name: brokers, Redis, each service process."""
    found: list[tuple[str, int]] = []
    for node in platform.nodes(cluster=platform.running_mode() == "cluster"):
        pid = node.process.pid()
        if pid is not None:
            found.append((f"kafka node {node.node_id}", pid))
    redis_pid = platform.redis().process.pid()
    if redis_pid is not None:
        found.append(("redis", redis_pid))
    for process in platform.services().processes():
        pid = process.pid()
        if pid is not None:
            found.append((process.name, pid))
    return found


def platform_processes(platform: Platform) -> Iterator[tuple[str, psutil.Process]]:
    """``(label, process)`` of every platform process and its descendants, then this one
    (labelled ``sdk (this bench)``).

    Children with the same short name under one parent are numbered in pid order
    (``worker#1``, ``worker#2``), so a restarted worker keeps its label.
    """
    for name, pid in _roots(platform):
        try:
            root = psutil.Process(pid)
            children = sorted(root.children(recursive=True), key=lambda p: p.pid)
        except psutil.NoSuchProcess:
            continue
        yield name, root
        seen: dict[str, int] = {}
        for child in children:
            short = short_name(child)
            seen[short] = seen.get(short, 0) + 1
            yield f"{name} / {short}#{seen[short]}", child
    yield "sdk (this bench)", psutil.Process()
