"""Read-while-writing byte streams on plain files (shared or node-local file systems).

A :class:`FileStreamWriter` appends length-prefixed chunks to one file and ends it with
an explicit end-of-stream frame; a :class:`FileStreamReader` in another process tails
the file, returning each chunk as soon as it is complete, and stops at the end frame.

File layout (all integers little-endian)::

    magic  b"FXSTRM\\x00\\x01"                      8 bytes, once
    frame  kind: u8 | length: u64 | payload         repeated
           kind 1 = data chunk, 2 = end of stream, 3 = aborted (payload: UTF-8 reason)

The writer creates the file under a temporary name, writes the magic and renames it
into place, so a reader never sees a file without its header. A frame is complete once
``length`` payload bytes follow its header; a reader that finds a partial frame waits.

If the writer dies, no end frame ever comes: the reader detects it through the
writer's lease (``<path>.writer``, see :mod:`fxstream.connectors.liveness`) and raises
:class:`~fxstream.connectors.liveness.StreamAborted`. On the writer's own machine the
dead PID is noticed within one poll; across hosts only the lease's staleness
(``stale_after`` seconds without a refresh) reveals it. A writer that exits its
``with`` block on an exception writes an abort frame, so readers fail at once with its
reason.

Integrity: the writer hashes the data chunks as it writes them; once it has closed,
:meth:`FileStreamWriter.describe` carries their SHA-256 (published on data-locations,
which only authenticated principals write). A reader given that digest
(``expected_sha256``) hashes what it reads and raises
:class:`~fxstream.connectors.integrity.StoreIntegrityError` at the end of the stream
if they differ. Chunks are raw bytes, handed out as they complete and never
deserialized here: a consumer that loads a chunk with a deserializer (pickle) must
wait for the end of the stream's verification first, or use a by-reference store,
whose objects are verified before they are returned.

Across hosts on NFS, appended bytes and the lease's mtime become visible to a reader
only after the client's attribute cache expires (``actimeo``, typically 3-60 s): the
stream still works, with that latency, and ``stale_after`` must exceed it.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from fxstream.connectors.descriptions import ObjectDescription, check_tier
from fxstream.connectors.integrity import Digest, verify_digest
from fxstream.connectors.liveness import (
    LeaseWatcher,
    StreamAborted,
    StreamWriterExit,
    WriterLease,
    lease_path_for,
)
from fxstream.topics import StorageTier

if TYPE_CHECKING:
    # Only the type: importing proxystore.serialize imports numpy (~0.3 s).
    from proxystore.serialize import BytesLike

__all__ = ["FILE_STREAM_MAGIC", "FileStreamReader", "FileStreamWriter"]

FILE_STREAM_MAGIC: Final = b"FXSTRM\x00\x01"
_FRAME = struct.Struct("<BQ")
_DATA, _END, _ABORT = 1, 2, 3
# A length above this is a corrupt file, not a real chunk (1 TiB).
_MAX_CHUNK = 1 << 40


def _write_all(fd: int, data: BytesLike) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FileStreamWriter(StreamWriterExit):
    """Appends chunks to a stream file that readers can tail while it grows.

    Args:
        path: the stream file; must not exist yet (a stream is written once).
        tier: ``"durable"`` for a shared directory, ``"ephemeral"`` for a node-local one.
            A durable stream is fsynced when it ends.
        lease_interval: seconds between refreshes of the writer's lease.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tier: StorageTier | str = StorageTier.DURABLE,
        lease_interval: float = 1.0,
    ) -> None:
        self.path = Path(path).absolute()
        self.tier = check_tier(tier)
        if self.path.exists():
            raise FileExistsError(
                f"stream file {self.path} already exists: a stream is written once; "
                "pick a new path or remove the old stream"
            )
        self._lease = WriterLease(lease_path_for(self.path), lease_interval)
        self._bytes_written = 0
        self._chunks = 0
        self._digest = Digest()
        self._fd: int | None = None
        # The lease first: a reader that sees the stream file can rely on the lease.
        self._lease.acquire()
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            _write_all(fd, FILE_STREAM_MAGIC)
            os.rename(temporary, self.path)
        except BaseException:
            self._lease.release()
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        self._fd = fd

    @property
    def chunks(self) -> int:
        """Data chunks written so far."""
        return self._chunks

    def describe(self) -> ObjectDescription:
        """The stream for data-locations: path, payload bytes written so far, tier, node,
        ``complete`` once the writer has closed (ended or aborted), and then the SHA-256
        of the data chunks (what a reader's ``expected_sha256`` checks)."""
        complete = self._fd is None
        return ObjectDescription(
            str(self.path),
            self._bytes_written,
            self.tier,
            self._lease.identity.host,
            complete=complete,
            sha256=self._digest.hexdigest() if complete else "",
        )

    def _frame(self, kind: int, payload: BytesLike) -> None:
        if self._fd is None:
            raise ValueError(f"stream {self.path} is closed: no more chunks can be written")
        size = memoryview(payload).nbytes
        _write_all(self._fd, _FRAME.pack(kind, size))
        if size:
            _write_all(self._fd, payload)

    def write(self, chunk: BytesLike) -> None:
        """Append one chunk; readers see it as soon as it is fully written."""
        self._frame(_DATA, chunk)
        self._digest.update(chunk)
        self._bytes_written += memoryview(chunk).nbytes
        self._chunks += 1

    def _finish(self, kind: int, payload: bytes) -> None:
        if self._fd is None:
            return
        try:
            self._frame(kind, payload)
            if self.tier is StorageTier.DURABLE:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None
            self._lease.release()

    def close(self) -> None:
        """Write the end-of-stream marker and release the lease (idempotent)."""
        self._finish(_END, b"")

    def abort(self, reason: str) -> None:
        """End the stream as aborted: readers raise StreamAborted with ``reason``."""
        self._finish(_ABORT, reason.encode()[:65536])


class FileStreamReader:
    """Tails a stream file: yields each chunk as it is completed, until end-of-stream.

    Args:
        path: the stream file (it may not exist yet).
        open_timeout: seconds to wait for the file to appear.
        stale_after: seconds without a lease refresh after which the writer counts as
            dead (the only check across hosts; see :mod:`fxstream.connectors.liveness`).
        poll_interval: the longest sleep between looks at a file that has not grown.
        expected_sha256: the digest of the data chunks from the writer's description
            (data-locations); checked at the end of the stream, which then raises
            :class:`~fxstream.connectors.integrity.StoreIntegrityError` on a mismatch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        open_timeout: float = 30.0,
        stale_after: float = 10.0,
        poll_interval: float = 0.05,
        expected_sha256: str | None = None,
    ) -> None:
        self.path = Path(path).absolute()
        self.poll_interval = poll_interval
        self.expected_sha256 = expected_sha256
        self._digest = Digest()
        self._watcher = LeaseWatcher(lease_path_for(self.path), stale_after)
        self._offset = len(FILE_STREAM_MAGIC)
        self._chunks = 0
        self._ended = False
        deadline = time.monotonic() + open_timeout
        while True:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"stream file {self.path} did not appear within {open_timeout} s: "
                        "is the writer running, and is the path on a file system both share?"
                    ) from None
                time.sleep(min(poll_interval, 0.05))
        magic = os.pread(self._fd, len(FILE_STREAM_MAGIC), 0)
        if magic != FILE_STREAM_MAGIC:
            os.close(self._fd)
            raise ValueError(f"{self.path} is not an fxstream file stream (bad magic {magic!r})")

    @property
    def chunks(self) -> int:
        """Data chunks read so far."""
        return self._chunks

    @property
    def sha256(self) -> str:
        """The SHA-256 of the data chunks read so far."""
        return self._digest.hexdigest()

    def _read_into(self, view: memoryview, offset: int) -> int:
        """Bytes read into ``view`` from ``offset`` (as many as the file holds now)."""
        got = 0
        while got < len(view):
            count = os.preadv(self._fd, [view[got:]], offset + got)
            if count == 0:
                break
            got += count
        return got

    def _await_more(self, pause: float, what: str, rechecked: bool) -> tuple[float, bool]:
        """Sleep before the next look at the file, or raise StreamAborted if the writer is gone.

        Returns the next pause and whether the next look is the last one: when the writer
        is gone, the file is read once more without sleeping, because its end frame may
        have landed just before its lease was removed.
        """
        reason = self._watcher.writer_gone()
        if reason is not None:
            if rechecked:
                raise StreamAborted(
                    str(self.path), f"{reason}; {self._chunks} chunks were read, {what}"
                )
            return pause, True
        time.sleep(pause)
        return min(pause * 2, self.poll_interval), False

    def read_chunk(self) -> bytearray | None:
        """The next chunk (blocking until it is complete), or None at end-of-stream.

        Raises:
            StreamAborted: the writer died, hung past ``stale_after``, or aborted.
        """
        if self._ended:
            return None
        header = bytearray(_FRAME.size)
        pause, rechecked = 0.001, False
        while self._read_into(memoryview(header), self._offset) < _FRAME.size:
            pause, rechecked = self._await_more(pause, "and no further frame came", rechecked)
        kind, length = _FRAME.unpack(header)
        if kind not in (_DATA, _END, _ABORT) or length > _MAX_CHUNK:
            raise ValueError(
                f"{self.path} is corrupt at byte {self._offset}: frame kind {kind}, length {length}"
            )
        payload = bytearray(length)
        view = memoryview(payload)
        got = 0
        pause, rechecked = 0.001, False
        while got < length:
            got += self._read_into(view[got:], self._offset + _FRAME.size + got)
            if got < length:
                pause, rechecked = self._await_more(
                    pause, f"and the next stopped at {got} of {length} bytes", rechecked
                )
        self._offset += _FRAME.size + length
        if kind == _END:
            self._ended = True
            if self.expected_sha256 is not None:
                verify_digest(
                    self._digest.hexdigest(),
                    self.expected_sha256,
                    key=str(self.path),
                    store="a file stream",
                )
            return None
        if kind == _ABORT:
            self._ended = True
            raise StreamAborted(str(self.path), f"the writer aborted: {payload.decode()}")
        self._chunks += 1
        self._digest.update(payload)
        return payload

    def __iter__(self) -> Iterator[bytearray]:
        while (chunk := self.read_chunk()) is not None:
            yield chunk

    def close(self) -> None:
        """Close the file (idempotent); the stream itself is left in place."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
