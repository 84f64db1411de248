"""The ADIOS2 stream measurement behind ``./fx bench stream`` runs for real on both engines."""

from __future__ import annotations

import glob
import tempfile

import pytest

from fxstream.ops.bench.stream_adios import measure_adios_stream


@pytest.mark.parametrize("engine", ["sst", "bp5"])
def test_measure_adios_stream_moves_every_array_to_a_consumer_process(engine: str) -> None:
    before = set(glob.glob(f"{tempfile.gettempdir()}/fxstream-bench-adios-*"))
    figures = measure_adios_stream(array_bytes=800_000, items=20, engine=engine)
    assert figures["engine"] == engine
    assert figures["items"] == 20 and figures["array_bytes"] == 800_000
    assert figures["seconds"] > 0
    assert figures["items_per_s"] == pytest.approx(20 / figures["seconds"], rel=0.01)
    assert figures["mb_per_s"] == pytest.approx(figures["items_per_s"] * 800_000 / 1e6, rel=0.01)
    assert set(glob.glob(f"{tempfile.gettempdir()}/fxstream-bench-adios-*")) == before


def test_measure_adios_stream_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        measure_adios_stream(array_bytes=12, items=1)
    with pytest.raises(ValueError, match="at least 1"):
        measure_adios_stream(array_bytes=8, items=0)
    with pytest.raises(ValueError, match="engine must be one of"):
        measure_adios_stream(array_bytes=8, items=1, engine="hdf5")
