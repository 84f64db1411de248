"""A ProxyStore connector on a directory: a shared file system, or node-local disk.

Two tiers (docs/data-plane.md, "Tiers"):

* ``durable``: the directory is on a shared file system (Lustre, GPFS, NFS)
  every node of the site mounts; objects survive a node.
* ``ephemeral``: the directory is node-local (``/tmp``, a local SSD); nothing
  is replicated, so the key names the node that wrote it and a reader on
  another node gets an error that says so instead of a missing file.

Objects are written once, read many: ``put`` writes a temporary file and
renames it into place, so a reader never sees half an object. :meth:`FileConnector.put_from`
does the same for a payload written as it is serialized (a large value never held twice in
the writer's memory), and :meth:`FileConnector.load_from` loads a large object from its
file after checking it, so the reader holds the value only, not its bytes as well. The key carries
the SHA-256 of the bytes written; :meth:`FileConnector.get` checks it before
returning anything, so a file replaced in the directory is refused with
:class:`~fxstream.connectors.integrity.StoreIntegrityError` (docs/security.md,
"Data integrity"). Objects are created ``0600``. Leases are file
modification times: :meth:`FileConnector.sweep_expired` deletes objects older
than ``lease_s`` (the agent calls it periodically).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, NamedTuple, TypeVar

from proxystore.serialize import BytesLike

from fxstream.connectors.integrity import Digest, sha256_of, verify_digest
from fxstream.topics import PayloadSink, PayloadSource, StorageTier

__all__ = [
    "STREAMED_LOAD_BYTES",
    "FileConnector",
    "FileObjectKey",
    "FileObjectWriter",
    "ObjectOnOtherNode",
]

_SUFFIX = ".fxobj"

STREAMED_LOAD_BYTES: Final = 32 * 1024 * 1024
"""Objects at least this large are loaded from their file by :meth:`FileConnector.load_from`
(read twice: checked, then loaded) rather than read into memory and loaded from there (one
read, but the bytes and the value held at once)."""

_CHECK_CHUNK_BYTES: Final = 4 * 1024 * 1024

_T = TypeVar("_T")


class ObjectOnOtherNode(FileNotFoundError):
    """An ephemeral object was written on another node, and ephemeral objects are not replicated."""


class FileObjectKey(NamedTuple):
    """An object's file name, the node that wrote it (ephemeral tier), its size and the
    SHA-256 of its bytes (checked by :meth:`FileConnector.get` before they are used)."""

    filename: str
    node: str = ""
    size_bytes: int = 0
    sha256: str = ""


class FileConnector:
    """A ProxyStore connector storing each object as one file in ``store_dir``.

    Args:
        store_dir: The directory (created if missing).
        tier: ``durable`` for a shared file system, ``ephemeral`` for node-local disk.
        lease_s: Age after which :meth:`sweep_expired` deletes an object (None: never).

    Proxy futures (:mod:`fxstream.connectors.futures`) use its write-once *slots*: files
    ``pf-<uuid4 hex>.fxobj`` written by a hard link from a temporary file, which fails
    when the slot exists (so the first writer wins, and a reader never sees half of one).
    They are swept with the objects.
    """

    key_type: ClassVar[type[FileObjectKey]] = FileObjectKey
    """The class of this connector's keys (how a proxy future's pointer names its value)."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        tier: StorageTier | str = StorageTier.DURABLE,
        lease_s: float | None = None,
    ) -> None:
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"lease_s must be positive (or None for no lease), not {lease_s}")
        self.store_dir = Path(store_dir).resolve()
        self.tier = StorageTier(tier)
        self.lease_s = lease_s
        self.node = socket.gethostname()
        self.store_dir.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FileConnector({str(self.store_dir)!r}, tier={self.tier.value})"

    # --- Connector protocol ----------------------------------------------------------------

    def close(self) -> None:
        """Nothing to release; stored objects stay."""

    def config(self) -> dict[str, Any]:
        """Everything :meth:`from_config` needs."""
        return {"store_dir": str(self.store_dir), "tier": self.tier.value, "lease_s": self.lease_s}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FileConnector:
        """A connector from :meth:`config`'s output."""
        return cls(**config)

    def evict(self, key: FileObjectKey) -> None:
        """Delete the object's file (a missing one is not an error)."""
        self._path(key).unlink(missing_ok=True)

    def evict_object_key(self, object_key: str, size_bytes: int) -> None:
        """Evict by what data-locations and a payload's envelope name: the file's path."""
        self.evict(FileObjectKey(Path(object_key).name, size_bytes=size_bytes))

    def exists(self, key: FileObjectKey) -> bool:
        """Whether the object's file is there (on this node, for the ephemeral tier)."""
        return self._path(key).exists()

    def get(self, key: FileObjectKey) -> bytes | None:
        """The object's bytes, or None when it is gone.

        Raises :class:`ObjectOnOtherNode` for an ephemeral object written on
        another node, and :class:`~fxstream.connectors.integrity.StoreIntegrityError`
        when the file's bytes are not those written (or the key has no digest).
        """
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._missing(key)
            return None
        verify_digest(sha256_of(data), key.sha256, key=str(path), store=repr(self))
        return data

    def _missing(self, key: FileObjectKey) -> None:
        """Raise :class:`ObjectOnOtherNode` when a missing object was written on another node."""
        if self.tier is StorageTier.EPHEMERAL and key.node and key.node != self.node:
            raise ObjectOnOtherNode(
                f"object {key.filename} is in the ephemeral store {self.store_dir} on node "
                f"{key.node}, and this is {self.node}: ephemeral objects are node-local and "
                "not replicated. Run the consumer on that node, or use a durable store "
                "(shared files or Redis); for fxstream's node-local tier (a client and "
                "an endpoint sharing a node), FXSTREAM_NODE_STORE=off in the client "
                "keeps its data in the store."
            ) from None

    def get_batch(self, keys: Sequence[FileObjectKey]) -> list[BytesLike | None]:
        """:meth:`get` for each key, in order."""
        return [self.get(key) for key in keys]

    def put(self, obj: bytes | bytearray | memoryview) -> FileObjectKey:
        """Write ``obj`` to a new file, atomically (temporary file, then rename)."""
        size = memoryview(obj).nbytes
        key = FileObjectKey(f"{uuid.uuid4().hex}{_SUFFIX}", self.node, size, sha256_of(obj))
        final = self._path(key)
        partial = final.with_name(f".{final.name}.partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(obj)
        partial.replace(final)
        return key

    def put_from(self, write: Callable[[PayloadSink], None]) -> FileObjectKey:
        """A new object of what ``write`` writes to the sink it is given (a serializer's
        :meth:`~fxstream.topics.Serializer.serialize_value_into`), hashed as it is written
        and renamed into place once complete; nothing is left behind when ``write`` raises."""
        writer = self.writer()
        try:
            write(writer)
        except BaseException:
            writer.abort()
            raise
        return writer.close()

    def writer(self) -> FileObjectWriter:
        """A new object written piece by piece: :meth:`FileObjectWriter.close` puts it in
        place and returns its key, :meth:`FileObjectWriter.abort` leaves nothing."""
        name = f"{uuid.uuid4().hex}{_SUFFIX}"
        final = self._path(FileObjectKey(name))
        return FileObjectWriter(final, FileObjectKey(name, self.node))

    def load_from(self, key: FileObjectKey, load: Callable[[PayloadSource], _T]) -> _T | None:
        """What ``load`` (a serializer's :meth:`~fxstream.topics.Serializer.deserialize_from`)
        reads from the object's file, or None when it is gone; the errors of :meth:`get`.

        The file is read twice through one open descriptor: first hashed in small chunks
        and checked against the key's digest, nothing loaded before it matches; then loaded,
        hashed again as ``load`` reads it, and the value is dropped with
        :class:`~fxstream.connectors.integrity.StoreIntegrityError` if the file changed
        between the two reads. A large value is so held once, never beside its bytes.
        """
        path = self._path(key)
        try:
            source = open(path, "rb")  # noqa: SIM115 - closed below, on every path
        except FileNotFoundError:
            self._missing(key)
            return None
        with source:
            checked = Digest()
            chunk = bytearray(_CHECK_CHUNK_BYTES)
            view = memoryview(chunk)
            while count := source.readinto(chunk):
                checked.update(view[:count])
            verify_digest(checked.hexdigest(), key.sha256, key=str(path), store=repr(self))
            source.seek(0)
            reader = _HashingSource(source)
            try:
                value = load(reader)
            except Exception:
                # Changed under the loader? That, not what the loader made of it, is the error.
                reader.drain()
                verify_digest(reader.hexdigest(), key.sha256, key=str(path), store=repr(self))
                raise
            reader.drain()
            verify_digest(reader.hexdigest(), key.sha256, key=str(path), store=repr(self))
        return value

    def put_batch(self, objs: Sequence[bytes | bytearray | memoryview]) -> list[FileObjectKey]:
        """:meth:`put` for each object, in order."""
        return [self.put(obj) for obj in objs]

    # --- fxstream extras -------------------------------------------------------------------

    def object_key(self, key: FileObjectKey) -> str:
        """The key as data-locations names it: the file's path."""
        return str(self._path(key))

    def size_of(self, key: FileObjectKey) -> int:
        """The object's size in bytes, as recorded when it was put."""
        return key.size_bytes

    # --- write-once slots (proxy futures) ---------------------------------------------------

    def new_slot(self) -> str:
        """A new slot name (a file name in the directory); nothing is written."""
        return f"pf-{uuid.uuid4().hex}{_SUFFIX}"

    def set_slot(self, slot: str, data: bytes) -> bool:
        """Write ``data`` to ``slot`` unless it exists; False when it did."""
        final = self._path(FileObjectKey(slot))
        partial = final.with_name(f".{final.name}.{uuid.uuid4().hex}.partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            try:
                os.link(partial, final)
            except FileExistsError:
                return False
            return True
        finally:
            partial.unlink(missing_ok=True)

    def get_slot(self, slot: str) -> bytes | None:
        """What ``slot`` holds, or None."""
        try:
            return self._path(FileObjectKey(slot)).read_bytes()
        except FileNotFoundError:
            return None

    def evict_slot(self, slot: str) -> None:
        """Empty ``slot`` (an empty one is not an error)."""
        self._path(FileObjectKey(slot)).unlink(missing_ok=True)

    def count_objects(self) -> int:
        """How many objects are stored in the directory now."""
        return sum(1 for _ in self.store_dir.glob(f"*{_SUFFIX}"))

    def sweep_expired(self, now: float | None = None) -> int:
        """Delete objects whose lease ran out (older than ``lease_s``); returns how many."""
        if self.lease_s is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.lease_s
        removed = 0
        for path in self.store_dir.glob(f"*{_SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _path(self, key: FileObjectKey) -> Path:
        name = Path(key.filename).name
        if name != key.filename or not name.endswith(_SUFFIX):
            raise ValueError(f"not a key of this connector: {key.filename!r}")
        return self.store_dir / name


class FileObjectWriter:
    """An object of a :class:`FileConnector` being written (a
    :class:`~fxstream.topics.PayloadSink`): a ``0600`` temporary file beside its final
    name, hashed as it is written."""

    def __init__(self, final: Path, key: FileObjectKey) -> None:
        self._final = final
        self._key = key
        self._partial = final.with_name(f".{final.name}.partial")
        fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._out = os.fdopen(fd, "wb")
        self._digest = Digest()
        self.size = 0

    def write(self, data: Any, /) -> int:
        """Append ``data`` (any buffer, written as it is)."""
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self._out.write(view)
        self.size += view.nbytes
        return view.nbytes

    def restart(self) -> None:
        """Discard what was written."""
        self._out.seek(0)
        self._out.truncate()
        self._digest = Digest()
        self.size = 0

    def close(self) -> FileObjectKey:
        """Put the object in place; its key (with its size and digest)."""
        try:
            self._out.close()
            self._partial.replace(self._final)
        except BaseException:
            self.abort()
            raise
        return self._key._replace(size_bytes=self.size, sha256=self._digest.hexdigest())

    def abort(self) -> None:
        """Delete what was written; the object never appears."""
        with contextlib.suppress(OSError):
            self._out.close()
        self._partial.unlink(missing_ok=True)


class _HashingSource:
    """A :class:`~fxstream.topics.PayloadSource` over an open file: hashes what is read,
    so the bytes loaded can be checked against the digest once more."""

    def __init__(self, source: io.BufferedReader) -> None:
        self._source = source
        self._digest = Digest()

    def read(self, size: int = -1, /) -> bytes:
        data = self._source.read(size)
        self._digest.update(data)
        return data

    def readinto(self, target: Any, /) -> int:
        view = memoryview(target).cast("B")
        count = self._source.readinto(view)
        self._digest.update(view[:count])
        return count

    def readline(self, size: int = -1, /) -> bytes:
        data = self._source.readline(size)
        self._digest.update(data)
        return data

    def drain(self) -> None:
        """Hash whatever the loader left unread (nothing, for a well-formed payload)."""
        while data := self._source.read(_CHECK_CHUNK_BYTES):
            self._digest.update(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
