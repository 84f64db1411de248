"""Agent liveness and task leases from heartbeats.

The API answers "is this endpoint online?" at query time from the latest
heartbeat (:meth:`RegistryView.endpoint_status`). This processor watches the
same stream as it happens, per agent (an endpoint may have several):

- an operator's log says when an agent came online and when it was lost (no
  heartbeat for ``LIVENESS_PERIODS`` of its periods);
- task leases: each heartbeat lists the tasks its agent holds. A task that has
  run for at least one heartbeat period becomes ``running`` in task-state
  (short tasks go from ``routed`` straight to their result, so they cost no
  event); when an agent is lost, every task its last heartbeat held becomes
  ``waiting-for-endpoint``, with an ``AgentLost`` attempt. Kafka hands those
  tasks, uncommitted, to the next agent of the endpoint once the agent's
  consumer session (its ``lease_timeout_s``) expires; that agent's heartbeats
  then make them ``running`` again, and a zombie that wakes up is fenced;
- malformed heartbeats are dead-lettered with the reason, never skipped.

Several liveness processes share ``heartbeats`` as one consumer group (faust's). Each
knows only the agents whose heartbeats are on its partitions (an endpoint's heartbeats
are keyed by the endpoint, so all of its agents are on one), and forgets them when the
partition is reassigned (:meth:`LivenessMonitor.forget`): otherwise it would declare
lost the agents whose heartbeats now go to another process.

It writes :class:`~fxstream.topics.TaskEvent` records to ``task-events``; the
task-state processor decides whether the lifecycle allows each step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fxstream.service.outgoing import Outgoing
from fxstream.service.registry import LIVENESS_PERIODS
from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetterReason,
    Heartbeat,
    RawRecord,
    RecordDecodeError,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskLease,
    TaskStateName,
    dead_letter_for,
    decode,
    encode,
)

__all__ = ["COMPONENT", "LivenessMonitor", "Transition"]

log = logging.getLogger(__name__)

COMPONENT = "liveness"


@dataclass(frozen=True)
class Transition:
    """An agent of an endpoint changed state: ``online`` or ``lost``."""

    endpoint_id: str
    change: str
    agent_id: str
    at: float


@dataclass
class _Agent:
    endpoint_id: str
    hostname: str
    sent_at: float
    period_s: float
    leases: list[TaskLease]
    # The heartbeats partition its beats are read from.
    partition: int = -1
    # Tasks already announced running by this agent, as (task id, attempt).
    announced: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class LivenessMonitor:
    """Folds heartbeats per agent into transitions and task events; no I/O of its own."""

    catalogue: Catalogue
    _agents: dict[str, _Agent] = field(default_factory=dict)

    def observe(self, records: Sequence[RawRecord]) -> tuple[list[Transition], list[Outgoing]]:
        """Fold a batch of heartbeat records: transitions, and the records to write
        (``running`` task events, and dead letters for malformed heartbeats)."""
        transitions: list[Transition] = []
        out: list[Outgoing] = []
        for record in records:
            try:
                beat = decode(record.value, Heartbeat)
            except RecordDecodeError as exc:
                letter = dead_letter_for(
                    record,
                    reason=str(exc),
                    error_type=DeadLetterReason.DECODE_ERROR,
                    component=COMPONENT,
                )
                out.append(
                    Outgoing(self.catalogue.dead_letter, letter.original_key, encode(letter))
                )
                log.warning(
                    "liveness: dead-lettered a heartbeat at offset %d: %s", record.offset, exc
                )
                continue
            transition = self._fold(beat, record.partition, out)
            if transition is not None:
                transitions.append(transition)
        return transitions, out

    def lost(self, now: float) -> tuple[list[Transition], list[Outgoing]]:
        """Agents whose last heartbeat is older than ``LIVENESS_PERIODS`` periods, and
        the ``waiting-for-endpoint`` events for the tasks they held."""
        transitions: list[Transition] = []
        out: list[Outgoing] = []
        gone = [
            agent_id
            for agent_id, agent in self._agents.items()
            if now - agent.sent_at > LIVENESS_PERIODS * agent.period_s
        ]
        for agent_id in gone:
            # Forgotten: if it wakes up (SIGCONT), its next heartbeat brings it back online.
            agent = self._agents.pop(agent_id)
            transitions.append(Transition(agent.endpoint_id, "lost", agent_id, now))
            silent = now - agent.sent_at
            for lease in agent.leases:
                error = TaskError(
                    type=TaskErrorType.AGENT_LOST,
                    message=(
                        f"agent {agent_id} on {agent.hostname} sent no heartbeat for "
                        f"{silent:.0f} s while holding the task; it goes to the next agent "
                        "of the endpoint once the agent's lease (consumer session) expires"
                    ),
                    retryable=True,
                )
                attempt = Attempt(
                    attempt=lease.attempt,
                    worker=agent.hostname,
                    started_at=lease.started_at,
                    error=error,
                )
                out.append(
                    self._event(lease, agent, TaskStateName.WAITING_FOR_ENDPOINT, now, attempt)
                )
        return transitions, out

    def online(self) -> list[str]:
        """The endpoints with an agent online as of the last :meth:`lost` check."""
        return sorted({a.endpoint_id for a in self._agents.values()})

    def forget(self, partitions: Iterable[int]) -> list[str]:
        """Forget the agents whose heartbeats are on ``partitions`` of ``heartbeats``
        (given to another liveness process); their ids."""
        gone = set(partitions)
        forgotten = [a for a, agent in self._agents.items() if agent.partition in gone]
        for agent_id in forgotten:
            del self._agents[agent_id]
        return forgotten

    def _fold(self, beat: Heartbeat, partition: int, out: list[Outgoing]) -> Transition | None:
        agent = self._agents.get(beat.agent_id)
        if agent is not None and beat.sent_at < agent.sent_at:
            return None  # an older heartbeat, redelivered: the newer one stands
        came_online = agent is None
        if agent is None:
            agent = _Agent(beat.endpoint_id, beat.hostname, beat.sent_at, beat.period_s, [])
            self._agents[beat.agent_id] = agent
        agent.partition = partition
        agent.sent_at, agent.period_s = beat.sent_at, beat.period_s
        agent.leases = list(beat.leases)
        self._announce_running(agent, beat, out)
        if came_online:
            return Transition(beat.endpoint_id, "online", beat.agent_id, beat.sent_at)
        return None

    def _announce_running(self, agent: _Agent, beat: Heartbeat, out: list[Outgoing]) -> None:
        held: set[tuple[str, int]] = set()
        for lease in beat.leases:
            key = (lease.task_id, lease.attempt)
            held.add(key)
            if lease.started_at is None or key in agent.announced:
                continue
            if beat.sent_at - lease.started_at < beat.period_s:
                continue  # likely to finish before anyone asks; not worth an event
            agent.announced.add(key)
            attempt = Attempt(
                attempt=lease.attempt, worker=beat.hostname, started_at=lease.started_at
            )
            out.append(self._event(lease, agent, TaskStateName.RUNNING, beat.sent_at, attempt))
        # Forget tasks no longer held, so the memory follows the leases.
        agent.announced &= held

    def _event(
        self,
        lease: TaskLease,
        agent: _Agent,
        state: TaskStateName,
        at: float,
        attempt: Attempt,
    ) -> Outgoing:
        event = TaskEvent(
            task_id=lease.task_id,
            user_id=lease.user_id,
            function_id=lease.function_id,
            endpoint_id=agent.endpoint_id,
            task_group_id=lease.task_group_id,
            state=state,
            at=at,
            source=COMPONENT,
            attempt=attempt,
        )
        return Outgoing(self.catalogue.task_events, lease.task_id.encode(), encode(event))
