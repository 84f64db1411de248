"""Task states on disk: the bounded-memory table behind every view of ``task-state``.

``task-state`` is compacted and grows with every task ever run; a view that kept it in
a dict grew with it (the API: ~1.4 kB per task, 250 MB in 6 minutes at 500 tasks/s).
:class:`TaskStateTable` keeps the latest state per task in RocksDB (``rocksdict``)
instead, with memory bounded by its settings, not by the number of tasks:

- a write buffer (memtable) of ``write_buffer_bytes``, at most two of them;
- a block cache of ``block_cache_bytes`` (index and filter blocks included);
- a small LRU of decoded states (``cache_entries``) for the tasks asked about most
  recently.

Beside the states it keeps each task group's members per user, in the order first
seen (for paged listings), and each task's group entry (to move it when a later state
names another group or user). Nothing here is durable: a table is rebuilt from the
topic when its view starts, so the write-ahead log is off and the directory is removed
on :meth:`close`. A directory left behind by a killed process is removed by the next
table made in the same parent directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Final

from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

from fxstream.topics import TaskState, TaskStateName, decode

__all__ = [
    "DEFAULT_BLOCK_CACHE_BYTES",
    "DEFAULT_CACHE_ENTRIES",
    "DEFAULT_WRITE_BUFFER_BYTES",
    "TABLE_DIR_PREFIX",
    "TaskStateTable",
]

DEFAULT_WRITE_BUFFER_BYTES: Final = 4 * 1024 * 1024
DEFAULT_BLOCK_CACHE_BYTES: Final = 8 * 1024 * 1024
DEFAULT_CACHE_ENTRIES: Final = 2_000
TABLE_DIR_PREFIX: Final = "fxstream-task-state-"

_STATE: Final = b"s\x00"
_MEMBER: Final = b"m\x00"  # task id -> its group key
_GROUP: Final = b"g\x00"  # group \0 user \0 sequence -> task id
_ROUTED: Final = b"r\x00"  # endpoint \0 function -> b"" once a task of it was routed there
_SEP: Final = b"\x00"
_SEQUENCE_BYTES: Final = 8
_FIGURES: Final = (
    ("memtables", "rocksdb.cur-size-all-mem-tables"),
    ("table_readers", "rocksdb.estimate-table-readers-mem"),
    ("block_cache", "rocksdb.block-cache-usage"),
    ("block_cache_pinned", "rocksdb.block-cache-pinned-usage"),
    ("sst_bytes", "rocksdb.live-sst-files-size"),
)


def _sweep_orphans(parent: Path) -> None:
    """Remove tables of processes that are gone (a SIGKILL skips :meth:`close`)."""
    for directory in parent.glob(f"{TABLE_DIR_PREFIX}*"):
        pid_text = directory.name[len(TABLE_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except PermissionError:
            continue  # alive, someone else's


class TaskStateTable:
    """The latest :class:`TaskState` per task id, and task-group membership, on disk.

    Writes come from one thread (a view's follower); reads from any thread.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES,
        block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        if cache_entries < 0:
            raise ValueError("cache_entries must not be negative")
        if directory is None:
            parent = Path(tempfile.gettempdir())
            _sweep_orphans(parent)
            directory = Path(tempfile.mkdtemp(prefix=f"{TABLE_DIR_PREFIX}{os.getpid()}-"))
        else:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        self.directory = directory
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(write_buffer_bytes)
        options.set_max_write_buffer_number(2)
        options.set_compression_type(DBCompressionType.lz4())
        table = BlockBasedOptions()
        table.set_block_cache(Cache(block_cache_bytes))
        table.set_cache_index_and_filter_blocks(True)
        options.set_block_based_table_factory(table)
        self._db = Rdict(str(directory), options)
        unlogged = WriteOptions()
        # Rebuilt from the topic at every start: no write-ahead log. (A property at run
        # time, though rocksdict's stub declares a method.)
        setattr(unlogged, "disable_wal", True)  # noqa: B010
        self._db.set_write_options(unlogged)
        self._cache: OrderedDict[str, TaskState] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._sequence = 0
        self._closed = False

    # --- writing (the follower thread) ---------------------------------------------------

    def put(self, key: str, state: TaskState, encoded: bytes) -> None:
        """Store ``state`` (``encoded`` is its record) as the latest under ``key`` (the
        record's Kafka key, its task id), and index it in its group."""
        if self._closed:
            return
        task_id = key.encode()
        batch = WriteBatch(raw_mode=True)
        batch.put(_STATE + task_id, encoded)
        old_group = self._db.get(_MEMBER + task_id)
        new_group = None
        if state.task_group_id is not None:
            new_group = _GROUP + state.task_group_id.encode() + _SEP + state.user_id.encode()
        if old_group is not None and (
            new_group is None or not old_group.startswith(new_group + _SEP)
        ):
            batch.delete(old_group)
            batch.delete(_MEMBER + task_id)
            old_group = None
        if new_group is not None and old_group is None:
            self._sequence += 1
            member = new_group + _SEP + self._sequence.to_bytes(_SEQUENCE_BYTES, "big")
            batch.put(member, task_id)
            batch.put(_MEMBER + task_id, member)
        if state.state == TaskStateName.ROUTED:
            # Only the router writes "routed", in the transaction of the dispatch itself; a
            # later state's function and endpoint come from the agent's result and are not
            # evidence of routing.
            batch.put(_routed_key(state.endpoint_id, state.function_id), b"")
        with self._lock:
            if not self._closed:
                self._db.write(batch)
            self._cache.pop(key, None)

    def delete(self, task_id: str) -> None:
        """Forget a task (its tombstone)."""
        if self._closed:
            return
        key = task_id.encode()
        batch = WriteBatch(raw_mode=True)
        batch.delete(_STATE + key)
        group = self._db.get(_MEMBER + key)
        if group is not None:
            batch.delete(group)
            batch.delete(_MEMBER + key)
        with self._lock:
            if not self._closed:
                self._db.write(batch)
            self._cache.pop(task_id, None)

    # --- reading -------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskState | None:
        """The latest state of ``task_id``, or None if the table has none."""
        with self._lock:
            cached = self._cache.get(task_id)
            if cached is not None:
                self._cache.move_to_end(task_id)
                return cached
            if self._closed:
                return None
            raw = self._db.get(_STATE + task_id.encode())
        if raw is None:
            return None
        state = decode(raw, TaskState)
        if self._cache_entries:
            with self._lock:
                self._cache[task_id] = state
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        return state

    def routed(self, endpoint_id: str, function_id: str) -> bool:
        """True once a task of ``function_id`` was routed to ``endpoint_id``.

        Kept after the task's own state is deleted: the endpoint has had the code.
        """
        with self._lock:
            if self._closed:
                return False
            return self._db.get(_routed_key(endpoint_id, function_id)) is not None

    def group(self, task_group_id: str, user_id: str) -> list[str]:
        """``user_id``'s task ids in ``task_group_id``, in the order first seen."""
        prefix = _GROUP + task_group_id.encode() + _SEP + user_id.encode() + _SEP
        return [value.decode() for _, value in self._scan(prefix)]

    def group_users(self, task_group_id: str) -> set[str]:
        """The users with at least one task in ``task_group_id``."""
        prefix = _GROUP + task_group_id.encode() + _SEP
        users: set[str] = set()
        for key, _ in self._scan(prefix):
            users.add(key[len(prefix) : -len(_SEP) - _SEQUENCE_BYTES].decode())
        return users

    def _scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        found: list[tuple[bytes, bytes]] = []
        with self._lock:
            if self._closed:
                return found
            for key, value in self._db.items(from_key=prefix):
                if not isinstance(key, bytes) or not key.startswith(prefix):
                    break
                found.append((key, value))
        return found

    def approximate_tasks(self) -> int:
        """RocksDB's estimate of the keys held (states and index entries)."""
        with self._lock:
            if self._closed:
                return 0
            return self._db.property_int_value("rocksdb.estimate-num-keys") or 0

    def memory_figures(self) -> dict[str, int]:
        """RocksDB's own account of its memory and files, in bytes (files: a count):
        memtables, table readers (outside the block cache), block cache (and its pinned
        part), live SST bytes and files."""
        with self._lock:
            if self._closed:
                return {}
            figures = {name: self._db.property_int_value(prop) or 0 for name, prop in _FIGURES}
            figures["sst_files"] = sum(
                int(self._db.property_value(f"rocksdb.num-files-at-level{level}") or 0)
                for level in range(7)
            )
            return figures

    def close(self) -> None:
        """Close the database and remove its directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cache.clear()
            self._db.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _routed_key(endpoint_id: str, function_id: str) -> bytes:
    return _ROUTED + endpoint_id.encode() + _SEP + function_id.encode()
