"""Named objects in the platform's Redis store: what a ``store://NAME`` staging URL names.

A staged file (``TaskSubmission.stage_in`` / ``stage_out``, :mod:`fxstream.topics.staging`)
may live in the platform's Redis store under a name its user chooses, rather than under
the random key a proxy gets. Names are per user: user ``U``'s object ``NAME`` is the key
``fxobj:named:U:NAME`` (inside the ``fxobj:`` keys the store's Redis user may touch), and
the agent reads and writes only the namespace of the task's submitter as the router
stamped it, so one user's ``store://`` URL never reaches another user's objects through
the agent. (The store's Redis credential itself is shared by the platform's users, as for
proxies: docs/security.md.)

Each value is the SHA-256 of the bytes (64 hex digits) followed by the bytes, checked on
every read (:class:`~fxstream.connectors.integrity.StoreIntegrityError`), and carries the
store's lease as its TTL. A batch of names is read or written in one pipeline (one round
trip: the store is one staging site). Objects are at most :data:`MAX_NAMED_OBJECT_BYTES`
(one Redis value, not split into chunks as proxies are).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import redis

from fxstream.connectors.integrity import sha256_of, verify_digest
from fxstream.connectors.redis import DEFAULT_KEY_PREFIX
from fxstream.connectors.stores import StoreSpec, StoreURLError

__all__ = ["MAX_NAMED_OBJECT_BYTES", "NAMED_PREFIX", "NamedObjectTooLarge", "NamedObjects"]

MAX_NAMED_OBJECT_BYTES: Final = 256 * 1024 * 1024
"""The largest named object (one Redis value, below its 512 MB limit)."""

NAMED_PREFIX: Final = f"{DEFAULT_KEY_PREFIX}named:"
"""The prefix of every named object's key (then ``<user id>:<name>``)."""

_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}(/[A-Za-z0-9._-]{1,128})*")
_DIGEST_CHARS = 64


class NamedObjectTooLarge(ValueError):
    """An object above :data:`MAX_NAMED_OBJECT_BYTES`: nothing was written."""


class NamedObjects:
    """Objects in a Redis store (a ``redis://`` or ``rediss://`` store URL) by user and name.

    Args:
        store_url: The store's URL, with its user and password (kept out of every repr).
        lease_s: The TTL of what is written (default: the URL's ``lease_s``, else the
            store's default lease).
    """

    def __init__(self, store_url: str, *, lease_s: float | None = None) -> None:
        spec = StoreSpec.parse(store_url)
        if spec.scheme not in ("redis", "rediss"):
            raise StoreURLError(
                f"store URL {spec.url!r}: store:// objects live in a Redis store; this "
                f"endpoint's store is {spec.scheme}://, so it cannot stage them"
            )
        options = spec.options
        self.location = spec.url
        self.lease_s = lease_s if lease_s is not None else spec.lease_s
        tls: dict[str, Any] = {}
        if options.get("tls"):
            tls = {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": options.get("ca_file")}
        self._client = redis.Redis(
            host=options["hostname"],
            port=options["port"],
            db=options["db"],
            username=options.get("username"),
            password=options.get("password"),
            **tls,
        )

    def __repr__(self) -> str:
        return f"NamedObjects({self.location!r})"

    def close(self) -> None:
        """Close the connection pool; the objects stay (until their lease ends)."""
        self._client.close()

    @staticmethod
    def key(user_id: str, name: str) -> str:
        """The Redis key of ``user_id``'s object ``name``; ``ValueError`` for a bad one."""
        if not _USER.fullmatch(user_id):
            raise ValueError(f"not a user id: {user_id!r}")
        if not _NAME.fullmatch(name) or any(s in (".", "..") for s in name.split("/")):
            raise ValueError(
                f"not a store object name: {name!r} (letters, digits, '.', '_', '-' and '/', "
                "no '.' or '..' segment)"
            )
        return f"{NAMED_PREFIX}{user_id}:{name}"

    def put(self, user_id: str, name: str, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` as ``user_id``'s object ``name`` (replacing it); returns its size."""
        return self.put_many(user_id, [(name, data)])[0]

    def put_many(
        self, user_id: str, objects: Sequence[tuple[str, bytes | bytearray | memoryview]]
    ) -> list[int]:
        """Write each ``(name, data)`` in one pipeline; returns their sizes.

        Raises :class:`NamedObjectTooLarge` (nothing written) for one above the limit.
        """
        ttl = None if self.lease_s is None else max(1, round(self.lease_s))
        sizes: list[int] = []
        pipeline = self._client.pipeline(transaction=False)
        for name, data in objects:
            view = memoryview(data).cast("B")
            if len(view) > MAX_NAMED_OBJECT_BYTES:
                raise NamedObjectTooLarge(
                    f"store object {name!r} is {len(view):,} bytes, above the "
                    f"{MAX_NAMED_OBJECT_BYTES:,}-byte limit of a store:// object: stage a file "
                    "that large through file:// or globus:// instead"
                )
            value = sha256_of(view).encode() + bytes(view)
            pipeline.set(self.key(user_id, name), value, ex=ttl)
            sizes.append(len(view))
        pipeline.execute()
        return sizes

    def get(self, user_id: str, name: str) -> bytes | None:
        """``user_id``'s object ``name``, or None when there is none (or its lease ended)."""
        return self.get_many(user_id, [name])[0]

    def get_many(self, user_id: str, names: Sequence[str]) -> list[bytes | None]:
        """Each object of ``names`` (None for a missing one), read in one round trip.

        Raises :class:`~fxstream.connectors.integrity.StoreIntegrityError` for one whose
        bytes are not those written.
        """
        if not names:
            return []
        keys = [self.key(user_id, name) for name in names]
        values: list[bytes | None] = self._client.mget(keys)  # type: ignore[assignment]
        found: list[bytes | None] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                found.append(None)
                continue
            digest, data = value[:_DIGEST_CHARS].decode("ascii", "replace"), value[_DIGEST_CHARS:]
            verify_digest(sha256_of(data), digest, key=key, store=f"Redis {self.location}")
            found.append(data)
        return found

    def delete(self, user_id: str, name: str) -> bool:
        """Delete ``user_id``'s object ``name``; False when there was none."""
        return bool(self._client.delete(self.key(user_id, name)))
