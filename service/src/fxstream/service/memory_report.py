"""Where a process's memory is: one log line a few minutes apart, for a long run's reading.

A resident set size (RSS) that creeps over a million tasks can be a leak (Python objects
kept), the allocator keeping memory that was freed (glibc returns little of its heap to
the system after a burst), or a native library's cache (RocksDB's memtables and block
cache). RSS alone cannot tell them apart; these figures can:

- ``rss``: the resident set size, as the soak bench samples it;
- ``py_blocks``: the memory blocks Python's allocator has handed out and not yet had back
  (:func:`sys.getallocatedblocks`): flat while the RSS creeps means no Python object
  leaks;
- ``gc_objects``: the objects the cycle collector tracks (containers: lists, dicts,
  instances), the usual suspects of a leak;
- ``malloc_used`` / ``malloc_free``: glibc's heap in use and freed but still held
  (``mallinfo2``; absent on another C library): a ``malloc_free`` that grows with each
  backlog spike is memory the allocator keeps, not a leak;
- the RocksDB figures of each on-disk table the process holds (memtables, table
  readers, block cache).

:class:`MemoryReport` gathers them; the stream processors log its line every
``FXSTREAM_MEMORY_REPORT_S`` seconds (default :data:`DEFAULT_REPORT_S`, 0: never) as
``memory: rss=... py_blocks=...``. With ``FXSTREAM_MALLOC_TRIM=1`` each report first
asks glibc to return its free heap to the system (``malloc_trim(0)``), and logs how much
that gave back.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Final

import psutil

__all__ = [
    "DEFAULT_REPORT_S",
    "MALLOC_TRIM_ENV",
    "REPORT_S_ENV",
    "MemoryReport",
    "malloc_figures",
    "malloc_trim",
    "report_interval_s",
    "report_periodically",
]

log = logging.getLogger(__name__)

DEFAULT_REPORT_S: Final = 120.0
"""Seconds between two memory lines (and trims) of a service process, by default."""
REPORT_S_ENV: Final = "FXSTREAM_MEMORY_REPORT_S"
MALLOC_TRIM_ENV: Final = "FXSTREAM_MALLOC_TRIM"
_MB: Final = 1024 * 1024


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


_LIBC: Final = _libc()


def malloc_figures() -> dict[str, int]:
    """glibc's heap in bytes: ``malloc_used`` (handed out, mmapped blocks included) and
    ``malloc_free`` (freed, still held by the allocator); empty without ``mallinfo2``."""
    mallinfo2 = getattr(_LIBC, "mallinfo2", None)
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"malloc_used": info.uordblks + info.hblkhd, "malloc_free": info.fordblks}


def malloc_trim() -> bool:
    """Ask glibc to give its free heap back to the system; False when it cannot."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def report_interval_s(environ: Mapping[str, str] = os.environ) -> float:
    """The seconds between memory lines (``FXSTREAM_MEMORY_REPORT_S``; 0: never).

    ``ValueError`` saying what to write when the setting is not a number of seconds."""
    raw = environ.get(REPORT_S_ENV, "").strip()
    if not raw:
        return DEFAULT_REPORT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"{REPORT_S_ENV} must be a number of seconds between memory lines (0: never), "
            f"e.g. {DEFAULT_REPORT_S:g}; not {raw!r}"
        )
    return value


class MemoryReport:
    """A process's memory figures (see the module notes), with the tables it holds."""

    def __init__(self, *, trim: bool | None = None) -> None:
        self._tables: dict[str, Callable[[], Mapping[str, int]]] = {}
        self.trim = os.environ.get(MALLOC_TRIM_ENV, "1").strip() != "0" if trim is None else trim

    def add_table(self, name: str, figures: Callable[[], Mapping[str, int]]) -> None:
        """Report ``figures()`` (bytes, RocksDB's own account) as ``name`` too."""
        self._tables[name] = figures

    def figures(self) -> dict[str, int]:
        """Every figure now, in bytes or counts (the tables' as ``<name>.<figure>``)."""
        figures = {
            "rss": psutil.Process().memory_info().rss,
            "py_blocks": sys.getallocatedblocks(),
            "gc_objects": len(gc.get_objects()),
            **malloc_figures(),
        }
        for name, table in self._tables.items():
            for key, value in table().items():
                figures[f"{name}.{key}"] = value
        return figures

    def line(self) -> str:
        """One log line: the figures, sizes in MB, counts as they are (trimming first
        when :attr:`trim` is set, with the RSS it gave back)."""
        parts: list[str] = []
        if self.trim:
            before = psutil.Process().memory_info().rss
            started = time.monotonic()
            if malloc_trim():
                after = psutil.Process().memory_info().rss
                parts.append(
                    f"trimmed={(before - after) / _MB:.1f}MB "
                    f"in {1000 * (time.monotonic() - started):.0f}ms"
                )
        for key, value in self.figures().items():
            counted = key in ("py_blocks", "gc_objects") or key.endswith("_files")
            parts.append(f"{key}={value}" if counted else f"{key}={value / _MB:.1f}MB")
        return "memory: " + " ".join(parts)


async def report_periodically(report: MemoryReport, interval_s: float) -> None:
    """Log ``report``'s line every ``interval_s`` seconds until cancelled (for a process
    without faust's timers: the REST API)."""
    while True:
        await asyncio.sleep(interval_s)
        log.info("%s", await asyncio.to_thread(report.line))
