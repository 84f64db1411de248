"""Producer -> consumer streams of numpy arrays between processes, over ADIOS2.

An :class:`Adios2Stream` names a stream and how it runs; it is a small frozen,
picklable value, so the producer and the consumer (another process, possibly started
with ``multiprocessing`` spawn) each get a copy and open their side:
``stream.writer()`` gives an :class:`Adios2StreamWriter`, ``stream.reader()`` an
:class:`Adios2StreamReader`.

Engines (``engine=``):

- ``"sst"`` (the default): ADIOS2's Sustainable Staging Transport, memory to memory.
  The writer publishes a contact file ``<path>.sst``; the reader connects to it and
  steps move over TCP (``DataTransport=WAN``, sockets, on the network interface
  ``interface``, ``lo`` = 127.0.0.1 by default). Nothing is stored: the tier is
  ``"ephemeral"``. Verified with the PyPI ``adios2`` wheel on this machine by
  ``tests/connectors/test_adios_stream.py`` (a writer process and a reader process).
  The writer's ``open`` waits until ``rendezvous_readers`` readers have connected
  (at most ``open_timeout`` seconds for them to announce themselves, then
  TimeoutError), and at most ``queue_limit`` steps wait in its memory for a slow
  reader (then ``send`` blocks: back-pressure, not loss). If the reader dies, SST
  drops it and the writer carries on, discarding later steps without an error.
- ``"bp5"``: read-while-writing on a BP5 file (a directory ``<path>``): the writer
  appends one step per array, the reader opens the file while it grows and polls for
  new steps. Works on any shared file system; the data stays afterwards (tier
  ``"durable"`` by default, ``"ephemeral"`` for a node-local directory).

Every step carries one array (sent as raw bytes: a ``uint8`` variable ``array``) and a
JSON string variable ``meta`` with the step's kind, sequence number, dtype, shape and
small user attributes.

End and abort. The writer's :meth:`~Adios2StreamWriter.close` sends a final step of
kind ``end`` before closing the engine, so a reader knows the stream is complete; a
writer leaving its ``with`` block on an exception sends an ``abort`` step with the
error instead. A producer that dies sends neither, and the reader raises
:class:`~fxstream.connectors.liveness.StreamAborted` within a bounded time:

- with SST, a killed writer's TCP connection drops and ``BeginStep`` returns an error
  (measured here: within a second); an engine end-of-stream without the ``end`` step
  also counts as aborted;
- with BP5 (and with an SST writer that hangs), nothing tells the reader, so it polls
  ``BeginStep`` with a timeout (``poll_interval``) and between polls checks the
  writer's lease ``<path>.writer`` (:mod:`fxstream.connectors.liveness`): a dead PID
  on the same machine is noticed at the next poll, a lease not refreshed for
  ``stale_after`` seconds anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, NamedTuple, Self, cast

import adios2.bindings as adios2_bindings  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt

from fxstream.connectors.adios import remove_bp5_reader_profile
from fxstream.connectors.descriptions import ObjectDescription, check_tier
from fxstream.connectors.integrity import Digest, verify_digest
from fxstream.connectors.liveness import (
    LeaseWatcher,
    StreamAborted,
    StreamWriterExit,
    WriterIdentity,
    WriterLease,
    lease_path_for,
)
from fxstream.topics import StorageTier

__all__ = [
    "ADIOS_STREAM_ENGINES",
    "Adios2Stream",
    "Adios2StreamReader",
    "Adios2StreamWriter",
    "StreamEngine",
    "StreamStep",
]

StreamEngine = Literal["sst", "bp5"]
ADIOS_STREAM_ENGINES: Final[tuple[StreamEngine, ...]] = ("sst", "bp5")
_META, _ARRAY = "meta", "array"
# SST readers announce themselves here before they connect (see Adios2StreamWriter._open).
_READERS_SUFFIX = ".readers"
# The user attributes of one step travel as JSON in its metadata: keep them small.
_MAX_ATTRIBUTES_BYTES = 64 * 1024


@dataclass(frozen=True)
class Adios2Stream:
    """One ADIOS2 array stream: where it lives and how it runs (give it to both sides).

    Args:
        path: the stream's name on disk. SST writes its contact file ``<path>.sst``,
            BP5 its data directory ``<path>``; both write the lease ``<path>.writer``.
            Must be on a file system the writer and the reader share.
        engine: ``"sst"`` (memory to memory over TCP) or ``"bp5"`` (file, read while
            written).
        tier: storage tier for the data-locations topic; defaults to ``"ephemeral"``
            for SST (nothing is stored) and ``"durable"`` for BP5.
        interface: SST's network interface for control and data (``lo``: 127.0.0.1).
        queue_limit: SST steps that may wait in the writer's memory for the reader.
        rendezvous_readers: SST readers the writer waits for when it opens.
        open_timeout: seconds a reader waits for the writer to appear.
        poll_interval: seconds a reader waits for a step before checking the writer's
            lease.
        stale_after: seconds without a lease refresh after which the writer is dead.
        lease_interval: seconds between the writer's lease refreshes.
    """

    path: str
    engine: StreamEngine = "sst"
    tier: StorageTier | str | None = None
    interface: str = "lo"
    queue_limit: int = 4
    rendezvous_readers: int = 1
    open_timeout: float = 30.0
    poll_interval: float = 0.25
    stale_after: float = 10.0
    lease_interval: float = 1.0
    _resolved_tier: StorageTier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.engine not in ADIOS_STREAM_ENGINES:
            raise ValueError(
                f"unknown ADIOS2 stream engine {self.engine!r}: use 'sst' (TCP staging) "
                "or 'bp5' (a file read while it is written)"
            )
        tier = check_tier(self.tier or ("ephemeral" if self.engine == "sst" else "durable"))
        if self.engine == "sst" and tier is StorageTier.DURABLE:
            raise ValueError(
                "an SST stream stores nothing, so it cannot be 'durable': use "
                "engine='bp5' on a shared directory for a durable stream"
            )
        if self.stale_after <= self.lease_interval:
            raise ValueError(
                f"stale_after ({self.stale_after} s) must exceed lease_interval "
                f"({self.lease_interval} s), or live writers look dead"
            )
        object.__setattr__(self, "path", str(Path(self.path).absolute()))
        object.__setattr__(self, "_resolved_tier", tier)

    @property
    def storage_tier(self) -> StorageTier:
        """The tier this stream's data lives in."""
        return self._resolved_tier

    def writer(self) -> Adios2StreamWriter:
        """Open the producer side (for SST: blocks until the reader(s) connect)."""
        return Adios2StreamWriter(self)

    def reader(self, *, expected_sha256: str | None = None) -> Adios2StreamReader:
        """Open the consumer side (waits up to ``open_timeout`` for the writer);
        ``expected_sha256`` is checked at the end of the stream."""
        return Adios2StreamReader(self, expected_sha256=expected_sha256)

    def remove(self) -> None:
        """Delete what the stream left on disk (BP5 data, SST contact file, lease)."""
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(f"{self.path}{_READERS_SUFFIX}", ignore_errors=True)
        for leftover in (f"{self.path}.sst", os.fspath(lease_path_for(self.path))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

    def _io(self, adios: Any, name: str, *, writing: bool) -> Any:
        io = adios.DeclareIO(name)
        if self.engine == "sst":
            io.SetEngine("SST")
            parameters = {
                "DataTransport": "WAN",
                "WANDataTransport": "sockets",
                "ControlInterface": self.interface,
                "DataInterface": self.interface,
                "OpenTimeoutSecs": str(int(max(1, self.open_timeout))),
            }
            if writing:
                parameters |= {
                    "RendezvousReaderCount": str(self.rendezvous_readers),
                    "QueueLimit": str(self.queue_limit),
                    "QueueFullPolicy": "Block",
                }
            io.SetParameters(parameters)
        else:
            io.SetEngine("BP5")
            if not writing:
                io.SetParameters({"OpenTimeoutSecs": str(int(max(1, self.open_timeout)))})
        return io


class StreamStep(NamedTuple):
    """One array received from a stream.

    Attributes:
        seq: the step's sequence number (0, 1, 2, ... in send order).
        array: the array, as sent (dtype and shape).
        attributes: the small attributes the writer sent with it.
    """

    seq: int
    array: npt.NDArray[Any]
    attributes: dict[str, Any]


class Adios2StreamWriter(StreamWriterExit):
    """The producer side of an :class:`Adios2Stream`: ``send`` arrays, then ``close``."""

    def __init__(self, stream: Adios2Stream) -> None:
        self.stream = stream
        self._sent = 0
        self._bytes = 0
        self._digest = Digest()
        self._engine: Any = None
        self._lease = WriterLease(lease_path_for(stream.path), stream.lease_interval)
        # The lease before the engine: a reader that can open the stream finds the lease.
        self._lease.acquire()
        try:
            self._adios = adios2_bindings.ADIOS()
            self._io = stream._io(self._adios, "fxstream-stream-writer", writing=True)
            self._meta = self._io.DefineVariable(_META)
            self._array = self._io.DefineVariable(
                _ARRAY, np.zeros(1, dtype=np.uint8), [], [], [1], False
            )
            self._engine = self._open()
        except BaseException:
            self._lease.release()
            raise

    def _open(self) -> Any:
        """The engine, opened for writing; for SST, once a reader has announced itself.

        SST's writer open waits for ``rendezvous_readers`` readers inside ADIOS2, holding
        the GIL and ignoring ``OpenTimeoutSecs`` (measured: still waiting after 10
        minutes), so it cannot be bounded from Python. Readers therefore announce
        themselves first (a marker file in ``<path>.readers/``, removed once connected),
        and the writer opens only when enough live readers are announced, or raises
        TimeoutError after ``open_timeout``. A reader that dies between its marker and
        its connection still leaves the writer waiting: the window is one open call.
        """
        if self.stream.engine == "sst":
            self._await_readers()
        return self._io.Open(self.stream.path, adios2_bindings.Mode.Write)

    def _await_readers(self) -> None:
        deadline = time.monotonic() + self.stream.open_timeout
        readers = Path(f"{self.stream.path}{_READERS_SUFFIX}")
        while True:
            live = 0
            for marker in readers.glob("*"):
                try:
                    identity = WriterIdentity(**json.loads(marker.read_text()))
                except (OSError, ValueError, TypeError):
                    continue  # being written or removed
                if identity.on_this_machine() and identity.process_gone():
                    continue  # a reader that died before it connected
                live += 1
            if live >= self.stream.rendezvous_readers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no reader connected to the SST stream {self.stream.path} within "
                    f"{self.stream.open_timeout} s: start the consumer (on a file system "
                    "shared with this writer), or raise open_timeout"
                )
            time.sleep(0.02)

    @property
    def sent(self) -> int:
        """Arrays sent so far."""
        return self._sent

    def describe(self) -> ObjectDescription:
        """The stream for data-locations: path, array bytes sent so far, tier, node,
        ``complete`` once the writer has closed (ended or aborted), and then the SHA-256
        of its data steps (what a reader's ``expected_sha256`` checks)."""
        complete = self._engine is None
        return ObjectDescription(
            self.stream.path,
            self._bytes,
            self.stream.storage_tier,
            self._lease.identity.host,
            complete=complete,
            sha256=self._digest.hexdigest() if complete else "",
        )

    def _step(self, meta: dict[str, Any], raw: npt.NDArray[np.uint8] | None) -> None:
        if self._engine is None:
            raise ValueError(f"stream {self.stream.path} is closed: nothing more can be sent")
        encoded = json.dumps(meta)
        if meta["kind"] == "data":
            # Each data step's metadata (seq, dtype, shape, attributes) and array bytes.
            self._digest.update(encoded.encode())
            if raw is not None:
                self._digest.update(raw.data)
        self._engine.BeginStep()
        self._engine.Put(self._meta, encoded)
        if raw is not None and raw.size:
            self._array.SetSelection([[], [int(raw.size)]])
            # Deferred, by address: ADIOS2 reads our buffer at EndStep, with no extra copy
            # (and the typed overload would refuse read-only arrays).
            self._engine.Put(self._array, raw.ctypes.data, adios2_bindings.Mode.Deferred)
        self._engine.EndStep()

    def send(self, array: npt.ArrayLike, **attributes: Any) -> int:
        """Send one array (any non-object dtype) with small JSON-able attributes.

        Returns the step's sequence number.
        """
        data = np.asarray(array)
        # ascontiguousarray would turn a 0-d array into a 1-d one: keep the caller's shape.
        shape = list(data.shape)
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        if data.dtype.hasobject or data.dtype.fields is not None:
            raise TypeError(
                f"cannot stream an array of dtype {data.dtype}: send plain numeric arrays "
                "(pickle anything else and send it as a uint8 array)"
            )
        meta = {
            "kind": "data",
            "seq": self._sent,
            "dtype": data.dtype.str,
            "shape": shape,
            "attributes": attributes,
        }
        try:
            encoded = json.dumps(attributes)
        except TypeError as error:
            raise TypeError(f"stream step attributes must be JSON values: {error}") from None
        if len(encoded) > _MAX_ATTRIBUTES_BYTES:
            raise ValueError(
                f"stream step attributes take {len(encoded)} bytes as JSON, over the "
                f"{_MAX_ATTRIBUTES_BYTES} limit: send bulk data as the array"
            )
        self._step(meta, data.reshape(-1).view(np.uint8))
        self._sent += 1
        self._bytes += data.nbytes
        return self._sent - 1

    def _finish(self, meta: dict[str, Any]) -> None:
        if self._engine is None:
            return
        try:
            self._step(meta, None)
        finally:
            try:
                self._engine.Close()
            finally:
                self._engine = None
                self._lease.release()

    def close(self) -> None:
        """Send the end-of-stream step and close (idempotent)."""
        self._finish({"kind": "end", "seq": self._sent})

    def abort(self, reason: str) -> None:
        """End the stream as aborted: its reader raises StreamAborted with ``reason``."""
        self._finish({"kind": "abort", "seq": self._sent, "reason": reason[:4096]})


class Adios2StreamReader:
    """The consumer side of an :class:`Adios2Stream`: iterate to receive each step.

    ``expected_sha256`` (the writer's description, from data-locations) is checked at
    the end of the stream: a mismatch raises
    :class:`~fxstream.connectors.integrity.StoreIntegrityError` there. Steps are numeric
    arrays and JSON attributes; nothing here unpickles them.
    """

    def __init__(self, stream: Adios2Stream, *, expected_sha256: str | None = None) -> None:
        self.stream = stream
        self.expected_sha256 = expected_sha256
        self._digest = Digest()
        self._received = 0
        self._ended = False
        self._watcher = LeaseWatcher(lease_path_for(stream.path), stream.stale_after)
        self._adios = adios2_bindings.ADIOS()
        self._io = stream._io(self._adios, "fxstream-stream-reader", writing=False)
        marker = self._announce() if stream.engine == "sst" else None
        try:
            self._engine: Any = self._io.Open(stream.path, adios2_bindings.Mode.Read)
        except Exception as error:
            raise TimeoutError(
                f"could not open the {stream.engine.upper()} stream {stream.path} within "
                f"{stream.open_timeout} s ({error}): is its writer running, on a file system "
                "this reader shares?"
            ) from error
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)

    def _announce(self) -> Path:
        """Tell an SST writer a reader is coming (see Adios2StreamWriter._open)."""
        readers = Path(f"{self.stream.path}{_READERS_SUFFIX}")
        readers.mkdir(parents=True, exist_ok=True)
        identity = WriterIdentity.current()
        marker = readers / f"{identity.host}-{identity.pid}-{uuid.uuid4().hex[:8]}"
        temporary = readers / f".{marker.name}.tmp"
        temporary.write_text(json.dumps(asdict(identity)))
        temporary.replace(marker)
        return marker

    @property
    def received(self) -> int:
        """Arrays received so far."""
        return self._received

    def _aborted(self, reason: str) -> StreamAborted:
        self._ended = True
        return StreamAborted(self.stream.path, f"{reason}; {self._received} arrays were received")

    def _begin_step(self) -> None:
        """Wait for the next step, or raise StreamAborted if the writer is gone."""
        rechecked = False
        while True:
            status = self._engine.BeginStep(
                adios2_bindings.StepMode.Read, self.stream.poll_interval
            )
            if status == adios2_bindings.StepStatus.OK:
                return
            if status == adios2_bindings.StepStatus.EndOfStream:
                raise self._aborted(
                    "the stream ended without an end-of-stream step (the writer closed "
                    "its engine without close(), or died)"
                )
            if status != adios2_bindings.StepStatus.NotReady:
                cause = self._watcher.writer_gone() or "the writer's connection was lost"
                raise self._aborted(f"ADIOS2 {self.stream.engine.upper()} failed ({cause})")
            reason = self._watcher.writer_gone()
            if reason is not None:
                # One more poll: the end step may have landed just before the lease went.
                if rechecked:
                    raise self._aborted(reason)
                rechecked = True

    def receive(self) -> StreamStep | None:
        """The next step (blocking), or None once the stream has ended.

        Raises:
            StreamAborted: the writer died, hung past ``stale_after``, or aborted.
        """
        if self._ended:
            return None
        self._begin_step()
        try:
            encoded = self._engine.Get(self._io.InquireVariable(_META), adios2_bindings.Mode.Sync)
            meta = json.loads(encoded)
            kind = meta["kind"]
            if kind == "end":
                self._ended = True
                if self.expected_sha256 is not None:
                    verify_digest(
                        self._digest.hexdigest(),
                        self.expected_sha256,
                        key=self.stream.path,
                        store=f"an ADIOS2 {self.stream.engine.upper()} stream",
                    )
                return None
            if kind == "abort":
                raise self._aborted(f"the writer aborted: {meta.get('reason', '')}")
            dtype = np.dtype(meta["dtype"])
            shape = tuple(int(n) for n in meta["shape"])
            raw = np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
            if raw.size:
                self._engine.Get(self._io.InquireVariable(_ARRAY), raw, adios2_bindings.Mode.Sync)
        finally:
            self._engine.EndStep()
        self._digest.update(encoded.encode())
        self._digest.update(raw.data)
        self._received += 1
        array = cast(npt.NDArray[Any], raw.view(dtype).reshape(shape))
        return StreamStep(int(meta["seq"]), array, dict(meta.get("attributes", {})))

    def __iter__(self) -> Iterator[StreamStep]:
        while (step := self.receive()) is not None:
            yield step

    def close(self) -> None:
        """Close the reader (idempotent)."""
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.Close()
            self._engine = None
            if self.stream.engine == "bp5":
                remove_bp5_reader_profile(self.stream.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
