"""Read-while-writing file streams between real processes: end, abort, hang, corruption.

Writers run as other processes (``roles.py file-write``). In the end-to-end case the
reader is a process too and starts before the writer exists; a gate holds the writer
after its first chunk until the reader has reported it, so the reader demonstrably
reads while the stream is being written.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from fxstream.connectors import FileStreamReader, FileStreamWriter, StreamAborted
from tests.connectors.roles import chunk_bytes, start_role

# A SIGKILLed writer must surface as StreamAborted within this many seconds.
ABORT_BOUND_S = 3.0
SIZE = 100_000


def test_a_reader_process_tails_the_stream_another_process_writes(workdir: Path) -> None:
    path = workdir / "stream"
    gate = workdir / "gate"
    with start_role(workdir, "file-read", "--path", str(path)) as reader:
        time.sleep(0.3)  # the reader is up and waiting for a file that does not exist yet
        assert not path.exists()
        with start_role(
            workdir,
            "file-write",
            "--path",
            str(path),
            "--chunks",
            "30",
            "--size",
            str(SIZE),
            "--gate",
            str(gate),
        ) as writer:
            assert reader.next_report() == {"index": 0, "intact": True}
            assert writer.process.poll() is None, "the writer must still be writing"
            gate.touch()
            reports = reader.reports_until("end", "aborted")
            assert writer.reports_until("closed")[-1] == {"closed": True}
            assert writer.wait() == 0 and reader.wait() == 0
    assert reports[:-1] == [{"index": i, "intact": True} for i in range(1, 30)]
    assert reports[-1] == {"end": True}
    # The writer removed its lease after the end marker; the stream stays for later readers.
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith("stream")) == ["stream"]
    with FileStreamReader(path) as again:
        assert [bytes(c) for c in again] == [chunk_bytes(i, SIZE) for i in range(30)]
        assert again.read_chunk() is None


@pytest.mark.parametrize("then", ["hang", "partial"])
def test_a_sigkilled_writer_aborts_the_reader_within_a_bound(workdir: Path, then: str) -> None:
    # "partial": the writer dies in the middle of a chunk (a header and 10 of 1000 bytes).
    path = workdir / "stream"
    with start_role(
        workdir, "file-write", "--path", str(path), "--chunks", "2", "--then", then
    ) as writer:
        writer.reports_until("hanging")
        with FileStreamReader(path) as reader:
            assert [bytes(reader.read_chunk() or b"") for _ in range(2)] == [
                chunk_bytes(0, 4096),
                chunk_bytes(1, 4096),
            ]
            os.kill(writer.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(StreamAborted, match=f"writer process {writer.pid}") as aborted:
                reader.read_chunk()
            waited = time.monotonic() - killed_at
    assert waited < ABORT_BOUND_S, f"the abort took {waited:.1f} s"
    assert "2 chunks were read" in aborted.value.reason
    if then == "partial":
        assert "stopped at 10 of 1000 bytes" in aborted.value.reason


def test_a_hung_writer_is_declared_dead_when_its_lease_goes_stale(workdir: Path) -> None:
    # SIGSTOP keeps the PID alive: only the lease's staleness (the check that works
    # across hosts) can end the wait.
    path = workdir / "stream"
    with start_role(
        workdir, "file-write", "--path", str(path), "--chunks", "1", "--then", "hang"
    ) as writer:
        writer.reports_until("hanging")
        with FileStreamReader(path, stale_after=1.5) as reader:
            assert reader.read_chunk() is not None
            os.kill(writer.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                with pytest.raises(StreamAborted, match="has not refreshed its lease"):
                    reader.read_chunk()
            finally:
                os.kill(writer.pid, signal.SIGKILL)
            waited = time.monotonic() - stopped_at
    assert 1.5 <= waited < 1.5 + ABORT_BOUND_S, f"declared dead after {waited:.1f} s"


def test_a_writer_that_raises_aborts_its_readers_with_the_error(workdir: Path) -> None:
    path = workdir / "stream"
    with start_role(
        workdir, "file-write", "--path", str(path), "--chunks", "3", "--then", "raise"
    ) as writer:
        assert writer.wait() == 1
    with FileStreamReader(path) as reader:
        assert len([reader.read_chunk() for _ in range(3)]) == 3
        with pytest.raises(StreamAborted, match="the producer failed on purpose"):
            reader.read_chunk()
        assert reader.read_chunk() is None


def test_writer_describes_itself_and_refuses_misuse(workdir: Path) -> None:
    path = workdir / "stream"
    with FileStreamWriter(path, tier="ephemeral") as writer:
        writer.write(b"abc")
        writer.write(bytearray(10))
        writer.write(memoryview(b"x" * 5))
        # No digest while the stream is open: it names the whole stream.
        assert writer.describe() == (str(path), 18, "ephemeral", socket.gethostname(), False, "")
        assert (workdir / "stream.writer").exists()
    assert not (workdir / "stream.writer").exists()
    assert writer.describe().complete
    expected = hashlib.sha256(b"abc" + bytes(10) + b"xxxxx").hexdigest()
    assert writer.describe().sha256 == expected
    with pytest.raises(ValueError, match="is closed"):
        writer.write(b"late")
    with pytest.raises(FileExistsError, match="written once"):
        FileStreamWriter(path)
    with pytest.raises(ValueError, match="unknown storage tier"):
        FileStreamWriter(workdir / "other", tier="fast")
    with FileStreamReader(path) as reader:
        assert [bytes(c) for c in reader] == [b"abc", bytes(10), b"xxxxx"]


def test_reader_errors_say_what_is_wrong(workdir: Path) -> None:
    with pytest.raises(TimeoutError, match=r"did not appear within 0\.2 s"):
        FileStreamReader(workdir / "missing", open_timeout=0.2)
    (workdir / "foreign").write_bytes(b"not a stream at all")
    with pytest.raises(ValueError, match="not an fxstream file stream"):
        FileStreamReader(workdir / "foreign")
    # A stream whose writer closed its lease without an end marker counts as aborted.
    with FileStreamWriter(workdir / "cut") as writer:
        writer.write(b"one")
    data = (workdir / "cut").read_bytes()
    (workdir / "cut").write_bytes(data[:-9])  # drop the end frame
    with FileStreamReader(workdir / "cut") as reader:
        assert reader.read_chunk() == b"one"
        with pytest.raises(StreamAborted, match=r"lease .* is gone"):
            reader.read_chunk()
