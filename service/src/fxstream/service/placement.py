"""The router's placement policy: which endpoint of a submission's group runs the task.

A submission with an ``endpoint_group`` may run on any of its candidates
(:meth:`~fxstream.topics.TaskSubmission.candidates`, sorted, each one authorised for
the user by the router before it asks here). :meth:`Placement.choose` picks one; a
submission with a single candidate is never asked about (it goes where it names, live
or not, as before groups existed). The signals are what the router's registry view
follows, so every router instance derives them from the same topics:

- **liveness**: an endpoint is live while its latest heartbeat is younger than
  ``LIVENESS_PERIODS`` of its periods (:meth:`RegistryView.endpoint_status`); an
  endpoint that is lost or never sent one is dropped. Only when no candidate is live
  does the policy choose among all of them (the task then waits in that endpoint's
  queue, as a task naming one dead endpoint does).
- **warmth** (policy ``warm``): the candidates' managers' latest warm adverts
  (:class:`~fxstream.service.warm_table.WarmTable`): rank 2 where a worker has the
  function loaded, 1 where a worker runs the function's container (a function that
  names one), else 0. An advert lags the routing by a heartbeat or more, so a task
  this instance routed to an endpoint in the last ``AFFINITY_S`` seconds counts as
  warmth there too (its function rank 2, its container rank 1): the tasks of a burst
  follow the first one instead of each starting its container somewhere else.
  Warmth counts only while the endpoint's load (below) exceeds the shortest among
  the live candidates by less than one round plus that shortest load again
  (``load - shortest < 1 + shortest``): a warm endpoint otherwise attracts every task
  of its function however long its queue. With idle workers elsewhere a cold start
  there beats queueing a round; with deep queues everywhere a cold start is small
  beside the wait, and only a warm queue about twice the shortest sends the task
  elsewhere.
- **pool budget** (policy ``warm``): an endpoint that runs fewer image pools than
  images (its heartbeat's ``pool_slots``) releases a pool for a task of an image it
  does not run, a cold start there and another when the released image's tasks come
  back. A candidate whose slots are all taken by other images (its warm advert's
  containers and those this instance routed there in the last ``AFFINITY_S``
  seconds) ranks -1 for such a task, below the candidates that would not release one
  (the image's own, or one with a free slot), as long as one of those is within twice
  the warmth bound (``load - shortest < 2 * (1 + shortest)``); past that, the wait
  there costs more than cold starts, and the task goes where the load is least. So
  the images of a burst spread over the endpoints' slots instead of every image
  becoming warm everywhere.
- **load**: the rounds of work ahead of a task sent now,
  ``(queue_depth + workers_busy + routed) / max(1, workers_total)`` (below 1 while
  a worker is idle): the latest
  heartbeat's queue and busy workers, plus the tasks this router instance routed
  there since that heartbeat was sent (heartbeats come every few seconds; without
  this every task of a burst would go to the same "shortest" endpoint). Per worker,
  so an endpoint of 3 workers takes three times the tasks of one of 1 (a task count
  alone splits them evenly: a wait three times longer on the small one). That count
  and the recent routings above are the only state here not derived from a topic:
  per instance (a restarted router starts without them), the count reset by each
  newer heartbeat, the routings forgotten after ``AFFINITY_S`` or beyond
  ``MAX_AFFINITIES`` (``MAX_IMAGES_PER_ENDPOINT`` containers per endpoint).
- **data locality**: the bytes of the submission's by-reference arguments whose
  reference names the candidate as its ``site``. The references are read from the
  payload's by-reference envelope (:func:`~fxstream.topics.payload_references`: a
  msgpack list the SDK puts in front of the serialized arguments so agents and the
  SDK handle the objects without loading the payload), never from the arguments
  themselves, and only when warmth and load leave a tie. The ``data-locations``
  topic is not read: a reference already names its site, and that topic grows with
  every object ever stored (a view of it would need an on-disk table like
  task-state's) only to add whether an object was evicted since.
- **tie-break**: a stable hash of the task id over the sorted tied candidates, so a
  re-read batch (a router restarted before its commit) routes every task as before
  when the signals have not moved.

Policies (the router's ``placement`` setting): ``warm`` (all of the above, the
default), ``backlog`` (liveness, load, locality, tie-break: Balsam's shortest
backlog), ``round-robin`` (liveness, then the next live candidate in turn per group,
per router instance) and ``random`` (liveness, then a uniform choice). The last two
exist for the benchmark that compares them.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fxstream.service.warm_table import WarmTable, Warmth
from fxstream.topics import DeserializationError, FunctionRecord, TaskSubmission, payload_references

if TYPE_CHECKING:  # the registry view (Kafka, RocksDB) is not needed to name a policy
    from fxstream.service.registry import EndpointStatus

__all__ = [
    "AFFINITY_S",
    "MAX_AFFINITIES",
    "MAX_IMAGES_PER_ENDPOINT",
    "MAX_ROUND_ROBIN_GROUPS",
    "Choice",
    "Placement",
    "PlacementPolicy",
    "PlacementStats",
    "Signals",
    "tie_break",
]

log = logging.getLogger(__name__)

MAX_ROUND_ROBIN_GROUPS = 4_096
"""Groups whose round-robin position is kept; past it every position starts over."""
AFFINITY_S = 60.0
"""How long a task routed to an endpoint makes its function (and container) count warm there."""
MAX_AFFINITIES = 65_536
"""Recent (endpoint, function or container) routings kept; the oldest is forgotten first."""
MAX_IMAGES_PER_ENDPOINT = 1_024
"""Containers recently routed to one endpoint kept for its pool budget; the oldest go first."""


class PlacementPolicy(enum.StrEnum):
    """How the router chooses among a group's endpoints."""

    WARM = "warm"
    BACKLOG = "backlog"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


class Signals(Protocol):
    """What placement reads: the router's registry view (heartbeats and ``warm``)."""

    @property
    def warm(self) -> WarmTable:
        """The warm table."""
        ...

    def endpoint_status(self, endpoint_id: str, now: float | None = None) -> EndpointStatus:
        """What the latest heartbeat of ``endpoint_id`` says, at ``now``."""
        ...


@dataclass(frozen=True)
class Choice:
    """The chosen endpoint and, for the log, why."""

    endpoint_id: str
    reason: str


@dataclass
class PlacementStats:
    """Counts since start, logged at shutdown."""

    chosen: int = 0
    warm: int = 0
    # Choices that would have sent a task to an endpoint whose pools were all taken by
    # other images (releasing one: a cold start) but for the pool budget.
    evictions_avoided: int = 0
    none_live: int = 0
    dead_dropped: int = 0


@dataclass
class _Pending:
    heartbeat_at: float | None
    routed: int = 0


@dataclass(frozen=True)
class _Scored:
    endpoint_id: str
    warm_rank: int
    load: float


def tie_break(task_id: str, tied: Sequence[str]) -> str:
    """The stable choice among ``tied``: a hash of ``task_id`` indexes them sorted."""
    ordered = sorted(tied)
    digest = hashlib.sha256(task_id.encode()).digest()
    return ordered[int.from_bytes(digest[:8], "big") % len(ordered)]


@dataclass
class Placement:
    """Chooses an endpoint for each grouped submission (see the module notes)."""

    signals: Signals
    policy: PlacementPolicy = PlacementPolicy.WARM
    clock: Callable[[], float] = time.time
    seed: int | None = None
    stats: PlacementStats = field(default_factory=PlacementStats)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._pending: dict[str, _Pending] = {}
        self._turns: dict[tuple[str, ...], int] = {}
        # (endpoint, "f:<function>" or "c:<container>") -> when a task was last routed so.
        self._recent: OrderedDict[tuple[str, str], float] = OrderedDict()
        # Per endpoint, the containers routed there recently (-> when), for its pool budget.
        self._recent_images: dict[str, OrderedDict[str, float]] = {}

    def choose(
        self,
        submission: TaskSubmission,
        function: FunctionRecord | None,
        candidates: Sequence[str],
        now: float | None = None,
    ) -> Choice:
        """The endpoint of ``candidates`` (at least one) that runs ``submission``."""
        if not candidates:
            raise ValueError("no candidate endpoint to choose from")
        now = self.clock() if now is None else now
        ordered = sorted(set(candidates))
        statuses = {e: self.signals.endpoint_status(e, now) for e in ordered}
        live = [e for e in ordered if statuses[e].state == "online"]
        self.stats.dead_dropped += len(ordered) - len(live)
        note = ""
        if not live:
            live = ordered
            note = "; no candidate is live, so it waits in the chosen one's queue"
            self.stats.none_live += 1
        choice = self._choose_live(submission, function, live, statuses, now)
        self._pending_of(choice.endpoint_id, statuses[choice.endpoint_id]).routed += 1
        if self.policy is PlacementPolicy.WARM:
            self._remember(choice.endpoint_id, submission, function, now)
        self.stats.chosen += 1
        return Choice(choice.endpoint_id, choice.reason + note)

    def _choose_live(
        self,
        submission: TaskSubmission,
        function: FunctionRecord | None,
        live: list[str],
        statuses: dict[str, EndpointStatus],
        now: float,
    ) -> Choice:
        if len(live) == 1:
            return Choice(live[0], "the only live candidate")
        if self.policy is PlacementPolicy.RANDOM:
            return Choice(self._random.choice(live), "random")
        if self.policy is PlacementPolicy.ROUND_ROBIN:
            group = tuple(live)
            if group not in self._turns and len(self._turns) >= MAX_ROUND_ROBIN_GROUPS:
                self._turns.clear()
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            return Choice(live[turn % len(live)], "round robin")
        loads = {e: self._load(e, statuses[e]) for e in live}
        shortest = min(loads.values())
        warm = self.policy is PlacementPolicy.WARM
        raw = {e: self._warm_rank(submission, function, e, now) if warm else 0 for e in live}
        container = None if function is None else function.container
        # A warm endpoint attracts the task while its wait is less than one round of its
        # workers plus the shortest wait again (see the module notes).
        scored = [
            _Scored(e, raw[e] if loads[e] - shortest < 1 + shortest else 0, loads[e]) for e in live
        ]
        if warm and container is not None:
            # Releasing another image's pool is avoided while a candidate that would not
            # is within twice that bound (past it, waiting there costs more).
            taken = {
                e for e in live if raw[e] == 0 and self._pools_taken(e, statuses[e], container, now)
            }
            if any(e not in taken and loads[e] - shortest < 2 * (1 + shortest) for e in live):
                scored = [
                    _Scored(s.endpoint_id, -1, s.load) if s.endpoint_id in taken else s
                    for s in scored
                ]
        best = min(scored, key=lambda s: (-s.warm_rank, s.load))
        tied = [
            s.endpoint_id for s in scored if (s.warm_rank, s.load) == (best.warm_rank, best.load)
        ]
        unpenalised = min(scored, key=lambda s: (-max(0, s.warm_rank), s.load))
        if unpenalised.warm_rank < 0:
            self.stats.evictions_avoided += 1
        what = f"warmth {best.warm_rank}, load {best.load:.2f} rounds"
        if best.warm_rank > 0:
            self.stats.warm += 1
        if len(tied) == 1:
            return Choice(tied[0], what)
        local = _local_bytes(submission, tied)
        most = max(local.values())
        if most > 0:
            tied = [e for e in tied if local[e] == most]
            what += f", {most:,} argument bytes there"
        if len(tied) == 1:
            return Choice(tied[0], what)
        return Choice(tie_break(submission.task_id, tied), what + ", tie broken by task id")

    def _load(self, endpoint_id: str, status: EndpointStatus) -> float:
        """Rounds of work ahead of a task sent now: the latest heartbeat's queue and busy
        workers, plus what this instance routed there since, over its workers (at least
        one); below 1 while a worker is idle."""
        ahead = (
            status.queue_depth + status.workers_busy + self._pending_of(endpoint_id, status).routed
        )
        return ahead / max(1, status.workers_total)

    def _pools_taken(
        self, endpoint_id: str, status: EndpointStatus, container: str, now: float
    ) -> bool:
        """Whether ``container``'s task there releases another image's pool: the endpoint
        runs at most ``pool_slots`` pools (0: every image's fits) and as many other images
        run there (its warm advert) or were just routed there."""
        if status.pool_slots <= 0:
            return False
        images = self.signals.warm.containers(endpoint_id)
        recent = self._recent_images.get(endpoint_id)
        if recent is not None:
            while recent and now - next(iter(recent.values())) >= AFFINITY_S:
                recent.popitem(last=False)
            images.update(recent)
        return container not in images and len(images) >= status.pool_slots

    def _warm_rank(
        self,
        submission: TaskSubmission,
        function: FunctionRecord | None,
        endpoint_id: str,
        now: float,
    ) -> int:
        """2: the function is (or was just routed) warm there; 1: its container; 0."""
        container = None if function is None else function.container
        warmth: Warmth = self.signals.warm.warmth(endpoint_id, submission.function_id, container)
        if warmth.rank == 2 or self._recently(endpoint_id, f"f:{submission.function_id}", now):
            return 2
        if warmth.rank == 1 or (
            container is not None and self._recently(endpoint_id, f"c:{container}", now)
        ):
            return 1
        return 0

    def _recently(self, endpoint_id: str, what: str, now: float) -> bool:
        at = self._recent.get((endpoint_id, what))
        return at is not None and now - at < AFFINITY_S

    def _remember(
        self,
        endpoint_id: str,
        submission: TaskSubmission,
        function: FunctionRecord | None,
        now: float,
    ) -> None:
        keys = [(endpoint_id, f"f:{submission.function_id}")]
        if function is not None and function.container is not None:
            keys.append((endpoint_id, f"c:{function.container}"))
        for key in keys:
            self._recent[key] = now
            self._recent.move_to_end(key)
        while len(self._recent) > MAX_AFFINITIES:
            self._recent.popitem(last=False)
        if function is not None and function.container is not None:
            images = self._recent_images.setdefault(endpoint_id, OrderedDict())
            images[function.container] = now
            images.move_to_end(function.container)
            while len(images) > MAX_IMAGES_PER_ENDPOINT:
                images.popitem(last=False)

    def _pending_of(self, endpoint_id: str, status: EndpointStatus) -> _Pending:
        """What this instance routed to ``endpoint_id`` since its latest heartbeat."""
        pending = self._pending.get(endpoint_id)
        if pending is None or pending.heartbeat_at != status.last_seen:
            pending = _Pending(status.last_seen)
            self._pending[endpoint_id] = pending
        return pending


def _local_bytes(submission: TaskSubmission, candidates: Sequence[str]) -> dict[str, int]:
    """Bytes of the submission's by-reference arguments stored at each candidate's site."""
    local = dict.fromkeys(candidates, 0)
    try:
        references, _ = payload_references(submission.payload)
    except DeserializationError:
        return local  # the agent refuses the payload; locality is moot
    for reference in references:
        if reference.site in local:
            local[reference.site] += reference.size_bytes
    return local
