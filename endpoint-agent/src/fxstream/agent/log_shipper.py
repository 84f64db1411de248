"""The agent's log, shipped to the platform for the endpoint's owner to read.

:class:`LogShipper` is a :class:`logging.Handler` on the agent's loggers: it keeps each
record at or above its level as a :class:`~fxstream.topics.LogLine` in a bounded queue
(the oldest lines go first when the agent logs faster than it ships, and the next batch
says how many: ``dropped``), and :meth:`LogShipper.ship` sends what is queued as
:class:`~fxstream.topics.EndpointLogs` batches on the endpoint's own topic
(``from.ep.<E>``), with each heartbeat. The ingress checks that a batch speaks for its
endpoint and forwards it to ``endpoint-logs``, which the API reads for the endpoint's
owner only (``GET /v1/endpoints/{id}/logs``, ``Client.get_endpoint_logs``,
``fxstream logs``).

The handler never blocks the agent and never logs through itself: a record logged while
a batch is being built or produced (librdkafka's own, say) is not queued, and a failed
send is counted, not logged again. What the agent logs must hold no secret (it never
logs tokens or passwords), since its owner reads it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Final, Protocol

from fxstream.topics import EndpointLogs, LogLine, encode, truncate_utf8

__all__ = ["DEFAULT_MAX_QUEUED", "LogShipper"]

DEFAULT_MAX_QUEUED: Final = 5_000
"""Lines queued at most between two shipments (the oldest go first)."""
_MAX_LINE_BYTES: Final = 8_000
_MAX_LINES_PER_BATCH: Final = 500
# A batch stays well under the endpoint topic's 5 MiB records (and the endpoint-logs 4 MiB).
_MAX_BATCH_BYTES: Final = 1_000_000
_MAX_BATCHES_PER_SHIP: Final = 8


class _Producer(Protocol):
    def produce(self, topic: str, value: bytes, key: bytes) -> None: ...


class LogShipper(logging.Handler):
    """Queues the agent's log lines and ships them in batches (see the module notes)."""

    def __init__(
        self,
        *,
        endpoint_id: str,
        agent_id: str,
        hostname: str,
        topic: str,
        level: int = logging.INFO,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        super().__init__(level)
        self.endpoint_id = endpoint_id
        self.agent_id = agent_id
        self.hostname = hostname
        self.topic = topic
        self.setFormatter(logging.Formatter("%(message)s"))
        self._lines: collections.deque[LogLine] = collections.deque(maxlen=max_queued)
        self._guard = threading.local()
        self._queue_lock = threading.Lock()
        self.dropped = 0
        self.shipped = 0
        self.send_failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        """Queue ``record`` (unless it was logged while shipping)."""
        if getattr(self._guard, "busy", False):
            return
        try:
            message = self.format(record)
        except Exception:  # a bad format string in someone's log call: keep its raw text
            message = str(record.msg)
        line = LogLine(
            at=record.created,
            level=record.levelname[:16],
            logger=record.name[:256],
            message=truncate_utf8(message, _MAX_LINE_BYTES),
        )
        with self._queue_lock:
            if len(self._lines) == self._lines.maxlen:
                self.dropped += 1
            self._lines.append(line)

    def ship(self, producer: _Producer) -> int:
        """Produce what is queued (a few batches at most); returns the lines sent."""
        self._guard.busy = True
        sent = 0
        try:
            for _ in range(_MAX_BATCHES_PER_SHIP):
                batch, dropped = self._take()
                if not batch:
                    break
                record = EndpointLogs(
                    endpoint_id=self.endpoint_id,
                    agent_id=self.agent_id,
                    hostname=self.hostname[:256],
                    sent_at=time.time(),
                    lines=batch,
                    dropped=dropped,
                )
                try:
                    producer.produce(
                        self.topic, value=encode(record), key=self.endpoint_id.encode()
                    )
                except Exception:  # a full local queue, a closed producer: lines lost, counted
                    self.send_failures += 1
                    with self._queue_lock:
                        self.dropped += len(batch)
                    break
                sent += len(batch)
        finally:
            self._guard.busy = False
        self.shipped += sent
        return sent

    def _take(self) -> tuple[list[LogLine], int]:
        batch: list[LogLine] = []
        size = 0
        with self._queue_lock:
            while self._lines and len(batch) < _MAX_LINES_PER_BATCH:
                line = self._lines[0]
                cost = len(line.message.encode("utf-8")) + len(line.logger) + 64
                if batch and size + cost > _MAX_BATCH_BYTES:
                    break
                batch.append(self._lines.popleft())
                size += cost
            dropped, self.dropped = (self.dropped, 0) if batch else (0, self.dropped)
        return batch, dropped
