"""Giving the heap of a backlog back to the system once it drains.

A client that had thousands of tasks in flight holds their futures, records and
results; when they are done, Python frees them, but glibc keeps most of the freed heap
for later (it returns only the top of its main arena on its own). So a long-running
client's resident size steps up at each new backlog peak and never comes down, although
the objects it tracks are bounded (the 1-hour soak, docs/benchmarks.md).

:class:`BacklogTrim` watches the number of tasks in flight; after a peak of at least
``peak`` tasks has drained to a quarter of it, it calls glibc's ``malloc_trim(0)`` (at
most once every ``every_s`` seconds), which returns the free pages inside the heap too.
It costs a few milliseconds of the results thread, after a burst, never per task.
``FXSTREAM_MALLOC_TRIM=0`` turns it off (the service processes read the same setting);
on a C library without ``malloc_trim`` it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["MALLOC_TRIM_ENV", "BacklogTrim", "malloc_trim", "trim_count", "trimming_enabled"]

MALLOC_TRIM_ENV: Final = "FXSTREAM_MALLOC_TRIM"
"""Set to ``0`` to keep the allocator's free heap (no trim after a backlog drains)."""

_DEFAULT_PEAK: Final = 1_000
_DEFAULT_EVERY_S: Final = 30.0


def _trim_function() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM: Final = _trim_function()
_trims = 0


def malloc_trim() -> bool:
    """Ask glibc to give its free heap back to the system; False when it cannot."""
    global _trims
    if _TRIM is None:
        return False
    _TRIM(0)
    _trims += 1
    return True


def trim_count() -> int:
    """How many times this process has trimmed its heap through :func:`malloc_trim`."""
    return _trims


def trimming_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False when ``FXSTREAM_MALLOC_TRIM`` is ``0``."""
    return environ.get(MALLOC_TRIM_ENV, "1").strip() != "0"


class BacklogTrim:
    """Trims the heap when a backlog of at least ``peak`` tasks has drained to a quarter.

    Call :meth:`observe` with the number of tasks in flight whenever it may have
    changed; it returns True when it trimmed. ``trim`` and ``clock`` are for tests
    that count calls; by default glibc's ``malloc_trim`` and :func:`time.monotonic`.
    """

    def __init__(
        self,
        *,
        peak: int = _DEFAULT_PEAK,
        every_s: float = _DEFAULT_EVERY_S,
        enabled: bool | None = None,
        trim: Callable[[], bool] = malloc_trim,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if peak < 1:
            raise ValueError(f"peak must be at least 1 task, not {peak}")
        self.peak = peak
        self.every_s = every_s
        self.enabled = trimming_enabled() if enabled is None else enabled
        self.trims = 0
        self._trim = trim
        self._clock = clock
        self._highest = 0
        self._last = -float("inf")

    def observe(self, in_flight: int) -> bool:
        """Note ``in_flight`` tasks; trim (and return True) if a backlog just drained."""
        if not self.enabled:
            return False
        if in_flight > self._highest:
            self._highest = in_flight
            return False
        if self._highest < self.peak or in_flight * 4 > self._highest:
            return False
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._highest = in_flight
        self._last = now
        if self._trim():
            self.trims += 1
            return True
        return False
