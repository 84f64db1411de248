"""Which topics a processor's consumer reads: an explicit list, kept current from the registry.

The router reads every user's ``from.user.<U>``, the ingress every endpoint's
``from.ep.<E>``, task-state every user's ``results.<U>`` and the trigger processor
the ``events.<S>`` of every source a rule names. They used to subscribe by pattern,
and aiokafka then asks for the metadata of *every topic of the cluster* each
``metadata_max_age_ms`` and folds it in Python: with 10,000 endpoints (two topics of
several partitions each) that alone took about a core per processor
(docs/benchmarks.md, ``bench service-scale``). Now each subscribes to the topics its
registry names (:class:`TopicFeed`): the users, the endpoints or the rules it
already follows, or a small view of them. Metadata then covers only the topics read
and can be refreshed rarely, since a registration, not a timer, brings a new topic in:
the API creates a user's or an endpoint's topics before it writes the record, so the
topic exists when the record is read.

The registry is the fast path, not the only one: the feed also lists the cluster's
topics at start and every ``list_every_s`` (30 s; one Admin API call, parsed in C by
librdkafka) and reads every topic matching the processor's ``pattern``, as the pattern
subscription did. So a topic whose name the registry does not hold (a user's topics
made but its record not written, a deployment provisioned by hand) is still read and
its records refused with a dead letter, not left unread; it is only found later.

A name the registry holds whose topic does not exist (yet, or any more) is left out
and asked about again at most every ``recheck_missing_s``: a consumer subscribed to a
missing topic would wait for its metadata, and asking the cluster for its list of
topics on every pass would cost what the pattern did.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fxstream.service.registry import RegistryView
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import Catalogue

__all__ = [
    "FEED_METADATA_MAX_AGE_MS",
    "TopicFeed",
    "TopicSource",
    "endpoint_topics",
    "follow",
    "rule_source_topics",
    "user_topics",
]

log = logging.getLogger(__name__)

TopicSource = Callable[[], Iterable[str]]
"""Names the topics to read now (the registry's view of them)."""

# With an explicit list, metadata is needed only to follow leaders (a leader change is
# also learnt from the error it causes, at once): no timer brings a new topic in.
FEED_METADATA_MAX_AGE_MS = 30_000


def user_topics(view: RegistryView, topic_of: Callable[[str], str]) -> TopicSource:
    """``topic_of(user_id)`` for every user ``view`` holds (it must follow ``users``)."""
    return lambda: [topic_of(user.user_id) for user in view.users()]


def endpoint_topics(view: RegistryView, catalogue: Catalogue) -> TopicSource:
    """Every live endpoint's ``from.ep.<E>`` (``view`` must follow ``endpoints``)."""
    return lambda: [catalogue.from_endpoint(ep.endpoint_id) for ep in view.endpoints()]


def rule_source_topics(view: RegistryView, catalogue: Catalogue) -> TopicSource:
    """The ``events.<S>`` of every source a live rule names, paused or not (``view`` must
    follow ``triggers``)."""
    return lambda: {catalogue.events(rule.source) for rule in view.triggers()}


class TopicFeed:
    """The existing topics of ``fixed``, of every source and matching ``pattern``, asked
    at most every ``every_s`` (the cluster listed for ``pattern`` every ``list_every_s``).

    ``directory`` answers which exist (it remembers a topic once seen and lists the
    cluster's topics only when asked about an unseen one). ``owns``: a view only the
    feed uses (the ingress's view of the endpoints), which :meth:`start` starts and
    waits for (:meth:`ViewFollower.start`) and :meth:`close` closes; a view shared with
    the processor is started by the processor, before its loop subscribes.
    """

    def __init__(
        self,
        directory: TopicDirectory,
        sources: Sequence[TopicSource],
        *,
        fixed: Iterable[str] = (),
        pattern: str | None = None,
        every_s: float = 1.0,
        list_every_s: float = 30.0,
        recheck_missing_s: float = 2.0,
        owns: ViewFollower | None = None,
    ) -> None:
        self._owned = owns
        self._pattern = None if pattern is None else re.compile(pattern)
        self._list_every_s = list_every_s
        self._next_list = float("-inf")
        self._listed: frozenset[str] = frozenset()
        self._directory = directory
        self._sources = tuple(sources)
        self._fixed = frozenset(fixed)
        self.every_s = every_s
        self._recheck_missing_s = recheck_missing_s
        # Topic -> when to ask again whether it exists.
        self._missing: dict[str, float] = {}
        self._asked_at = float("-inf")
        self._current: frozenset[str] = frozenset()

    async def start(self) -> None:
        """Start the owned view and wait until it holds what its topics held."""
        if self._owned is not None:
            await self._owned.start()

    def close(self) -> None:
        """Close the owned view."""
        if self._owned is not None:
            self._owned.close()

    def due(self, now: float | None = None) -> bool:
        """True once ``every_s`` has passed since the last :meth:`wanted`."""
        return (time.monotonic() if now is None else now) - self._asked_at >= self.every_s

    async def wanted(self) -> frozenset[str]:
        """The topics to read now: those named that exist.

        If the cluster cannot be asked (the broker is away), the last answer is kept and
        the error logged: the consumer goes on reading what it reads.
        """
        now = time.monotonic()
        self._asked_at = now
        if self._pattern is not None and now >= self._next_list:
            self._next_list = now + self._list_every_s
            try:
                await self._directory.refresh()
            except Exception as exc:
                log.warning("cannot list the cluster's topics (%r); the registry's only", exc)
            else:
                self._listed = frozenset(
                    name for name in self._directory.known() if self._pattern.match(name)
                )
        names = set(self._fixed) | self._listed
        for source in self._sources:
            names.update(source())
        ask = {name for name in names if self._missing.get(name, now) <= now}
        try:
            present = await self._directory.present(ask) if ask else set()
        except Exception as exc:
            log.warning("cannot tell which topics exist (%r); reading the same ones", exc)
            return self._current
        for name in ask - present:
            if name not in self._missing:
                log.info("topic %s is named but does not exist; asking again later", name)
            self._missing[name] = now + self._recheck_missing_s
        for name in present:
            self._missing.pop(name, None)
        # Forget what is no longer named.
        for name in set(self._missing) - names:
            del self._missing[name]
        self._current = frozenset(present)
        return self._current


async def follow(
    consumer: Any, feed: TopicFeed, subscribed: frozenset[str], listener: Any, name: str
) -> frozenset[str]:
    """Subscribe aiokafka's ``consumer`` to what ``feed`` names now, if the feed is due
    (:meth:`TopicFeed.due`) and that differs from ``subscribed``; returns what it is
    subscribed to. Call it between batches only: the rebalance a change starts hands
    partitions over through ``listener`` (a
    :class:`~fxstream.service.rebalance.PartitionGuard`)."""
    if not feed.due():
        return subscribed
    wanted = await feed.wanted()
    if wanted == subscribed:
        return subscribed
    if wanted:
        consumer.subscribe(topics=sorted(wanted), listener=listener)
    else:
        consumer.unsubscribe()
    log.info(
        "%s: reading %d topics (+%d, -%d)",
        name,
        len(wanted),
        len(wanted - subscribed),
        len(subscribed - wanted),
    )
    return wanted
