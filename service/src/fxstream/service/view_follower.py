"""A processor's registry view, started once and caught up on demand.

The router (users, functions, endpoints) and the ingress (task-state) each plan from a
:class:`~fxstream.service.registry.RegistryView`. Both need the same two things from it:
at start, to hold everything written before the processor began; and, when a record
names something the view does not hold yet, to read what the followed topics hold *now*
(bounded) before deciding the record is wrong. :class:`ViewFollower` is that, once.
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
        """Start the view and wait until it holds what its topics held at start (once)."""
        async with self._start_lock:
            if self._started:
                return
            await asyncio.to_thread(self.view.start)
            current = await asyncio.to_thread(self.view.wait_until_current, self._start_timeout_s)
            if not current:
                raise RuntimeError(
                    f"the {self._name}'s view of {', '.join(self._topics)} did not catch up "
                    f"in {self._start_timeout_s:g} s"
                )
            self._started = True

    def close(self) -> None:
        """Stop following."""
        self.view.close()

    async def catch_up(self) -> None:
        """Wait (bounded by ``catch_up_s``) until the view has read what the topics hold now.

        Waiting for the topics' current ends, rather than a fixed time, makes a truly
        unknown id cost one round trip; and only partitions that grew since the last
        catch-up are waited for, so a flood of unknown ids (or an end the view cannot
        reach, like a transaction marker) costs the budget at most once per change.
        """
        deadline = time.monotonic() + self._catch_up_s
        try:
            ends = await asyncio.wait_for(
                self._directory.end_offsets(self._topics), self._catch_up_s
            )
        except Exception as exc:  # cannot ask: fall back to waiting out the budget
            log.warning("%s: cannot read the end offsets (%r); waiting instead", self._name, exc)
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            return
        grown = {tp: end for tp, end in ends.items() if end > self._caught_up_to.get(tp, 0)}
        self._caught_up_to.update(grown)
        for (topic, partition), end in grown.items():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.to_thread(self.view.wait_for_offset, topic, partition, end - 1, remaining)
