"""The file watcher on real files and the session broker: one event per complete file, never
for a half-written one; include/exclude; a watcher SIGKILLed and restarted neither loses nor
repeats an event; an event source's own principal writes only its own events topic."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from fxstream.connectors import event_writer as event_writer_module
from fxstream.connectors.event_writer import EventTopicMissing, EventWriter
from fxstream.connectors.file_watcher import FILE_EVENT_TYPE, FileWatcher, file_event_key
from fxstream.service.accounts import AccountManager
from fxstream.topics import CallHung, Catalogue, Event, KafkaConnection
from tests.hung_calls import hang_first_call
from tests.triggers.support import read_events, running, start_source, wait_for_events

CHUNK = b"x" * 4096


def _paths(events: list[Event]) -> Counter[str]:
    return Counter(str(event.attributes["path"]) for event in events)


def _write_slowly(path: Path, chunks: int, pause_s: float, check: Callable[[], None]) -> None:
    """Write ``chunks`` chunks through one open, pausing between them and calling ``check``
    while the file is still open (half written)."""
    with path.open("wb") as out:
        for _ in range(chunks):
            out.write(CHUNK)
            out.flush()
            os.fsync(out.fileno())
            time.sleep(pause_s)
            check()


def _watcher(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    source_name: str,
    directory: Path,
    **options: Any,
) -> FileWatcher:
    """A watcher of ``directory`` writing ``source_name``'s events as the watcher role."""
    writer = EventWriter(kafka, source_name, role="watcher", catalogue=catalogue)
    return FileWatcher(writer, directory, **options)


def test_a_file_written_slowly_in_chunks_fires_one_event_after_it_is_closed(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    watched = tmp_path / "watched"
    watched.mkdir()
    watcher = _watcher(kafka, catalogue, source_name, watched, mode="close")
    frame = watched / "frame-0001.h5"

    def nothing_yet() -> None:
        assert read_events(kafka, topic) == [], "an event for a half-written file"

    with running(watcher):
        assert watcher.ready.wait(30)
        _write_slowly(frame, chunks=5, pause_s=0.3, check=nothing_yet)
        closed_at = time.time()
        events = wait_for_events(kafka, topic, lambda found: len(found) >= 1)
        time.sleep(1.0)  # a second event, if any, would be written by now
        events = read_events(kafka, topic)
    assert len(events) == 1
    (event,) = events
    stat = frame.stat()
    assert event.source == source_name and event.event_type == FILE_EVENT_TYPE
    assert event.event_key == file_event_key(str(frame.resolve()), stat.st_size, stat.st_mtime_ns)
    assert event.attributes["size"] == 5 * len(CHUNK) == stat.st_size
    assert event.attributes["detected_by"] == "close-write"
    assert event.attributes["relative_path"] == "frame-0001.h5"
    assert event.occurred_at >= closed_at - 0.05
    assert event.data is None, "a file event names the file; its bytes never go to Kafka"


def test_stable_mode_fires_once_for_a_writer_that_reopens_the_file_per_chunk(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    watcher = _watcher(kafka, catalogue, source_name, tmp_path, mode="stable", stable_s=2.0)
    frame = tmp_path / "frame.bin"
    with running(watcher):
        assert watcher.ready.wait(30)
        for _ in range(4):  # one open and close per chunk: IN_CLOSE_WRITE would fire 4 times
            with frame.open("ab") as out:
                out.write(CHUNK)
            last_write = time.time()
            time.sleep(0.3)
        assert read_events(kafka, topic) == [], "an event before the size was stable"
        events = wait_for_events(kafka, topic, lambda found: len(found) >= 1, timeout=10)
        time.sleep(1.5)
        events = read_events(kafka, topic)
    assert len(events) == 1
    assert events[0].attributes["size"] == 4 * len(CHUNK)
    assert events[0].attributes["detected_by"] == "stable"
    assert events[0].occurred_at >= last_write + 2.0 - 0.05, "announced before stable_s"


def test_include_and_exclude_patterns_choose_the_files(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    watched, staging = tmp_path / "watched", tmp_path / "staging"
    watched.mkdir()
    staging.mkdir()
    watcher = _watcher(
        kafka, catalogue, source_name, watched, mode="close", include=["*.h5"], exclude=["skip-*"]
    )
    with running(watcher):
        assert watcher.ready.wait(30)
        (watched / "a.h5").write_bytes(CHUNK)
        (watched / "b.txt").write_bytes(CHUNK)
        (watched / "skip-c.h5").write_bytes(CHUNK)
        # The write-then-rename idiom: the temporary name is not watched, the final one is.
        (watched / ".d.h5.partial").write_bytes(CHUNK * 2)
        os.rename(watched / ".d.h5.partial", watched / "d.h5")
        # Moved in from outside the directory: no close comes, and it is complete.
        (staging / "f.h5").write_bytes(CHUNK * 3)
        os.rename(staging / "f.h5", watched / "f.h5")
        (watched / "sub").mkdir()
        (watched / "sub" / "e.h5").write_bytes(CHUNK)  # not recursive: not watched
        wait_for_events(kafka, topic, lambda found: len(found) >= 3)
        time.sleep(1.0)
        events = read_events(kafka, topic)
    by_name = {str(e.attributes["relative_path"]): e for e in events}
    assert sorted(by_name) == ["a.h5", "d.h5", "f.h5"]
    assert len(events) == 3
    assert by_name["d.h5"].attributes["detected_by"] == "moved"
    assert by_name["d.h5"].attributes["size"] == 2 * len(CHUNK)
    assert by_name["f.h5"].attributes["detected_by"] == "created"
    assert by_name["f.h5"].attributes["size"] == 3 * len(CHUNK)


def test_a_watcher_killed_and_restarted_neither_loses_nor_repeats_an_event(
    kafka: KafkaConnection,
    credentials: Path,
    unique_prefix: str,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    topic = event_topic(source_name)
    watched = tmp_path / "watched"
    watched.mkdir()
    command = ("watch", str(watched), "--source", source_name, "--mode", "close")
    expected: dict[str, int] = {}

    def complete(name: str, size: int) -> None:
        (watched / name).write_bytes(b"d" * size)
        expected[str((watched / name).resolve())] = size

    with start_source(tmp_path, credentials, unique_prefix, *command) as first:
        first.wait_ready()
        for i in range(5):
            complete(f"before-{i}.dat", 100 + i)
        wait_for_events(kafka, topic, lambda found: len(found) >= 5)
        # Files completed just before the kill: their transactions may or may not commit.
        for i in range(5):
            complete(f"at-kill-{i}.dat", 200 + i)
        # A file half written when the watcher dies, finished after it restarts.
        slow = (watched / "slow.dat").open("wb")
        slow.write(b"s" * 1000)
        slow.flush()
        first.kill()
    for i in range(3):  # completed while no watcher runs
        complete(f"while-down-{i}.dat", 300 + i)
    with start_source(tmp_path, credentials, unique_prefix, *command) as second:
        second.wait_ready()
        slow.write(b"s" * 1000)
        slow.close()
        expected[str((watched / "slow.dat").resolve())] = 2000
        for i in range(2):
            complete(f"after-{i}.dat", 400 + i)
        wait_for_events(kafka, topic, lambda found: set(_paths(found)) >= set(expected))
        time.sleep(1.5)  # a repeat, if any, would be written by now
        assert second.terminate() == 0, second.log.read_text()[-2000:]
    events = read_events(kafka, topic)
    counts = _paths(events)
    assert {path: n for path, n in counts.items() if n != 1} == {}, "repeated events"
    assert set(counts) == set(expected), "lost or unexpected events"
    sizes = {str(e.attributes["path"]): e.attributes["size"] for e in events}
    assert sizes == expected, "an event for a half-written file"


def test_a_source_principal_writes_its_own_events_topic_only(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    topic_cleanup: list[str],
) -> None:
    assert kafka.secure, "the session broker is the secure platform: ACLs are enforced"
    manager = AccountManager.connect(kafka, catalogue)
    other = event_topic(f"other-{uuid.uuid4().hex[:6]}")
    principal = manager.create_source_principal(source_name)
    topic_cleanup.append(catalogue.events(source_name))
    try:
        as_source = principal.connection(kafka)
        assert as_source.username == f"src.{source_name}"
        own = EventWriter(as_source, source_name, role="watcher", catalogue=catalogue)
        assert own.start() == set()
        event = Event(
            source=source_name, event_key="k-1", event_type="test", occurred_at=time.time()
        )
        own.write([event])
        own.close()
        assert [e.event_key for e in read_events(kafka, catalogue.events(source_name))] == ["k-1"]
        other_source = other.removeprefix(catalogue.prefix + "events.")
        foreign = EventWriter(as_source, other_source, role="watcher", catalogue=catalogue)
        with pytest.raises(EventTopicMissing, match="may not see it"):
            foreign.start(timeout_s=10)
        # Nor can it write there past the writer's check, nor use another source's ids.
        refused: list[KafkaError] = []
        producer = Producer({**as_source.confluent(), "log_level": 2})
        producer.produce(other, b"v", on_delivery=lambda err, _msg: refused.append(err))
        producer.flush(15)
        assert [e.code() for e in refused] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
        transactional = Producer(
            {
                **as_source.confluent(),
                "transactional.id": f"fxstream-source.{other_source}.watcher",
                "log_level": 2,
            }
        )
        with pytest.raises(KafkaException, match=r"(?i)authoriz"):
            transactional.init_transactions(15)
        assert read_events(kafka, other) == []
    finally:
        manager.delete_source_principal(source_name)


def test_an_event_writer_whose_producer_hangs_refuses_to_write_on_and_a_restart_recovers(
    kafka: KafkaConnection,
    event_topic: Callable[[str], str],
    source_name: str,
    catalogue: Catalogue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transactional call that never returns (librdkafka's, stood in for: see
    tests/hung_calls.py) is given up at its deadline: the write raises CallHung, later
    writes are refused saying to restart the source, and the restarted writer fences the
    hung producer, so nothing of the hung transaction is ever committed."""
    topic = event_topic(source_name)
    monkeypatch.setattr(event_writer_module, "HUNG_GRACE_S", 1.0)
    release = hang_first_call(monkeypatch, event_writer_module, "commit_transaction")

    def event(key: str) -> Event:
        return Event(
            source=source_name, event_key=key, event_type="created", occurred_at=time.time()
        )

    hung = EventWriter(kafka, source_name, role="watcher", catalogue=catalogue)
    hung.start(scan=False)
    try:
        began = time.monotonic()
        with pytest.raises(CallHung, match="commit_transaction did not return"):
            hung.write([event("first")], timeout_s=2.0)
        assert time.monotonic() - began < 15
        with pytest.raises(RuntimeError, match="restart the source"):
            hung.write([event("second")])
        hung.close()
        monkeypatch.setattr(event_writer_module, "Producer", Producer)
        restarted = EventWriter(kafka, source_name, role="watcher", catalogue=catalogue)
        assert "first" not in restarted.start()  # its transaction was never committed
        restarted.write([event("second")])
        restarted.close()
    finally:
        release.set()
    assert [e.event_key for e in read_events(kafka, topic)] == ["second"]


def test_files_created_and_closed_at_once_are_announced_by_their_close_without_a_proc_scan(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    event_topic: Callable[[str], str],
    source_name: str,
    tmp_path: Path,
) -> None:
    """A file written and closed at once (a detector's frame) has its creation and its
    close read together: its close announces it, and no scan of every process's open
    files (``/proc``, 1-2 ms with a few dozen processes) is made for it: a file that
    appeared waits 20 ms for its close first. A scan is made only for a file whose close
    had not come 20 ms after its creation (this writer would have to stall between open
    and close for that), so the scans stay a small fraction of the files; before this
    there was at least one per batch, made as soon as its first file's creation was read
    (and that file was announced as ``created``)."""
    topic = event_topic(source_name)
    watched = tmp_path / "watched"
    watched.mkdir()
    watcher = _watcher(kafka, catalogue, source_name, watched, mode="close")
    files = 60
    with running(watcher):
        assert watcher.ready.wait(30)
        scans_at_start = watcher.writer_scans
        for i in range(files):
            (watched / f"frame-{i:04d}.dat").write_bytes(CHUNK)
            if i % 10 == 9:
                time.sleep(0.3)  # several batches, each read after its files closed
        events = wait_for_events(kafka, topic, lambda found: len(found) >= files)
        time.sleep(1.0)
        events = read_events(kafka, topic)
        scans = watcher.writer_scans - scans_at_start
    assert len(events) == files and len(_paths(events)) == files
    assert all(e.attributes["detected_by"] == "close-write" for e in events)
    assert scans < files // 20, f"{scans} /proc scans for {files} files closed at once"
