"""What the service's aiokafka loops share: stopping cleanly, and a batch's next offsets."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["StoppableLoop", "offsets_after"]

log = logging.getLogger(__name__)


def offsets_after(batch: dict[Any, list[Any]]) -> dict[Any, int]:
    """Per partition of a ``getmany`` batch, the offset to commit: one past its last record."""
    return {tp: records[-1].offset + 1 for tp, records in batch.items() if records}


class StoppableLoop:
    """A consume loop that :meth:`stop` ends after the batch in hand.

    Subclasses check ``_stopping`` between batches, set ``_consumer`` once it is
    made, and set ``_done`` when ``run`` returns.
    """

    name = "loop"

    def __init__(self) -> None:
        self._stopping = asyncio.Event()
        self._done = asyncio.Event()
        self._consumer: Any = None

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish (and commit) the batch in hand, then leave the consumer group."""
        self._stopping.set()
        if self._consumer is None:  # never started
            return
        try:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        except TimeoutError:
            log.warning("%s: did not stop within %.0f s", self.name, timeout_s)
