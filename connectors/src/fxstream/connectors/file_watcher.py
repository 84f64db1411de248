"""A file watcher: one event on ``events.<source>`` when a file in a directory is complete.

A file is *complete* when (``mode=``):

- ``"close"`` (Linux inotify, the default where available): a process that had it open for
  writing closed it (``IN_CLOSE_WRITE``), or it was renamed within the directory (the
  write-then-rename idiom: the rename is atomic), or it appeared (moved in from elsewhere,
  linked) and no process on this host has it open for writing (``/proc``, checked for the
  files that appeared and were not closed or renamed within 20 ms: a close or rename
  announces a file without the scan). A file written through one open in slow
  chunks fires once, at its close. A writer that opens and closes the file once per chunk
  fires once per close: use ``"stable"`` for such writers, and for files written from
  another host (NFS, Lustre: inotify sees only this kernel's writes).
- ``"stable"``: its size and modification time have not changed for ``stable_s`` seconds
  (checked every ``poll_s``). Set ``stable_s`` above the writer's longest pause.

Either way the event is written after the file is complete, never for a half-written file
(a ``"stable"`` watcher trusts ``stable_s``). ``include`` and ``exclude`` are
:func:`fnmatch.fnmatchcase` patterns matched against the path relative to the watched
directory (``*`` also matches ``/``); a file is watched when it matches some ``include``
and no ``exclude`` pattern. Directories are watched recursively with ``recursive=True``.

The event (:class:`~fxstream.topics.Event`, ``event_type="file-complete"``) names the file by
reference: ``attributes`` hold ``path`` (absolute), ``relative_path``, ``size``, ``mtime``,
``mtime_ns``, ``host`` and ``detected_by`` (``close-write``, ``moved``, ``created``,
``stable`` or ``scan``); the file's bytes stay where they are. Its key is :func:`file_event_key`:
``<path>|<size>|<mtime_ns>``, so a file that changes after its event gets a new event.

Restart guarantee (exactly once). The watcher writes through an
:class:`~fxstream.connectors.event_writer.EventWriter` (transactional id
``fxstream-source.<source>.watcher``). On start it fences its predecessor, reads the keys of
the last ``scan_records`` committed records of each partition of ``events.<source>``
(default 50,000), starts watching, and then scans the directory: a complete file whose key
is among them is skipped, any other complete file gets its event. So a watcher killed at any
point (SIGKILL included) and restarted on the same directory and source:

- loses no event: a file completed while no watcher ran, or whose event's transaction the
  kill aborted, is found by the start scan;
- repeats no event, provided the earlier event is among the last ``scan_records`` records of
  its partition (a file left in the directory for longer than that many later events of its
  partition would be announced again);
- in ``"close"`` mode, decides at the start scan that a file is complete when no process on
  this host has it open for writing (``/proc/<pid>/fdinfo``); a file still open is announced
  at its close. A watcher that cannot inspect every process (not root, other users'
  writers) waits ``stable_s`` without a change for such a file instead. In ``"stable"``
  mode the start scan waits ``stable_s`` like any change.

Readers of ``events.<source>`` must read with ``isolation.level=read_committed``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver

from fxstream.connectors.event_writer import EventWriter
from fxstream.topics import Event

__all__ = [
    "FILE_EVENT_TYPE",
    "WATCH_MODES",
    "FileWatcher",
    "WatchMode",
    "WriterScan",
    "close_mode_available",
    "file_event_key",
    "open_for_writing",
]

log = logging.getLogger(__name__)

WatchMode = Literal["close", "stable"]
WATCH_MODES: Final[tuple[WatchMode, ...]] = ("close", "stable")
FILE_EVENT_TYPE: Final = "file-complete"
_MAX_KEY_CHARS: Final = 1024
_MAX_EVENTS_PER_TRANSACTION: Final = 500
_APPEARED_GRACE_S: Final = 0.02
"""How long a file that appeared waits for its close before ``/proc`` is scanned for its
writers: a writer's close comes microseconds after its create, and the scan costs 1-2 ms
with a few dozen processes; a file moved in from elsewhere is announced this much later."""


def close_mode_available() -> bool:
    """True where inotify (and so ``IN_CLOSE_WRITE``) is available: Linux."""
    try:
        import watchdog.observers.inotify  # noqa: F401
    except ImportError:
        return False
    return True


def file_event_key(path: str, size: int, mtime_ns: int) -> str:
    """The event key of a file's content: ``<path>|<size>|<mtime_ns>``, or
    ``sha256:<hex of that>`` when longer than an event key may be (1,024 characters)."""
    key = f"{path}|{size}|{mtime_ns}"
    if len(key) <= _MAX_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class WriterScan(NamedTuple):
    """What :func:`open_for_writing` found.

    Attributes:
        busy: the paths some process has open for writing.
        complete: False when some process could not be inspected (another user's, without
            root), so a path not in ``busy`` may still be open.
    """

    busy: set[str]
    complete: bool


def open_for_writing(paths: Collection[str]) -> WriterScan:
    """Those of ``paths`` (absolute, symlinks resolved) some process on this host has open
    for writing, from ``/proc/<pid>/fd`` and ``fdinfo``."""
    wanted = set(paths)
    found: set[str] = set()
    if not wanted:
        return WriterScan(found, True)
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return WriterScan(found, False)
    complete = True
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # the process ended
        except OSError:
            complete = False
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target not in wanted:
                continue
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    flags = next(
                        int(line.split()[1], 8) for line in info if line.startswith("flags:")
                    )
            except (OSError, StopIteration, ValueError, IndexError):
                continue
            if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                found.add(target)
    return WriterScan(found, complete)


@dataclass(frozen=True)
class _Change:
    path: str
    how: Literal["closed", "moved", "created", "changed"]


class _Handler(FileSystemEventHandler):
    def __init__(self, changes: queue.SimpleQueue[_Change]) -> None:
        self._changes = changes

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        if isinstance(event, FileClosedEvent):
            self._changes.put(_Change(os.fsdecode(event.src_path), "closed"))
        elif isinstance(event, FileMovedEvent):
            self._changes.put(_Change(os.fsdecode(event.dest_path), "moved"))
        elif isinstance(event, FileCreatedEvent):
            self._changes.put(_Change(os.fsdecode(event.src_path), "created"))
        elif isinstance(event, FileModifiedEvent):
            self._changes.put(_Change(os.fsdecode(event.src_path), "changed"))


@dataclass
class _Pending:
    size: int
    mtime_ns: int
    since: float


class FileWatcher:
    """Watches ``directory`` and writes one event per complete file (see the module doc).

    Args:
        writer: the source's event writer (not yet started: :meth:`run` starts it).
        directory: the directory to watch (must exist).
        mode: ``"close"`` or ``"stable"``; default ``"close"`` where inotify exists.
        stable_s: seconds a file's size and mtime must not change (``"stable"`` mode).
        include: patterns of relative paths to watch (default: every file).
        exclude: patterns of relative paths to ignore.
        recursive: also watch subdirectories.
        poll_s: how often pending files are checked and the stop flag is looked at.
    """

    def __init__(
        self,
        writer: EventWriter,
        directory: str | os.PathLike[str],
        *,
        mode: WatchMode | None = None,
        stable_s: float = 2.0,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        recursive: bool = False,
        poll_s: float | None = None,
    ) -> None:
        root = Path(os.path.realpath(directory))
        if not root.is_dir():
            raise NotADirectoryError(f"cannot watch {directory}: it is not a directory")
        chosen: WatchMode = mode or ("close" if close_mode_available() else "stable")
        if chosen not in WATCH_MODES:
            raise ValueError(f"unknown watch mode {chosen!r}: use 'close' or 'stable'")
        if chosen == "close" and not close_mode_available():
            raise ValueError(
                "mode 'close' needs inotify (Linux); use mode 'stable' with a stable_s above "
                "the writers' longest pause"
            )
        if stable_s <= 0:
            raise ValueError(f"stable_s must be positive, not {stable_s}")
        self.writer = writer
        self.root = root
        self.mode: WatchMode = chosen
        self.stable_s = stable_s
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.recursive = recursive
        self.poll_s = poll_s if poll_s is not None else min(0.25, max(0.02, stable_s / 4))
        self.host = socket.gethostname()
        self.emitted = 0
        """Events this watcher wrote."""
        self.writer_scans = 0
        """``/proc`` scans for writers (:func:`open_for_writing`) this watcher made: at the
        start scan, and for files that appeared with no close read with them."""
        self.ready = threading.Event()
        """Set once the watch is in place and the start scan is done."""
        self._changes: queue.SimpleQueue[_Change] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._appeared: dict[str, float] = {}
        """Files that appeared with no close read yet, and when (monotonic) they did."""
        self._complete: list[tuple[str, str]] = []

    # --- filters -------------------------------------------------------------------------

    def relative(self, path: str) -> str | None:
        """``path`` relative to the watched directory, or None when outside it (or in a
        subdirectory of a non-recursive watch)."""
        try:
            rel = Path(path).relative_to(self.root)
        except ValueError:
            return None
        if not self.recursive and len(rel.parts) != 1:
            return None
        return rel.as_posix()

    def matches(self, relative_path: str) -> bool:
        """Whether a file at ``relative_path`` is watched (include and exclude patterns)."""
        included = any(fnmatch.fnmatchcase(relative_path, p) for p in self.include)
        return included and not any(fnmatch.fnmatchcase(relative_path, p) for p in self.exclude)

    # --- running -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Start the writer, watch, scan, then write events until ``stop`` is set."""
        self.writer.start()
        observer = self._observer()
        # In close mode every write's IN_MODIFY would only be dropped: not asked for.
        wanted: list[type[FileSystemEvent]] | None = (
            [FileClosedEvent, FileMovedEvent, FileCreatedEvent] if self.mode == "close" else None
        )
        observer.schedule(
            _Handler(self._changes), str(self.root), recursive=self.recursive, event_filter=wanted
        )
        observer.start()
        try:
            self._scan()
            self.ready.set()
            log.info(
                "watching %s (%s mode) for source %s", self.root, self.mode, self.writer.source
            )
            while not stop.is_set():
                self._take_changes(_APPEARED_GRACE_S if self._appeared else self.poll_s)
                self._check_appeared()
                self._check_pending()
                self._flush()
        finally:
            observer.stop()
            observer.join(5.0)
            self.writer.close()

    def _observer(self) -> BaseObserver:
        if self.mode == "close":
            from watchdog.observers.inotify import InotifyObserver

            return InotifyObserver()
        from watchdog.observers import Observer

        return Observer()

    def _files(self) -> Iterator[str]:
        walk = self.root.rglob("*") if self.recursive else self.root.iterdir()
        for entry in walk:
            try:
                if entry.is_file():
                    yield str(entry)
            except OSError:
                continue

    def _scan(self) -> None:
        """The start scan: every watched file already there (see the module doc)."""
        paths = [p for p in self._files() if (rel := self.relative(p)) and self.matches(rel)]
        if self.mode == "stable":
            for path in paths:
                self._track(path)
            return
        self._settle(paths, "scan")

    def _settle(self, paths: Collection[str], how: str) -> None:
        """``close`` mode, files no close event may come for (there at the start scan, or
        moved in): complete unless some process has one open for writing (then its close
        announces it). Where another user's processes cannot be inspected, a file not
        seen open waits ``stable_s`` without a change instead (or for its close)."""
        scan = open_for_writing(paths)
        self.writer_scans += 1 if paths else 0
        for path in paths:
            if path in scan.busy:
                continue
            if scan.complete:
                self._complete.append((path, how))
            else:
                self._track(path)

    def _take_changes(self, timeout: float) -> None:
        try:
            change = self._changes.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            rel = self.relative(change.path)
            if rel is not None and self.matches(rel):
                if self.mode == "stable":
                    self._track(change.path)
                elif change.how == "closed":
                    self._complete.append((change.path, "close-write"))
                    # Its close announces it: no scan of /proc for its writers (1-2 ms
                    # with a few dozen processes) for a file created and closed at once.
                    self._appeared.pop(change.path, None)
                elif change.how == "moved":
                    self._complete.append((change.path, "moved"))
                    self._appeared.pop(change.path, None)
                elif change.how == "created":
                    self._appeared.setdefault(change.path, time.monotonic())
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                return

    def _check_appeared(self) -> None:
        """``close`` mode: files that appeared and nobody has open for writing are complete
        (moved in from outside the directory: no close will come); the others are
        announced at their close."""
        if not self._appeared:
            return
        # A writer's close follows its create within microseconds: a file waits
        # _APPEARED_GRACE_S for it before its writers are looked for.
        settled = time.monotonic() - _APPEARED_GRACE_S
        due = [path for path, seen in self._appeared.items() if seen <= settled]
        for path in due:
            del self._appeared[path]
        if due:
            self._settle(due, "created")

    def _track(self, path: str) -> None:
        try:
            stat = os.stat(path)
        except OSError:
            self._pending.pop(path, None)
            return
        now = time.monotonic()
        known = self._pending.get(path)
        if known is None or (known.size, known.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
            self._pending[path] = _Pending(stat.st_size, stat.st_mtime_ns, now)

    def _check_pending(self) -> None:
        now = time.monotonic()
        for path in list(self._pending):
            self._track(path)
            known = self._pending.get(path)
            if known is not None and now - known.since >= self.stable_s:
                del self._pending[path]
                self._complete.append((path, "stable"))

    def _flush(self) -> None:
        events: list[Event] = []
        keys: set[str] = set()
        for path, how in self._complete:
            event = self.event_for(path, how)
            if event is None or event.event_key in keys:
                continue
            if self.writer.already_written(event.event_key):
                log.debug("already announced: %s", event.event_key)
                continue
            keys.add(event.event_key)
            events.append(event)
        self._complete.clear()
        for start in range(0, len(events), _MAX_EVENTS_PER_TRANSACTION):
            batch = events[start : start + _MAX_EVENTS_PER_TRANSACTION]
            self.writer.write(batch)
            self.emitted += len(batch)
            for event in batch:
                log.info("file complete: %s", event.event_key)

    def event_for(self, path: str, how: str) -> Event | None:
        """The event for the file at ``path`` as it is now (None if it is gone)."""
        try:
            stat = os.stat(path)
        except OSError:
            return None
        rel = self.relative(path) or os.path.basename(path)
        return Event(
            source=self.writer.source,
            event_key=file_event_key(path, stat.st_size, stat.st_mtime_ns),
            event_type=FILE_EVENT_TYPE,
            occurred_at=time.time(),
            attributes={
                "path": path,
                "relative_path": rel,
                "size": stat.st_size,
                "mtime": stat.st_mtime,
                "mtime_ns": stat.st_mtime_ns,
                "host": self.host,
                "detected_by": how,
            },
        )
