"""What a connector says about an object it created, for the ``data-locations`` topic.

Every object or stream that an fxstream connector creates can describe itself as an
:class:`ObjectDescription` (its key, its size in bytes and its storage tier). The
data-locations publisher turns that into a record; connectors never publish themselves.

Tiers:

- ``"durable"``: the bytes survive the process that wrote them and are visible from
  other nodes (a shared file system directory, Redis with AOF);
- ``"ephemeral"``: node-local or in-memory bytes, written once and read many times,
  with no replication (a node-local directory, an in-flight SST stream).
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

__all__ = ["TIERS", "ObjectDescription", "Tier", "check_tier"]

Tier = Literal["durable", "ephemeral"]
TIERS: Final[tuple[Tier, ...]] = ("durable", "ephemeral")


class ObjectDescription(NamedTuple):
    """One stored object or stream as the data-locations topic sees it.

    Attributes:
        key: the object's key as a string (unique within its store).
        size_bytes: the bytes the object holds (for a stream: the bytes written so far).
        tier: ``"durable"`` or ``"ephemeral"``.
    """

    key: str
    size_bytes: int
    tier: Tier


def check_tier(tier: str) -> Tier:
    """``tier`` if it is a known tier, else a ValueError that lists the valid ones."""
    if tier not in TIERS:
        raise ValueError(
            f"unknown storage tier {tier!r}: use 'durable' (shared, survives the writer) "
            "or 'ephemeral' (node-local, written once, no replication)"
        )
    return tier
