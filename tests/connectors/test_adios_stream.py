"""ADIOS2 array streams between real processes, on SST (TCP on 127.0.0.1) and on BP5.

The SST tests are the evidence that SST works with the PyPI ``adios2`` wheel on this
machine: a writer process and a reader process exchange steps over the WAN data
transport (sockets on ``lo``). Each engine is run through the same cases: a clean end,
a producer killed with SIGKILL mid-stream, a hung producer (SIGSTOP: only its lease
can tell), and a producer that raises.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from fxstream.connectors import Adios2Stream, StreamAborted
from tests.connectors.roles import start_role, stream_array

ENGINES = ["sst", "bp5"]
# A SIGKILLed producer must surface as StreamAborted within this many seconds.
ABORT_BOUND_S = 5.0


def _stream(workdir: Path, engine: str, **options: object) -> tuple[Adios2Stream, Path]:
    stream = Adios2Stream(str(workdir / f"stream-{engine}"), engine=engine, **options)  # type: ignore[arg-type]
    pickled = workdir / f"stream-{engine}.pickle"
    pickled.write_bytes(pickle.dumps(stream))
    return stream, pickled


@pytest.mark.parametrize("engine", ENGINES)
def test_a_reader_process_receives_every_step_then_the_end(workdir: Path, engine: str) -> None:
    stream, pickled = _stream(workdir, engine)
    gate = workdir / "gate"
    # Both sides are processes of their own; the reader is started first and the writer
    # holds back all but the first step until the reader has received it (the gate),
    # so the reader demonstrably reads while the writer is still writing.
    with (
        start_role(workdir, "adios-read", "--stream", str(pickled)) as reader,
        start_role(
            workdir,
            "adios-write",
            "--stream",
            str(pickled),
            "--items",
            "20",
            "--elements",
            "50000",
            "--gate",
            str(gate),
        ) as writer,
    ):
        first = reader.next_report(60)
        assert first["seq"] == 0 and first["intact"]
        gate.touch()
        reports = [first, *reader.reports_until("end", "aborted", timeout=60)]
        described = writer.reports_until("closed")[-1]["described"]
        assert described[:5] == [
            stream.path,
            20 * 50000 * 8,
            stream.storage_tier.value,
            socket.gethostname(),
            True,
        ]
        assert len(described[5]) == 64, "a closed stream describes its sha256"
        assert writer.wait() == 0 and reader.wait() == 0
    steps = [r for r in reports if "seq" in r]
    assert [r["seq"] for r in steps] == list(range(20))
    assert all(r["intact"] for r in steps)
    assert steps[7]["attributes"] == {"index": 7, "label": "step-7"}
    assert reports[-1] == {"end": True}
    stream.remove()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sigkilled_producer_aborts_the_stream_within_a_bound(workdir: Path, engine: str) -> None:
    stream, pickled = _stream(workdir, engine)
    with (
        start_role(
            workdir, "adios-write", "--stream", str(pickled), "--items", "3", "--then", "hang"
        ) as writer,
        stream.reader() as reader,
    ):
        received = [reader.receive() for _ in range(3)]
        writer.reports_until("hanging")
        os.kill(writer.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(StreamAborted) as aborted:
            reader.receive()
        waited = time.monotonic() - killed_at
    assert [step.seq for step in received if step is not None] == [0, 1, 2]
    assert np.array_equal(received[2].array, stream_array(2, 1000))  # type: ignore[union-attr]
    assert waited < ABORT_BOUND_S, f"the abort took {waited:.1f} s"
    assert "3 arrays were received" in aborted.value.reason
    stream.remove()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hung_producer_is_declared_dead_when_its_lease_goes_stale(
    workdir: Path, engine: str
) -> None:
    # SIGSTOP keeps the PID alive, so only the lease's staleness (the check that also
    # works across hosts) can end the wait.
    stream, pickled = _stream(workdir, engine, stale_after=2.0, lease_interval=0.2)
    with start_role(
        workdir, "adios-write", "--stream", str(pickled), "--items", "2", "--then", "hang"
    ) as writer:
        reader = stream.reader()
        try:
            assert reader.receive() is not None and reader.receive() is not None
            writer.reports_until("hanging")
            os.kill(writer.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            with pytest.raises(StreamAborted, match="has not refreshed its lease") as aborted:
                reader.receive()
            waited = time.monotonic() - stopped_at
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            reader.close()
    assert 2.0 <= waited < 2.0 + ABORT_BOUND_S, f"declared dead after {waited:.1f} s"
    assert str(writer.pid) in aborted.value.reason
    stream.remove()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_producer_that_raises_aborts_with_its_error(workdir: Path, engine: str) -> None:
    stream, pickled = _stream(workdir, engine)
    with (
        start_role(
            workdir, "adios-write", "--stream", str(pickled), "--items", "1", "--then", "raise"
        ) as writer,
        stream.reader() as reader,
    ):
        assert reader.receive() is not None
        with pytest.raises(StreamAborted, match="the producer failed on purpose"):
            reader.receive()
        assert writer.wait() == 1
    stream.remove()


def test_bp5_carries_any_numeric_dtype_and_shape(workdir: Path) -> None:
    stream = Adios2Stream(str(workdir / "dtypes"), engine="bp5")
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(7, dtype=np.int64),
        np.zeros((0, 5)),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex128),
        np.array([True, False, True]),
        np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3)),
    ]
    with stream.writer() as writer:
        for array in arrays:
            writer.send(array, dtype=str(array.dtype))
        with pytest.raises(TypeError, match="cannot stream"):
            writer.send(np.array([object()]))
        with pytest.raises(TypeError, match="JSON"):
            writer.send(np.zeros(1), when=object())
    # BP5 keeps the stream: a reader that comes after the writer closed reads it all.
    with stream.reader() as reader:
        received = list(reader)
    assert len(received) == len(arrays)
    for step, array in zip(received, arrays, strict=True):
        assert step.array.dtype == array.dtype and step.array.shape == array.shape
        assert np.array_equal(step.array, array)
        assert step.attributes == {"dtype": str(array.dtype)}
    described = writer.describe()
    assert described.size_bytes == sum(a.nbytes for a in arrays)
    assert (described.key, described.tier, described.complete) == (stream.path, "durable", True)
    stream.remove()
    assert not any(workdir.iterdir())


def test_bad_stream_settings_are_refused_with_what_to_do(workdir: Path) -> None:
    with pytest.raises(ValueError, match=r"'sst' .* or 'bp5'"):
        Adios2Stream(str(workdir / "x"), engine="hdf5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be 'durable'"):
        Adios2Stream(str(workdir / "x"), engine="sst", tier="durable")
    with pytest.raises(ValueError, match="stale_after"):
        Adios2Stream(str(workdir / "x"), engine="bp5", stale_after=1.0, lease_interval=1.0)
    assert Adios2Stream(str(workdir / "x"), engine="bp5").storage_tier == "durable"
    assert Adios2Stream(str(workdir / "x")).storage_tier == "ephemeral"


def test_a_reader_without_a_writer_times_out_clearly(workdir: Path) -> None:
    stream = Adios2Stream(str(workdir / "nobody"), engine="bp5", open_timeout=1)
    with pytest.raises(TimeoutError, match="is its writer running"):
        stream.reader()


def test_an_sst_writer_without_a_reader_times_out_clearly(workdir: Path) -> None:
    stream = Adios2Stream(str(workdir / "lonely"), engine="sst", open_timeout=1)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no reader connected"):
        stream.writer()
    assert 1 <= time.monotonic() - started < 5
    assert not any(workdir.iterdir()), "the writer left its lease or contact file behind"
