"""The ADIOS2 step source on real BP5 streams and the session broker: one event per step,
the data left in ADIOS2 and read back by reference; a source killed mid-stream and
restarted announces every step once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adios2.bindings as adios2_bindings  # type: ignore[import-untyped]
import numpy as np

from fxstream.connectors import Adios2Stream
from fxstream.connectors.adios_steps import (
    STEP_EVENT_TYPE,
    Adios2StepSource,
    read_step,
    read_stream_step,
    step_event_key,
)
from fxstream.connectors.event_writer import EventWriter
from fxstream.topics import Catalogue, KafkaConnection
from tests.triggers.support import read_events, start_source, wait_for_events


def _frame(index: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.arange(1000, dtype=np.float64).reshape(10, 100) * (index + 1)


def test_each_step_of_a_bp5_stream_fires_one_event_and_its_data_stays_in_adios2(
    kafka: KafkaConnection,
    credentials: Path,
    unique_prefix: str,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    stream = Adios2Stream(str(tmp_path / "frames"), engine="bp5")
    command = ("adios", stream.path, "--source", source_name)
    writer = stream.writer()
    try:
        for i in range(3):
            writer.send(_frame(i), label=f"frame-{i}")
        with start_source(tmp_path, credentials, unique_prefix, *command) as first:
            first.wait_ready()
            # Announced while the writer is still writing (read while written).
            wait_for_events(kafka, topic, lambda found: len(found) >= 3)
            first.kill()
        for i in range(3, 5):
            writer.send(_frame(i), label=f"frame-{i}")
    finally:
        writer.close()
    with start_source(tmp_path, credentials, unique_prefix, *command) as second:
        second.wait_ready()
        # The end-of-stream step ends the source by itself.
        assert second.process.wait(timeout=30) == 0, second.log.read_text()[-2000:]
        assert "stopped (end): 2 events" in second.output()
    events = read_events(kafka, topic)
    steps = sorted(int(e.attributes["step"]) for e in events)  # type: ignore[arg-type]
    assert steps == [0, 1, 2, 3, 4], "a step lost or announced twice"
    for event in events:
        step = int(event.attributes["step"])  # type: ignore[arg-type]
        assert event.event_type == STEP_EVENT_TYPE and event.source == source_name
        assert event.event_key == step_event_key(stream.path, step)
        assert event.data is None, "the step's data stays in ADIOS2"
        assert event.attributes["label"] == f"frame-{step}"
        assert event.attributes["shape"] == "[10, 100]"
        # The consumer's side: the step the event names, read by reference from the file.
        read = read_stream_step(str(event.attributes["path"]), step)
        assert read.seq == event.attributes["seq"] == step
        np.testing.assert_array_equal(read.array, _frame(step))
        assert read.attributes == {"label": f"frame-{step}"}
    stream.remove()


def test_any_bp5_file_gives_one_event_per_step_naming_its_variables(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    path = str(tmp_path / "simulation.bp")
    adios = adios2_bindings.ADIOS()
    io = adios.DeclareIO("simulation")
    io.SetEngine("BP5")
    temperature = np.zeros(64, dtype=np.float64)
    variable = io.DefineVariable("temperature", temperature, [64], [0], [64], True)
    engine = io.Open(path, adios2_bindings.Mode.Write)
    for step in range(4):
        temperature[:] = np.linspace(0, 1, 64) + step
        engine.BeginStep()
        engine.Put(variable, temperature, adios2_bindings.Mode.Sync)
        engine.EndStep()
    engine.Close()

    source = Adios2StepSource(
        EventWriter(kafka, source_name, role="adios2", catalogue=catalogue), path
    )
    thread = threading.Thread(target=source.run, args=(threading.Event(),), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert source.ended == "end-of-stream" and source.emitted == 4
    time.sleep(0.2)
    events = sorted(read_events(kafka, topic), key=lambda e: int(e.attributes["step"]))  # type: ignore[arg-type]
    assert [e.attributes["step"] for e in events] == [0, 1, 2, 3]
    for event in events:
        step = int(event.attributes["step"])  # type: ignore[arg-type]
        assert event.attributes["variables"] == "temperature"
        assert "seq" not in event.attributes  # not an Adios2Stream: no stream metadata
        np.testing.assert_allclose(
            read_step(path, step, "temperature", np.float64), np.linspace(0, 1, 64) + step
        )
