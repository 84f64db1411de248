"""Records a processor decided to write, and writing a batch of them with one wait.

Processors first *plan* a batch (pure decisions, no I/O) into :class:`Outgoing`
records, then hand them to :func:`send_all`, which starts every send before
awaiting any: one round trip per batch instead of one per record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from faust.types import ProducerT

__all__ = ["RECORD_OVERHEAD_BYTES", "Outgoing", "fits", "send_all"]

# Room for the record batch header, timestamps and varints around key and value;
# generous, so a record we accept is never refused by the broker for a few bytes.
RECORD_OVERHEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to produce: topic, key, value bytes and optional headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None = None


def fits(size: int, max_message_bytes: int) -> bool:
    """True when a record of ``size`` key and value bytes is within ``max.message.bytes``."""
    return size + RECORD_OVERHEAD_BYTES <= max_message_bytes


async def send_all(producer: ProducerT, records: Sequence[Outgoing]) -> None:
    """Produce ``records`` and wait until the broker acknowledged all of them.

    Raises the first send failure: the caller must then stop without
    acknowledging its input (see the processors' fail-stop).
    """
    if not records:
        return
    pending = [await producer.send(r.topic, r.key, r.value, None, None, r.headers) for r in records]
    await asyncio.gather(*pending)
