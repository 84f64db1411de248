"""The image pools: one process engine per container image an endpoint allows.

An endpoint that allows images (``images`` in its config) runs each task in the image its
function names (``WorkItem.image``; ``None``: the endpoint's ``image``, or no container
when its ``runtime`` is ``process``). :class:`ImagePools` is an
:class:`~fxstream.agent.engine.Engine` holding one
:class:`~fxstream.agent.process_engine.ProcessEngine` per image: the default image's pool
is started with the agent, another image's at its first task, each with ``size`` warm
workers kept until the agent stops (sizing pools to the task mix, releasing idle ones and
evicting the least recently used are not built yet). Counts and warm state are the sum of
the pools'; each warm worker names its image.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from fxstream.agent.containers import ContainerError, Image, runtime_for
from fxstream.agent.engine import (
    WORKER_START_FAILED,
    EngineCounts,
    WarmState,
    WorkItem,
    WorkOutcome,
)
from fxstream.agent.process_engine import ProcessEngine
from fxstream.agent.worker_process import RunnerSpec

__all__ = ["ImagePools"]


class ImagePools:
    """A process engine per image (see the module notes); the ``"process"`` engine kind.

    ``default`` is the image of items that name none (``None``: no container);
    ``images`` every image an item may name. ``readonly`` and ``writable`` are given to
    every pool (see :class:`~fxstream.agent.process_engine.ProcessEngine`).
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
    ) -> None:
        self._size = size
        self._runner = runner
        self._images = {image.name: image for image in images}
        self._default = default.name if default is not None else None
        if default is not None:
            self._images[default.name] = default
        self._readonly = tuple(readonly)
        self._writable = tuple(writable)
        self._lock = threading.Lock()
        self._closed = False
        self._pools: dict[str | None, ProcessEngine] = {}
        self._pools[self._default] = self._start(self._default)

    def _start(self, name: str | None) -> ProcessEngine:
        image = self._images.get(name) if name is not None else None
        container = image is not None and image.runtime != "process"
        return ProcessEngine(
            self._size,
            self._runner,
            runtime=runtime_for(image.runtime) if image is not None and container else None,
            image=image if container else None,
            readonly=self._readonly,
            writable=self._writable,
        )

    @property
    def name(self) -> str:
        """``"process"``: warm worker processes, per image."""
        return "process"

    def pools(self) -> dict[str | None, ProcessEngine]:
        """The pools started so far, by image name (``None``: no container)."""
        with self._lock:
            return dict(self._pools)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the default image's workers have started."""
        return self.pools()[self._default].wait_ready(timeout)

    def submit(self, item: WorkItem) -> Future[WorkOutcome]:
        """Queue ``item`` in its image's pool (started now if it is the image's first).

        Raises ``ValueError`` for an image this engine does not run (the agent refuses
        those before: :meth:`~fxstream.agent.policy.TaskPolicy.image_for`) and
        ``RuntimeError`` once closed. A pool that cannot start resolves the item with a
        ``WorkerStartFailed`` outcome.
        """
        name = item.image if item.image is not None else self._default
        if name is not None and name not in self._images:
            raise ValueError(f"image {name!r} is not one this endpoint runs")
        with self._lock:
            if self._closed:
                raise RuntimeError("the image pools are closed")
            pool = self._pools.get(name)
            if pool is None:
                try:
                    pool = self._pools[name] = self._start(name)
                except (ContainerError, OSError) as exc:
                    failed: Future[WorkOutcome] = Future()
                    failed.set_running_or_notify_cancel()
                    failed.set_result(_start_failed(item, name, exc))
                    return failed
        return pool.submit(item)

    def cancel(self, task_id: str, reason: str = "", *, kill: bool = True) -> bool:
        """Cancel the item of ``task_id`` in whichever pool holds it."""
        return any(pool.cancel(task_id, reason, kill=kill) for pool in self.pools().values())

    def counts(self) -> EngineCounts:
        """The pools' counts, summed."""
        counts = [pool.counts() for pool in self.pools().values()]
        return EngineCounts(
            workers_total=sum(c.workers_total for c in counts),
            workers_idle=sum(c.workers_idle for c in counts),
            workers_busy=sum(c.workers_busy for c in counts),
            queued=sum(c.queued for c in counts),
        )

    def warm(self) -> list[WarmState]:
        """Every pool's warm workers (each names its image)."""
        return [state for pool in self.pools().values() for state in pool.warm()]

    def close(self, timeout: float = 10.0) -> None:
        """Close every pool at once (so within ``timeout`` for all); idempotent."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        closing = [
            threading.Thread(target=pool.close, args=(timeout,), name="fxstream-pool-close")
            for pool in pools
        ]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()


def _start_failed(item: WorkItem, image: str | None, exc: Exception) -> WorkOutcome:
    return WorkOutcome(
        task_id=item.task_id,
        ok=False,
        value=None,
        error_type=WORKER_START_FAILED,
        error_message=f"cannot start workers in image {image!r}: {exc}",
        traceback="",
        worker="",
        started_at=None,
        finished_at=time.time(),
    )
