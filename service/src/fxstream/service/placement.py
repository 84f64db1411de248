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
- **warmth** (policy ``warm``), for a function without a container: the candidates'
  managers' latest warm adverts (:class:`~fxstream.service.warm_table.WarmTable`):
  rank 2 where a worker has the function loaded, else 0. An advert lags the routing by
  a heartbeat or more, so a task this instance routed to an endpoint in the last
  ``AFFINITY_S`` seconds counts as warmth there too: the tasks of a burst follow the
  first one. Warmth counts only while the endpoint's load (below) exceeds the shortest
  among the live candidates by less than one round plus that shortest load again
  (``load - shortest < 1 + shortest``): loading a function into a running worker costs
  milliseconds, so with idle workers elsewhere the task goes there.
- **images and pool slots** (policy ``warm``), for a function with a container: an
  endpoint runs at most ``pool_slots`` image pools (its heartbeat; 0: every image's
  pool fits), and a task of an image whose pool does not run there starts one (a cold
  start: seconds) and, with every slot taken, releases another image's pool (that
  image's next task there is cold again). The images *resident* on an endpoint are its
  warm advert's containers and those this instance routed there in the last
  ``AFFINITY_S`` seconds. Each candidate is *warm* (the image is resident: rank 1, 2
  where its function is loaded), *free* (not resident, and fewer images resident than
  slots) or *full*. The task goes

  1. where the image is warm, the least loaded of those (then the higher rank), unless
     a free candidate's wait is shorter by more than ``cold_start_s``
     (:data:`DEFAULT_COLD_START_S`): then it *spills* there, taking that slot (the
     image then has two homes). The wait is the tasks ahead over the rate the endpoint
     was measured to finish them (its heartbeats: tasks queued and running at one
     heartbeat plus those routed since, less those at the next, over the time between,
     while it had work at both; a moving average), else its load in rounds of
     ``round_s`` (:data:`DEFAULT_ROUND_S`, a short task's). A queued 50 ms task costs
     less than a cold start: an image keeps its home until its queue there is seconds
     longer;
  2. else (no candidate runs it) to the least loaded free candidate: its *home*;
  3. else (every slot taken) to the least loaded candidate, which releases a pool
     (counted as a forced eviction).

  A full candidate is never chosen while the image is warm somewhere or a slot is
  free, however long the queues: with as many slots as images, each image gets a home
  and only spare slots take spills, so the agents never evict (their pick,
  :mod:`fxstream.agent.pick`, still bounds how long an image waits where they must).
  Ties among homes and spill targets break by a hash of the image, so an image's
  tasks agree.
- **load**: the rounds of work ahead of a task sent now,
  ``(queue_depth + workers_busy + routed) / max(1, workers_total)`` (below 1 while
  a worker is idle): the latest
  heartbeat's queue and busy workers, plus the tasks this router instance routed
  there since that heartbeat was sent (heartbeats come every few seconds; without
  this every task of a burst would go to the same "shortest" endpoint). Per worker,
  so an endpoint of 3 workers takes three times the tasks of one of 1 (a task count
  alone splits them evenly: a wait three times longer on the small one). That count,
  the recent routings and the drain rates above are the only state here not derived
  from a topic: per instance (a restarted router starts without them), the count
  reset by each newer heartbeat, the routings forgotten after ``AFFINITY_S`` or beyond
  ``MAX_AFFINITIES`` (``MAX_IMAGES_PER_ENDPOINT`` containers per endpoint), a rate per
  endpoint of the registry.
- **data locality**: the bytes of the submission's by-reference arguments whose
  reference names the candidate as its ``site``. The references are read from the
  payload's by-reference envelope (:func:`~fxstream.topics.payload_references`: a
  msgpack list the SDK puts in front of the serialized arguments so agents and the
  SDK handle the objects without loading the payload), never from the arguments
  themselves, and only when warmth and load leave a tie. The ``data-locations``
  topic is not read: a reference already names its site, and that topic grows with
  every object ever stored (a view of it would need an on-disk table like
  task-state's) only to add whether an object was evicted since.
- **tie-break**: a stable hash of the task id (of the image, for a home or a spill)
  over the sorted tied candidates, so a re-read batch (a router restarted before its
  commit) routes every task as before when the signals have not moved.

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
    "DEFAULT_COLD_START_S",
    "DEFAULT_ROUND_S",
    "MAX_AFFINITIES",
    "MAX_IMAGES_PER_ENDPOINT",
    "MAX_ROUND_ROBIN_GROUPS",
    "RATE_WEIGHT",
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
DEFAULT_COLD_START_S = 2.0
"""A pool start (container, interpreter, worker import): 0.3 s measured on a quiet machine
(``./fx bench coldstart``, ``process``), 1.5-4 s under the routing bench's load."""
DEFAULT_ROUND_S = 0.05
"""A round of work where no heartbeat has measured one yet: a short task's."""
RATE_WEIGHT = 0.5
"""The newest measurement's weight in an endpoint's drain rate (a moving average)."""


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
    # Tasks of an image whose least loaded candidate had all its pool slots taken by
    # other images (sending it there releases one: a cold start), sent where the image
    # runs or a slot is free instead.
    evictions_avoided: int = 0
    # Tasks of an image that ran nowhere (and was routed nowhere lately) sent to a free
    # pool slot: its new home.
    homes: int = 0
    # Tasks of an image warm elsewhere sent to a free pool slot, the wait where it is
    # warm being longer than the one there by more than a cold start.
    spills: int = 0
    # Tasks of an image no candidate runs, with every pool slot taken: one is released.
    forced_evictions: int = 0
    none_live: int = 0
    dead_dropped: int = 0


@dataclass
class _Pending:
    heartbeat_at: float | None
    routed: int = 0
    backlog: int = 0  # queued and running at that heartbeat


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
    cold_start_s: float = DEFAULT_COLD_START_S
    """What a task of an image is taken to lose by starting its pool (``warm`` policy)."""
    round_s: float = DEFAULT_ROUND_S
    """Seconds a round of work is taken to last where no heartbeat measured it yet."""

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._pending: dict[str, _Pending] = {}
        self._turns: dict[tuple[str, ...], int] = {}
        # (endpoint, "f:<function>" or "c:<container>") -> when a task was last routed so.
        self._recent: OrderedDict[tuple[str, str], float] = OrderedDict()
        # Per endpoint, the containers routed there recently (-> when), for its pool budget.
        self._recent_images: dict[str, OrderedDict[str, float]] = {}
        # Per endpoint, the tasks per second it was measured to finish (heartbeats).
        self._rates: dict[str, float] = {}

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
        container = None if function is None else function.container
        if self.policy is PlacementPolicy.WARM and container is not None:
            return self._choose_image(submission, function, container, live, statuses, loads, now)
        shortest = min(loads.values())
        warm = self.policy is PlacementPolicy.WARM
        raw = {e: self._warm_rank(submission, function, e, now) if warm else 0 for e in live}
        # A warm endpoint attracts the task while its wait is less than one round of its
        # workers plus the shortest wait again (see the module notes).
        ranked = {e: raw[e] if loads[e] - shortest < 1 + shortest else 0 for e in live}
        best = max(ranked.values())
        tied = [e for e in live if ranked[e] == best]
        least = min(loads[e] for e in tied)
        tied = [e for e in tied if loads[e] == least]
        if best > 0:
            self.stats.warm += 1
        return self._settle(submission, tied, f"warmth {best}, load {least:.2f} rounds")

    def _choose_image(
        self,
        submission: TaskSubmission,
        function: FunctionRecord | None,
        container: str,
        live: list[str],
        statuses: dict[str, EndpointStatus],
        loads: dict[str, float],
        now: float,
    ) -> Choice:
        """The ``warm`` policy for a task of a function with a container (module notes)."""
        raw = {e: self._warm_rank(submission, function, e, now) for e in live}
        warm = [e for e in live if raw[e] > 0]
        free = [e for e in live if raw[e] == 0 and self._has_free_slot(e, statuses[e], now)]
        full = [e for e in live if raw[e] == 0 and e not in free]
        least_loaded = min(loads.values())
        if any(loads[e] == least_loaded for e in full) and (warm or free):
            self.stats.evictions_avoided += 1
        if warm:
            home_load = min(loads[e] for e in warm)
            homes = [e for e in warm if loads[e] == home_load]
            if free:
                waits = {e: self._wait_s(e, statuses[e]) for e in (*homes, *free)}
                home_wait = min(waits[e] for e in homes)
                spill_wait = min(waits[e] for e in free)
                if home_wait - spill_wait > self.cold_start_s:
                    targets = [e for e in free if waits[e] == spill_wait]
                    self.stats.spills += 1
                    choice = self._settle(
                        submission,
                        targets,
                        f"spill: {container} waits ~{home_wait:.1f} s where warm, "
                        f"~{spill_wait:.1f} s plus a cold start in a free pool slot here",
                        key=container,
                    )
                    log.info(
                        "placement: %s spills to %s (a free pool slot): ~%.1f s of wait where "
                        "it is warm against ~%.1f s there, cold start ~%.1f s",
                        container,
                        choice.endpoint_id,
                        home_wait,
                        spill_wait,
                        self.cold_start_s,
                    )
                    return choice
            self.stats.warm += 1
            best = max(raw[e] for e in homes)
            return self._settle(
                submission,
                [e for e in homes if raw[e] == best],
                f"warmth {best} ({container} runs there), load {home_load:.2f} rounds",
            )
        if free:
            least = min(loads[e] for e in free)
            self.stats.homes += 1
            choice = self._settle(
                submission,
                [e for e in free if loads[e] == least],
                f"a home for {container}: a free pool slot, load {least:.2f} rounds",
                key=container,
            )
            log.info(
                "placement: %s gets a home on %s (a free pool slot, load %.2f rounds)",
                container,
                choice.endpoint_id,
                least,
            )
            return choice
        least = min(loads[e] for e in full)
        self.stats.forced_evictions += 1
        log.debug(
            "placement: no candidate runs %s or has a free pool slot; the least loaded "
            "releases one",
            container,
        )
        return self._settle(
            submission,
            [e for e in full if loads[e] == least],
            f"every pool slot is taken: {container} releases one (a cold start), "
            f"load {least:.2f} rounds",
        )

    def _settle(
        self, submission: TaskSubmission, tied: list[str], what: str, key: str | None = None
    ) -> Choice:
        """One of ``tied``: the most argument bytes there, then a stable hash of ``key``
        (default: the task id)."""
        if len(tied) == 1:
            return Choice(tied[0], what)
        local = _local_bytes(submission, tied)
        most = max(local.values())
        if most > 0:
            tied = [e for e in tied if local[e] == most]
            what += f", {most:,} argument bytes there"
        if len(tied) == 1:
            return Choice(tied[0], what)
        by = "task id" if key is None else "image"
        return Choice(
            tie_break(submission.task_id if key is None else key, tied),
            what + f", tie broken by {by}",
        )

    def _load(self, endpoint_id: str, status: EndpointStatus) -> float:
        """Rounds of work ahead of a task sent now: the latest heartbeat's queue and busy
        workers, plus what this instance routed there since, over its workers (at least
        one); below 1 while a worker is idle."""
        return self._ahead(endpoint_id, status) / max(1, status.workers_total)

    def _ahead(self, endpoint_id: str, status: EndpointStatus) -> int:
        """Tasks ahead of one sent now: queued and running at the latest heartbeat, plus
        those this instance routed there since."""
        return (
            status.queue_depth + status.workers_busy + self._pending_of(endpoint_id, status).routed
        )

    def _wait_s(self, endpoint_id: str, status: EndpointStatus) -> float:
        """Seconds a task sent now waits there: the tasks ahead over the rate the endpoint
        was measured to drain them (heartbeats), else its load in rounds of ``round_s``."""
        rate = self._rates.get(endpoint_id)
        if rate is None:
            return self._load(endpoint_id, status) * self.round_s
        return self._ahead(endpoint_id, status) / rate

    def _has_free_slot(self, endpoint_id: str, status: EndpointStatus, now: float) -> bool:
        """Whether a pool may start there without releasing another image's: every pool
        fits (``pool_slots`` 0), or fewer images run there (its warm advert) or were just
        routed there than it has slots."""
        if status.pool_slots <= 0:
            return True
        return len(self._residents(endpoint_id, now)) < status.pool_slots

    def _residents(self, endpoint_id: str, now: float) -> set[str]:
        """The images whose pools run at ``endpoint_id`` (its warm advert) or that this
        instance routed there in the last ``AFFINITY_S`` seconds."""
        images = self.signals.warm.containers(endpoint_id)
        recent = self._recent_images.get(endpoint_id)
        if recent is not None:
            while recent and now - next(iter(recent.values())) >= AFFINITY_S:
                recent.popitem(last=False)
            images.update(recent)
        return images

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
        """What this instance routed to ``endpoint_id`` since its latest heartbeat (a newer
        heartbeat first measures how fast the endpoint drained its tasks since the last)."""
        pending = self._pending.get(endpoint_id)
        if pending is None or pending.heartbeat_at != status.last_seen:
            backlog = status.queue_depth + status.workers_busy
            if pending is not None:
                self._measure(endpoint_id, pending, status, backlog)
            pending = _Pending(status.last_seen, backlog=backlog)
            self._pending[endpoint_id] = pending
        return pending

    def _measure(
        self, endpoint_id: str, before: _Pending, status: EndpointStatus, backlog: int
    ) -> None:
        """Fold the tasks ``endpoint_id`` finished between two heartbeats, while it had work
        at both, into its drain rate (tasks per second, a moving average)."""
        if before.heartbeat_at is None or status.last_seen is None:
            return
        elapsed = status.last_seen - before.heartbeat_at
        finished = before.backlog + before.routed - backlog
        if elapsed <= 0 or before.backlog <= 0 or backlog <= 0 or finished <= 0:
            return  # idle at either end (no rate to see), or other routers' tasks hide it
        sample = finished / elapsed
        rate = self._rates.get(endpoint_id)
        self._rates[endpoint_id] = (
            sample if rate is None else RATE_WEIGHT * sample + (1 - RATE_WEIGHT) * rate
        )


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
