"""Fixtures of the connector tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A private directory for stores and streams, removed after the test."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)
