"""The digest every by-reference object carries, and the check made before it is loaded.

A connector computes the SHA-256 of an object's bytes when it writes them and
puts the digest in the key it returns (``RedisObjectKey.sha256``,
``FileObjectKey.sha256``, ...). The key travels inside the payload of a Kafka
record, which only an authenticated principal could write; the store itself
(Redis, a shared directory, a Globus collection) is not trusted. A connector's
``get`` hashes the bytes it read and raises :class:`StoreIntegrityError` on a
mismatch, so nothing substituted in the store is ever handed to a deserializer.
A key without a digest is refused the same way: no code path loads an
unverified object.

Hashing never copies: :class:`Digest` updates from memoryviews of the chunks as
they are written or read, so a 1 GB object costs one pass of SHA-256
(about 0.5 s) and no second gigabyte.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Final

from fxstream.topics import IntegrityError

if TYPE_CHECKING:
    # Only the type: importing proxystore.serialize imports numpy (~0.3 s).
    from proxystore.serialize import BytesLike

__all__ = ["SHA256_PATTERN", "Digest", "StoreIntegrityError", "sha256_of", "verify_digest"]

SHA256_PATTERN: Final = re.compile(r"^[0-9a-f]{64}$")
"""A digest as keys and references carry it: 64 lowercase hex digits."""


class StoreIntegrityError(IntegrityError):
    """An object read from a store is not the object that was written there.

    Raised before anything is deserialized; a payload being loaded lets it through
    unwrapped (:class:`~fxstream.topics.IntegrityError`), so the task fails with it.
    ``key`` and ``store`` name the object and where it was read; ``expected`` and
    ``found`` are the digests (``found`` is empty when the key carried no digest).
    """

    def __init__(self, key: str, store: str, expected: str, found: str) -> None:
        self.key = key
        self.store = store
        self.expected = expected
        self.found = found
        if not expected:
            detail = "its reference carries no sha256 digest, so it cannot be verified"
        else:
            detail = f"sha256 {found} differs from the {expected} recorded when it was written"
        super().__init__(
            f"store integrity check failed for object {key!r} in {store}: {detail}. The object "
            "was substituted or corrupted in the store after it was written; nothing was "
            "deserialized. Check who can write to this store (docs/security.md, 'Data "
            "integrity'), then resubmit the task so its input is written again."
        )

    def __reduce__(self) -> tuple[type[StoreIntegrityError], tuple[str, str, str, str]]:
        # Pickles (and so travels from a worker process) with its fields, not its message.
        return type(self), (self.key, self.store, self.expected, self.found)


class Digest:
    """A running SHA-256 over the chunks of one object, fed without copying."""

    __slots__ = ("_hash",)

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, chunk: BytesLike) -> None:
        """Add the next chunk (any buffer; it is hashed in place)."""
        self._hash.update(memoryview(chunk).cast("B"))

    def hexdigest(self) -> str:
        """The digest of everything added so far."""
        return self._hash.hexdigest()


def sha256_of(data: BytesLike) -> str:
    """The hex SHA-256 of a buffer, hashed in place."""
    digest = Digest()
    digest.update(data)
    return digest.hexdigest()


def verify_digest(found: str, expected: str, *, key: str, store: str) -> None:
    """Raise :class:`StoreIntegrityError` unless ``found`` is the (well-formed) ``expected``."""
    if not SHA256_PATTERN.match(expected or "") or found != expected:
        raise StoreIntegrityError(key, store, expected, found if expected else "")
