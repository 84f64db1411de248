"""A ProxyStore connector on Redis that splits large objects and leases every key.

Why not ProxyStore's own ``RedisConnector``: Redis refuses one value above
``proto-max-bulk-len`` (512 MB by default), and fxstream users pass 1 GB
arrays. This connector stores an object up to ``chunk_bytes`` under one key and
a larger one as numbered chunks ``<key>:0 .. <key>:n-1``, written in one
pipeline; the chunk count travels in the key, so a reader needs no extra
round trip. Every key carries a TTL (the *lease*, see docs/data-plane.md,
"Lifetimes"): an object nobody evicts, because the client that owned it died,
still goes away once the records that refer to it can no longer be replayed.

Keys are ``<prefix><uuid4 hex>``; :meth:`RedisConnector.count_objects` scans
for the prefix, which is how the tests count leaked objects.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import redis
from proxystore.serialize import BytesLike

from fxstream.topics import StorageTier

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_KEY_PREFIX", "RedisConnector", "RedisObjectKey"]

DEFAULT_CHUNK_BYTES: Final = 64 * 1024 * 1024
"""Objects above this are split; well below Redis's 512 MB limit on one value."""

DEFAULT_KEY_PREFIX: Final = "fxobj:"


class RedisObjectKey(NamedTuple):
    """Where an object is: its Redis key, and how many chunks it was split into."""

    redis_key: str
    chunks: int = 1
    size_bytes: int = 0


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
    """

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
        self._client = redis.Redis(host=hostname, port=port, db=db)

    def __repr__(self) -> str:
        return f"RedisConnector({self.hostname}:{self.port}/{self.db}, tier={self.tier.value})"

    # --- Connector protocol ----------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool; stored objects stay."""
        self._client.close()

    def config(self) -> dict[str, Any]:
        """Everything :meth:`from_config` needs to reconnect (no secrets)."""
        return {
            "hostname": self.hostname,
            "port": self.port,
            "db": self.db,
            "lease_s": self.lease_s,
            "key_prefix": self.key_prefix,
            "chunk_bytes": self.chunk_bytes,
            "tier": self.tier.value,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RedisConnector:
        """A connector from :meth:`config`'s output."""
        return cls(**config)

    def evict(self, key: RedisObjectKey) -> None:
        """Delete the object and all its chunks (a missing object is not an error)."""
        self._client.delete(*self._keys_of(key))

    def evict_object_key(self, object_key: str, size_bytes: int) -> None:
        """Evict by what data-locations and a payload's envelope name: key and size."""
        chunks = max(1, -(-size_bytes // self.chunk_bytes))
        self.evict(RedisObjectKey(object_key, chunks, size_bytes))

    def exists(self, key: RedisObjectKey) -> bool:
        """Whether every part of the object is still stored."""
        names = self._keys_of(key)
        return int(self._client.exists(*names)) == len(names)

    def get(self, key: RedisObjectKey) -> bytes | None:
        """The object's bytes, or None when it (or any chunk of it) is gone."""
        if key.chunks <= 1:
            value: bytes | None = self._client.get(key.redis_key)  # type: ignore[assignment]
            return value
        parts: list[bytes | None] = self._client.mget(self._keys_of(key))  # type: ignore[assignment]
        if any(part is None for part in parts):
            return None
        return b"".join(part for part in parts if part is not None)

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
            key = RedisObjectKey(name, chunks, size)
            for part_name, start in zip(
                self._keys_of(key), range(0, max(size, 1), self.chunk_bytes), strict=True
            ):
                # redis-py sends a memoryview as is: no chunk is copied (a 1 GB object
                # queued in the pipeline as bytes would be a second 1 GB in memory).
                pipeline.set(part_name, view[start : start + self.chunk_bytes], ex=self._ttl())
            keys.append(key)
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
