"""A processor's registry view, started once and caught up on demand.

The router (users, functions, endpoints) and the ingress (task-state) each plan from a
:class:`~fxstream.service.registry.RegistryView`. Both need the same two things from it:
at start, to hold everything written before the processor began; and, when a record
names something the view does not hold yet, to read what the followed topics hold *now*
before deciding the record is wrong (however long that takes while the view reads: a
lagging view must delay a decision, never turn it into a refusal). :class:`ViewFollower`
is that, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from fxstream.service.registry import RegistryView
from fxstream.service.topic_directory import TopicDirectory

__all__ = ["ViewFollower"]

log = logging.getLogger(__name__)


class ViewFollower:
    """Starts a view, waits for it at start, and catches it up with its topics' ends."""

    def __init__(
        self,
        view: RegistryView,
        directory: TopicDirectory,
        topics: Sequence[str],
        *,
        name: str,
        catch_up_s: float,
        start_timeout_s: float,
    ) -> None:
        """``topics`` are the followed topics :meth:`catch_up` reads to their ends;
        ``name`` names the processor in log lines and errors."""
        self.view = view
        self._directory = directory
        self._topics = tuple(topics)
        self._name = name
        self._catch_up_s = catch_up_s
        self._start_timeout_s = start_timeout_s
        self._caught_up_to: dict[tuple[str, int], int] = {}
        self._started = False
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the view and wait until it holds what its topics held at start (once).

        A long ``task-state`` takes a while to read on a loaded machine: the wait is
        logged every ``start_timeout_s`` and lasts as long as the view reads; only a
        view that stopped raises (a processor that judged records from a partial view
        would refuse valid ones).
        """
        async with self._start_lock:
            if self._started:
                return
            await asyncio.to_thread(self.view.start)
            began = time.monotonic()
            while not await asyncio.to_thread(self.view.wait_until_current, self._start_timeout_s):
                self._check_following()
                log.warning(
                    "%s: still reading %s as it was at start (%.0f s so far)",
                    self._name,
                    ", ".join(self._topics),
                    time.monotonic() - began,
                )
            self._started = True

    def close(self) -> None:
        """Stop following."""
        self.view.close()

    async def catch_up(self) -> None:
        """Wait until the view has read what the followed topics hold now.

        Waiting for the topics' current ends, rather than a fixed time, makes a truly
        unknown id cost one round trip; and only partitions that grew since the last
        catch-up that reached its ends are waited for, so a flood of unknown ids costs
        one end-offset request each while the view is current. A view that lags (a
        loaded machine, a burst of writes) is waited for as long as it reads, with a
        warning every ``catch_up_s``: deciding from a view that has not read what was
        written before the record in hand would refuse a valid record (a result whose
        task's ``routed`` state the view has not read yet, a task of a function just
        registered). A view that stopped raises, so the processor restarts.
        """
        began = time.monotonic()
        while True:
            try:
                ends = await asyncio.wait_for(
                    self._directory.end_offsets(self._topics), self._catch_up_s
                )
                break
            except Exception as exc:  # cannot ask now: the broker is away; ask again
                self._check_following()
                log.warning("%s: cannot read the end offsets (%r); asking again", self._name, exc)
                await asyncio.sleep(min(1.0, self._catch_up_s))
        grown = {tp: end for tp, end in ends.items() if end > self._caught_up_to.get(tp, 0)}
        if not grown:
            return
        while not await asyncio.to_thread(self.view.wait_until_read, grown, self._catch_up_s):
            self._check_following()
            log.warning(
                "%s: the view of %s lags; waiting until it has read what they held %.0f s ago",
                self._name,
                ", ".join(self._topics),
                time.monotonic() - began,
            )
        self._caught_up_to.update(grown)

    def _check_following(self) -> None:
        if not self.view.following:
            raise RuntimeError(
                f"the {self._name}'s view of {', '.join(self._topics)} stopped reading"
            )
