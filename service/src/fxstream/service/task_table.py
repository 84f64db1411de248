"""Task states on disk: the bounded-memory table behind every view of ``task-state``.

``task-state`` is compacted and grows with every task ever run; a view that kept it in
a dict grew with it (the API: ~1.4 kB per task, 250 MB in 6 minutes at 500 tasks/s).
:class:`TaskStateTable` keeps the latest state per task in RocksDB (``rocksdict``)
instead, with memory bounded by its settings, not by the number of tasks:

- a write buffer (memtable) of ``write_buffer_bytes``, at most two of them;
- a block cache of ``block_cache_bytes`` (index and filter blocks included);
- a small LRU of decoded states (``cache_entries``) for the tasks asked about most
  recently;
- for the ``recent_entries`` tasks written most recently, what the writer last wrote of
  each (its group entry and summary, ~0.3 kB): a task's states come seconds apart, and
  its second and later states are then written without reading the table first (those
  reads were most of a write's cost: ``./fx bench profile``).

Reads stay cheap as the table grows: every key is in a Bloom filter (a new task's
reads, of keys it does not have yet, mostly skip the files), and the index and filter
of each file are partitioned, so a read brings the few small partitions it needs
through the block cache, not a file's whole index. Without them a table of 150,000
tasks cost 535 µs of CPU per task written and 218 µs per read of a missing key; with
them 89 and 17, and 94 and 22 at 500,000 tasks (docs/benchmarks.md, "bench profile").

Beside the states it keeps each task group's members per user, in the order first
seen (for paged listings), and each task's group entry (to move it when a later state
names another group or user).

An *indexed* table (the API's; ``indexed=True``) also keeps what filtered queries
(:meth:`TaskStateTable.query`, ``GET /v1/tasks``) need, so none of them reads every task:

- per task, a small summary (its user, submission time, state, function, endpoint,
  group and tags: ~100-2,500 bytes), rewritten with each state;
- per user, the task ids ordered by submission time (``submitted_at``; for a task whose
  states never carried it, the time the table first saw it);
- per user and tag ``key: value``, the task ids with that tag, ordered the same way;
- per user and task group, the group's task ids, ordered the same way.

A query walks one of these orders (its group's if it names a task group, else a tag's
if it names a tag, else the user's), between
its time bounds, and checks the other filters on each summary; a request walks at most
``max_scan`` entries (its page then ends early, with a cursor to go on), so its cost is
bounded whatever the number of tasks, and a tag query's walk is proportional to the
tasks with that tag (a group query's to the group's tasks), not to all the user's tasks.
Each new task costs ``1 +`` its number of tags (``+ 1`` in a group) index entries
once, and every state one summary write.

Nothing here is durable: a table is rebuilt from the topic when its view starts, so the
write-ahead log is off and the directory is removed on :meth:`close`. A directory left
behind by a killed process is removed by the next table made in the same parent
directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
from rocksdict import (
    BlockBasedIndexType,
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
    "DEFAULT_MAX_SCAN",
    "DEFAULT_RECENT_ENTRIES",
    "DEFAULT_WRITE_BUFFER_BYTES",
    "TABLE_DIR_PREFIX",
    "QueryPage",
    "StateCounts",
    "TaskQuery",
    "TaskStateTable",
]

DEFAULT_WRITE_BUFFER_BYTES: Final = 4 * 1024 * 1024
DEFAULT_BLOCK_CACHE_BYTES: Final = 8 * 1024 * 1024
DEFAULT_CACHE_ENTRIES: Final = 2_000
DEFAULT_RECENT_ENTRIES: Final = 4_096
TABLE_DIR_PREFIX: Final = "fxstream-task-state-"

_STATE: Final = b"s\x00"
_MEMBER: Final = b"m\x00"  # task id -> its group key
_GROUP: Final = b"g\x00"  # group \0 user \0 sequence -> task id
_ROUTED: Final = b"r\x00"  # endpoint \0 function -> b"" once a task of it was routed there
# Indexed tables only: each task's summary, and its entries in the query orders.
_SUMMARY: Final = b"i\x00"  # task id -> _Summary
_BY_USER: Final = b"u\x00"  # user \0 time (8) task id -> b""
_BY_TAG: Final = b"t\x00"  # user \0 tag key \0 tag value \0 time (8) task id -> b""
_BY_GROUP: Final = b"o\x00"  # user \0 task group \0 time (8) task id -> b""
_TIME_BYTES: Final = 8
_LAST_TIME: Final = (1 << 64) - 1
DEFAULT_MAX_SCAN: Final = 10_000
# Entries read per hold of the lock (a query lets the follower's writes in between).
_CHUNK: Final = 256
_SEP: Final = b"\x00"
_SEQUENCE_BYTES: Final = 8
_FIGURES: Final = (
    ("memtables", "rocksdb.cur-size-all-mem-tables"),
    ("table_readers", "rocksdb.estimate-table-readers-mem"),
    ("block_cache", "rocksdb.block-cache-usage"),
    ("block_cache_pinned", "rocksdb.block-cache-pinned-usage"),
    ("sst_bytes", "rocksdb.live-sst-files-size"),
)


class _Summary(msgspec.Struct, array_like=True, frozen=True):
    """What a query checks of a task without decoding its state."""

    user: str
    at: int  # microseconds since the epoch: its position in the query orders
    state: str
    function: str
    endpoint: str
    group: str | None
    tags: dict[str, str]


_summary_decoder = msgspec.msgpack.Decoder(_Summary)
_summary_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class TaskQuery:
    """A filter over one user's tasks: every field given must match (tags: each of them)."""

    user_id: str
    tags: Mapping[str, str] | None = None
    states: frozenset[str] | None = None
    function_id: str | None = None
    endpoint_id: str | None = None
    task_group_id: str | None = None
    since: float | None = None
    """Submitted at or after (seconds since the epoch)."""
    until: float | None = None
    """Submitted at or before."""
    descending: bool = False
    """Newest first (default: oldest first)."""

    def matches(self, summary: _Summary) -> bool:
        """Whether a task summarised as ``summary`` passes every filter."""
        return (
            summary.user == self.user_id
            and (self.states is None or summary.state in self.states)
            and (self.function_id is None or summary.function == self.function_id)
            and (self.endpoint_id is None or summary.endpoint == self.endpoint_id)
            and (self.task_group_id is None or summary.group == self.task_group_id)
            and all(summary.tags.get(k) == v for k, v in (self.tags or {}).items())
        )


@dataclass(frozen=True)
class QueryPage:
    """What one :meth:`TaskStateTable.query` found: ``matches`` as (task id, position),
    ``cursor`` the position to go on from (None: nothing further matches), and how many
    entries it read (``scanned``)."""

    matches: list[tuple[str, bytes]]
    cursor: bytes | None
    scanned: int


@dataclass(frozen=True)
class StateCounts:
    """What :meth:`TaskStateTable.count_states` found: tasks per state among the
    ``scanned`` newest; ``complete`` false when older tasks were left uncounted."""

    by_state: dict[str, int]
    scanned: int
    complete: bool


def _micros(at: float) -> int:
    return min(max(int(at * 1_000_000), 0), _LAST_TIME)


def _time_key(micros: int) -> bytes:
    return micros.to_bytes(_TIME_BYTES, "big")


def _summary_of(state: TaskState, at: int) -> _Summary:
    return _Summary(
        user=state.user_id,
        at=at,
        state=str(state.state),
        function=state.function_id,
        endpoint=state.endpoint_id,
        group=state.task_group_id,
        tags=dict(state.tags),
    )


def _order_prefix(user_id: str, tag: tuple[str, str] | None = None) -> bytes:
    if tag is None:
        return _BY_USER + user_id.encode() + _SEP
    key, value = tag
    return _BY_TAG + user_id.encode() + _SEP + key.encode() + _SEP + value.encode() + _SEP


def _group_prefix(user_id: str, task_group_id: str) -> bytes:
    return _BY_GROUP + user_id.encode() + _SEP + task_group_id.encode() + _SEP


def _index_keys(summary: _Summary, task_id: bytes) -> list[bytes]:
    position = _time_key(summary.at) + task_id
    keys = [_order_prefix(summary.user) + position]
    keys += [_order_prefix(summary.user, tag) + position for tag in summary.tags.items()]
    if summary.group is not None:
        keys.append(_group_prefix(summary.user, summary.group) + position)
    return keys


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
        indexed: bool = False,
        recent_entries: int = DEFAULT_RECENT_ENTRIES,
    ) -> None:
        """``indexed``: also keep what :meth:`query` needs (see the module);
        ``recent_entries``: tasks whose last write is remembered (see the module)."""
        if cache_entries < 0 or recent_entries < 0:
            raise ValueError("cache_entries and recent_entries must not be negative")
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
        # Most reads of a write are of keys that do not exist yet (a new task's group
        # entry and summary): without a Bloom filter each one searched every file. And
        # with one index block per file, the large file's (MBs) went through the 8 MiB
        # cache on every read: a partitioned index and filter, their small top level
        # pinned, keep a read to the partitions it needs (see the module notes).
        table.set_bloom_filter(10, False)
        table.set_index_type(BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_pin_top_level_index_and_filter(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        options.set_block_based_table_factory(table)
        self._db = Rdict(str(directory), options)
        unlogged = WriteOptions()
        # Rebuilt from the topic at every start: no write-ahead log. (A property at run
        # time, though rocksdict's stub declares a method.)
        setattr(unlogged, "disable_wal", True)  # noqa: B010
        self._db.set_write_options(unlogged)
        self._cache: OrderedDict[str, TaskState] = OrderedDict()
        self._cache_entries = cache_entries
        # What the writer last wrote for the most recently written tasks (group entry,
        # summary): a task's next state, seconds later, needs no read of the table.
        # Written and read by the writer thread only.
        self._recent: OrderedDict[bytes, tuple[bytes | None, _Summary | None]] = OrderedDict()
        self._recent_entries = recent_entries
        self._lock = threading.Lock()
        self._sequence = 0
        self._closed = False
        self.indexed = indexed

    # --- writing (the follower thread) ---------------------------------------------------

    def put(self, key: str, state: TaskState, encoded: bytes) -> None:
        """Store ``state`` (``encoded`` is its record) as the latest under ``key`` (the
        record's Kafka key, its task id), and index it in its group."""
        if self._closed:
            return
        task_id = key.encode()
        batch = WriteBatch(raw_mode=True)
        batch.put(_STATE + task_id, encoded)
        known = self._recent.pop(task_id, None)
        member = known[0] if known is not None else self._db.get(_MEMBER + task_id)
        new_group = None
        if state.task_group_id is not None:
            new_group = _GROUP + state.task_group_id.encode() + _SEP + state.user_id.encode()
        if member is not None and (new_group is None or not member.startswith(new_group + _SEP)):
            batch.delete(member)
            batch.delete(_MEMBER + task_id)
            member = None
        if new_group is not None and member is None:
            self._sequence += 1
            member = new_group + _SEP + self._sequence.to_bytes(_SEQUENCE_BYTES, "big")
            batch.put(member, task_id)
            batch.put(_MEMBER + task_id, member)
        if state.state == TaskStateName.ROUTED:
            # Only the router writes "routed", in the transaction of the dispatch itself; a
            # later state's function and endpoint come from the agent's result and are not
            # evidence of routing.
            batch.put(_routed_key(state.endpoint_id, state.function_id), b"")
        summary = None
        if self.indexed:
            old = known[1] if known is not None else self._summary(task_id)
            summary = self._index(batch, task_id, state, old)
        with self._lock:
            if not self._closed:
                self._db.write(batch)
            self._cache.pop(key, None)
        self._recent[task_id] = (member, summary)
        if len(self._recent) > self._recent_entries:
            self._recent.popitem(last=False)

    def put_state_only(self, key: str, encoded: bytes) -> None:
        """Store the encoded state ``encoded`` as the latest under ``key`` and nothing else:
        no group entry, no routing mark, no summary (:meth:`get` reads it back; group and
        query reads do not see it). For a table only ever looked up by task id, whose
        writer need not decode a state to store it. Not for an indexed table."""
        if self._closed:
            return
        if self.indexed:
            raise ValueError("an indexed table keeps a summary of every state: use put()")
        with self._lock:
            if not self._closed:
                self._db.put(_STATE + key.encode(), encoded)
            self._cache.pop(key, None)

    def delete(self, task_id: str, *, if_held: bool = False) -> None:
        """Forget a task (its tombstone). ``if_held``: write nothing unless the table holds
        a state of it (a filtered view's tombstones are mostly of tasks it never kept):
        a Bloom-filter probe, and a read only when the key may be there."""
        if self._closed:
            return
        key = task_id.encode()
        if if_held and key not in self._recent and not self._holds(key):
            return
        batch = WriteBatch(raw_mode=True)
        batch.delete(_STATE + key)
        known = self._recent.pop(key, None)
        group = known[0] if known is not None else self._db.get(_MEMBER + key)
        if group is not None:
            batch.delete(group)
            batch.delete(_MEMBER + key)
        summary = None
        if self.indexed:
            summary = known[1] if known is not None else self._summary(key)
        if summary is not None:
            for index_key in _index_keys(summary, key):
                batch.delete(index_key)
            batch.delete(_SUMMARY + key)
        with self._lock:
            if not self._closed:
                self._db.write(batch)
            self._cache.pop(task_id, None)

    def _holds(self, task_id: bytes) -> bool:
        """Whether a state of ``task_id`` is stored (its group entry and summary are
        written and deleted with it)."""
        state_key = _STATE + task_id
        with self._lock:
            if self._closed or not self._db.key_may_exist(state_key):
                return False
            return self._db.get(state_key) is not None

    def _summary(self, task_id: bytes) -> _Summary | None:
        raw = self._db.get(_SUMMARY + task_id)
        return None if raw is None else _summary_decoder.decode(raw)

    def _index(
        self, batch: WriteBatch, task_id: bytes, state: TaskState, old: _Summary | None
    ) -> _Summary:
        """Add to ``batch`` the task's new summary (``old``: its previous one), and its
        index entries if they move; return the new summary."""
        submitted = state.timings.submitted_at
        if submitted is not None:
            at = _micros(submitted)
        elif old is not None and old.user == state.user_id:
            at = old.at
        else:
            at = _micros(state.updated_at)
        summary = _summary_of(state, at)
        if old is not None and (old.user, old.at, old.tags, old.group) != (
            summary.user,
            summary.at,
            summary.tags,
            summary.group,
        ):
            for key in _index_keys(old, task_id):
                batch.delete(key)
            old = None
        if old is None:
            for key in _index_keys(summary, task_id):
                batch.put(key, b"")
        batch.put(_SUMMARY + task_id, _summary_encoder.encode(summary))
        return summary

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

    def query(
        self,
        query: TaskQuery,
        *,
        limit: int,
        after: bytes | None = None,
        max_scan: int = DEFAULT_MAX_SCAN,
    ) -> QueryPage:
        """The tasks of ``query.user_id`` that match ``query``, in submission-time order.

        Walks the order of the query's task group (else of its first tag, else the
        user's order) from ``after``
        (a cursor from an earlier page) between ``since`` and ``until``, and stops at
        ``limit`` matches or after ``max_scan`` entries: a page may then hold fewer than
        ``limit`` (even none) with a cursor to go on. Only an indexed table answers.
        """
        if not self.indexed:
            raise RuntimeError("this task-state table keeps no query index (indexed=False)")
        if query.task_group_id is not None:
            prefix = _group_prefix(query.user_id, query.task_group_id)
        else:
            tag = next(iter(query.tags.items())) if query.tags else None
            prefix = _order_prefix(query.user_id, tag)
        low = _time_key(_micros(query.since)) if query.since is not None else b""
        high = _time_key(_micros(query.until) if query.until is not None else _LAST_TIME)
        matches: list[tuple[str, bytes]] = []
        scanned = 0
        last: bytes | None = None
        for position, summary in self._walk(prefix, low, high, after, query.descending):
            scanned += 1
            last = position
            if summary is not None and query.matches(summary):
                matches.append((position[_TIME_BYTES:].decode(), position))
            if len(matches) >= limit or scanned >= max_scan:
                return QueryPage(matches, last, scanned)
        return QueryPage(matches, None, scanned)

    def count_states(self, user_id: str, *, max_scan: int = DEFAULT_MAX_SCAN) -> StateCounts:
        """How many of ``user_id``'s newest tasks (at most ``max_scan`` of them, newest
        first by submission time) are in each state, read from their summaries (no state
        is decoded). Only an indexed table answers."""
        if not self.indexed:
            raise RuntimeError("this task-state table keeps no query index (indexed=False)")
        counts: dict[str, int] = {}
        scanned = 0
        high = _time_key(_LAST_TIME)
        for _, summary in self._walk(_order_prefix(user_id), b"", high, None, True):
            if scanned >= max_scan:
                return StateCounts(counts, scanned, complete=False)
            scanned += 1
            if summary is not None and summary.user == user_id:
                counts[summary.state] = counts.get(summary.state, 0) + 1
        return StateCounts(counts, scanned, complete=True)

    def _walk(
        self, prefix: bytes, low: bytes, high: bytes, after: bytes | None, descending: bool
    ) -> Iterator[tuple[bytes, _Summary | None]]:
        """(position, summary) of the entries under ``prefix`` whose time is within
        ``low``..``high`` (inclusive), after ``after``, in order; the lock is held for
        one chunk of entries at a time."""
        if descending:
            start = prefix + high + b"\xff"
            if after is not None:
                start = min(start, prefix + after)
        else:
            start = prefix + low
            if after is not None:
                start = max(start, prefix + after + b"\x00")
        skip = prefix + after if after is not None else None
        while True:
            chunk: list[tuple[bytes, _Summary | None]] = []
            with self._lock:
                if self._closed:
                    return
                for key, _ in self._db.items(from_key=start, backwards=descending):
                    if not isinstance(key, bytes) or not key.startswith(prefix):
                        break
                    if key == skip:
                        continue
                    position = key[len(prefix) :]
                    moment = position[:_TIME_BYTES]
                    if (moment < low) if descending else (moment > high):
                        break
                    summary = self._summary(position[_TIME_BYTES:])
                    chunk.append((position, summary))
                    if len(chunk) >= _CHUNK:
                        break
            yield from chunk
            if len(chunk) < _CHUNK:
                return
            last = prefix + chunk[-1][0]
            start, skip = (last, last) if descending else (last + b"\x00", None)

    def count_tasks(self) -> int:
        """How many tasks the table holds a state of, exactly (a scan of every state key:
        for tests and diagnostics, not a hot path)."""
        count = 0
        with self._lock:
            if self._closed:
                return 0
            for key in self._db.keys(from_key=_STATE):
                if not isinstance(key, bytes) or not key.startswith(_STATE):
                    break
                count += 1
        return count

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
