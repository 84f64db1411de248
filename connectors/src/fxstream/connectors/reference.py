"""Automatic pass-by-reference: large arguments and results go to a store, proxies travel.

The SDK packs a task's arguments with :meth:`ByReference.pack_arguments`, the
worker packs a result with :meth:`ByReference.pack_value`. A value whose
serialized size is above ``threshold_bytes`` is written to the store *as the
fxstream payload already serialized* (so it is serialized once: the size test
and the stored bytes are the same work) and replaced in the payload by a
reference of a few hundred bytes; small values stay inline. The payload is
then wrapped (:func:`~fxstream.topics.wrap_references`) with the list of
objects it refers to, so the agent can publish data-locations and the SDK
can evict them without loading anything.

How a reference resolves, in the process that loads the payload:

* bytes-like values (``bytes``, ``bytearray``, ``memoryview``) are fetched when
  the payload is loaded, because a proxy cannot offer the buffer protocol
  (``hashlib.sha256(proxy)`` would fail);
* anything else arrives as a ProxyStore :class:`~proxystore.proxy.Proxy` and
  is fetched lazily, on first use inside the function;
* results are always fetched by the SDK before the future resolves.

A result that is, or holds, one of these argument proxies is written with the
proxy's value in its place (:func:`proxies_by_value`): the caller gets what the
function returned, mutated or not, never a proxy of an argument object the SDK
evicts once the result is consumed.

Large values are never held twice by the side that moves them, on a store whose
connector can stream (the file connector of the node-local tier and of shared file
systems, :meth:`~fxstream.connectors.file.FileConnector.put_from` and
:meth:`~fxstream.connectors.file.FileConnector.load_from`): a buffer above the threshold
(``bytes``, ``bytearray``, an array's memory) is pickled straight into its file, and an
object of :data:`~fxstream.connectors.file.STREAMED_LOAD_BYTES` or more is loaded from
its file after it has been checked, not read into memory first. Other stores (Redis)
take and return whole payloads.

Integrity: the connector's key (pickled inside the payload, so inside a Kafka
record only an authenticated principal could write) carries the SHA-256 of the
stored bytes, and the connector checks it when it reads them, before
:func:`load_payload` sees a byte; :class:`ObjectReference` carries the same
digest. A store whose connector records no digest is refused for
pass-by-reference.

Explicit proxies (``store.proxy(obj)``) pass through untouched: their owner
manages their lifetime (and, with a store of fxstream's, they are verified the
same way).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import io
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

from proxystore.proxy import Proxy, extract, get_factory
from proxystore.store import get_store
from proxystore.store.base import Store
from proxystore.store.exceptions import ProxyResolveMissingKeyError
from proxystore.store.factory import StoreFactory

from fxstream.connectors.file import STREAMED_LOAD_BYTES
from fxstream.connectors.integrity import SHA256_PATTERN
from fxstream.topics import (
    ObjectReference,
    SerializationError,
    Serializer,
    StorageTier,
    wrap_references,
)

__all__ = [
    "DEFAULT_PROXY_THRESHOLD_BYTES",
    "ByReference",
    "Packed",
    "StoredObject",
    "collect_references",
    "evict_objects",
    "load_payload",
    "proxies_by_value",
]

DEFAULT_PROXY_THRESHOLD_BYTES: Final = 64 * 1024
"""Values that serialize above this many bytes travel by reference (``./fx bench payload``)."""

_SERIALIZER: Final = Serializer()
_BYTES_LIKE: Final = (bytes, bytearray, memoryview)


def load_payload(data: Any) -> Any:
    """Deserializer of stored objects: they are fxstream payloads (any strategy)."""
    return _SERIALIZER.deserialize(bytes(data) if not isinstance(data, bytes) else data)


class _ReferenceFactory(StoreFactory[Any, Any]):
    """The factory of a value passed by reference: loads a large object from a streaming
    connector's file (:meth:`~fxstream.connectors.file.FileConnector.load_from`) instead
    of reading its bytes into memory first; anything else as ProxyStore's factory does."""

    def resolve(self) -> Any:
        """The value, fetched and checked; ``ProxyResolveMissingKeyError`` when it is gone."""
        store = self.get_store()
        connector = store.connector
        load_from = getattr(connector, "load_from", None)
        size_of = getattr(connector, "size_of", None)
        if load_from is None or size_of is None or size_of(self.key) < STREAMED_LOAD_BYTES:
            return super().resolve()
        value = load_from(self.key, _SERIALIZER.deserialize_from)
        if value is None:
            raise ProxyResolveMissingKeyError(self.key, type(store), store.name)
        if self.evict:
            store.evict(self.key)
        return value


_loaded: contextvars.ContextVar[tuple[list[StoreFactory[Any, Any]], bool] | None] = (
    contextvars.ContextVar("fxstream_loaded_references", default=None)
)


def _fetch_on_load(factory: StoreFactory[Any, Any]) -> Any:
    collecting = _loaded.get()
    if collecting is None:
        return factory.resolve()
    found, fetch = collecting
    found.append(factory)
    return factory.resolve() if fetch else None


class _FetchOnLoad:
    """Pickles as "fetch this object while loading the payload" (for bytes-like values)."""

    __slots__ = ("factory",)

    def __init__(self, factory: StoreFactory[Any, Any]) -> None:
        self.factory = factory

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _fetch_on_load, (self.factory,)


@contextlib.contextmanager
def collect_references(*, fetch: bool = True) -> Iterator[list[StoreFactory[Any, Any]]]:
    """Collect the factories of the by-reference values met while loading a payload.

    The SDK loads a result inside this block and then evicts what it fetched
    with :func:`evict_objects` once the value is delivered. With ``fetch=False``
    nothing is fetched (the values load as None): only what to evict is found.
    """
    found: list[StoreFactory[Any, Any]] = []
    token = _loaded.set((found, fetch))
    try:
        yield found
    finally:
        _loaded.reset(token)


def proxies_by_value(obj: Any) -> Any:
    """A :data:`~fxstream.topics.Substitute` writing this module's proxies as their values.

    A proxy made here for a large argument (its factory loads with
    :func:`load_payload`) is replaced by its target (fetched if the function
    never used it); anything else, explicit proxies included, is left as it is.
    """
    if not issubclass(type(obj), Proxy):
        return NotImplemented
    factory = get_factory(obj)
    if isinstance(factory, StoreFactory) and factory.deserializer is load_payload:
        return extract(obj)
    return NotImplemented


@runtime_checkable
class _Releasable(Protocol):
    """A hold on an object someone else evicts when the last hold goes (a proxy future's
    :class:`~fxstream.connectors.futures.FutureHold`)."""

    def release(self) -> list[str]:
        """End the hold; the object keys evicted because of it."""
        ...


def evict_objects(
    objects: Sequence[StoredObject | StoreFactory[Any, Any] | ObjectReference | Any],
) -> list[str]:
    """Evict objects (from :class:`Packed`, :func:`collect_references` or an envelope's
    reference list, :func:`~fxstream.topics.payload_references`), and release holds on
    proxy futures (:class:`~fxstream.connectors.futures.FutureHold`, whose last release
    evicts the future's value).

    Returns the object keys evicted (what data-locations tombstones name). A
    store that cannot be reached is skipped: the object's lease reclaims it. So
    is a reference whose store is not open in this process, or whose connector
    cannot evict by object key (``evict_object_key``).
    """
    evicted: list[str] = []
    for item in objects:
        try:
            if isinstance(item, _Releasable):
                evicted.extend(item.release())
            elif isinstance(item, StoredObject):
                item.store.evict(item.key)
                evicted.append(item.reference.object_key)
            elif isinstance(item, ObjectReference):
                store = get_store(item.store)
                evict = getattr(store.connector, "evict_object_key", None) if store else None
                if evict is not None:
                    evict(item.object_key, item.size_bytes)
                    evicted.append(item.object_key)
            else:
                store = item.get_store()
                store.evict(item.key)
                evicted.append(_object_key(store.connector, item.key))
        except Exception:  # eviction is best effort; the lease is the backstop
            continue
    return evicted


def _object_key(connector: Any, key: Any) -> str:
    return str(connector.object_key(key)) if hasattr(connector, "object_key") else str(key)


@dataclass(frozen=True)
class StoredObject:
    """An object this process put in a store: enough to evict it later."""

    store: Store[Any]
    key: Any
    reference: ObjectReference


@dataclass(frozen=True)
class Packed:
    """A packed payload and the objects it put in the store (empty when all inline)."""

    payload: bytes
    stored: list[StoredObject] = field(default_factory=list)
    holds: tuple[Any, ...] = ()
    """Holds on the proxy futures passed as top-level arguments
    (:class:`~fxstream.connectors.futures.FutureHold`; set by the SDK): released with
    :attr:`stored` once the task's result is consumed."""
    parents: tuple[str, ...] = ()
    """The tasks whose results the payload's :class:`~fxstream.topics.ParentResult`
    placeholders stand for (the task's ``depends_on``); set by the SDK."""

    @property
    def references(self) -> list[ObjectReference]:
        """What data-locations should say about :attr:`stored`."""
        return [item.reference for item in self.stored]


class ByReference:
    """Decides which values travel inline and puts the others in ``store``.

    Args:
        store: Where large values go; None means everything must fit inline.
        threshold_bytes: Values that serialize above this go by reference.
        serializer: The payload serializer (its data strategy must be able to
            pickle a proxy: pickle or dill).
        site: What data-locations calls the writer (an endpoint id, or '' for a client).
        fallback: Where a large value goes instead when ``has_room`` says ``store`` has
            no room for it (the node-local tier, :mod:`fxstream.connectors.node_local`,
            falls back to Redis).
        has_room: Asked with each value's size before it is put in ``store``.
    """

    def __init__(
        self,
        store: Store[Any] | None,
        *,
        threshold_bytes: int = DEFAULT_PROXY_THRESHOLD_BYTES,
        serializer: Serializer | None = None,
        site: str = "",
        fallback: Store[Any] | None = None,
        has_room: Callable[[int], bool] | None = None,
    ) -> None:
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must not be negative, not {threshold_bytes}")
        self.store = store
        self.threshold_bytes = threshold_bytes
        self.serializer = serializer or _SERIALIZER
        self.site = site
        self.fallback = fallback
        self._has_room = has_room
        self._node = socket.gethostname()

    def pack_arguments(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Packed:
        """``(args, kwargs)`` as a payload, with each large argument put in the store."""
        kwargs = {} if kwargs is None else dict(kwargs)
        # A buffer above the threshold goes by reference whatever the rest is: no need to
        # serialize all the arguments first only to learn that (a copy of every byte).
        whole: bytes | None = None
        if self.store is None or not any(
            self._large_buffer(value) for value in (*args, *kwargs.values())
        ):
            whole = self._whole_arguments(tuple(args), kwargs)
            if whole is not None and (len(whole) <= self.threshold_bytes or self.store is None):
                return Packed(whole)
        stored: list[StoredObject] = []
        new_args = [self._maybe_stored(value, stored) for value in args]
        new_kwargs = {name: self._maybe_stored(value, stored) for name, value in kwargs.items()}
        if not stored:
            return Packed(whole or self.serializer.pack_arguments(tuple(args), kwargs))
        payload = self.serializer.pack_arguments(tuple(new_args), new_kwargs)
        return Packed(wrap_references(payload, [s.reference for s in stored]), stored)

    def pack_value(self, value: Any) -> Packed:
        """A result as a payload: the whole value goes by reference when it is large.

        Argument proxies inside it are written as their values (:func:`proxies_by_value`).
        """
        streamed = None
        if self.store is not None and not issubclass(type(value), Proxy):
            size = _buffer_bytes(value)
            if size is not None and size > self.threshold_bytes:
                streamed = self._put_streamed(value, size, substitute=proxies_by_value)
        if streamed is None:
            inline, streamed = self._spilled(value, proxies_by_value)
            if streamed is None:
                assert inline is not None
                return Packed(inline)
        stored_object, factory = streamed
        # The reference itself is pickled whatever the data strategy (JSON cannot hold it).
        reference = _SERIALIZER.serialize_value(_FetchOnLoad(factory))
        return Packed(wrap_references(reference, [stored_object.reference]), [stored_object])

    def _large_buffer(self, value: Any) -> bool:
        # type(), never isinstance: isinstance falls back to a proxy's __class__, which
        # resolves it (and a proxy future's would wait for its value).
        return (
            issubclass(type(value), _BYTES_LIKE) and memoryview(value).nbytes > self.threshold_bytes
        )

    def _maybe_stored(self, value: Any, stored: list[StoredObject]) -> Any:
        if issubclass(type(value), Proxy):
            return value
        if isinstance(value, _BYTES_LIKE) and memoryview(value).nbytes <= self.threshold_bytes:
            return value
        size = _buffer_bytes(value)
        streamed = None
        if size is not None and size > self.threshold_bytes:
            streamed = self._put_streamed(value, size)
        if streamed is None:
            _, streamed = self._spilled(value, None)
            if streamed is None:
                return value
        stored_object, factory = streamed
        stored.append(stored_object)
        if isinstance(value, _BYTES_LIKE):
            return _FetchOnLoad(factory)
        return Proxy(factory)

    def _store_for(self, size: int) -> Store[Any]:
        assert self.store is not None
        if self._has_room is not None and self.fallback is not None and not self._has_room(size):
            return self.fallback
        return self.store

    def _put_streamed(
        self, value: Any, size: int, *, substitute: Any = None
    ) -> tuple[StoredObject, StoreFactory[Any, Any]] | None:
        """``value`` (a buffer of ``size`` bytes) pickled straight into the store, when its
        connector can stream (:meth:`~fxstream.connectors.file.FileConnector.put_from`);
        None when it cannot (the caller serializes it whole)."""
        store = self._store_for(size)
        put_from = getattr(store.connector, "put_from", None)
        if put_from is None:
            return None
        key = put_from(
            lambda sink: self.serializer.serialize_value_into(value, sink, substitute=substitute)
        )
        return self._stored(store, key, getattr(key, "size_bytes", size))

    def _whole_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes | None:
        """The arguments' payload when it is at most the threshold; None when it is larger
        and the store streams (found without holding a large payload: the probe stops
        the pickler once past the threshold). With a store that does not stream, the
        payload whatever its size, as before."""
        if self._writer_of(self._store_for(self.threshold_bytes + 1)) is None or not all(
            isinstance(name, str) for name in kwargs
        ):
            # (pack_arguments refuses a name that is not a str, with the remedy.)
            return self.serializer.pack_arguments(args, kwargs)
        probe = _SpillSink(self.threshold_bytes, None)
        try:
            self.serializer.serialize_value_into((args, kwargs), probe)
        except _PastThreshold:
            return None
        except SerializationError:
            # pack_arguments says which argument does not serialize.
            return self.serializer.pack_arguments(args, kwargs)
        return probe.value()

    def _spilled(
        self, value: Any, substitute: Any
    ) -> tuple[bytes, None] | tuple[None, tuple[StoredObject, StoreFactory[Any, Any]]]:
        """``value`` serialized: its payload when it is at most the threshold, else the
        object it was put in the store as. On a store that streams, the payload is kept in
        memory only up to the threshold and then written on to its file as it is made."""
        if self.store is None:
            return self.serializer.serialize_value(value, substitute=substitute), None
        store = self._store_for(self.threshold_bytes + 1)
        writer_of = self._writer_of(store)
        if writer_of is not None:
            room = self._has_room if store is self.store else None
            sink = _SpillSink(self.threshold_bytes, writer_of, room)
            try:
                self.serializer.serialize_value_into(value, sink, substitute=substitute)
            except _NoRoom:
                sink.abort()
                if self.fallback is None:
                    raise
                # The tier filled up under this value: the store it falls back to takes it.
                store = self.fallback
            except BaseException:
                sink.abort()
                raise
            else:
                if sink.writer is None:
                    return sink.value(), None
                key = sink.writer.close()
                return None, self._stored(store, key, getattr(key, "size_bytes", 0))
        payload = self.serializer.serialize_value(value, substitute=substitute)
        if len(payload) <= self.threshold_bytes:
            return payload, None
        return None, self._put(payload, store)

    @staticmethod
    def _writer_of(store: Store[Any]) -> Callable[[], Any] | None:
        writer = getattr(store.connector, "writer", None)
        return writer if callable(writer) else None

    def _put(
        self, payload: bytes, store: Store[Any] | None = None
    ) -> tuple[StoredObject, StoreFactory[Any, Any]]:
        store = store or self._store_for(len(payload))
        key = store.connector.put(payload)
        return self._stored(store, key, len(payload))

    def _stored(
        self, store: Store[Any], key: Any, size: int
    ) -> tuple[StoredObject, StoreFactory[Any, Any]]:
        connector = store.connector
        digest = getattr(key, "sha256", "")
        if not isinstance(digest, str) or not SHA256_PATTERN.match(digest):
            connector.evict(key)
            raise TypeError(
                f"the store {store.name!r} ({type(connector).__name__}) does not record a "
                "digest of what it stores, so a value passed by reference could not be verified "
                "before it is loaded: use one of fxstream's stores (redis://, file://, adios2://, "
                "Globus; see fxstream.connectors.open_store)"
            )
        tier = getattr(connector, "tier", StorageTier.DURABLE)
        object_key = _object_key(connector, key)
        reference = ObjectReference(
            object_key=object_key,
            store=store.name,
            size_bytes=size,
            tier=StorageTier(tier),
            site=self.site,
            node=self._node,
            sha256=digest,
        )
        factory: StoreFactory[Any, Any] = _ReferenceFactory(
            key, store_config=store.config(), deserializer=load_payload
        )
        return StoredObject(store, key, reference), factory


# How often (bytes written) a value of unknown size asks again whether its store has room.
_ROOM_CHECK_BYTES: Final = 64 * 1024 * 1024


class _PastThreshold(SerializationError):
    """Raised by a probing :class:`_SpillSink` to stop the pickler: the payload is larger
    than the threshold (a :class:`SerializationError`, so no strategy retries another way)."""


class _NoRoom(SerializationError):
    """Raised by a :class:`_SpillSink` whose store has no room left for the value (the
    value then goes to the fallback store, serialized whole)."""


class _SpillSink:
    """A payload sink that keeps up to ``limit`` bytes in memory, then (``open_writer``
    given) opens a store writer, hands it what it kept and writes every later piece on
    to it as it comes; with no ``open_writer`` it stops the pickler past ``limit``."""

    def __init__(
        self,
        limit: int,
        open_writer: Callable[[], Any] | None,
        has_room: Callable[[int], bool] | None = None,
    ) -> None:
        self._limit = limit
        self._open_writer = open_writer
        self._has_room = has_room
        self._buffer = io.BytesIO()
        self._room_checked_at = 0
        self.writer: Any = None
        self.spilled = False

    def write(self, data: Any, /) -> int:
        if self.writer is not None:
            return self._write_on(data)
        size = memoryview(data).nbytes
        if self._buffer.tell() + size <= self._limit:
            return self._buffer.write(data)
        self.spilled = True
        if self._open_writer is None:
            raise _PastThreshold("past the threshold")
        self.writer = self._open_writer()
        kept = self._buffer.getbuffer()
        try:
            self.writer.write(kept)
        finally:
            kept.release()
        self._buffer = io.BytesIO()
        return self._write_on(data)

    def _write_on(self, data: Any) -> int:
        try:
            written = int(self.writer.write(data))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _NoRoom(
                    "the store's file system is full: free space there (for the node-local "
                    "tier, FXSTREAM_NODE_STORE=off sends large values to the proxy store)"
                ) from exc
            raise
        if self._has_room is not None and self.writer.size >= (
            self._room_checked_at + _ROOM_CHECK_BYTES
        ):
            # A value of unknown size: the store's room is asked again as it grows.
            self._room_checked_at = self.writer.size
            if not self._has_room(0):
                raise _NoRoom("the node-local tier would keep too little free")
        return written

    def restart(self) -> None:
        if self.writer is not None:
            self.writer.restart()
        else:
            self._buffer = io.BytesIO()

    def value(self) -> bytes:
        """What was kept in memory (the whole payload when nothing spilled)."""
        return self._buffer.getvalue()

    def abort(self) -> None:
        """Delete what was written to the store, if anything."""
        if self.writer is not None:
            self.writer.abort()


def _buffer_bytes(value: Any) -> int | None:
    """The size of ``value``'s memory when it is a buffer (``bytes``, ``bytearray``,
    ``memoryview``, a NumPy array), else None. Never called on a proxy (``memoryview``
    would resolve it)."""
    try:
        return memoryview(value).nbytes
    except (TypeError, ValueError, BufferError):  # an object array, say: no buffer
        return None
