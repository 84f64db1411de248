"""What a connector says about an object or stream it created, for ``data-locations``.

Every object or stream that the ADIOS2 and file-stream connectors create can describe
itself as an :class:`ObjectDescription`: its key, its size in bytes, its storage tier
(:class:`~fxstream.topics.StorageTier`), the node that wrote it and whether it is
complete (a stream still being written is not). The data-locations publisher
(:mod:`fxstream.connectors.locations`) turns that into a record; connectors never
publish themselves.
"""

from __future__ import annotations

from typing import NamedTuple

from fxstream.topics import ObjectReference, StorageTier

__all__ = ["ObjectDescription", "check_tier"]


class ObjectDescription(NamedTuple):
    """One stored object or stream as the data-locations topic sees it.

    Attributes:
        key: the object's key as a string (its path, unique within its store).
        size_bytes: the bytes the object holds (for a stream: the bytes written so far).
        tier: durable (shared, survives the writer) or ephemeral (node-local / in memory).
        node: the host that wrote it.
        complete: False while a stream is still being written.
        sha256: the SHA-256 of its bytes ('' for a stream until it is complete), what a
            reader given it verifies (docs/security.md, "Data integrity").
    """

    key: str
    size_bytes: int
    tier: StorageTier
    node: str = ""
    complete: bool = True
    sha256: str = ""

    def reference(self, store: str, site: str = "") -> ObjectReference:
        """The :class:`~fxstream.topics.ObjectReference` that data-locations publishes."""
        return ObjectReference(
            object_key=self.key,
            store=store,
            size_bytes=self.size_bytes,
            tier=self.tier,
            site=site,
            node=self.node,
            sha256=self.sha256,
        )


def check_tier(tier: StorageTier | str) -> StorageTier:
    """``tier`` as a StorageTier, or a ValueError that lists the valid ones."""
    try:
        return StorageTier(tier)
    except ValueError:
        raise ValueError(
            f"unknown storage tier {tier!r}: use 'durable' (shared, survives the writer) "
            "or 'ephemeral' (node-local, written once, no replication)"
        ) from None
