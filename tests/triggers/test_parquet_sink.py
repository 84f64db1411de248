"""The Parquet sink on the session broker and real files: every record of results, events and
task-state is one row, once, after the sink is SIGKILLed mid-run (twice) and restarted;
the files have the explicit schema, day/hour directories, and read with pandas and DuckDB;
a file closed but never committed is deleted and its rows written again."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from fxstream.connectors.parquet_sink import SCHEMAS, ParquetSink, SinkDirectoryInUse
from fxstream.service.accounts import AccountManager
from fxstream.topics import (
    Catalogue,
    Event,
    KafkaConnection,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
    encode,
    ensure_topics,
)
from fxstream.topics.acls import SERVICE_GROUP_PREFIX
from tests.conftest import write_kafka_credentials
from tests.triggers.support import running, start_source

HOUR_MS = 3_600_000


@dataclass
class Deployment:
    """One test's topics, what was produced to them, and the sink's principal."""

    catalogue: Catalogue
    user: str
    source: str
    service: KafkaConnection
    group: str
    produced: dict[str, set[tuple[str, int, int]]]


@pytest.fixture
def deployment(
    kafka: KafkaConnection, catalogue: Catalogue, topic_cleanup: list[str]
) -> Iterator[Deployment]:
    """results.<U>, events.<S> and task-state under a fresh prefix, and a service principal
    of the test's own (the sink's role) with the ACL table's rights."""
    tag = uuid.uuid4().hex[:8]
    user, source = f"u{tag}", f"s{tag}"
    topics = {
        catalogue.results(user): catalogue.spec("results.{user_id}"),
        catalogue.events(source): catalogue.spec("events.{source}"),
        catalogue.task_state: catalogue.spec("task-state"),
    }
    ensure_topics(AdminClient({**kafka.confluent(), "log_level": 2}), catalogue, topics)
    topic_cleanup.extend(topics)
    manager = AccountManager.connect(kafka, catalogue)
    username = f"fxstream-service-{tag}"
    service = manager.ensure_service_principal(username).connection(kafka)
    try:
        yield Deployment(
            catalogue,
            user,
            source,
            service,
            f"{SERVICE_GROUP_PREFIX}-sink-{tag}",
            {"results": set(), "events": set(), "task_state": set()},
        )
    finally:
        manager.delete_service_principal(username)


def _produce(kafka: KafkaConnection, d: Deployment, start: int, count: int) -> None:
    """``count`` records of each kind; every tenth is stamped two hours ago."""
    producer = Producer({**kafka.confluent(), "enable.idempotence": True, "log_level": 2})
    now = time.time()

    def delivered(kind: str) -> Callable[[KafkaError | None, Message], None]:
        def record(error: KafkaError | None, message: Message) -> None:
            assert error is None, error
            d.produced[kind].add((message.topic(), message.partition(), message.offset()))  # type: ignore[arg-type]

        return record

    for i in range(start, start + count):
        task = f"task-{i}"
        stamp = int((now - 2 * 3600) * 1000) if i % 10 == 0 else int(now * 1000)
        timings = TaskTimings(submitted_at=now - 1, finished_at=now)
        failed = i % 7 == 0
        result = TaskResult(
            task_id=task,
            user_id=d.user,
            function_id="fn-1",
            endpoint_id="ep-1",
            outcome="error" if failed else "success",
            value=None if failed else b"r" * (10 + i),
            error=TaskError(type="ValueError", message=f"bad {i}") if failed else None,
            timings=timings,
        )
        state = TaskState(
            task_id=task,
            user_id=d.user,
            function_id="fn-1",
            endpoint_id="ep-1",
            state=TaskStateName.FAILED if failed else TaskStateName.SUCCEEDED,
            updated_at=now,
            timings=timings,
            value=None if failed else b"r" * (10 + i),
        )
        event = Event(
            source=d.source,
            event_key=f"file-{i}",
            event_type="file-complete",
            occurred_at=now,
            attributes={"path": f"/data/file-{i}.h5", "size": i},
            data=b"tiny",
        )
        for kind, topic, record in (
            ("results", d.catalogue.results(d.user), result),
            ("task_state", d.catalogue.task_state, state),
            ("events", d.catalogue.events(d.source), event),
        ):
            producer.produce(
                topic,
                key=task.encode(),
                value=encode(record),
                timestamp=stamp,
                on_delivery=delivered(kind),
            )
    assert producer.flush(30) == 0


def _rows(root: Path, kind: str) -> int:
    """Rows in the kind's files now (0 while a restarting sink deletes a file under us)."""
    if not (root / kind).is_dir():
        return 0
    try:
        return int(ds.dataset(root / kind, format="parquet", partitioning="hive").count_rows())
    except OSError:
        return 0


def _wait_some_rows(root: Path, kind: str, rows: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _rows(root, kind) < rows:
        assert time.monotonic() < deadline, f"fewer than {rows} {kind} rows in {timeout} s"
        time.sleep(0.1)


def _wait_rows(root: Path, expected: dict[str, set[tuple[str, int, int]]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_rows(root, kind) < len(rows) for kind, rows in expected.items()):
        assert time.monotonic() < deadline, {k: _rows(root, k) for k in expected}
        time.sleep(0.2)


def _check_archive(root: Path, d: Deployment) -> None:
    for kind, produced in d.produced.items():
        frame = pd.read_parquet(root / kind)
        coordinates = list(zip(frame["topic"], frame["partition"], frame["offset"], strict=True))
        assert len(coordinates) == len(set(coordinates)), f"{kind}: a row twice"
        assert {(str(t), int(p), int(o)) for t, p, o in coordinates} == produced, (
            f"{kind}: rows lost or unexpected"
        )
        assert not {"value", "data"} & set(frame.columns), "bulk bytes in the archive"
        # Each row is in the day and hour (UTC) of its Kafka timestamp; some are 2 h old.
        stamped = pd.to_datetime(frame["kafka_time"], utc=True)
        assert list(frame["day"].astype(str)) == list(stamped.dt.strftime("%Y-%m-%d"))
        assert [int(h) for h in frame["hour"]] == list(stamped.dt.hour)
        assert len(set(frame["hour"])) >= 2
        # DuckDB reads the same files with the hive columns.
        (row,) = duckdb.sql(
            "select count(*), count(distinct topic || ':' || partition || ':' || \"offset\"), "
            f"count(distinct hour) from read_parquet('{root / kind}/**/*.parquet', "
            "hive_partitioning = true)"
        ).fetchall()
        assert row[0] == row[1] == len(produced) and row[2] >= 2
        for file in (root / kind).rglob("*.parquet"):
            assert pq.read_schema(file).equals(SCHEMAS[kind]), file
    results = pd.read_parquet(root / "results")
    failed = results[results["outcome"] == "error"]
    assert set(failed["error_type"]) == {"ValueError"} and failed["value_bytes"].isna().all()
    succeeded = results[results["outcome"] == "success"]
    assert (succeeded["value_bytes"] >= 10).all()
    events = pd.read_parquet(root / "events")
    assert set(events["data_bytes"]) == {4}
    first = events.loc[events["event_key"] == "file-1", "attributes"].iloc[0]
    assert json.loads(first) == {"path": "/data/file-1.h5", "size": 1}


def test_every_row_is_archived_once_after_the_sink_is_killed_mid_run(
    kafka: KafkaConnection, deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    root = tmp_path / "archive"
    credentials = write_kafka_credentials(d.service, tmp_path / "service.json")
    command = (
        "sink",
        str(root),
        "--group",
        d.group,
        "--max-rows",
        "25",
        "--max-age-s",
        "0.2",
    )
    prefix = d.catalogue.prefix
    _produce(kafka, d, 0, 60)
    with start_source(tmp_path, credentials, prefix, *command) as first:
        first.wait_ready()
        _wait_some_rows(root, "results", 10, timeout=20)
        _produce(kafka, d, 60, 60)
        time.sleep(0.3)
        first.kill()
    with start_source(tmp_path, credentials, prefix, *command) as second:
        second.wait_ready()
        _produce(kafka, d, 120, 60)
        time.sleep(0.4)
        second.kill()
    with start_source(tmp_path, credentials, prefix, *command) as third:
        third.wait_ready()
        _wait_rows(root, d.produced, timeout=20)
        assert third.terminate() == 0, third.log.read_text()[-2000:]
    assert not list(root.rglob(".*.tmp")), "a temporary file left in the archive"
    _check_archive(root, d)


def test_a_file_closed_but_never_committed_is_replaced_not_repeated(
    kafka: KafkaConnection, deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    root = tmp_path / "archive"

    def sink() -> ParquetSink:
        return ParquetSink(
            d.service, root, catalogue=d.catalogue, group=d.group, max_rows=20, max_age_s=0.2
        )

    _produce(kafka, d, 0, 30)
    first = sink()
    with running(first):
        assert first.ready.wait(30)
        _wait_rows(root, d.produced, timeout=20)
    # What a crash between a file's rename and its offset commit leaves: a file whose first
    # offset is the group's committed offset (here holding rows of committed offsets, so a
    # sink that kept it would archive them twice).
    last = max(
        (f for f in (root / "results").rglob("*.parquet")), key=lambda f: f.name.split("+")[-1]
    )
    topic, partition, offsets = last.name.removesuffix(".parquet").split("+")
    after = int(offsets.split("-")[1]) + 1
    uncommitted = last.with_name(f"{topic}+{partition}+{after:020d}-{after + 4:020d}.parquet")
    shutil.copyfile(last, uncommitted)
    assert _rows(root, "results") > len(d.produced["results"])

    # One sink per directory, and only under the group its files match.
    second = sink()
    stop = threading.Event()
    with running(second):
        assert second.ready.wait(30)
        with pytest.raises(SinkDirectoryInUse, match="another Parquet sink"):
            sink().run(stop)
        _produce(kafka, d, 30, 10)
        _wait_rows(root, d.produced, timeout=20)
    assert second.deleted_uncommitted == 1 and not uncommitted.exists()
    other_group = ParquetSink(d.service, root, catalogue=d.catalogue, group=d.group + "-x")
    with pytest.raises(SinkDirectoryInUse, match="archived by the consumer group"):
        other_group.run(stop)
    _check_archive(root, d)
