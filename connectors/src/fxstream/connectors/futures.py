"""Proxy futures: a reference to data that does not exist yet (ProxyStore's ``Store.future``).

A :class:`ProxyFuture` names a *slot* in a store before anything is written there. Its
:meth:`~ProxyFuture.proxy` is an ordinary ProxyStore :class:`~proxystore.proxy.Proxy`
that can be passed to a task as any argument; the task's first use of it blocks until a
holder of the future (the client, or a producer task the future itself was passed to)
calls :meth:`~ProxyFuture.set_result`, so a consumer can start, and do its own start-up
work, before its producer has finished (the dissertation's ProxyFutures pattern, section
4.3.1 of Pauloski's "Programming the continuum").

How a value gets there, and why a worker can trust it
-----------------------------------------------------
``set_result`` serializes the value (the fxstream payload of the future's data
strategy) and writes it with the connector's ordinary ``put``, whose key carries the
SHA-256 of the bytes (:mod:`fxstream.connectors.integrity`). It then writes a *pointer*
to the slot: that key as JSON, signed with the future's Ed25519 private key, with a
write-once ``set`` (Redis ``SET NX``; a hard link on a file store), so a second
``set_result`` fails instead of replacing the value. The private key lives only in the
:class:`ProxyFuture` (the client, and a task it was passed to); the proxy carries the
public key. A reader polls the slot, verifies the pointer's signature before decoding
it, then reads the object, whose digest the connector checks as for any by-reference
value: nothing unauthenticated reaches a deserializer. A value written into the slot by
anyone else (the store is not trusted for integrity: every user holds its password)
fails with :class:`ProxyFutureForged`, a
:class:`~fxstream.connectors.integrity.StoreIntegrityError`; so does a reference whose
public key is missing or malformed. A consumer can verify but not forge: a worker that
receives only the proxy cannot write a value other consumers would accept.

Waiting is bounded: a reader that finds no pointer within the future's ``timeout_s``
(:data:`DEFAULT_PROXY_FUTURE_TIMEOUT_S` unless the creator chose another) raises
:class:`ProxyFutureTimeout`, which names the setting. A producer that cannot produce can
say so with :meth:`ProxyFuture.set_exception`: readers then raise
:class:`ProxyFutureFailed` with its message at once, instead of waiting out the timeout.

Lifetime: the pointer and the value carry the connector's lease like every stored
object. The client that created the future owns it: every task given its proxy as a
top-level argument holds it (:func:`hold_futures`), and once ``consumers`` such tasks'
results have been consumed and no other holder is left, the value and the slot are
evicted (:class:`FutureOwner`). :meth:`ProxyFuture.evict` evicts at once. A task given
the future itself (a producer) holds it too (:class:`ProducerHold`): once its result is
consumed, a future it left unset is failed for its readers, so a consumer of a producer
that crashed fails at once rather than at its timeout.

The stores that support it implement the slot methods (``new_slot``, ``set_slot``,
``get_slot``, ``evict_slot`` and ``key_type``): :class:`~fxstream.connectors.RedisConnector`
and :class:`~fxstream.connectors.FileConnector`. ADIOS2 and Globus stores are refused
with an error that says so.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar, cast

from proxystore.proxy import Proxy, get_factory
from proxystore.store import get_or_create_store
from proxystore.store.base import Store
from proxystore.store.config import StoreConfig
from proxystore.store.factory import StoreFactory

from fxstream.connectors.integrity import SHA256_PATTERN, StoreIntegrityError
from fxstream.connectors.reference import load_payload, proxies_by_value
from fxstream.topics import IntegrityError, Serializer

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "DEFAULT_PROXY_FUTURE_TIMEOUT_S",
    "FutureFactory",
    "FutureHold",
    "FutureOwner",
    "ProducerHold",
    "ProxyFuture",
    "ProxyFutureError",
    "ProxyFutureFailed",
    "ProxyFutureForged",
    "ProxyFutureTimeout",
    "SlotConnector",
    "hold_futures",
]

T = TypeVar("T")

DEFAULT_PROXY_FUTURE_TIMEOUT_S: Final = 600.0
"""How long a reader waits for a proxy future's value unless its creator chose otherwise
(``timeout_s`` of ``Client.proxy_future`` / ``Executor.proxy_future``)."""

_DOMAIN: Final = b"fxstream proxy future v1\x00"
_SIGNATURE_BYTES: Final = 64
_KEY_BYTES: Final = 32
# A pointer is a key as JSON (a few hundred bytes) or an error message (bounded below).
_MAX_POINTER_BYTES: Final = 64 * 1024
_MAX_ERROR_CHARS: Final = 4_000
_FIRST_POLL_S: Final = 0.002
_LONGEST_POLL_S: Final = 0.05


# --- errors --------------------------------------------------------------------------------


class ProxyFutureError(Exception):
    """A proxy future cannot be used as asked (set twice, evicted, an unsupported store)."""


class ProxyFutureTimeout(ProxyFutureError, TimeoutError):
    """No value was set for a proxy future within its ``timeout_s``.

    ``slot`` names the future, ``store`` where it was waited for, ``timeout_s`` how long.
    """

    def __init__(self, slot: str, store: str, timeout_s: float) -> None:
        self.slot = slot
        self.store = store
        self.timeout_s = timeout_s
        super().__init__(
            f"proxy future {slot} in {store} was not set within {timeout_s:g} s (its "
            "timeout_s: the timeout_s argument of Client.proxy_future / Executor.proxy_future, "
            f"default {DEFAULT_PROXY_FUTURE_TIMEOUT_S:g} s): its producer has not called "
            "set_result. Check that the producer runs and did not fail, or create the future "
            "with a larger timeout_s"
        )

    def __reduce__(self) -> tuple[type[ProxyFutureTimeout], tuple[str, str, float]]:
        # Pickles (and so travels from a worker process) with its fields, not its message.
        return type(self), (self.slot, self.store, self.timeout_s)


class ProxyFutureFailed(ProxyFutureError):
    """The producer of a proxy future set an exception instead of a value
    (:meth:`ProxyFuture.set_exception`); ``reason`` is its message."""

    def __init__(self, slot: str, reason: str) -> None:
        self.slot = slot
        self.reason = reason
        super().__init__(f"the producer of proxy future {slot} failed: {reason}")

    def __reduce__(self) -> tuple[type[ProxyFutureFailed], tuple[str, str]]:
        return type(self), (self.slot, self.reason)


class ProxyFutureForged(StoreIntegrityError):
    """What a proxy future's slot holds was not written by a holder of the future.

    Raised before anything is decoded or deserialized. ``key`` is the slot, ``store``
    where it was read, ``expected`` the future's public key (hex; empty when the
    reference carried none) and ``found`` what was wrong.
    """

    def __init__(self, key: str, store: str, expected: str, found: str) -> None:
        self.key = key
        self.store = store
        self.expected = expected
        self.found = found
        IntegrityError.__init__(
            self,
            f"proxy future {key!r} in {store} refused: {found}. Only a holder of the "
            "future (its creator, or a task it was passed to) can set its value, so the slot "
            "was written by someone else, or the reference was altered; nothing was "
            "deserialized. Check who can write to this store (docs/security.md, 'Data "
            "integrity').",
        )


# --- stores with slots ---------------------------------------------------------------------


class SlotConnector(Protocol):
    """A connector with write-once slots: what a proxy future needs of its store."""

    key_type: type[Any]
    """The class of its object keys (a NamedTuple of JSON values)."""

    def new_slot(self) -> str:
        """A new slot name; nothing is written."""
        ...

    def set_slot(self, slot: str, data: bytes) -> bool:
        """Write ``data`` to ``slot`` if it is empty (with the store's lease); False if not."""
        ...

    def get_slot(self, slot: str) -> bytes | None:
        """What ``slot`` holds, or None."""
        ...

    def evict_slot(self, slot: str) -> None:
        """Empty ``slot`` (an empty one is not an error)."""
        ...

    def put(self, obj: bytes | bytearray | memoryview) -> Any:
        """Store an object; its key."""
        ...

    def get(self, key: Any) -> Any:
        """An object's bytes (digest checked), or None."""
        ...

    def evict(self, key: Any) -> None:
        """Delete an object."""
        ...


def _slots_of(store: Store[Any]) -> SlotConnector:
    connector = store.connector
    needed = ("new_slot", "set_slot", "get_slot", "evict_slot", "key_type")
    if not all(hasattr(connector, name) for name in needed):
        raise ProxyFutureError(
            f"the store {store.name!r} ({type(connector).__name__}) cannot hold proxy futures: "
            "they need write-once slots, which fxstream's Redis (redis://, rediss://) and file "
            "(file://) stores have and ADIOS2 and Globus stores do not"
        )
    return cast(SlotConnector, connector)


def _location(connector: Any) -> str:
    location = getattr(connector, "location", None)
    return str(location) if location else repr(connector)


def _message(slot: str, body: bytes) -> bytes:
    return _DOMAIN + slot.encode() + b"\x00" + body


def _public_key(hex_key: str, slot: str, where: str) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = bytes.fromhex(hex_key)
        if len(raw) != _KEY_BYTES:
            raise ValueError
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError):
        raise ProxyFutureForged(
            slot, where, "", "its reference carries no valid public key, so it cannot be verified"
        ) from None


def _verified_pointer(data: bytes, slot: str, verify_key: str, where: str) -> dict[str, Any]:
    """The pointer a slot holds, once its signature is verified (nothing decoded before)."""
    from cryptography.exceptions import InvalidSignature

    public = _public_key(verify_key, slot, where)
    if len(data) <= _SIGNATURE_BYTES or len(data) > _MAX_POINTER_BYTES:
        raise ProxyFutureForged(
            slot, where, verify_key, f"it holds {len(data)} bytes, not a signed pointer"
        )
    signature, body = data[:_SIGNATURE_BYTES], data[_SIGNATURE_BYTES:]
    try:
        public.verify(signature, _message(slot, body))
    except InvalidSignature:
        raise ProxyFutureForged(
            slot, where, verify_key, "its signature does not verify with the future's public key"
        ) from None
    pointer = json.loads(body)
    if not isinstance(pointer, dict):
        raise ProxyFutureError(f"proxy future {slot}: a signed pointer that is not an object")
    return pointer


def _key_from(connector: SlotConnector, pointer: Mapping[str, Any], slot: str) -> Any:
    fields = pointer.get("key")
    key_type = connector.key_type
    if not isinstance(fields, list) or len(fields) != len(getattr(key_type, "_fields", ())):
        raise ProxyFutureError(
            f"proxy future {slot}: its signed pointer does not name a {key_type.__name__}"
        )
    return key_type(*fields)


# --- the reader's side: the factory inside the proxy ----------------------------------------


class FutureFactory(StoreFactory[Any, T]):
    """The factory of a proxy future's proxy: waits for the value, verifies it, loads it.

    ``key`` is the slot; ``verify_key`` the future's Ed25519 public key (hex);
    ``timeout_s`` how long :meth:`resolve` waits before :class:`ProxyFutureTimeout`.
    In the creating client it also knows the future's :class:`FutureOwner` (never
    pickled), so a task given the proxy can hold the future (:func:`hold_futures`).
    """

    def __init__(
        self,
        slot: str,
        store_config: StoreConfig,
        *,
        verify_key: str,
        timeout_s: float,
        owner: FutureOwner | None = None,
    ) -> None:
        # The key is the slot name (ProxyStore types keys as tuples; only this class reads it).
        super().__init__(cast(Any, slot), store_config, deserializer=load_payload)
        self.verify_key = verify_key
        self.timeout_s = timeout_s
        self._owner = owner

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_owner"] = None  # the creator's bookkeeping stays with the creator
        return state

    def __repr__(self) -> str:
        return f"FutureFactory(slot={self.key!r}, timeout_s={self.timeout_s:g})"

    @property
    def owner(self) -> FutureOwner | None:
        """The future's owner, in the client that created it (None elsewhere)."""
        return self._owner

    def resolve(self) -> T:
        """The value, once set (waiting up to ``timeout_s``).

        Raises:
            ProxyFutureTimeout: nothing was set in time.
            ProxyFutureFailed: the producer set an exception.
            ProxyFutureForged: the slot holds something no holder of the future wrote.
            StoreIntegrityError: the value's bytes are not those written.
            ProxyFutureError: the value was evicted (or the store has no slots).
        """
        return self.wait(self.timeout_s)

    def wait(self, timeout_s: float | None) -> T:
        """:meth:`resolve` with another bound (None: this future's ``timeout_s``)."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        store = self.get_store()
        connector = _slots_of(store)
        slot = str(self.key)
        deadline = time.monotonic() + bound
        interval = _FIRST_POLL_S
        while True:
            data = connector.get_slot(slot)
            if data is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProxyFutureTimeout(slot, _location(connector), bound)
            time.sleep(min(interval, left))
            interval = min(interval * 2, _LONGEST_POLL_S)
        return cast(T, self._load(connector, slot, data))

    def _load(self, connector: SlotConnector, slot: str, data: bytes) -> Any:
        where = _location(connector)
        pointer = _verified_pointer(data, slot, self.verify_key, where)
        if "error" in pointer:
            raise ProxyFutureFailed(slot, str(pointer["error"]))
        key = _key_from(connector, pointer, slot)
        raw = connector.get(key)  # the digest in the signed key is checked here
        if raw is None:
            raise ProxyFutureError(
                f"proxy future {slot} was set, but its value is no longer in {where}: it was "
                "evicted (once the results of its consumer tasks were consumed: the consumers "
                "argument of Client.proxy_future) or its lease ended"
            )
        return load_payload(raw)

    def is_set(self) -> bool:
        """Whether an authentic value (or exception) was set."""
        store = self.get_store()
        connector = _slots_of(store)
        data = connector.get_slot(str(self.key))
        if data is None:
            return False
        _verified_pointer(data, str(self.key), self.verify_key, _location(connector))
        return True

    def evict_value(self) -> list[str]:
        """Evict the value (if an authentic pointer names one) and empty the slot.

        Returns what was evicted (the slot, and the value's object key). Never raises: a
        store that cannot be reached keeps both until their lease ends.
        """
        slot = str(self.key)
        evicted: list[str] = []
        try:
            connector = _slots_of(self.get_store())
            data = connector.get_slot(slot)
            if data is not None:
                with contextlib.suppress(IntegrityError, ProxyFutureError, ValueError):
                    pointer = _verified_pointer(data, slot, self.verify_key, "")
                    if "key" in pointer:
                        key = _key_from(connector, pointer, slot)
                        connector.evict(key)
                        object_key = getattr(connector, "object_key", None)
                        evicted.append(str(object_key(key)) if object_key else str(key))
            connector.evict_slot(slot)
            evicted.append(slot)
        except Exception:  # eviction is best effort; the lease is the backstop
            return evicted
        return evicted


# --- ownership: who evicts the value, and when ------------------------------------------------


class FutureOwner:
    """The creating client's count of the tasks that hold a proxy future.

    Each task given the future's proxy as a top-level argument holds it
    (:meth:`hold`); its hold is released once its result is consumed (or the task
    will never run). When ``consumers`` holds were released and none is left, the
    value and the slot are evicted; a later holder that releases with none left evicts
    again (what it set since).
    """

    def __init__(self, factory: FutureFactory[Any], consumers: int) -> None:
        if consumers < 1:
            raise ValueError(f"consumers must be at least 1, not {consumers}")
        self._factory = factory
        self.consumers = consumers
        self._lock = threading.Lock()
        self.outstanding = 0
        self.released = 0
        self.evicted = False
        """Whether its value was evicted (by its consumers' releases or ``evict()``)."""

    def hold(self) -> FutureHold:
        """A new hold, for one consumer task."""
        with self._lock:
            self.outstanding += 1
        return FutureHold(self)

    def _end(self, *, counted: bool) -> list[str]:
        with self._lock:
            self.outstanding -= 1
            if counted:
                self.released += 1
            due = counted and self.outstanding == 0 and self.released >= self.consumers
            if due:
                self.evicted = True
        return self._factory.evict_value() if due else []


class FutureHold:
    """One consumer task's hold on a proxy future (in its ``PreparedTask.stored``).

    :meth:`release` ends it as consumed (``fxstream.connectors.evict_objects`` calls
    it with the task's other objects); :meth:`discard` ends it without counting, for a
    task that was never sent. Either happens once.
    """

    __slots__ = ("_done", "_lock", "owner")

    def __init__(self, owner: FutureOwner) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._done = False

    def _finish(self) -> bool:
        with self._lock:
            done, self._done = self._done, True
        return not done

    def release(self) -> list[str]:
        """The task's result was consumed: what was evicted because of it."""
        return self.owner._end(counted=True) if self._finish() else []

    def discard(self) -> None:
        """The task was never sent: end the hold without counting it as a consumer."""
        if self._finish():
            self.owner._end(counted=False)


class ProducerHold:
    """A producer task's hold on a proxy future it was given (in its ``PreparedTask.stored``).

    Released once the task's result is consumed: the task has ended then, so a future it
    did not set will not be set by it. Unless it is set, its readers are told so at once
    (:meth:`ProxyFuture.set_exception`) instead of waiting out their timeout. A task never
    sent (:meth:`discard`) changes nothing.
    """

    __slots__ = ("_done", "_lock", "future")

    def __init__(self, future: ProxyFuture[Any]) -> None:
        self.future = future
        self._lock = threading.Lock()
        self._done = False

    def _finish(self) -> bool:
        with self._lock:
            done, self._done = self._done, True
        return not done

    def release(self) -> list[str]:
        """The producer's result was consumed: fail the readers if it set nothing."""
        owner = self.future._owner
        if not self._finish() or owner is None or owner.evicted or owner.outstanding == 0:
            return []  # already told, or evicted (so it was set), or nobody waits for it
        with contextlib.suppress(Exception):  # set meanwhile, or the store is away
            if not self.future.done():
                self.future.set_exception(
                    "the producer task it was given ended (failed, or returned) without setting it"
                )
        return []

    def discard(self) -> None:
        """The task was never sent: nothing to tell."""
        self._finish()


def hold_futures(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
) -> list[FutureHold | ProducerHold]:
    """The holds of a task on the proxy futures this process created, among its top-level
    arguments: a :class:`FutureHold` for each future's proxy (a consumer; its factory
    knows the owner), a :class:`ProducerHold` for each :class:`ProxyFuture` (a producer).
    Proxies are never resolved here."""
    holds: list[FutureHold | ProducerHold] = []
    for value in (*args, *(kwargs or {}).values()):
        # type(), never isinstance: that would resolve a proxy (and wait for its value).
        cls = type(value)
        if issubclass(cls, ProxyFuture):
            if value._owner is not None:
                holds.append(ProducerHold(value))
            continue
        if not issubclass(cls, Proxy):
            continue
        factory = get_factory(value)
        if isinstance(factory, FutureFactory) and factory.owner is not None:
            holds.append(factory.owner.hold())
    return holds


# --- the writer's side: the future itself ---------------------------------------------------


class ProxyFuture(Generic[T]):
    """A value that will exist: set it once (:meth:`set_result`), hand out :meth:`proxy`.

    Create one with :meth:`create` (or ``Client.proxy_future``). It pickles with its
    private key, so a task it is passed to can set it; pass only :meth:`proxy` to tasks
    that only read it. The key never appears in its repr.
    """

    def __init__(
        self,
        slot: str,
        store_config: StoreConfig,
        *,
        signing_key: bytes,
        timeout_s: float,
        data_strategy: str,
        owner: FutureOwner | None = None,
    ) -> None:
        if len(signing_key) != _KEY_BYTES:
            raise ValueError(f"a signing key is {_KEY_BYTES} bytes, not {len(signing_key)}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.slot = slot
        self.store_config = store_config
        self.timeout_s = timeout_s
        self.data_strategy = data_strategy
        self._signing_key = signing_key
        self._owner = owner

    @classmethod
    def create(
        cls,
        store: Store[Any],
        *,
        timeout_s: float = DEFAULT_PROXY_FUTURE_TIMEOUT_S,
        serializer: Serializer | None = None,
        consumers: int = 1,
    ) -> ProxyFuture[Any]:
        """A new future in ``store`` (nothing is written yet).

        ``timeout_s`` bounds every wait for its value; ``serializer``'s data strategy
        writes the value (default: fxstream's); ``consumers`` is how many consumer tasks'
        consumed results evict it (:class:`FutureOwner`). Raises
        :class:`ProxyFutureError` for a store without slots.
        """
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        connector = _slots_of(store)
        private = Ed25519PrivateKey.generate()
        raw = private.private_bytes_raw()
        future: ProxyFuture[Any] = cls(
            connector.new_slot(),
            store.config(),
            signing_key=raw,
            timeout_s=timeout_s,
            data_strategy=(serializer or Serializer()).data.id,
        )
        future._owner = FutureOwner(future._factory(), consumers)
        return future

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = None  # the creator's bookkeeping stays with the creator
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ProxyFuture(slot={self.slot!r}, timeout_s={self.timeout_s:g})"

    @property
    def verify_key(self) -> str:
        """The public key (hex) its proxies verify the value with."""
        return self._private().public_key().public_bytes_raw().hex()

    def _private(self) -> Ed25519PrivateKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return Ed25519PrivateKey.from_private_bytes(self._signing_key)

    def _factory(self) -> FutureFactory[T]:
        return FutureFactory(
            self.slot,
            self.store_config,
            verify_key=self.verify_key,
            timeout_s=self.timeout_s,
            owner=self._owner,
        )

    def _connector(self) -> SlotConnector:
        return _slots_of(get_or_create_store(self.store_config, register=True))

    def proxy(self) -> T:
        """A proxy of the value, to pass to a task: its first use waits for the value.

        Typed as the value (it behaves as one); a task given it as a top-level argument
        holds the future until its result is consumed (:func:`hold_futures`).
        """
        return cast(T, Proxy(self._factory()))

    def set_result(self, value: T) -> None:
        """Write the value (once). Raises :class:`ProxyFutureError` if it was already set,
        :class:`ProxyFutureForged` if someone else wrote the slot first."""
        serializer = Serializer().with_data(self.data_strategy)
        payload = serializer.serialize_value(value, substitute=proxies_by_value)
        connector = self._connector()
        key = connector.put(payload)
        digest = getattr(key, "sha256", "")
        if not isinstance(digest, str) or not SHA256_PATTERN.match(digest):
            connector.evict(key)
            raise ProxyFutureError(
                f"the store of proxy future {self.slot} ({type(connector).__name__}) records no "
                "digest of what it stores, so its value could not be verified"
            )
        body = json.dumps({"key": list(key)}, separators=(",", ":")).encode()
        if not self._publish(connector, body):
            connector.evict(key)
            self._refuse_second_write(connector)

    def set_exception(self, error: BaseException | str) -> None:
        """Tell the readers the value will not come: they raise :class:`ProxyFutureFailed`
        with this message (an exception's type and text) instead of waiting."""
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        body = json.dumps({"error": reason[:_MAX_ERROR_CHARS]}, separators=(",", ":")).encode()
        connector = self._connector()
        if not self._publish(connector, body):
            self._refuse_second_write(connector)

    def _publish(self, connector: SlotConnector, body: bytes) -> bool:
        signature = self._private().sign(_message(self.slot, body))
        return connector.set_slot(self.slot, signature + body)

    def _refuse_second_write(self, connector: SlotConnector) -> None:
        existing = connector.get_slot(self.slot)
        if existing is not None:
            # Raises ProxyFutureForged when it is not ours.
            _verified_pointer(existing, self.slot, self.verify_key, _location(connector))
        raise ProxyFutureError(
            f"proxy future {self.slot} was already set: a proxy future is written once"
        )

    def done(self) -> bool:
        """Whether a value (or an exception) was set."""
        return self._factory().is_set()

    def result(self, timeout: float | None = None) -> T:
        """The value, waiting up to ``timeout`` seconds (default: the future's ``timeout_s``)."""
        return self._factory().wait(timeout)

    def evict(self) -> list[str]:
        """Evict the value and the slot now (consumers reading it later fail)."""
        if self._owner is not None:
            self._owner.evicted = True
        return self._factory().evict_value()
