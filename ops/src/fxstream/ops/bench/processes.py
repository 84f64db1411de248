"""The processes of a running platform, labelled: what the benches that read memory or CPU
per process (``soak``, ``profile``, ``trigger``) walk, and the CPU accounting they share."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping

import psutil

from fxstream.ops.platform import Platform

__all__ = ["cpu_per_item", "cpu_seconds", "platform_processes", "short_name"]


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


def platform_processes(
    platform: Platform, extra: Mapping[str, int] | None = None
) -> Iterator[tuple[str, psutil.Process]]:
    """``(label, process)`` of every platform process and its descendants, then of each of
    ``extra`` (``label -> pid``: a bench's own helpers, e.g. a file watcher) and its
    descendants, then this one (labelled ``sdk (this bench)``).

    Children with the same short name under one parent are numbered in pid order
    (``worker#1``, ``worker#2``), so a restarted worker keeps its label.
    """
    for name, pid in [*_roots(platform), *(extra or {}).items()]:
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


def cpu_seconds(
    platform: Platform, extra: Mapping[str, int] | None = None
) -> dict[str, tuple[int, float]]:
    """``label -> (pid, CPU seconds so far, user + system)`` of every process
    :func:`platform_processes` walks."""
    found: dict[str, tuple[int, float]] = {}
    for label, process in platform_processes(platform, extra):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        found[label] = (process.pid, times.user + times.system)
    return found


def cpu_per_item(
    before: Mapping[str, tuple[int, float]], after: Mapping[str, tuple[int, float]], items: int
) -> dict[str, float]:
    """Microseconds of CPU per item (task, file) per process between two
    :func:`cpu_seconds` readings, largest first; a process that restarted (or started)
    meanwhile counts from zero."""
    spent: dict[str, float] = {}
    for label, (pid, seconds) in after.items():
        earlier = before.get(label)
        start = earlier[1] if earlier is not None and earlier[0] == pid else 0.0
        spent[label] = max(seconds - start, 0.0) * 1e6 / max(items, 1)
    return dict(sorted(spent.items(), key=lambda item: -item[1]))
