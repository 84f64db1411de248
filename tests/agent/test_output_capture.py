"""What a task prints is kept in bounded tail buffers (:mod:`fxstream.agent.output_capture`)."""

from __future__ import annotations

import sys
import threading

import pytest

from fxstream.agent.output_capture import TailBuffer, captured


def test_the_buffer_keeps_the_tail_and_counts_what_it_dropped() -> None:
    buffer = TailBuffer(limit=10)
    for n in range(100):
        assert buffer.write(f"{n:02d}") == 2
    assert buffer.text() == "[... 190 characters of output dropped ...]\n9596979899"
    with pytest.raises(TypeError, match="must be str"):
        buffer.write(b"bytes")  # type: ignore[arg-type]
    assert TailBuffer(limit=10).text() == ""


def test_prints_of_the_call_and_its_threads_are_captured_then_the_streams_come_back() -> None:
    before = sys.stdout, sys.stderr
    with captured(limit=1_000) as output:
        print("from the call")
        thread = threading.Thread(target=lambda: print("from a thread", file=sys.stderr))
        thread.start()
        thread.join()
    assert (sys.stdout, sys.stderr) == before
    assert output.stdout == "from the call\n"
    assert output.stderr == "from a thread\n"
