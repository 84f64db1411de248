"""A ProxyStore connector on Redis that splits large objects and leases every key.

Why not ProxyStore's own ``RedisConnector``: Redis refuses one value above
``proto-max-bulk-len`` (512 MB by default), and fxstream users pass 1 GB
arrays. This connector stores an object up to ``chunk_bytes`` under one key and
a larger one as numbered chunks ``<key>:0 .. <key>:n-1``, written in one
pipeline; the chunk count travels in the key, so a reader needs no extra
round trip. Every key carries a TTL (the *lease*, see docs/data-plane.md,
"Lifetimes"): an object nobody evicts, because the client that owned it died,
still goes away once the records that refer to it can no longer be replayed.

Integrity: the key also carries the SHA-256 of the object's bytes, computed
while it is written; :meth:`RedisConnector.get` hashes what Redis returns and
raises :class:`~fxstream.connectors.integrity.StoreIntegrityError` on a
mismatch, before anything is deserialized (docs/security.md, "Data integrity").

Authentication: the platform's Redis requires a user and password (ACL users,
the default user disabled). They are given to the constructor (or in the store
URL, ``redis://USER:PASSWORD@HOST:PORT/DB``) and never appear in
:meth:`RedisConnector.config`, in a repr or in an error: a connector rebuilt
from its config in the same process (a ProxyStore factory resolving a proxy)
finds them in a process-wide table filled when the first connector to that
server was opened with them, or else in ``FXSTREAM_STORE_URL`` (the SDK's store
URL variable) when that names the same host and port. TLS (``rediss://``)
verifies the server against ``ca_file``.

Keys are ``<prefix><uuid4 hex>``; :meth:`RedisConnector.count_objects` scans
for the prefix, which is how the tests count leaked objects.
"""

from __future__ import annotations

import contextlib
import os
import threading
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Final, NamedTuple

import redis
from proxystore.serialize import BytesLike

from fxstream.connectors.integrity import Digest, sha256_of, verify_digest
from fxstream.topics import StorageTier

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_KEY_PREFIX",
    "STORE_URL_ENV",
    "RedisConnector",
    "RedisObjectKey",
    "redact_url",
]

DEFAULT_CHUNK_BYTES: Final = 64 * 1024 * 1024
"""Objects above this are split; well below Redis's 512 MB limit on one value."""

DEFAULT_KEY_PREFIX: Final = "fxobj:"

_credentials: dict[tuple[str, int], tuple[str | None, str]] = {}
_credentials_lock = threading.Lock()


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (what logs and errors may show)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    userinfo, at, hostport = authority.rpartition("@")
    if not at:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{hostport}{slash}{tail}"


STORE_URL_ENV: Final = "FXSTREAM_STORE_URL"
"""The SDK's store URL variable; a connector without a password looks there too."""


def _credentials_from_environment(hostname: str, port: int) -> tuple[str | None, str] | None:
    """The user and password of ``FXSTREAM_STORE_URL`` when it names this server."""
    url = os.environ.get(STORE_URL_ENV, "")
    if not url.startswith(("redis://", "rediss://")):
        return None
    try:
        parsed = urllib.parse.urlsplit(url)
        same = parsed.hostname == hostname and parsed.port == port
    except ValueError:
        return None
    if not same or parsed.password is None:
        return None
    username = urllib.parse.unquote(parsed.username) if parsed.username else None
    return username, urllib.parse.unquote(parsed.password)


class RedisObjectKey(NamedTuple):
    """Where an object is: its Redis key, how many chunks it was split into, its size, and
    the SHA-256 of its bytes (checked by :meth:`RedisConnector.get` before they are used)."""

    redis_key: str
    chunks: int = 1
    size_bytes: int = 0
    sha256: str = ""


class RedisConnector:
    """A ProxyStore connector on one Redis server, with chunking and a lease per key.

    Args:
        hostname: Redis host.
        port: Redis port.
        db: Redis database number.
        lease_s: TTL of every key in seconds (``None``: no TTL; not advised).
        key_prefix: Prefix of every key this connector writes.
        chunk_bytes: Largest value stored under one key.
        tier: What the server's persistence makes this store: durable with
            AOF (the platform's Redis), ephemeral without.
        username: The Redis ACL user (None: the server's default user).
        password: Its password; never kept in :meth:`config`. When None, the
            password a connector to the same host and port was opened with in
            this process is used, or that of ``FXSTREAM_STORE_URL`` if it names
            this server.
        tls: Connect over TLS (``rediss://``).
        ca_file: The CA that signed the server's certificate (TLS only).

    Proxy futures (:mod:`fxstream.connectors.futures`) use its write-once *slots*:
    :meth:`set_slot` is a ``SET NX`` with the lease, under a key ``<prefix>pf-<uuid4 hex>``.
    """

    key_type: ClassVar[type[RedisObjectKey]] = RedisObjectKey
    """The class of this connector's keys (how a proxy future's pointer names its value)."""

    def __init__(
        self,
        hostname: str,
        port: int,
        *,
        db: int = 0,
        lease_s: float | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        tier: StorageTier | str = StorageTier.DURABLE,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ca_file: str | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"lease_s must be positive (or None for no lease), not {lease_s}")
        self.hostname = hostname
        self.port = port
        self.db = db
        self.lease_s = lease_s
        self.key_prefix = key_prefix
        self.chunk_bytes = chunk_bytes
        self.tier = StorageTier(tier)
        self.tls = tls
        self.ca_file = ca_file
        with _credentials_lock:
            if password is None and (hostname, port) not in _credentials:
                found = _credentials_from_environment(hostname, port)
                if found is not None:
                    _credentials[(hostname, port)] = found
            if password is not None:
                _credentials[(hostname, port)] = (username, password)
            elif (hostname, port) in _credentials:
                known_user, password = _credentials[(hostname, port)]
                username = username if username is not None else known_user
        self.username = username
        tls_options: dict[str, Any] = {}
        if tls:
            tls_options = {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": ca_file}
        self._client = redis.Redis(
            host=hostname,
            port=port,
            db=db,
            username=username,
            password=password,
            **tls_options,
        )

    def __repr__(self) -> str:
        user = f"{self.username}@" if self.username else ""
        scheme = "rediss" if self.tls else "redis"
        return (
            f"RedisConnector({scheme}://{user}{self.hostname}:{self.port}/{self.db}, "
            f"tier={self.tier.value})"
        )

    @property
    def location(self) -> str:
        """Where this store is, for errors and logs (no password)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.hostname}:{self.port}/{self.db}"

    @contextlib.contextmanager
    def _access(self, action: str) -> Iterator[None]:
        """Turn Redis's authentication refusals into an error that says what to do."""
        try:
            yield
        except redis.exceptions.NoPermissionError as exc:
            raise PermissionError(
                f"Redis {self.location} refused to {action} for user {self.username!r} ({exc}): "
                f"this connector's keys must start with the prefix the user may use "
                f"(fxobj: for the platform's fxstream user), not {self.key_prefix!r}"
            ) from None
        except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
            if isinstance(exc, redis.exceptions.ResponseError) and "NOAUTH" not in str(exc):
                raise
            raise PermissionError(
                f"Redis {self.location} refused to {action}: it requires a user and password "
                f"({exc}). Use the store URL with them, redis://fxstream:PASSWORD@HOST:PORT/DB "
                "(the platform writes it to <home>/platform.json and the SDK's credentials "
                "file), as the SDK's store_url (FXSTREAM_STORE_URL) and the endpoint's store_url"
            ) from None

    # --- Connector protocol ----------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool; stored objects stay."""
        self._client.close()

    def config(self) -> dict[str, Any]:
        """Everything :meth:`from_config` needs to reconnect (no password: see the module)."""
        return {
            "hostname": self.hostname,
            "port": self.port,
            "db": self.db,
            "lease_s": self.lease_s,
            "key_prefix": self.key_prefix,
            "chunk_bytes": self.chunk_bytes,
            "tier": self.tier.value,
            "username": self.username,
            "tls": self.tls,
            "ca_file": self.ca_file,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RedisConnector:
        """A connector from :meth:`config`'s output."""
        return cls(**config)

    def evict(self, key: RedisObjectKey) -> None:
        """Delete the object and all its chunks (a missing object is not an error)."""
        with self._access("evict an object"):
            self._client.delete(*self._keys_of(key))

    def evict_object_key(self, object_key: str, size_bytes: int) -> None:
        """Evict by what data-locations and a payload's envelope name: key and size."""
        chunks = max(1, -(-size_bytes // self.chunk_bytes))
        self.evict(RedisObjectKey(object_key, chunks, size_bytes))

    def exists(self, key: RedisObjectKey) -> bool:
        """Whether every part of the object is still stored."""
        names = self._keys_of(key)
        with self._access("check an object"):
            return int(self._client.exists(*names)) == len(names)

    def get(self, key: RedisObjectKey) -> bytes | None:
        """The object's bytes, or None when it (or any chunk of it) is gone.

        Raises:
            StoreIntegrityError: the bytes are not those written (their SHA-256
                differs from the key's), or the key carries no digest.
        """
        digest = Digest()
        if key.chunks <= 1:
            with self._access("read an object"):
                value: bytes | None = self._client.get(key.redis_key)  # type: ignore[assignment]
            if value is None:
                return None
            digest.update(value)
        else:
            with self._access("read an object"):
                parts: list[bytes | None] = self._client.mget(self._keys_of(key))  # type: ignore[assignment]
            if any(part is None for part in parts):
                return None
            # Hashed part by part before the join: no extra copy for the check.
            for part in parts:
                assert part is not None
                digest.update(part)
            value = b"".join(part for part in parts if part is not None)
            del parts
        verify_digest(
            digest.hexdigest(), key.sha256, key=key.redis_key, store=f"Redis {self.location}"
        )
        return value

    def get_batch(self, keys: Sequence[RedisObjectKey]) -> list[BytesLike | None]:
        """:meth:`get` for each key, in order."""
        return [self.get(key) for key in keys]

    def put(self, obj: bytes | bytearray | memoryview) -> RedisObjectKey:
        """Store ``obj`` under a new key (split into chunks when large)."""
        return self.put_batch([obj])[0]

    def put_batch(self, objs: Sequence[bytes | bytearray | memoryview]) -> list[RedisObjectKey]:
        """Store each object under its own new key, all in one pipeline."""
        keys: list[RedisObjectKey] = []
        pipeline = self._client.pipeline(transaction=False)
        for obj in objs:
            view = memoryview(obj).cast("B")
            size = len(view)
            name = f"{self.key_prefix}{uuid.uuid4().hex}"
            chunks = max(1, -(-size // self.chunk_bytes))
            key = RedisObjectKey(name, chunks, size, sha256_of(view))
            for part_name, start in zip(
                self._keys_of(key), range(0, max(size, 1), self.chunk_bytes), strict=True
            ):
                # redis-py sends a memoryview as is: no chunk is copied (a 1 GB object
                # queued in the pipeline as bytes would be a second 1 GB in memory).
                pipeline.set(part_name, view[start : start + self.chunk_bytes], ex=self._ttl())
            keys.append(key)
        with self._access("store an object"):
            pipeline.execute()
        return keys

    # --- fxstream extras -------------------------------------------------------------------

    def object_key(self, key: RedisObjectKey) -> str:
        """The key as data-locations names it."""
        return key.redis_key

    def size_of(self, key: RedisObjectKey) -> int:
        """The object's size in bytes, as recorded when it was put."""
        return key.size_bytes

    def renew(self, key: RedisObjectKey, lease_s: float | None = None) -> bool:
        """Extend the object's lease to ``lease_s`` (default: the connector's); False if gone."""
        seconds = self._ttl() if lease_s is None else max(1, round(lease_s))
        if seconds is None:
            return self.exists(key)
        pipeline = self._client.pipeline(transaction=False)
        for name in self._keys_of(key):
            pipeline.expire(name, seconds)
        return all(pipeline.execute())

    # --- write-once slots (proxy futures) ---------------------------------------------------

    def new_slot(self) -> str:
        """A new slot name under this connector's prefix; nothing is written."""
        return f"{self.key_prefix}pf-{uuid.uuid4().hex}"

    def _check_slot(self, slot: str) -> str:
        if not slot.startswith(self.key_prefix):
            raise ValueError(f"not a slot of this connector (prefix {self.key_prefix!r}): {slot!r}")
        return slot

    def set_slot(self, slot: str, data: bytes) -> bool:
        """Write ``data`` to ``slot`` unless it holds something (``SET NX``, with the lease);
        False when it did."""
        with self._access("set a proxy future"):
            return bool(self._client.set(self._check_slot(slot), data, nx=True, ex=self._ttl()))

    def get_slot(self, slot: str) -> bytes | None:
        """What ``slot`` holds, or None."""
        with self._access("read a proxy future"):
            value: bytes | None = self._client.get(self._check_slot(slot))  # type: ignore[assignment]
        return value

    def evict_slot(self, slot: str) -> None:
        """Empty ``slot`` (an empty one is not an error)."""
        with self._access("evict a proxy future"):
            self._client.delete(self._check_slot(slot))

    def count_objects(self) -> int:
        """How many objects (not chunks) under this connector's prefix are stored now."""
        count = 0
        for name in self._client.scan_iter(match=f"{self.key_prefix}*", count=1000):
            text = name.decode() if isinstance(name, bytes) else str(name)
            tail = text[len(self.key_prefix) :]
            # A chunked object has keys "<id>:0".."<id>:n-1"; count its chunk 0 only.
            if ":" not in tail or tail.endswith(":0"):
                count += 1
        return count

    def _ttl(self) -> int | None:
        return None if self.lease_s is None else max(1, round(self.lease_s))

    @staticmethod
    def _keys_of(key: RedisObjectKey) -> list[str]:
        if key.chunks <= 1:
            return [key.redis_key]
        return [f"{key.redis_key}:{index}" for index in range(key.chunks)]
