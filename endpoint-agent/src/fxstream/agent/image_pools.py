"""The image pools: one process engine per container image an endpoint allows.

An endpoint that allows images (``images`` in its config) runs each task in the image its
function names (``WorkItem.image``; ``None``: the endpoint's ``image``, or no container
when its ``runtime`` is ``process``). :class:`ImagePools` is an
:class:`~fxstream.agent.engine.Engine` holding one
:class:`~fxstream.agent.process_engine.ProcessEngine` of warm workers per image in use.
Counts and warm state are the sum of the pools'; each warm worker names its image and
whether it holds a task. An interpreter other than the agent's (an endpoint's
``interpreters``, :mod:`fxstream.agent.python_envs`) has a pool too, named by its path
(the name ``WorkItem.image`` gives for a task of its Python version): its workers run
that interpreter, in the default image's container when there is one; it is sized and
released as another image's pool.

Sizing and release (the endpoint config's ``pool_idle_s`` and ``max_workers``):

* The default image's pool starts with the agent, with ``size`` workers; another image's
  at its first task (a *cold start*: container, interpreter, worker import; counted in
  :meth:`ImagePools.starts`).
* A pool is *idle* while none of its tasks is queued or running. A pool other than the
  default's that stays idle ``idle_s`` seconds is released: its workers are stopped,
  and its image's next task starts it again, cold.
* Without ``max_workers`` every image's pool has ``size`` workers (there is room for all
  of them: nothing is resized or evicted, :meth:`ImagePools.room` is None).
* With ``max_workers`` the budget is workers, not whole pools, and each pool is sized to
  the task mix (funcX's section 6.1). The mix is the images of the last ``mix_window``
  tasks submitted (a sliding window, default :data:`DEFAULT_MIX_WINDOW`). A pool's
  *target* is ``max(1, floor(share x max_workers))`` capped by its *demand* (its tasks
  queued and running; at least one worker while the pool runs). When those floors of one
  overrun the budget, the largest targets give up workers first (down to one); when
  there are more pools than ``max_workers``, pools with tasks (or starting) keep their
  worker first, then images waiting longest, then idle pools (those of images not
  ``wanted`` by the agent, with the fewest tasks and least recently used, lose theirs
  first); an idle pool left without one is released (the LRU eviction: the default's
  too, a pool is a pool), an image left without one waits.
  Workers left over (floors round down, demand caps) go one at a time to the pools
  still under their demand: largest remainder of ``share x max_workers`` first, then
  the oldest waiter (a running pool's busy spell began with its task, an awaited
  image's is its oldest task waiting), round after round.
* The keeper thread moves the pools toward their targets: an image waiting for a pool
  gets the budget first (its pool starts with as much of its target as is free, and
  grows to it as room frees), then running pools below target grow (starting workers).
  When that need is not met by free workers or by workers already retiring, pools above
  their targets shrink (largest surplus first, then least recently used) by
  :meth:`~fxstream.agent.process_engine.ProcessEngine.resize`: idle workers are retired
  at once, busy ones once they have answered what they hold; a task is never killed to
  make room, and a retired worker counts against the budget until it has ended. A pool
  above its target keeps its warm workers while no other pool needs them.
* A task whose image has no pool and gets no worker waits, in order (never dropped:
  counted as queued, cancellable, failed with ``PoolClosed`` only when the engine
  closes); images that wait are served oldest first. A pool that never goes idle keeps
  its worker (a steady stream of one image's tasks delays another image's when every
  worker of the budget is a busy pool's), unless the agent stops feeding it.
* :meth:`ImagePools.room` tells the agent which images' pools want tasks (two per worker
  of the pool's current size; an awaited pool's target size), so it hands over tasks of
  warm pools first (:mod:`fxstream.agent.pick`); it is None when every image's pool fits
  with one worker (nothing is ever evicted). While an image waits for a worker and no
  pool is idle, one pool is offered none so it goes idle (one of an image the agent has
  nothing queued for first, which is also released first).

Bounds: at most ``max_workers`` workers run across the pools at once, the retired ones
still ending included; the window holds ``mix_window`` image names. Gaps: the mix is
what the engine is handed, which the agent's warm-first pick and its ``workers +
prefetch`` cap shape (its own queued tasks are not counted), and a pool grows a worker
at a time of cold starts (each new worker starts its container and interpreter).

One keeper thread starts, resizes and stops pools and resolves what waited; every outcome
is resolved off the caller's thread, as the engine protocol promises.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Final

from fxstream.agent.containers import ContainerError, Image, runtime_for
from fxstream.agent.engine import (
    POOL_CLOSED,
    TASK_CANCELLED,
    WORKER_START_FAILED,
    EngineCounts,
    PoolRoom,
    WarmState,
    WorkItem,
    WorkOutcome,
)
from fxstream.agent.process_engine import ProcessEngine
from fxstream.agent.python_envs import PythonInterpreter
from fxstream.agent.worker_process import RunnerSpec

__all__ = ["DEFAULT_MIX_WINDOW", "DEFAULT_POOL_IDLE_S", "ImagePools"]

DEFAULT_POOL_IDLE_S: Final = 300.0
"""How long a non-default image's pool may sit idle before its workers stop, by default."""

DEFAULT_MIX_WINDOW: Final = 100
"""How many of the latest tasks submitted the task mix (each image's share) is read from."""

log = logging.getLogger(__name__)

_Resolution = tuple["Future[WorkOutcome]", WorkOutcome]
_Release = tuple["_Pool", int]  # a pool being released, and the workers it held then
_NO_WAITER: Final = sys.maxsize  # the "oldest task" of an image with none waiting


class _Pool:
    """A running pool: its engine, its items in flight, when it was last used."""

    __slots__ = ("busy_since", "engine", "inflight", "last_used")

    def __init__(self, engine: ProcessEngine) -> None:
        self.engine = engine
        self.inflight = 0  # submitted to it and not yet answered
        self.last_used = time.monotonic()  # the last submit or answer
        self.busy_since = _NO_WAITER  # the submission that made it busy (its sequence)


class _Waiting:
    """A task waiting for its image's pool to start."""

    __slots__ = ("future", "item", "seq")

    def __init__(self, seq: int, item: WorkItem) -> None:
        self.seq = seq
        self.item = item
        self.future: Future[WorkOutcome] = Future()


class ImagePools:
    """A process engine per image in use (see the module notes); the ``"process"`` engine.

    ``default`` is the image of items that name none (``None``: no container);
    ``images`` every image an item may name; ``interpreters`` the other interpreters'
    pools an item may name, by name (their paths). ``readonly`` and ``writable`` are given to
    every pool (see :class:`~fxstream.agent.process_engine.ProcessEngine`). ``idle_s``
    is how long a non-default pool may sit idle (``None``: kept until the engine
    closes); ``max_workers`` caps the workers across pools, each pool sized to the task
    mix of the last ``mix_window`` tasks (``None``: ``size`` per image, no resizing nor
    eviction). ``ValueError`` says what to change in any of them.
    """

    def __init__(
        self,
        size: int,
        runner: RunnerSpec,
        *,
        default: Image | None,
        images: Sequence[Image],
        readonly: Sequence[str] = (),
        writable: Sequence[str] = (),
        idle_s: float | None = DEFAULT_POOL_IDLE_S,
        max_workers: int | None = None,
        interpreters: Mapping[str, PythonInterpreter] | None = None,
        mix_window: int = DEFAULT_MIX_WINDOW,
    ) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got size={size}")
        if idle_s is not None and not idle_s > 0:
            raise ValueError(f"idle_s must be a positive number of seconds, not {idle_s}")
        if mix_window < 1:
            raise ValueError(f"mix_window must be at least 1 task, not {mix_window}")
        self._size = size
        self._runner = runner
        self._images = {image.name: image for image in images}
        self._default = default.name if default is not None else None
        if default is not None:
            self._images[default.name] = default
        self._interpreters = dict(interpreters or {})
        clash = sorted(set(self._interpreters) & set(self._images))
        if clash:
            raise ValueError(f"{clash[0]!r} names both an image and an interpreter")
        pools = len(self._images) + len(self._interpreters) + (1 if self._default is None else 0)
        # With a budget, pools are sized to the task mix (module notes); without, each has
        # `size` workers and the budget holds them all.
        self._mix = max_workers is not None
        self._max_workers = size * pools if max_workers is None else max_workers
        if self._max_workers < size:
            raise ValueError(
                f"max_workers={self._max_workers} leaves no room for the default pool's {size} "
                f"workers: set it to {size} or more"
            )
        # The most pools at once: one worker each with a budget, else all of them.
        self._max_pools = self._max_workers if self._mix else pools
        self._pool_kinds = pools
        # The images of the latest tasks submitted, and how many each has among them.
        self._window: deque[str | None] = deque(maxlen=mix_window)
        self._received: Counter[str | None] = Counter()
        # The keeper's last targets (worker counts), for room().
        self._targets_now: dict[str | None, int] = {}
        # The pool not offered more tasks (room) so it goes idle for an image waiting for a
        # slot: (its name,), or None.
        self._draining: tuple[str | None] | None = None
        # The images the agent last said it has tasks queued for (room): their pools are
        # released last.
        self._wanted: set[str | None] = set()
        self._idle_s = idle_s
        self._readonly = tuple(readonly)
        self._writable = tuple(writable)
        # Re-entrant: a task resolved while a pool is handed its waiting items may submit.
        self._cond = threading.Condition(threading.RLock())
        self._closed = False
        self._pools: dict[str | None, _Pool] = {}
        self._starting: dict[str | None, int] = {}  # pools starting, by their sizes
        self._stopping = 0  # pools being released: their workers still count
        self._stopping_workers = 0  # and how many workers they held
        self._waiting: dict[str | None, deque[_Waiting]] = {}
        self._deferred: list[_Resolution] = []
        self._seq = itertools.count()
        self._starts: Counter[str | None] = Counter()
        self._pools[self._default] = _Pool(self._start(self._default, size))
        self._starts[self._default] += 1
        self._keeper = threading.Thread(target=self._keep, name="fxstream-image-pools", daemon=True)
        self._keeper.start()

    def _start(self, name: str | None, size: int) -> ProcessEngine:
        python = self._interpreters.get(name) if name is not None else None
        if python is not None:  # another interpreter, in the default image
            name = self._default
        image = self._images.get(name) if name is not None else None
        container = image is not None and image.runtime != "process"
        return ProcessEngine(
            size,
            self._runner,
            runtime=runtime_for(image.runtime) if image is not None and container else None,
            image=image if container else None,
            readonly=self._readonly,
            writable=self._writable,
            python=python,
            on_retired=self._poke,
        )

    def _poke(self) -> None:
        """A pool's retired worker has ended: its place in the budget is free."""
        with self._cond:
            self._cond.notify_all()

    # --- what the agent and tests read --------------------------------------------------

    @property
    def name(self) -> str:
        """``"process"``: warm worker processes, per image."""
        return "process"

    @property
    def max_workers(self) -> int:
        """The most workers running across the pools at once."""
        return self._max_workers

    def pools(self) -> dict[str | None, ProcessEngine]:
        """The pools running now, by image name (``None``: no container)."""
        with self._cond:
            return {name: pool.engine for name, pool in self._pools.items()}

    def waiting(self) -> dict[str | None, int]:
        """Tasks waiting for their image's pool to start, by image."""
        with self._cond:
            return {name: len(queue) for name, queue in self._waiting.items()}

    def targets(self) -> dict[str | None, int]:
        """The worker count each running, starting or awaited pool is sized toward, as the
        keeper last planned it (0: no room for it now; see the module notes)."""
        with self._cond:
            return dict(self._targets_now)

    def mix(self) -> dict[str | None, int]:
        """How many of the latest ``mix_window`` tasks submitted were of each image."""
        with self._cond:
            return dict(self._received)

    def starts(self) -> dict[str | None, int]:
        """How many times each image's pool has started (each a cold start of its workers)."""
        with self._cond:
            return dict(self._starts)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the default image's workers have started (True if it is released)."""
        engine = self.pools().get(self._default)
        return True if engine is None else engine.wait_ready(timeout)

    def counts(self) -> EngineCounts:
        """The running pools' counts, summed; tasks waiting for a pool are queued. One
        snapshot with the keeper's decisions: ``workers_total`` never exceeds
        :attr:`max_workers` (a retired worker still ending counts in it)."""
        with self._cond:
            counts = [pool.engine.counts() for pool in self._pools.values()]
            waiting = sum(len(queue) for queue in self._waiting.values())
        return EngineCounts(
            workers_total=sum(c.workers_total for c in counts),
            workers_idle=sum(c.workers_idle for c in counts),
            workers_busy=sum(c.workers_busy for c in counts),
            queued=waiting + sum(c.queued for c in counts),
        )

    def warm(self) -> list[WarmState]:
        """Every running pool's workers (each names its image and whether it is idle)."""
        return [state for engine in self.pools().values() for state in engine.warm()]

    def room(self, wanted: Collection[str | None] = ()) -> PoolRoom | None:
        """Which images' tasks the pools want now, ``wanted`` being the images the agent
        has tasks queued for (None when the budget holds every image's pool, with one
        worker at least: nothing is ever evicted, any task may come next).

        A running or starting pool wants tasks until it holds two per worker of its
        current size (one running, one queued: the next starts without waiting for the
        agent); an image whose tasks wait for a pool counts as starting, sized to its
        target. ``spare`` counts the pools that may still start with one worker each
        (others shrink to make room). While an image waits for a slot
        and no pool is idle, one pool is offered no more tasks, so it goes idle and makes
        way: one of an image not ``wanted`` if any, then the one with the fewest tasks,
        then the least recently used. Idle pools are offered none either then (the
        keeper releases one, again of an image not ``wanted`` first).
        """
        if self._max_pools >= self._pool_kinds:
            return None
        with self._cond:
            self._wanted = {self._default if name is None else name for name in wanted}
            free: dict[str | None, int] = {
                name: max(0, 2 * pool.engine.size - pool.inflight)
                for name, pool in self._pools.items()
            }
            for name, queue in self._waiting.items():
                size = self._starting.get(name) or max(1, self._targets_now.get(name, 1))
                free[name] = max(0, 2 * size - len(queue))
            for name, size in self._starting.items():
                free.setdefault(name, 2 * size)
            pending = sum(1 for name in self._waiting if name not in self._starting)
            slots = self._max_pools - len(self._pools) - len(self._starting) - self._stopping
            blocked = max(0, pending - slots)
            # Slots no release under way will free: only then must a pool make way.
            if pending - slots - self._stopping > 0:
                idle = [name for name, pool in self._pools.items() if pool.inflight == 0]
                draining = self._draining
                if (
                    not idle
                    and self._pools
                    and (draining is None or draining[0] not in self._pools)
                ):
                    victim = min(self._pools, key=self._release_order)
                    self._draining = draining = (victim,)
                if draining is not None and draining[0] in self._pools:
                    idle.append(draining[0])
                for name in idle:
                    free[name] = 0
            else:
                self._draining = None
            if self._default is not None and self._default in free:
                free[None] = free[self._default]
            unwanted = sum(1 for name in self._pools if name not in self._wanted)
            return PoolRoom(
                free=free, spare=max(0, slots - pending), blocked=blocked, unwanted=unwanted
            )

    def _release_order(self, name: str | None) -> tuple[bool, int, float]:
        """How soon a running pool makes way (lock held; smallest first): not wanted, fewest
        tasks, least recently used."""
        pool = self._pools[name]
        return (name in self._wanted, pool.inflight, pool.last_used)

    # --- submit, cancel, close ----------------------------------------------------------

    def submit(self, item: WorkItem) -> Future[WorkOutcome]:
        """Queue ``item`` in its image's pool, or until that pool starts (module notes).

        Raises ``ValueError`` for an image this engine does not run (the agent refuses
        those before: :meth:`~fxstream.agent.policy.TaskPolicy.image_for`) or a
        non-positive walltime, and ``RuntimeError`` once closed. A pool that cannot
        start resolves its waiting items with a ``WorkerStartFailed`` outcome.
        """
        name = item.image if item.image is not None else self._default
        if name is not None and name not in self._images and name not in self._interpreters:
            raise ValueError(f"image {name!r} is not one this endpoint runs")
        if item.walltime_s is not None and not item.walltime_s > 0:
            raise ValueError(f"walltime_s must be positive, got {item.walltime_s}")
        with self._cond:
            if self._closed:
                raise RuntimeError("the image pools are closed")
            seq = next(self._seq)
            self._note_received(name)
            pool = self._pools.get(name)
            if pool is None:
                waiting = _Waiting(seq, item)
                self._waiting.setdefault(name, deque()).append(waiting)
                self._cond.notify_all()
                return waiting.future
            if pool.inflight == 0:
                pool.busy_since = seq
            pool.inflight += 1  # never released while this is counted
            pool.last_used = time.monotonic()
            if self._mix:  # its demand and the mix changed: targets may too
                self._cond.notify_all()
        try:
            future = pool.engine.submit(item)
        except BaseException:
            self._answered(pool)
            raise
        future.add_done_callback(lambda _: self._answered(pool))
        return future

    def _note_received(self, name: str | None) -> None:
        """Count a task of ``name`` in the mix window (lock held)."""
        if len(self._window) == self._window.maxlen:
            oldest = self._window[0]  # the append below drops it
            self._received[oldest] -= 1
            if not self._received[oldest]:
                del self._received[oldest]
        self._window.append(name)
        self._received[name] += 1

    def cancel(self, task_id: str, reason: str = "", *, kill: bool = True) -> bool:
        """Cancel the item of ``task_id``: dropped if it waits for its pool, else cancelled
        in whichever pool holds it."""
        with self._cond:
            for name, queue in self._waiting.items():
                for waiting in queue:
                    if waiting.item.task_id == task_id:
                        queue.remove(waiting)
                        if not queue:
                            del self._waiting[name]
                        message = f"task {task_id} was cancelled" + (
                            f": {reason}" if reason else ""
                        )
                        outcome = WorkOutcome.failure(waiting.item, TASK_CANCELLED, message)
                        self._deferred.append((waiting.future, outcome))
                        self._cond.notify_all()
                        return True
            engines = [pool.engine for pool in self._pools.values()]
        return any(engine.cancel(task_id, reason, kill=kill) for engine in engines)

    def close(self, timeout: float = 10.0) -> None:
        """Close every pool at once (so within ``timeout`` for all); idempotent. Tasks
        waiting for a pool resolve with ``PoolClosed``."""
        with self._cond:
            self._closed = True
            resolutions, self._deferred = self._deferred, []
            for queue in self._waiting.values():
                for waiting in queue:
                    message = "the engine was closed before the task's image pool started"
                    resolutions.append(
                        (waiting.future, WorkOutcome.failure(waiting.item, POOL_CLOSED, message))
                    )
            self._waiting.clear()
            self._cond.notify_all()
        _resolve(resolutions)
        if threading.current_thread() is not self._keeper:
            self._keeper.join()
        with self._cond:
            engines = [pool.engine for pool in self._pools.values()]
            self._pools.clear()
        _close_all(engines, timeout)

    # --- the keeper thread ----------------------------------------------------------------

    def _answered(self, pool: _Pool) -> None:
        """One of ``pool``'s items was answered: it may be idle now."""
        with self._cond:
            pool.inflight -= 1
            pool.last_used = time.monotonic()
            if pool.inflight == 0 or self._mix:  # idle, or its demand changed
                self._cond.notify_all()

    def _keep(self) -> None:
        """The keeper thread: :meth:`_keep_going`, failing what waits should it fail."""
        try:
            self._keep_going()
        except BaseException:
            log.exception("the image pools' keeper failed; failing the tasks waiting for a pool")
            with self._cond:
                waiting = [w for queue in self._waiting.values() for w in queue]
                self._waiting.clear()
                self._closed = True
            message = "the image pools' keeper failed (see the agent's log)"
            _resolve((w.future, WorkOutcome.failure(w.item, POOL_CLOSED, message)) for w in waiting)

    def _keep_going(self) -> None:
        """Release idle pools, size the pools to the mix, start pools for waiting tasks,
        resolve what was cancelled."""
        while True:
            with self._cond:
                resolutions, self._deferred = self._deferred, []
                if self._closed:
                    break
                now = time.monotonic()
                release = self._expired(now)
                start = None
                if not release:
                    release, start = self._plan()
                if not (resolutions or release or start):
                    self._cond.wait(self._next_expiry(now))
                    continue
            _resolve(resolutions)
            if release:
                self._stop_pools(release)
            if start:
                self._start_for(*start)
        _resolve(resolutions)

    def _expired(self, now: float) -> list[_Release]:
        """Remove (lock held) the pools idle longer than ``idle_s``, the default's aside."""
        if self._idle_s is None:
            return []
        expired = [
            name
            for name, pool in self._pools.items()
            if name != self._default and pool.inflight == 0 and now - pool.last_used >= self._idle_s
        ]
        return [self._pop(name) for name in expired]

    def _pop(self, name: str | None) -> _Release:
        """Take pool ``name`` out to release it (lock held); its workers count until stopped."""
        pool = self._pools.pop(name)
        held = pool.engine.counts().workers_total
        self._stopping += 1
        self._stopping_workers += held
        return pool, held

    def _stop_pools(self, release: list[_Release]) -> None:
        """Stop the released pools' workers (all at once), then free their budget."""
        _close_all([pool.engine for pool, _ in release], 10.0)
        with self._cond:
            self._stopping -= len(release)
            self._stopping_workers -= sum(held for _, held in release)
            self._cond.notify_all()

    def _next_expiry(self, now: float) -> float | None:
        """Seconds until the next idle pool expires (lock held), or None."""
        if self._idle_s is None:
            return None
        due = [
            pool.last_used + self._idle_s - now
            for name, pool in self._pools.items()
            if name != self._default and pool.inflight == 0
        ]
        return max(0.0, min(due)) if due else None

    # --- sizing to the mix (lock held) ------------------------------------------------------

    def _plan(self) -> tuple[list[_Release], tuple[str | None, int] | None]:
        """Move the pools toward their targets (module notes): the idle pools to release
        (no room for them), else the pool to start (its image and size, reserved); running
        pools are resized here."""
        targets = self._targets_now = self._targets()
        evicted = [
            name for name, pool in self._pools.items() if pool.inflight == 0 and not targets[name]
        ]
        if evicted:
            return [self._pop(name) for name in evicted], None
        free = self._max_workers - self._used()
        start: tuple[str | None, int] | None = None
        unmet = 0
        # Images waiting for a pool get the budget first, the one waiting longest first.
        for name in self._awaited():
            got = min(targets[name], max(0, free))
            if got and start is None:
                start = (name, got)
                self._starting[name] = got
            free -= got
            unmet += targets[name] - got
        # Then running pools below their targets grow, the one busy longest first.
        for name in sorted(self._pools, key=lambda n: self._pools[n].busy_since):
            engine = self._pools[name].engine
            short = targets[name] - engine.size
            if short > 0:
                got = min(short, max(0, free))
                if got:
                    engine.resize(engine.size + got)
                free -= got
                unmet += short - got
        if unmet:
            self._shrink(targets, unmet - self._retiring())
        return [], start

    def _awaited(self) -> list[str | None]:
        """Images whose tasks wait for a pool that is not starting, longest waiting first."""
        waiting = [
            (queue[0].seq, name)
            for name, queue in self._waiting.items()
            if queue and name not in self._pools and name not in self._starting
        ]
        return [name for _, name in sorted(waiting, key=lambda entry: entry[0])]

    def _used(self) -> int:
        """Workers held against the budget: running pools' (retired ones still ending
        included), starting pools' and released pools' not yet stopped."""
        running = sum(pool.engine.counts().workers_total for pool in self._pools.values())
        return running + sum(self._starting.values()) + self._stopping_workers

    def _retiring(self) -> int:
        """Workers that will leave the budget without more being done: retired ones still
        ending and released pools' not yet stopped."""
        retiring = sum(
            max(0, pool.engine.counts().workers_total - pool.engine.size)
            for pool in self._pools.values()
        )
        return retiring + self._stopping_workers

    def _shrink(self, targets: dict[str | None, int], count: int) -> None:
        """Retire ``count`` workers of pools above their targets: the largest surplus
        first, then the least recently used (each pool retires its idle ones first)."""
        surplus = {
            name: pool.engine.size - targets[name]
            for name, pool in self._pools.items()
            if pool.engine.size > targets[name]
        }
        for name in sorted(surplus, key=lambda n: (-surplus[n], self._pools[n].last_used)):
            if count <= 0:
                return
            engine = self._pools[name].engine
            cut = min(surplus[name], count)
            engine.resize(engine.size - cut)
            count -= cut

    def _targets(self) -> dict[str | None, int]:
        """Each running, starting or awaited pool's target worker count (module notes);
        0: no room for it now. Without a budget, ``size`` each."""
        demand: dict[str | None, int] = {}
        rank: dict[str | None, tuple[int, int]] = {}  # who keeps a worker first
        for name, pool in self._pools.items():
            demand[name] = pool.inflight
            rank[name] = (0, pool.busy_since) if pool.inflight else (2, 0)
        idle = sorted(
            (name for name, pool in self._pools.items() if not pool.inflight),
            key=self._release_order,
            reverse=True,  # the last to be released keeps its worker first
        )
        for place, name in enumerate(idle):
            rank[name] = (2, place)
        for name in self._starting:
            demand[name] = len(self._waiting.get(name, ()))
            rank[name] = (0, _NO_WAITER)
        for name in self._awaited():
            demand[name] = len(self._waiting[name])
            rank[name] = (1, self._waiting[name][0].seq)
        if not self._mix:
            return dict.fromkeys(demand, self._size)
        budget = self._max_workers
        order = sorted(demand, key=rank.__getitem__)
        kept = order[:budget]
        targets = dict.fromkeys(order, 0)
        seen = len(self._window)
        quota = {name: budget * self._received.get(name, 0) for name in kept}  # x seen
        for name in kept:
            share = quota[name] // seen if seen else 0
            targets[name] = max(1, min(demand[name], share))
        # Floors of one beyond the shares may overrun the budget: the largest give way.
        for _ in range(sum(targets.values()) - budget):
            cut = max(
                (name for name in kept if targets[name] > 1),
                key=lambda n: (targets[n], rank[n]),
            )
            targets[cut] -= 1
        self._hand_out(targets, kept, demand, quota, rank, seen)
        return targets

    def _hand_out(
        self,
        targets: dict[str | None, int],
        kept: list[str | None],
        demand: dict[str | None, int],
        quota: dict[str | None, int],
        rank: dict[str | None, tuple[int, int]],
        seen: int,
    ) -> None:
        """Give the workers the targets leave over to pools still under their demand, one
        each per round: largest remainder first, then the one waiting longest."""
        left = self._max_workers - sum(targets.values())
        order = sorted(kept, key=lambda n: (-(quota[n] % seen if seen else 0), rank[n][1]))
        while left > 0:
            wanting = [name for name in order if targets[name] < demand[name]][:left]
            if not wanting:
                return
            for name in wanting:
                targets[name] += 1
            left -= len(wanting)

    def _start_for(self, name: str | None, size: int) -> None:
        """Start ``name``'s pool of ``size`` workers (reserved) and hand it the tasks
        waiting for it."""
        try:
            engine = self._start(name, size)
        except (ContainerError, OSError) as exc:
            with self._cond:
                self._starting.pop(name, None)
                failed = self._waiting.pop(name, deque())
                self._cond.notify_all()
            message = f"cannot start workers in image {name!r}: {exc}"
            _resolve(
                (w.future, WorkOutcome.failure(w.item, WORKER_START_FAILED, message))
                for w in failed
            )
            return
        with self._cond:
            self._starting.pop(name, None)
            self._cond.notify_all()
            if not self._closed:
                pool = self._pools[name] = _Pool(engine)
                self._starts[name] += 1
                handed = self._waiting.pop(name, deque())
                pool.inflight = len(handed)
                if handed:
                    pool.busy_since = handed[0].seq
                # Under the lock: a cancel finds each item either waiting or in the pool.
                for waiting in handed:
                    self._hand(pool, waiting)
                return
        engine.close()  # closed while it started: what waited is answered already

    def _hand(self, pool: _Pool, waiting: _Waiting) -> None:
        """Submit a waiting item to its started pool; its answer resolves the item."""
        try:
            inner = pool.engine.submit(waiting.item)
        except (RuntimeError, ValueError) as exc:
            self._answered(pool)
            outcome = WorkOutcome.failure(
                waiting.item, POOL_CLOSED, f"the image's pool refused it: {exc}"
            )
            self._deferred.append((waiting.future, outcome))
            return
        inner.add_done_callback(functools.partial(self._relay, pool, waiting.future))

    def _relay(self, pool: _Pool, outer: Future[WorkOutcome], inner: Future[WorkOutcome]) -> None:
        self._answered(pool)
        _resolve([(outer, inner.result())])


def _resolve(resolutions: Iterable[_Resolution]) -> None:
    """Set outcomes on futures (a future its holder cancelled keeps that)."""
    for future, outcome in resolutions:
        with contextlib.suppress(InvalidStateError):  # cancelled by its holder meanwhile
            future.set_result(outcome)


def _close_all(engines: Sequence[ProcessEngine], timeout: float) -> None:
    """Close pools at once (so within ``timeout`` for all)."""
    closing = [
        threading.Thread(target=engine.close, args=(timeout,), name="fxstream-pool-close")
        for engine in engines
    ]
    for thread in closing:
        thread.start()
    for thread in closing:
        thread.join()
