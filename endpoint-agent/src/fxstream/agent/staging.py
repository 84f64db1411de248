"""The staging hop: a task's files staged in before it runs and out after it succeeded.

A task may declare files (``TaskSubmission.stage_in`` and ``stage_out``, checked on the
wire by :mod:`fxstream.topics.staging`). For such a task the agent, in its
:class:`Stager`'s *transfer slots* (Balsam's name: a bounded pool of threads, so the poll
thread and the engine's thread never wait on a transfer):

1. makes the task's working directory, ``<work_dir>/<task id>`` (0700, empty: an earlier
   attempt's is removed first);
2. stages every input in, batched per site: one copy per ``file://`` file (inside the
   endpoint's staging ``roots`` only), one Redis round trip for all ``store://`` objects
   of the task (the submitter's own, :class:`~fxstream.connectors.NamedObjects`), one
   Globus transfer per source collection for the ``globus://`` files;
3. hands the task to the engine; the worker runs the function *in* that directory (its
   current directory) with ``FXSTREAM_TASK_DIR`` (and Globus Compute's
   ``GC_TASK_SANDBOX_DIR``) set to it (:mod:`fxstream.agent.runner`), so the function
   opens its inputs by their relative paths and writes its outputs there;
4. once the function succeeded, stages every output out the same way (one Globus
   transfer per destination collection), then answers the task; the directory is removed
   (unless ``keep_task_dirs``).

A transfer that fails fails the task with a clear error, never a lost or hung one:
``StagingFailed`` (not retryable: a missing source, a URL outside the staging roots, a
refused permission, an output the function did not write; the message names the file,
the site and what to do) or ``StagingUnavailable`` (a site unreachable or a transfer past
``timeout_s``: retryable, and retried by the agent up to the task's ``max_retries``, which
stages in and runs again). Every Globus wait is bounded by ``timeout_s`` (the task is then
cancelled on Globus). A task cancelled while staging in is answered cancelled before it
runs (:meth:`Stager.cancel`, skip-only cancels too: it has not started); an agent that
stops answers the tasks still staging ``PoolClosed`` (retryable:
handed back, uncommitted, to the next agent).

Hostile input: a ``file://`` path is resolved (symbolic links followed) and must lie in a
staging root the endpoint's owner declared; an output must resolve inside the task's
directory and be a regular file (a symbolic link the function left pointing elsewhere is
refused); a ``globus://`` collection must be among ``allowed_collections`` when that is
set; a ``store://`` name is read and written only in the submitter's namespace (the
router-stamped user). The walltime bounds the function's run only, not its staging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

import globus_sdk
import redis

from fxstream.agent.engine import (
    POOL_CLOSED,
    STAGING_FAILED,
    STAGING_UNAVAILABLE,
    TASK_CANCELLED,
    Engine,
    WorkItem,
    WorkOutcome,
)
from fxstream.connectors import NamedObjects, NamedObjectTooLarge, StoreIntegrityError
from fxstream.connectors.globus import (
    GlobusAuthConfig,
    GlobusTransferError,
    GlobusTransferFailed,
    GlobusTransferFaulted,
    GlobusTransferHelper,
    GlobusTransferRejected,
    TransferItem,
)
from fxstream.topics import StageItem, TaskSubmission

__all__ = [
    "DEFAULT_STAGING_SLOTS",
    "DEFAULT_STAGING_TIMEOUT_S",
    "TASK_DIR_ENV",
    "TASK_DIR_ENV_GC",
    "GlobusStaging",
    "Stager",
    "StagingError",
    "StagingSettings",
]

log = logging.getLogger(__name__)

TASK_DIR_ENV: Final = "FXSTREAM_TASK_DIR"
"""The variable that names a staged task's working directory in its worker."""
TASK_DIR_ENV_GC: Final = "GC_TASK_SANDBOX_DIR"
"""Globus Compute's name for the same directory (its ``run_in_sandbox``), also set."""
DEFAULT_STAGING_SLOTS: Final = 4
"""Tasks staging at once (the transfer slots)."""
DEFAULT_STAGING_TIMEOUT_S: Final = 3600.0
"""The longest one Globus transfer may take before the task fails ``StagingUnavailable``."""


@dataclass(frozen=True)
class GlobusStaging:
    """The endpoint's Globus side (its YAML's ``staging.globus:``).

    ``collection`` is the UUID of the Globus collection that serves the staging
    ``work_dir`` and ``collection_path`` that directory as the collection shows it;
    ``allowed_collections`` the collections tasks may stage from and to (empty: any);
    ``auth`` where the Transfer credential is (a :class:`GlobusAuthConfig`'s fields:
    ``access_token_file``, ``access_token_env``, or ``client_id`` with
    ``client_secret_file`` or ``client_secret_env``; never the secret itself);
    ``transfer_base_url`` a non-production Transfer API (None: Globus's).
    """

    collection: str
    collection_path: str = "/"
    allowed_collections: tuple[str, ...] = ()
    auth: dict[str, str] = field(default_factory=dict)
    transfer_base_url: str | None = None
    poll_initial_s: float = 1.0
    poll_max_s: float = 30.0
    max_faults: int | None = 5
    verify_checksum: bool = True


@dataclass(frozen=True)
class StagingSettings:
    """An endpoint's staging (its YAML's ``staging:`` section; absent: no staging).

    ``work_dir`` holds the tasks' working directories (absolute; default: the endpoint's
    directory's ``tasks``); ``roots`` the directories ``file://`` URLs must resolve into
    (absolute; empty: ``file://`` refused); ``slots`` how many tasks stage at once;
    ``timeout_s`` the longest one Globus transfer may take; ``keep_task_dirs`` keeps each
    task's directory after it was answered (for debugging; nothing removes them then).
    """

    work_dir: str | None = None
    roots: tuple[str, ...] = ()
    slots: int = DEFAULT_STAGING_SLOTS
    timeout_s: float = DEFAULT_STAGING_TIMEOUT_S
    keep_task_dirs: bool = False
    globus: GlobusStaging | None = None

    def problems(self) -> list[str]:
        """What is wrong with these settings, each saying what to set (empty: usable)."""
        found: list[str] = []
        if self.work_dir is not None and not os.path.isabs(self.work_dir):
            found.append(f"staging.work_dir must be an absolute path, not {self.work_dir!r}")
        if any(not isinstance(r, str) or not os.path.isabs(r) for r in self.roots):
            found.append("staging.roots must be absolute paths (the directories file:// may use)")
        if any(os.path.realpath(r) == "/" for r in self.roots):
            found.append("staging.roots may not be / (it would allow every file of the host)")
        if not 1 <= self.slots <= 256:
            found.append(f"staging.slots must be between 1 and 256, not {self.slots}")
        if not 0 < self.timeout_s <= 7 * 86400:
            found.append(f"staging.timeout_s must be in (0, 604800] seconds, not {self.timeout_s}")
        if self.globus is not None:
            g = self.globus
            if not g.collection_path.startswith("/"):
                found.append("staging.globus.collection_path must be absolute on the collection")
            try:
                GlobusAuthConfig.from_dict(g.auth)
            except (TypeError, ValueError) as exc:
                found.append(f"staging.globus.auth: {exc}")
            if not 0 < g.poll_initial_s <= g.poll_max_s:
                found.append("staging.globus: 0 < poll_initial_s <= poll_max_s")
        return found

    def task_root(self, endpoint_dir: Path) -> Path:
        """Where the tasks' working directories are (``work_dir``, else ``<endpoint>/tasks``)."""
        return Path(self.work_dir) if self.work_dir is not None else endpoint_dir / "tasks"


class StagingError(Exception):
    """A file could not be staged; ``retryable`` when a retry may cure it (a site
    unreachable, a transfer too slow), and the message says what failed and what to do."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    @property
    def error_type(self) -> str:
        """``StagingUnavailable`` when retryable, else ``StagingFailed``."""
        return STAGING_UNAVAILABLE if self.retryable else STAGING_FAILED


def _failure(
    item: WorkItem, exc: StagingError, *, ran: WorkOutcome | None = None, when: str
) -> WorkOutcome:
    note = (
        " The function ran and succeeded; its result is not kept (the task failed)."
        if ran is not None
        else " The function did not run."
    )
    retry = (
        " A retry may cure it: the agent retries up to the task's max_retries."
        if exc.retryable
        else " A retry will not cure it."
    )
    return WorkOutcome(
        task_id=item.task_id,
        ok=False,
        value=None,
        error_type=exc.error_type,
        error_message=f"staging {when} failed: {exc}{note}{retry}",
        traceback="",
        worker=ran.worker if ran is not None else "",
        started_at=ran.started_at if ran is not None else None,
        finished_at=time.time(),
    )


class Stager:
    """Stages the files of the tasks that declare some, in a bounded pool of slots.

    Args:
        settings: The endpoint's ``staging:`` section (None: it stages nothing, and a
            task that declares files fails ``StagingFailed`` saying so).
        endpoint_dir: The endpoint's directory (the default ``work_dir``'s parent).
        store_url: The endpoint's store (``store://`` objects need a Redis one).
    """

    def __init__(
        self, settings: StagingSettings | None, *, endpoint_dir: Path, store_url: str | None
    ) -> None:
        self.settings = settings
        self.task_root = (settings or StagingSettings()).task_root(endpoint_dir)
        self._store_url = store_url
        self._roots = tuple(Path(os.path.realpath(r)) for r in (settings.roots if settings else ()))
        slots = settings.slots if settings is not None else 1
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="fxstream-staging")
        self._lock = threading.Lock()
        self._closed = False
        self._pending: dict[str, Future[WorkOutcome]] = {}
        # Tasks staging in (not yet given to the engine) -> a cancel's reason, if one came.
        self._staging_in: dict[str, str | None] = {}

    @staticmethod
    def wanted(submission: TaskSubmission) -> bool:
        """Whether the task declares files to stage."""
        return bool(submission.stage_in or submission.stage_out)

    def task_dir(self, task_id: str) -> Path:
        """The task's working directory."""
        return self.task_root / task_id

    def run(
        self,
        submission: TaskSubmission,
        user_id: str,
        item: WorkItem,
        engine: Engine,
        cancelled: Callable[[], str | None],
    ) -> Future[WorkOutcome]:
        """Stage in, run on ``engine``, stage out; the future resolves with the task's
        outcome and never raises. ``user_id`` is the router-stamped submitter (whose
        ``store://`` namespace is used); ``cancelled`` gives a cancel's reason, if any."""
        outer: Future[WorkOutcome] = Future()
        with self._lock:
            if self._closed:
                outer.set_result(WorkOutcome.failure(item, POOL_CLOSED, "the agent is stopping"))
                return outer
            self._pending[item.task_id] = outer
            self._staging_in[item.task_id] = None
        outer.add_done_callback(lambda _: self._forget(item.task_id))
        try:
            self._pool.submit(
                self._stage_in_and_run, submission, user_id, item, engine, cancelled, outer
            )
        except RuntimeError:  # shut down between the check and here
            self._resolve(outer, WorkOutcome.failure(item, POOL_CLOSED, "the agent is stopping"))
        return outer

    def cancel(self, task_id: str, reason: str) -> bool:
        """Cancel a task still staging in (it is answered cancelled and never runs); False
        when it is not staging in (not here, or already given to the engine)."""
        with self._lock:
            if task_id not in self._staging_in:
                return False
            self._staging_in[task_id] = reason
            return True

    def close(self) -> None:
        """Stop taking tasks; those still staging resolve ``PoolClosed`` (handed back)."""
        with self._lock:
            self._closed = True
            pending = list(self._pending.items())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for task_id, future in pending:
            if not future.done():
                outcome = WorkOutcome(
                    task_id=task_id,
                    ok=False,
                    value=None,
                    error_type=POOL_CLOSED,
                    error_message="the agent stopped while the task's files were staging",
                    traceback="",
                    worker="",
                    started_at=None,
                    finished_at=time.time(),
                )
                self._resolve(future, outcome)

    # --- the steps ---------------------------------------------------------------------

    def _forget(self, task_id: str) -> None:
        with self._lock:
            self._pending.pop(task_id, None)
            self._staging_in.pop(task_id, None)

    @staticmethod
    def _resolve(future: Future[WorkOutcome], outcome: WorkOutcome) -> None:
        with contextlib.suppress(Exception):  # resolved already (by close)
            future.set_result(outcome)

    def _stage_in_and_run(
        self,
        submission: TaskSubmission,
        user_id: str,
        item: WorkItem,
        engine: Engine,
        cancelled: Callable[[], str | None],
        outer: Future[WorkOutcome],
    ) -> None:
        directory = self.task_dir(submission.task_id)
        try:
            began = time.monotonic()
            self._fresh_directory(directory)
            self._stage_in(submission, user_id, directory)
            log.info(
                "task %s: %d files staged in %.2f s",
                submission.task_id,
                len(submission.stage_in),
                time.monotonic() - began,
            )
        except StagingError as exc:
            log.warning("task %s: staging in failed: %s", submission.task_id, exc)
            self._cleanup(directory)
            self._resolve(outer, _failure(item, exc, when="in"))
            return
        except Exception as exc:  # a bug or an OS error we did not foresee: still an answer
            log.exception("task %s: staging in failed", submission.task_id)
            self._cleanup(directory)
            failed = StagingError(f"{type(exc).__name__}: {exc}")
            self._resolve(outer, _failure(item, failed, when="in"))
            return
        with self._lock:
            reason = self._staging_in.pop(item.task_id, None)
        reason = reason if reason is not None else cancelled()
        if reason is not None:
            self._cleanup(directory)
            self._resolve(
                outer,
                WorkOutcome.failure(
                    item, TASK_CANCELLED, f"task {item.task_id} was cancelled: {reason}"
                ),
            )
            return
        if outer.done():  # closed meanwhile
            self._cleanup(directory)
            return
        try:
            inner = engine.submit(item)
        except (RuntimeError, ValueError) as exc:
            self._cleanup(directory)
            self._resolve(outer, WorkOutcome.failure(item, POOL_CLOSED, str(exc)))
            return
        reason = cancelled()
        if reason is not None:  # a cancel that came while it was being submitted
            engine.cancel(item.task_id, reason)
        inner.add_done_callback(
            lambda done: self._after_run(submission, user_id, item, directory, done, outer)
        )

    def _after_run(
        self,
        submission: TaskSubmission,
        user_id: str,
        item: WorkItem,
        directory: Path,
        done: Future[WorkOutcome],
        outer: Future[WorkOutcome],
    ) -> None:
        # On the engine's thread (callbacks must be short): the rest goes to a slot.
        outcome = done.result()
        try:
            self._pool.submit(self._stage_out, submission, user_id, item, directory, outcome, outer)
        except RuntimeError:  # the agent is stopping: nothing more is staged
            if outcome.ok and submission.stage_out:
                outcome = WorkOutcome.failure(item, POOL_CLOSED, "the agent is stopping")
            self._resolve(outer, outcome)

    def _stage_out(
        self,
        submission: TaskSubmission,
        user_id: str,
        item: WorkItem,
        directory: Path,
        ran: WorkOutcome,
        outer: Future[WorkOutcome],
    ) -> None:
        outcome = ran
        if not ran.ok or not submission.stage_out:
            # Failed (nothing is staged out), or nothing to stage out: only the clean-up.
            self._cleanup(directory)
            self._resolve(outer, outcome)
            return
        try:
            began = time.monotonic()
            self._stage_out_files(submission, user_id, directory)
            log.info(
                "task %s: %d files staged out in %.2f s",
                submission.task_id,
                len(submission.stage_out),
                time.monotonic() - began,
            )
        except StagingError as exc:
            log.warning("task %s: staging out failed: %s", submission.task_id, exc)
            outcome = _failure(item, exc, ran=ran, when="out")
        except Exception as exc:  # a bug or an OS error we did not foresee: still an answer
            log.exception("task %s: staging out failed", submission.task_id)
            failed = StagingError(f"{type(exc).__name__}: {exc}")
            outcome = _failure(item, failed, ran=ran, when="out")
        # The directory goes before the answer: once answered, nothing of the task is left.
        self._cleanup(directory)
        self._resolve(outer, outcome)

    # --- directories -------------------------------------------------------------------

    def _fresh_directory(self, directory: Path) -> None:
        if self.settings is None:
            raise StagingError(
                "this endpoint does not stage files (its config has no staging: section). "
                "What to do: submit the task to an endpoint that stages files, or ask this "
                "endpoint's owner to add staging: (work_dir, roots, globus) to its config "
                "(docs/hpc.md, 'Staging')"
            )
        try:
            self.task_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if directory.exists() or directory.is_symlink():
                self._remove(directory)
            directory.mkdir(mode=0o700)
        except OSError as exc:
            raise StagingError(
                f"cannot make the task's working directory {directory}: {exc}. What to do: "
                "the endpoint's owner checks staging.work_dir (writable, space left)"
            ) from exc

    def _cleanup(self, directory: Path) -> None:
        if self.settings is None or self.settings.keep_task_dirs:
            return
        self._remove(directory)

    @staticmethod
    def _remove(directory: Path) -> None:
        if directory.is_symlink():
            directory.unlink()
        elif directory.exists():
            shutil.rmtree(directory, ignore_errors=True)

    # --- stage in ----------------------------------------------------------------------

    def _stage_in(self, submission: TaskSubmission, user_id: str, directory: Path) -> None:
        by_scheme = _by_scheme(submission.stage_in)
        for item in by_scheme.get("file", []):
            source = self._inside_roots(item.parsed.path, item.url, reading=True)
            target = _inside(directory, item.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(source, target)
            except OSError as exc:
                raise StagingError(
                    f"cannot copy {item.url} to {item.path}: {exc.strerror or exc}. What to do: "
                    "check the file is readable by the endpoint's user"
                ) from exc
        stored = by_scheme.get("store", [])
        if stored:
            names = [item.parsed.path for item in stored]
            with self._named_objects() as objects:
                try:
                    values = objects.get_many(user_id, names)
                except StoreIntegrityError as exc:
                    raise StagingError(f"a store object was altered in the store: {exc}") from exc
                except redis.RedisError as exc:
                    raise _store_error(objects, exc) from exc
            for item, value in zip(stored, values, strict=True):
                if value is None:
                    raise StagingError(
                        f"{item.url}: no such object of user {user_id} in the store (never "
                        "written, deleted, or its lease ended). What to do: write it first "
                        "(client.put_object(name, data)) and resubmit"
                    )
                target = _inside(directory, item.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(value)
        for collection, items in _by_collection(by_scheme.get("globus", [])).items():
            for item in items:
                _inside(directory, item.path).parent.mkdir(parents=True, exist_ok=True)
            globus = self._globus(collection)
            self._transfer(
                collection,
                globus.collection,
                [
                    TransferItem(item.parsed.path, self._collection_path(directory, item.path))
                    for item in items
                ],
                what=f"stage in {len(items)} files of task {submission.task_id}",
            )
            for item in items:
                if not _inside(directory, item.path).is_file():
                    raise StagingError(
                        f"the Globus transfer of {item.url} succeeded but {item.path} is not in "
                        "the task's directory. What to do: the endpoint's owner checks that "
                        "staging.globus.collection and collection_path serve staging.work_dir"
                    )

    # --- stage out ---------------------------------------------------------------------

    def _stage_out_files(self, submission: TaskSubmission, user_id: str, directory: Path) -> None:
        by_scheme = _by_scheme(submission.stage_out)
        # Every output must be there (a regular file, inside the task's directory) before
        # anything is sent anywhere.
        sources = {item.path: _output(directory, item) for item in submission.stage_out}
        for item in by_scheme.get("file", []):
            target = self._inside_roots(item.parsed.path, item.url, reading=False)
            partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(sources[item.path], partial)
                os.replace(partial, target)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    partial.unlink()
                raise StagingError(
                    f"cannot write {item.path} to {item.url}: {exc.strerror or exc}. What to "
                    "do: check the directory is writable by the endpoint's user"
                ) from exc
        stored = by_scheme.get("store", [])
        if stored:
            with self._named_objects() as objects:
                try:
                    objects.put_many(
                        user_id,
                        [(item.parsed.path, sources[item.path].read_bytes()) for item in stored],
                    )
                except NamedObjectTooLarge as exc:
                    raise StagingError(str(exc)) from exc
                except redis.RedisError as exc:
                    raise _store_error(objects, exc) from exc
        for collection, items in _by_collection(by_scheme.get("globus", [])).items():
            globus = self._globus(collection)
            self._transfer(
                globus.collection,
                collection,
                [
                    TransferItem(self._collection_path(directory, item.path), item.parsed.path)
                    for item in items
                ],
                what=f"stage out {len(items)} files of task {submission.task_id}",
            )

    # --- sites -------------------------------------------------------------------------

    def _inside_roots(self, path: str, url: str, *, reading: bool) -> Path:
        """The real path of a ``file://`` URL's path, which must be in a staging root."""
        if not self._roots:
            raise StagingError(
                f"{url}: this endpoint declares no staging roots, so it stages no file:// "
                "URL. What to do: use store:// or globus://, or ask the endpoint's owner to "
                "add the directory to staging.roots"
            )
        real = Path(os.path.realpath(path))
        if not any(real == root or root in real.parents for root in self._roots):
            raise StagingError(
                f"{url} resolves to {real}, outside this endpoint's staging roots "
                f"({', '.join(map(str, self._roots))}): refused. What to do: use a file "
                "inside one of them (symbolic links are followed before the check)"
            )
        if reading and not real.is_file():
            raise StagingError(
                f"{url}: no such file on endpoint host (or not a regular file). What to do: "
                "check the path, and that the file was written before the task was submitted"
            )
        if not reading and real.is_dir():
            raise StagingError(f"{url} is a directory; name the file to write")
        return real

    @contextlib.contextmanager
    def _named_objects(self) -> Iterator[NamedObjects]:
        if self._store_url is None:
            raise StagingError(
                "store:// URLs need the endpoint's Redis store and this endpoint has none "
                "(store_url). What to do: use file:// or globus://, or ask the endpoint's "
                "owner to set store_url"
            )
        try:
            objects = NamedObjects(self._store_url)
        except ValueError as exc:
            raise StagingError(str(exc)) from exc
        try:
            yield objects
        finally:
            objects.close()

    def _globus(self, collection: str) -> GlobusStaging:
        globus = self.settings.globus if self.settings is not None else None
        if globus is None:
            raise StagingError(
                f"globus://{collection}: this endpoint has no Globus collection "
                "(staging.globus). What to do: use file:// or store://, or ask the endpoint's "
                "owner to configure staging.globus"
            )
        if globus.allowed_collections and collection not in globus.allowed_collections:
            raise StagingError(
                f"globus://{collection}: this endpoint does not stage from or to that "
                "collection (staging.globus.allowed_collections). What to do: use an allowed "
                "collection, or ask the endpoint's owner to add it"
            )
        return globus

    def _collection_path(self, directory: Path, local: str) -> str:
        """A file of the task's directory as the endpoint's collection shows it."""
        assert self.settings is not None and self.settings.globus is not None
        relative = PurePosixPath(directory.name) / local
        return str(PurePosixPath(self.settings.globus.collection_path) / relative)

    def _transfer(
        self, source: str, destination: str, items: Sequence[TransferItem], *, what: str
    ) -> None:
        """One Globus transfer of ``items`` (a site's batch), waited for up to
        ``timeout_s``; its failures become :class:`StagingError`."""
        assert self.settings is not None and self.settings.globus is not None
        globus = self.settings.globus
        try:
            helper = GlobusTransferHelper(
                GlobusAuthConfig.from_dict(globus.auth).authorizer(),
                base_url=globus.transfer_base_url,
                poll_initial_s=globus.poll_initial_s,
                poll_max_s=globus.poll_max_s,
                max_faults=globus.max_faults,
            )
        except GlobusTransferError as exc:  # the credential cannot be read
            raise StagingError(f"Globus credential: {exc}") from exc
        except globus_sdk.GlobusError as exc:
            raise StagingError(f"Globus credential: {exc}", retryable=True) from exc
        try:
            helper.transfer(
                source,
                destination,
                items,
                timeout_s=self.settings.timeout_s,
                label=f"fxstream {what}"[:128],
                verify_checksum=globus.verify_checksum,
            )
        except (GlobusTransferFaulted, GlobusTransferFailed) as exc:
            raise StagingError(f"Globus transfer {source} -> {destination}: {exc}") from exc
        except GlobusTransferRejected as exc:
            transient = exc.http_status >= 500 or exc.http_status == 429
            raise StagingError(
                f"Globus transfer {source} -> {destination}: {exc}", retryable=transient
            ) from exc
        except GlobusTransferError as exc:  # unreachable, or past timeout_s (cancelled)
            raise StagingError(
                f"Globus transfer {source} -> {destination}: {exc}", retryable=True
            ) from exc
        finally:
            helper.close()


def _by_scheme(items: Sequence[StageItem]) -> dict[str, list[StageItem]]:
    grouped: dict[str, list[StageItem]] = {}
    for item in items:
        grouped.setdefault(item.parsed.scheme, []).append(item)
    return grouped


def _by_collection(items: Sequence[StageItem]) -> dict[str, list[StageItem]]:
    """Globus items by their collection: one transfer per remote site."""
    grouped: dict[str, list[StageItem]] = {}
    for item in items:
        grouped.setdefault(item.parsed.authority, []).append(item)
    return grouped


def _inside(directory: Path, local: str) -> Path:
    """``local`` in the task's directory (checked on the wire; re-checked here after
    symbolic links are resolved, in case the function left one)."""
    target = directory / local
    real = Path(os.path.realpath(target))
    base = Path(os.path.realpath(directory))
    if base not in real.parents:
        raise StagingError(
            f"{local} resolves to {real}, outside the task's directory (a symbolic link?): refused"
        )
    return target


def _output(directory: Path, item: StageItem) -> Path:
    target = _inside(directory, item.path)
    if target.is_symlink() or not target.is_file():
        raise StagingError(
            f"output {item.path} (to {item.url}) is not a file in the task's directory: the "
            "function did not write it (or wrote a directory or a symbolic link). What to do: "
            f"write it at that path relative to the working directory (${TASK_DIR_ENV})"
        )
    return target


def _store_error(objects: NamedObjects, exc: redis.RedisError) -> StagingError:
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return StagingError(
            f"the store {objects.location} cannot be reached ({type(exc).__name__}: {exc}). "
            "What to do: resubmit once it is back (the agent retries up to max_retries)",
            retryable=True,
        )
    return StagingError(
        f"the store {objects.location} refused ({type(exc).__name__}: {exc}). What to do: "
        "the endpoint's owner checks its store_url (user, password, key prefix fxobj:)"
    )
