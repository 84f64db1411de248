"""The SDK gives a drained backlog's heap back (:mod:`fxstream.sdk.heap`)."""

from __future__ import annotations

import psutil
import pytest

from fxstream.sdk.heap import BacklogTrim, malloc_trim, trim_count, trimming_enabled

MB = 1_000_000


def test_malloc_trim_returns_freed_heap_that_pinned_blocks_held() -> None:
    """What the SDK relies on: glibc keeps freed heap below a live block, and a trim gives
    its pages back (the bench's client grew this way at each backlog peak)."""
    process = psutil.Process()
    blocks = [bytes(1_000) + i.to_bytes(4, "little") for i in range(100_000)]
    pinned = blocks[::100]  # one live block every ~100 kB keeps the heap from shrinking
    del blocks
    held = process.memory_info().rss
    before = trim_count()
    assert malloc_trim()
    released = held - process.memory_info().rss
    assert trim_count() == before + 1
    assert released > 50 * MB, f"the trim gave back only {released / MB:.1f} MB"
    assert len(pinned) == 1_000


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _trim_noting(calls: list[float], clock: _Clock) -> BacklogTrim:
    """A trimmer (peak 1,000, every 30 s) whose trims note the clock's time."""
    return BacklogTrim(
        peak=1_000,
        every_s=30,
        enabled=True,
        trim=lambda: calls.append(clock.now) or True,
        clock=clock,
    )


def test_a_backlog_is_trimmed_once_it_has_drained_to_a_quarter() -> None:
    calls: list[float] = []
    clock = _Clock()
    trim = _trim_noting(calls, clock)
    for in_flight in (10, 500, 1_200, 900, 301):
        assert not trim.observe(in_flight)
    assert trim.observe(300)  # a quarter of the 1,200 peak
    assert calls == [0.0]
    assert not trim.observe(0)  # drained further: the same backlog, trimmed already
    assert trim.trims == 1


def test_trims_are_spaced_and_small_backlogs_never_trim() -> None:
    calls: list[float] = []
    clock = _Clock()
    trim = _trim_noting(calls, clock)
    for in_flight in (999, 0, 999, 0):
        assert not trim.observe(in_flight)
    assert trim.observe(2_000) is False and trim.observe(0)
    clock.now = 10.0
    assert not trim.observe(5_000) and not trim.observe(0)  # within 30 s of the last
    clock.now = 31.0
    assert trim.observe(0)  # the 5,000 peak still counts once the spacing allows
    assert calls == [0.0, 31.0]


def test_trimming_is_off_with_the_setting() -> None:
    assert not trimming_enabled({"FXSTREAM_MALLOC_TRIM": "0"})
    assert trimming_enabled({})
    trim = BacklogTrim(enabled=trimming_enabled({"FXSTREAM_MALLOC_TRIM": "0"}), trim=lambda: True)
    assert not trim.observe(10_000) and not trim.observe(0)
    with pytest.raises(ValueError, match="peak must be at least 1"):
        BacklogTrim(peak=0)
