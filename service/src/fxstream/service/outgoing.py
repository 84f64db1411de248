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

__all__ = ["Outgoing", "send_all"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to produce: topic, key, value bytes and optional headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None = None


async def send_all(producer: ProducerT, records: Sequence[Outgoing]) -> None:
    """Produce ``records`` and wait until the broker acknowledged all of them.

    Raises the first send failure: the caller must then stop without
    acknowledging its input (see the processors' fail-stop).
    """
    if not records:
        return
    pending = [await producer.send(r.topic, r.key, r.value, None, None, r.headers) for r in records]
    await asyncio.gather(*pending)
