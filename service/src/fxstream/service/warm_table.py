"""The router's table of what each endpoint manager holds warm, folded from ``warm``.

Every agent publishes a :class:`~fxstream.topics.WarmAdvert` whenever what its engine
holds warm changes (seen at a heartbeat: each live worker, the container its pool
runs, the functions it has loaded, whether it is idle). The ingress checks it and
forwards it to the compacted ``warm`` topic under ``<endpoint id>/<manager id>``, so
the latest advert per manager is what the topic keeps. The router's
:class:`~fxstream.service.registry.RegistryView` reads that topic from the beginning
at start and keeps following it, folding each advert into a :class:`WarmTable`: the
table is derived from the topic alone (every router instance builds the same one),
and a restarted router has it back once the view is current.

What an entry holds is a summary, not the advert: the function ids and containers
its workers hold warm, and how many of them were idle. Queries
(:meth:`WarmTable.warmth`) answer per endpoint over all its managers.

Bounds: at most ``max_entries`` managers (default :data:`MAX_ENTRIES`); a new
manager beyond that evicts the one whose advert is oldest (least recently
advertised), logged. Each entry keeps at most :data:`MAX_FUNCTIONS_PER_ENTRY`
function ids and as many containers (an advert is itself cut to the ``warm``
topic's record size by the agent). So the table holds at most ``max_entries`` x
(``MAX_FUNCTIONS_PER_ENTRY`` x 2) ids of at most 128 (containers 1,024) characters.

Staleness: an entry says nothing once its endpoint is not live. The table does
not know liveness; the placement policy asks it only about endpoints whose latest
heartbeat is current (:mod:`fxstream.service.placement`), so an advert of a lost
endpoint is ignored from the moment the endpoint is lost. It is not deleted then:
an agent that comes back with the same warm set does not advertise again (nothing
changed), so deleting would forget true warmth; a restarted agent advertises its new
workers (the first heartbeat of a process always sends an advert), replacing the
entry under the same key. A tombstone (null value) deletes the entry.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from fxstream.topics import WarmAdvert

__all__ = ["MAX_ENTRIES", "MAX_FUNCTIONS_PER_ENTRY", "WarmTable", "Warmth", "warm_key"]

log = logging.getLogger(__name__)

MAX_ENTRIES = 4_096
"""Managers the table holds by default; the least recently advertised is evicted."""
MAX_FUNCTIONS_PER_ENTRY = 1_024
"""Function ids (and containers) kept per manager; the rest of an advert is ignored."""


def warm_key(endpoint_id: str, manager_id: str) -> str:
    """The ``warm`` topic's key of a manager's advert (what the ingress writes)."""
    return f"{endpoint_id}/{manager_id}"


@dataclass(frozen=True)
class _Entry:
    endpoint_id: str
    advertised_at: float
    functions: frozenset[str]
    containers: frozenset[str]
    workers: int
    idle: int


@dataclass(frozen=True)
class Warmth:
    """How warm one endpoint is for one function: over all its managers' latest adverts."""

    function_warm: bool = False
    """A worker has the function loaded."""
    container_warm: bool = False
    """A worker runs the function's container (only for a function that names one)."""
    idle_warm_workers: int = 0
    """Idle workers that have the function loaded, when advertised."""

    @property
    def rank(self) -> int:
        """2: the function is loaded; 1: its container runs; 0: neither."""
        return 2 if self.function_warm else 1 if self.container_warm else 0


class WarmTable:
    """The latest advert per ``<endpoint>/<manager>``, summarised; thread-safe."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max_entries = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_endpoint: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fold(self, key: str, advert: WarmAdvert | None) -> bool:
        """Fold the record under ``key`` (None: a tombstone deletes it).

        Returns False (and changes nothing) for an advert whose key is not
        ``<its endpoint>/<its manager>`` or that is older than the entry it would
        replace (records of one key are in order on the topic, so only a rewritten
        history could do that).
        """
        with self._lock:
            if advert is None:
                self._drop(key)
                return True
            if key != warm_key(advert.endpoint_id, advert.manager_id):
                return False
            old = self._entries.get(key)
            if old is not None and old.advertised_at > advert.advertised_at:
                return False
            functions: set[str] = set()
            containers: set[str] = set()
            for worker in advert.workers:
                if worker.container is not None and len(containers) < MAX_FUNCTIONS_PER_ENTRY:
                    containers.add(worker.container)
                for function_id in worker.function_ids:
                    if len(functions) >= MAX_FUNCTIONS_PER_ENTRY:
                        break
                    functions.add(function_id)
            self._drop(key)
            self._entries[key] = _Entry(
                endpoint_id=advert.endpoint_id,
                advertised_at=advert.advertised_at,
                functions=frozenset(functions),
                containers=frozenset(containers),
                workers=len(advert.workers),
                idle=sum(1 for w in advert.workers if w.idle),
            )
            self._by_endpoint.setdefault(advert.endpoint_id, set()).add(key)
            while len(self._entries) > self._max_entries:
                oldest = next(iter(self._entries))  # the least recently folded
                log.warning(
                    "warm table: full (%d managers); forgetting the oldest advert, %s",
                    self._max_entries,
                    oldest,
                )
                self._drop(oldest)
                self.evicted += 1
            return True

    def warmth(self, endpoint_id: str, function_id: str, container: str | None) -> Warmth:
        """How warm ``endpoint_id`` is for ``function_id`` (whose container is ``container``)."""
        function_warm = container_warm = False
        idle = 0
        with self._lock:
            for key in self._by_endpoint.get(endpoint_id, ()):
                entry = self._entries[key]
                if function_id in entry.functions:
                    function_warm = True
                    # A summary: idle workers of a manager that has the function loaded.
                    idle += entry.idle
                if container is not None and container in entry.containers:
                    container_warm = True
        return Warmth(function_warm, container_warm, idle)

    def containers(self, endpoint_id: str) -> set[str]:
        """The containers ``endpoint_id``'s workers run (its pools' images), over its managers."""
        with self._lock:
            found: set[str] = set()
            for key in self._by_endpoint.get(endpoint_id, ()):
                found |= self._entries[key].containers
            return found

    def managers(self, endpoint_id: str) -> list[str]:
        """The keys of ``endpoint_id``'s managers the table holds, sorted."""
        with self._lock:
            return sorted(self._by_endpoint.get(endpoint_id, ()))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        keys = self._by_endpoint.get(entry.endpoint_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_endpoint[entry.endpoint_id]
