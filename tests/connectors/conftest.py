"""Fixtures of the connector tests."""

from __future__ import annotations

import glob
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A private directory for stores and streams, removed after the test."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_adios_profiles_left_in_tmp() -> Iterator[None]:
    """ADIOS2's BP5 reader writes /tmp/<name>_<pid>_profiling.json on every close: the
    connectors remove theirs, and this checks that no test (or process it ran) left one."""
    before = set(glob.glob("/tmp/*_profiling.json"))
    yield
    left = set(glob.glob("/tmp/*_profiling.json")) - before
    if left:
        # Another pytest-xdist worker's reader may be between writing its profile and
        # its connector removing it: a profile left a second later is a leak.
        time.sleep(1.0)
        left &= set(glob.glob("/tmp/*_profiling.json"))
    assert not left, f"ADIOS2 reader profiles left in /tmp: {sorted(left)[:5]}"
