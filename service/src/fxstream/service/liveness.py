"""Endpoint liveness from heartbeats: which endpoints are online, and when one is lost.

The API answers "is this endpoint online?" at query time from the latest
heartbeat (:meth:`RegistryView.endpoint_status`). This processor watches the
same stream as it happens, so an operator's log says when an endpoint came
online, restarted (a new agent id) or was lost, and malformed heartbeats are
dead-lettered with the reason instead of being skipped silently. It is the
place where task leases (tasks an agent holds, renewed by each heartbeat) are
to be enforced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxstream.service.deadletter import RawRecord, dead_letter_for
from fxstream.service.outgoing import Outgoing
from fxstream.service.registry import LIVENESS_PERIODS
from fxstream.topics import Catalogue, Heartbeat, RecordDecodeError, decode, encode

__all__ = ["COMPONENT", "LivenessMonitor", "Transition"]

log = logging.getLogger(__name__)

COMPONENT = "liveness"


@dataclass(frozen=True)
class Transition:
    """An endpoint changed state: ``online``, ``restarted`` or ``lost``."""

    endpoint_id: str
    change: str
    agent_id: str
    at: float


@dataclass
class _Seen:
    agent_id: str
    sent_at: float
    period_s: float
    online: bool = True


@dataclass
class LivenessMonitor:
    """Folds heartbeats per endpoint and reports transitions; no I/O of its own."""

    catalogue: Catalogue
    _endpoints: dict[str, _Seen] = field(default_factory=dict)

    def observe(self, records: Sequence[RawRecord]) -> tuple[list[Transition], list[Outgoing]]:
        """Fold a batch of heartbeat records: transitions, and dead letters to write."""
        transitions: list[Transition] = []
        letters: list[Outgoing] = []
        for record in records:
            try:
                beat = decode(record.value, Heartbeat)
            except RecordDecodeError as exc:
                letter = dead_letter_for(
                    record, reason=str(exc), error_type="RecordDecodeError", component=COMPONENT
                )
                letters.append(Outgoing(self.catalogue.dead_letter, record.key, encode(letter)))
                log.warning(
                    "liveness: dead-lettered a heartbeat at offset %d: %s", record.offset, exc
                )
                continue
            transition = self._fold(beat)
            if transition is not None:
                transitions.append(transition)
        return transitions, letters

    def lost(self, now: float) -> list[Transition]:
        """Endpoints whose last heartbeat is older than ``LIVENESS_PERIODS`` periods."""
        lost = []
        for endpoint_id, seen in self._endpoints.items():
            if seen.online and now - seen.sent_at > LIVENESS_PERIODS * seen.period_s:
                seen.online = False
                lost.append(Transition(endpoint_id, "lost", seen.agent_id, now))
        return lost

    def online(self) -> list[str]:
        """The endpoints online as of the last :meth:`lost` check."""
        return sorted(e for e, seen in self._endpoints.items() if seen.online)

    def _fold(self, beat: Heartbeat) -> Transition | None:
        seen = self._endpoints.get(beat.endpoint_id)
        if seen is not None and beat.sent_at < seen.sent_at:
            return None  # an older heartbeat, redelivered: the newer one stands
        self._endpoints[beat.endpoint_id] = _Seen(beat.agent_id, beat.sent_at, beat.period_s)
        if seen is None or not seen.online:
            return Transition(beat.endpoint_id, "online", beat.agent_id, beat.sent_at)
        if seen.agent_id != beat.agent_id:
            return Transition(beat.endpoint_id, "restarted", beat.agent_id, beat.sent_at)
        return None
