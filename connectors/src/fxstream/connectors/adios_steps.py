"""An ADIOS2 step source: one event on ``events.<source>`` per step of a BP5 stream.

:class:`Adios2StepSource` opens a BP5 file (a directory) for streaming reads while its
writer appends steps, and for every step writes one :class:`~fxstream.topics.Event`
(``event_type="adios2-step"``) naming the file and the step: ``attributes`` hold ``path``,
``engine`` (``"BP5"``), ``step`` and ``variables`` (the step's variable names, comma
separated). The step's data is not read and stays in ADIOS2; a consumer reads exactly that
step by reference with :func:`read_step` (any variable) or :func:`read_stream_step` (a step
of an :class:`~fxstream.connectors.Adios2Stream`). For an ``Adios2Stream`` written with
``engine="bp5"`` the source also reads the step's small ``meta`` string and adds ``seq``,
``dtype``, ``shape`` (JSON) and ``label`` (the step's ``label`` attribute, if any); its
``end`` or ``abort`` step ends the source (no event for it).

The source stops at the end of the stream (the writer closed its engine, or sent ``end``),
when ``stop`` is set, or after ``idle_timeout_s`` without a new step.

Restart guarantee: each event's key is :func:`step_event_key` (``<path>#<step>``), written
in a transaction by an :class:`~fxstream.connectors.event_writer.EventWriter` (transactional
id ``fxstream-source.<source>.adios2``). A restarted source reads the topic's recent keys,
walks the file from its first step again and skips the steps already announced: no step is
lost or announced twice, provided the earlier event is among the last ``scan_records``
records of its partition (see :mod:`fxstream.connectors.event_writer`).

SST is not a source here: an SST step lives only in the writer's memory until its readers
release it, so an event cannot name it by reference for a later consumer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Final

import adios2.bindings as adios2_bindings  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt

from fxstream.connectors.adios import remove_bp5_reader_profile
from fxstream.connectors.adios_stream import StreamStep
from fxstream.connectors.event_writer import EventWriter
from fxstream.topics import Event

__all__ = [
    "STEP_EVENT_TYPE",
    "Adios2StepSource",
    "read_step",
    "read_stream_step",
    "step_event_key",
]

log = logging.getLogger(__name__)

STEP_EVENT_TYPE: Final = "adios2-step"
_MAX_KEY_CHARS: Final = 1024
_META = "meta"
_ARRAY = "array"


def step_event_key(path: str, step: int) -> str:
    """The event key of one step: ``<path>#<step>`` (``sha256:<hex>`` when too long)."""
    key = f"{path}#{step}"
    if len(key) <= _MAX_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class Adios2StepSource:
    """Writes one event per step of the BP5 file ``path`` (see the module doc).

    Args:
        writer: the source's event writer (not yet started: :meth:`run` starts it).
        path: the BP5 file (directory) to follow.
        open_timeout_s: how long to wait for the file to appear.
        poll_s: how long one wait for a new step lasts before ``stop`` is looked at.
        idle_timeout_s: stop after this many seconds without a new step (None: never).
    """

    def __init__(
        self,
        writer: EventWriter,
        path: str | os.PathLike[str],
        *,
        open_timeout_s: float = 30.0,
        poll_s: float = 0.25,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.writer = writer
        self.path = str(Path(path).absolute())
        self.open_timeout_s = open_timeout_s
        self.poll_s = poll_s
        self.idle_timeout_s = idle_timeout_s
        self.emitted = 0
        """Events this source wrote."""
        self.steps_seen = 0
        """Steps read (announced now or before a restart)."""
        self.ended: str | None = None
        """Why the source stopped reading: ``end``, ``abort``, ``end-of-stream``, ``idle``."""

    def run(self, stop: threading.Event | None = None) -> None:
        """Start the writer and announce every step until the stream ends (or ``stop``)."""
        stop = stop or threading.Event()
        self.writer.start()
        adios = adios2_bindings.ADIOS()
        io = adios.DeclareIO("fxstream-step-source")
        io.SetEngine("BP5")
        io.SetParameters({"OpenTimeoutSecs": str(int(max(1, self.open_timeout_s)))})
        try:
            engine = io.Open(self.path, adios2_bindings.Mode.Read)
        except Exception as error:
            raise TimeoutError(
                f"could not open the BP5 stream {self.path} within {self.open_timeout_s} s "
                f"({error}): is its writer running, on a file system this host shares?"
            ) from error
        try:
            self._follow(io, engine, stop)
        finally:
            with contextlib.suppress(Exception):
                engine.Close()
            remove_bp5_reader_profile(self.path)
            self.writer.close()

    def _follow(self, io: Any, engine: Any, stop: threading.Event) -> None:
        last_step = time.monotonic()
        while not stop.is_set():
            status = engine.BeginStep(adios2_bindings.StepMode.Read, self.poll_s)
            if status == adios2_bindings.StepStatus.NotReady:
                if (
                    self.idle_timeout_s is not None
                    and time.monotonic() - last_step > self.idle_timeout_s
                ):
                    self.ended = "idle"
                    return
                continue
            if status != adios2_bindings.StepStatus.OK:
                self.ended = "end-of-stream"
                return
            last_step = time.monotonic()
            try:
                step = int(engine.CurrentStep())
                variables = io.AvailableVariables()
                meta = self._meta(io, engine, variables)
            finally:
                engine.EndStep()
            if meta is not None and meta.get("kind") in ("end", "abort"):
                self.ended = str(meta["kind"])
                return
            self.steps_seen += 1
            event = self.event_for(step, sorted(variables), meta)
            if self.writer.already_written(event.event_key):
                continue
            self.writer.write([event])
            self.emitted += 1
            log.info("step %d of %s announced", step, self.path)

    @staticmethod
    def _meta(io: Any, engine: Any, variables: dict[str, Any]) -> dict[str, Any] | None:
        """The step's ``meta`` (an Adios2Stream step), or None for other files."""
        if variables.get(_META, {}).get("Type") != "string":
            return None
        try:
            value = json.loads(engine.Get(io.InquireVariable(_META), adios2_bindings.Mode.Sync))
        except (ValueError, TypeError):
            return None
        return value if isinstance(value, dict) else None

    def event_for(self, step: int, variables: list[str], meta: dict[str, Any] | None) -> Event:
        """The event announcing ``step`` of this file."""
        attributes: dict[str, str | int | float | bool | None] = {
            "path": self.path,
            "engine": "BP5",
            "step": step,
            "variables": ",".join(variables)[:4096],
        }
        if meta is not None and meta.get("kind") == "data":
            attributes["seq"] = int(meta.get("seq", step))
            attributes["dtype"] = str(meta.get("dtype", ""))
            attributes["shape"] = json.dumps(meta.get("shape", []))
            label = meta.get("attributes", {}).get("label")
            if isinstance(label, str | int | float | bool):
                attributes["label"] = label
        return Event(
            source=self.writer.source,
            event_key=step_event_key(self.path, step),
            event_type=STEP_EVENT_TYPE,
            occurred_at=time.time(),
            attributes=attributes,
        )


def _open_random_access(path: str) -> tuple[Any, Any, Any]:
    adios = adios2_bindings.ADIOS()
    io = adios.DeclareIO("fxstream-step-reader")
    io.SetEngine("BP5")
    return adios, io, io.Open(path, adios2_bindings.Mode.ReadRandomAccess)


def read_step(path: str, step: int, variable: str, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """The flat array ``variable`` holds at ``step`` of the BP5 file ``path`` (by reference:
    what a step event names), read as ``dtype`` (the variable's ADIOS2 type)."""
    _adios, io, engine = _open_random_access(path)
    try:
        var = io.InquireVariable(variable)
        if var is None:
            raise KeyError(f"no variable {variable!r} in {path}")
        var.SetStepSelection([step, 1])
        out = np.empty(int(var.SelectionSize()), dtype=dtype)
        if out.size:
            engine.Get(var, out, adios2_bindings.Mode.Sync)
        return out
    finally:
        engine.Close()
        remove_bp5_reader_profile(path)


def read_stream_step(path: str, step: int) -> StreamStep:
    """The array and attributes of ``step`` of an ``Adios2Stream`` written as BP5 (the step a
    step event names), read by reference from the file."""
    _adios, io, engine = _open_random_access(path)
    try:
        meta_var = io.InquireVariable(_META)
        meta_var.SetStepSelection([step, 1])
        meta = json.loads(engine.Get(meta_var, adios2_bindings.Mode.Sync))
        if meta.get("kind") != "data":
            raise ValueError(f"step {step} of {path} is the stream's {meta.get('kind')} step")
        dtype = np.dtype(meta["dtype"])
        shape = tuple(int(n) for n in meta["shape"])
        raw = np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
        if raw.size:
            array_var = io.InquireVariable(_ARRAY)
            array_var.SetStepSelection([step, 1])
            engine.Get(array_var, raw, adios2_bindings.Mode.Sync)
        return StreamStep(int(meta["seq"]), raw.view(dtype).reshape(shape), meta["attributes"])
    finally:
        engine.Close()
        remove_bp5_reader_profile(path)
