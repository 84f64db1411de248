"""The processors' memory line (:mod:`fxstream.service.memory_report`): its figures move
with what they claim to measure, and a bad interval setting says what to write."""

from __future__ import annotations

import gc
import re
import tempfile
from pathlib import Path

import pytest

from fxstream.service.memory_report import (
    DEFAULT_REPORT_S,
    REPORT_S_ENV,
    MemoryReport,
    malloc_figures,
    report_interval_s,
)
from fxstream.service.task_table import TaskStateTable


def test_python_blocks_and_tracked_objects_count_what_is_kept() -> None:
    report = MemoryReport(trim=False)
    # Earlier tests leave cyclic garbage; a collection triggered while the lists are made
    # would free it and hide them (CI saw 81,768 of 100,000). Collect first, then hold
    # the collector still, so the figures move only by what this test keeps.
    gc.collect()
    gc.disable()
    try:
        before = report.figures()
        kept = [[n] for n in range(100_000)]  # lists: always tracked by the collector
        during = report.figures()
        del kept
        after = report.figures()
    finally:
        gc.enable()
    assert during["py_blocks"] - before["py_blocks"] >= 100_000
    assert during["gc_objects"] - before["gc_objects"] >= 100_000
    assert after["gc_objects"] <= during["gc_objects"] - 100_000


@pytest.mark.skipif(not malloc_figures(), reason="not glibc: no mallinfo2 here")
def test_malloc_figures_see_a_large_c_allocation_and_its_release() -> None:
    before = malloc_figures()
    # bytearrays of this size come from malloc (not Python's small-object arenas).
    held = [bytearray(4096) for _ in range(2_000)]
    during = malloc_figures()
    assert during["malloc_used"] - before["malloc_used"] >= 2_000 * 4096
    del held
    after = malloc_figures()
    assert after["malloc_used"] < during["malloc_used"] - 1_000 * 4096


def test_the_line_names_every_figure_and_a_tables_own() -> None:
    with tempfile.TemporaryDirectory() as directory:
        table = TaskStateTable(Path(directory) / "table")
        try:
            report = MemoryReport(trim=True)
            report.add_table("view", table.memory_figures)
            line = report.line()
        finally:
            table.close()
    assert line.startswith("memory: ")
    for name in ("rss", "py_blocks", "gc_objects", "view.memtables", "view.block_cache"):
        assert re.search(rf"\b{re.escape(name)}=\d", line), (name, line)
    if malloc_figures():
        assert re.search(r"trimmed=-?\d+\.\dMB in \d+ms", line), line


def test_the_interval_setting() -> None:
    assert report_interval_s({}) == DEFAULT_REPORT_S
    assert report_interval_s({REPORT_S_ENV: "0"}) == 0
    assert report_interval_s({REPORT_S_ENV: " 60 "}) == 60
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match=rf"{REPORT_S_ENV} must be a number of seconds"):
            report_interval_s({REPORT_S_ENV: bad})
