"""A ProxyStore connector that stores each object as an ADIOS2 BP5 file.

Every object is one BP5 file (a directory ``<store_dir>/<object_id>.bp``) holding one
step with one global ``uint8`` array variable ``object`` and an ``fxstream.size``
attribute. One file per object is what stays correct with many concurrent writer and
reader processes and no MPI: an ADIOS2 BP5 file has exactly one writer, so objects
written by different processes never share a file, and nothing needs a lock across
processes. A put writes the file under a hidden temporary name and renames it into
place, so a reader (or ``exists``) never sees a half-written object; an evict renames
it away before deleting it, so concurrent evicts do not collide.

Large objects are not copied on the way in (the serialized bytes are handed to ADIOS2
by address, a deferred put that BP5 writes straight from the caller's buffer) and are
read straight into the ``bytearray`` that ``get`` returns.

Keys are :class:`Adios2Key` (the object id and its size), so an object can be described
for the data-locations topic (:meth:`Adios2Connector.describe`) without touching disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self

import adios2.bindings as adios2_bindings  # type: ignore[import-untyped]
import numpy as np
from proxystore.serialize import BytesLike

from fxstream.connectors.descriptions import ObjectDescription, check_tier
from fxstream.connectors.integrity import sha256_of, verify_digest
from fxstream.topics import StorageTier

__all__ = ["Adios2Connector", "Adios2Key", "remove_bp5_reader_profile"]

_VARIABLE = "object"
# Where ADIOS2's BP5 reader writes a profile on every close, whatever its parameters say.
_BP5_READER_PROFILE = "/tmp/{name}_{pid:x}_profiling.json"
_SIZE_ATTRIBUTE = "fxstream.size"


def remove_bp5_reader_profile(path: str | os.PathLike[str]) -> None:
    """Remove the profile ADIOS2's BP5 reader left in /tmp when it closed ``path``.

    ``BP5Reader::Close`` writes ``/tmp/<file name>_<pid in hex>_profiling.json``
    unconditionally (the ``Profile`` engine parameter does not stop it in 2.12), so a
    store read 10,000 times would leave 10,000 files in /tmp. The name is fixed by the
    file's name and our PID, so the reader removes exactly its own file.
    """
    profile = _BP5_READER_PROFILE.format(name=Path(path).name, pid=os.getpid())
    with contextlib.suppress(FileNotFoundError):
        os.unlink(profile)


class Adios2Key(NamedTuple):
    """Key to one object in an :class:`Adios2Connector`'s directory.

    Attributes:
        object_id: the object's unique id (its file is ``<object_id>.bp``).
        size_bytes: the object's size in bytes.
        sha256: the SHA-256 of its bytes, checked by :meth:`Adios2Connector.get`
            before they are returned (docs/security.md, "Data integrity").
    """

    object_id: str
    size_bytes: int
    sha256: str = ""


class Adios2Connector:
    """ProxyStore connector on ADIOS2 BP5 files in one directory.

    Args:
        store_dir: the directory that holds the objects (created if missing). For the
            durable tier it must be on a file system every reader shares.
        tier: ``durable`` (shared directory) or ``ephemeral`` (node-local
            directory), recorded for the data-locations topic.
        lease_s: age after which :meth:`sweep_expired` deletes an object (None: never),
            as with the file connector.
        clear: remove ``store_dir`` and every object in it on :meth:`close`. Off by
            default, because a store directory is usually shared with other processes
            that still resolve proxies after this one closes.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        tier: StorageTier | str = StorageTier.DURABLE,
        lease_s: float | None = None,
        clear: bool = False,
    ) -> None:
        self.store_dir = Path(store_dir).absolute()
        self.tier = check_tier(tier)
        self.lease_s = lease_s
        self.node = socket.gethostname()
        self.clear = clear
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # One ADIOS2 instance per connector, made on first use (from_config in a worker
        # costs nothing until it reads); ADIOS2 objects are not thread-safe, hence the lock.
        self._adios: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.store_dir)!r}, tier={self.tier.value})"

    def _instance(self) -> Any:
        if self._adios is None:
            self._adios = adios2_bindings.ADIOS()
        return self._adios

    def _path(self, key: Adios2Key) -> Path:
        if not key.object_id or "/" in key.object_id or key.object_id.startswith("."):
            raise ValueError(f"{key!r} is not an Adios2Connector key (bad object id)")
        return self.store_dir / f"{key.object_id}.bp"

    def config(self) -> dict[str, Any]:
        """Everything needed to rebuild this connector in another process."""
        return {
            "store_dir": str(self.store_dir),
            "tier": self.tier.value,
            "lease_s": self.lease_s,
            "clear": self.clear,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Adios2Connector:
        """A connector rebuilt from :meth:`config`."""
        return cls(
            config["store_dir"],
            tier=config.get("tier", StorageTier.DURABLE),
            lease_s=config.get("lease_s"),
            clear=config.get("clear", False),
        )

    def describe(self, key: Adios2Key) -> ObjectDescription:
        """(path, size in bytes, tier, node, sha256) of the object at ``key``, for
        data-locations."""
        return ObjectDescription(
            self.object_key(key), key.size_bytes, self.tier, self.node, sha256=key.sha256
        )

    def object_key(self, key: Adios2Key) -> str:
        """The key as data-locations names it: the object's BP5 file (a directory)."""
        return str(self._path(key))

    def size_of(self, key: Adios2Key) -> int:
        """The object's size in bytes, as recorded when it was put."""
        return key.size_bytes

    def count_objects(self) -> int:
        """How many objects are stored in the directory now (no file is opened)."""
        return sum(1 for entry in self.store_dir.glob("*.bp") if not entry.name.startswith("."))

    def sweep_expired(self, now: float | None = None) -> int:
        """Evict objects older than ``lease_s`` (by their file's mtime); returns how many."""
        if self.lease_s is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.lease_s
        removed = 0
        for entry in self.store_dir.glob("*.bp"):
            if entry.name.startswith("."):
                continue
            try:
                expired = entry.stat().st_mtime < cutoff
            except FileNotFoundError:
                continue
            if expired:
                self.evict(Adios2Key(entry.name.removesuffix(".bp"), 0))
                removed += 1
        return removed

    def put(self, obj: BytesLike) -> Adios2Key:
        """Write ``obj`` as a new BP5 file; returns its key."""
        view = memoryview(obj)
        if not view.contiguous:
            raise ValueError("Adios2Connector.put needs a contiguous buffer (bytes, bytearray)")
        data = np.frombuffer(view.cast("B") if view.format != "B" else view, dtype=np.uint8)
        key = Adios2Key(uuid.uuid4().hex, int(data.size), sha256_of(view))
        final = self._path(key)
        temporary = self.store_dir / f".{key.object_id}.bp.tmp"
        try:
            self._write(temporary, data)
            os.rename(temporary, final)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return key

    def _write(self, path: Path, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        size = int(data.size)
        with self._lock:
            adios = self._instance()
            io_name = f"put-{path.name}"
            io = adios.DeclareIO(io_name)
            try:
                io.SetEngine("BP5")
                io.DefineAttribute(_SIZE_ATTRIBUTE, np.array([size], dtype=np.int64))
                variable = None
                if size:
                    # The sample array only gives ADIOS2 the type; the data goes by address
                    # below (the typed overloads refuse the read-only view of a bytes object).
                    variable = io.DefineVariable(
                        _VARIABLE, np.zeros(1, dtype=np.uint8), [size], [0], [size], True
                    )
                engine = io.Open(str(path), adios2_bindings.Mode.Write)
                try:
                    engine.BeginStep()
                    if variable is not None:
                        # Deferred: BP5 writes from our buffer at EndStep, without a copy.
                        engine.Put(variable, data.ctypes.data, adios2_bindings.Mode.Deferred)
                    engine.EndStep()
                finally:
                    engine.Close()
            finally:
                adios.RemoveIO(io_name)

    def get(self, key: Adios2Key) -> bytearray | None:
        """The object's bytes, or None if there is no object at ``key``.

        Raises :class:`~fxstream.connectors.integrity.StoreIntegrityError` when
        they are not the bytes written (or the key has no digest).
        """
        path = self._path(key)
        if not path.is_dir():
            return None
        try:
            data = self._read(path)[1]
        except Exception:
            # Evicted between the check and the read: a missing object, not an error.
            if not path.is_dir():
                return None
            raise
        assert data is not None
        verify_digest(sha256_of(data), key.sha256, key=str(path), store=repr(self))
        return data

    def _read(self, path: Path, *, with_data: bool = True) -> tuple[int, bytearray | None]:
        """(size, bytes) of the object file at ``path``; bytes is None unless ``with_data``."""
        with self._lock:
            adios = self._instance()
            io_name = f"get-{uuid.uuid4().hex}"
            io = adios.DeclareIO(io_name)
            try:
                io.SetEngine("BP5")
                engine = io.Open(str(path), adios2_bindings.Mode.ReadRandomAccess)
                try:
                    attribute = io.InquireAttribute(_SIZE_ATTRIBUTE)
                    if attribute is None:
                        raise ValueError(f"{path} is not an Adios2Connector object (no size)")
                    size = int(attribute.Data()[0])
                    if not with_data:
                        return size, None
                    buffer = bytearray(size)
                    if size:
                        variable = io.InquireVariable(_VARIABLE)
                        engine.Get(
                            variable,
                            np.frombuffer(buffer, dtype=np.uint8),
                            adios2_bindings.Mode.Sync,
                        )
                    return size, buffer
                finally:
                    engine.Close()
                    remove_bp5_reader_profile(path)
            finally:
                adios.RemoveIO(io_name)

    def exists(self, key: Adios2Key) -> bool:
        """Whether an object is stored at ``key``."""
        return self._path(key).is_dir()

    def evict(self, key: Adios2Key) -> None:
        """Remove the object at ``key`` (a missing object is not an error)."""
        path = self._path(key)
        doomed = self.store_dir / f".{key.object_id}.bp.evicted-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def put_batch(self, objs: Sequence[BytesLike]) -> list[Adios2Key]:
        """Put each object; keys in the same order."""
        return [self.put(obj) for obj in objs]

    def get_batch(self, keys: Sequence[Adios2Key]) -> list[BytesLike | None]:
        """Get each key's object (None where missing), in the same order."""
        return [self.get(key) for key in keys]

    def keys(self) -> list[Adios2Key]:
        """Every object stored in the directory now (for leak checks and cleanup).

        These keys carry no digest (only the writer's key has it, and the directory
        is not trusted), so :meth:`get` refuses them: list to count or evict, not to read.
        """
        found = []
        for entry in sorted(self.store_dir.glob("*.bp")):
            if entry.name.startswith("."):
                continue
            try:
                size, _ = self._read(entry, with_data=False)
            except Exception:
                if entry.is_dir():
                    raise
                continue  # evicted while we listed
            found.append(Adios2Key(entry.name.removesuffix(".bp"), size))
        return found

    def close(self, clear: bool | None = None) -> None:
        """Release ADIOS2; remove the directory if ``clear`` (default: the constructor's)."""
        with self._lock:
            self._adios = None
        if self.clear if clear is None else clear:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
