"""Staged files: what a task copies in before it runs and out after it succeeded.

A :class:`StagingSpec` names a task's input files (``stage_in``: ``(url, path)`` pairs,
from the URL to the path in the task's working directory) and output files
(``stage_out``: ``(path, url)`` pairs, from the working directory to the URL). Submit
with it through :meth:`~fxstream.sdk.Executor.submit_staged`, or
``Client.prepare_task(..., staging=...)`` / ``Client.run(..., staging=...)``. The
endpoint's agent stages the inputs in, runs the function with its working directory as
its current directory (also in ``$FXSTREAM_TASK_DIR``, and Globus Compute's
``$GC_TASK_SANDBOX_DIR``), then stages the outputs out; a transfer that fails fails the
task with :class:`~fxstream.sdk.errors.StagingFailed` (or
:class:`~fxstream.sdk.errors.StagingUnavailable`, retryable).

URLs (:mod:`fxstream.topics.staging`): ``file:///PATH`` (inside the endpoint's staging
roots), ``store://NAME`` (your object in the platform's Redis store: write it with
:meth:`~fxstream.sdk.Client.put_object`, read an output with
:meth:`~fxstream.sdk.Client.get_object`) and ``globus://COLLECTION/PATH``. Everything is
checked here, before anything is sent, and again by the router's and agent's decoding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fxstream.topics import MAX_STAGE_ITEMS, StageItem

__all__ = ["StagingSpec"]


@dataclass(frozen=True, init=False)
class StagingSpec:
    """A task's staged files: ``stage_in`` ``(url, path)`` and ``stage_out`` ``(path, url)``.

    ``path`` is relative to the task's working directory (e.g. ``"inputs/a.dat"``).
    Raises ``ValueError`` (saying what is accepted) for a URL or path that is not
    accepted, more than :data:`~fxstream.topics.MAX_STAGE_ITEMS` files either way, a
    path staged in twice or a URL staged out to twice.
    """

    stage_in: tuple[StageItem, ...]
    stage_out: tuple[StageItem, ...]

    def __init__(
        self,
        stage_in: Iterable[tuple[str, str]] = (),
        stage_out: Iterable[tuple[str, str]] = (),
    ) -> None:
        inputs = tuple(StageItem(url=url, path=path) for url, path in stage_in)
        outputs = tuple(StageItem(url=url, path=path) for path, url in stage_out)
        for name, items in (("stage_in", inputs), ("stage_out", outputs)):
            if len(items) > MAX_STAGE_ITEMS:
                raise ValueError(
                    f"{name} names {len(items)} files; at most {MAX_STAGE_ITEMS}: stage a "
                    "directory's files as one archive, or split the task"
                )
        paths = [item.path for item in inputs]
        if len(set(paths)) != len(paths):
            raise ValueError("stage_in names a local path more than once")
        urls = [item.url for item in outputs]
        if len(set(urls)) != len(urls):
            raise ValueError("stage_out names a destination URL more than once")
        object.__setattr__(self, "stage_in", inputs)
        object.__setattr__(self, "stage_out", outputs)

    def __bool__(self) -> bool:
        return bool(self.stage_in or self.stage_out)
