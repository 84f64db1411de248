"""What the trigger tests share: the ``fxstream-source`` command as a real process, and a
``read_committed`` reader of an events topic."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from confluent_kafka import Consumer, KafkaError, TopicPartition

from fxstream.connectors.source_cli import READY_LINE
from fxstream.topics import Event, KafkaConnection, decode

__all__ = [
    "Runnable",
    "SourceProcess",
    "read_events",
    "running",
    "start_source",
    "wait_for_events",
]


class SourceProcess:
    """A running ``fxstream-source`` process: its stdout lines (read by a thread), and
    stops by PID."""

    def __init__(self, process: subprocess.Popen[str], log: Path) -> None:
        self.process = process
        self.log = log
        self._lines: queue.Queue[str] = queue.Queue()
        self._pump = threading.Thread(target=self._read_lines, daemon=True)
        self._pump.start()

    def _read_lines(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def wait_ready(self, timeout: float = 30.0) -> str:
        """The ready line (fails with the process's stderr if it does not come in time)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.process.args} was not ready within {timeout:.1f} s (exit "
                    f"{self.process.poll()}); its stderr:\n{self.log.read_text()[-4000:]}"
                ) from None
            if line.startswith(READY_LINE):
                return line

    def output(self) -> str:
        """Every stdout line read so far (after the process ended: all of them)."""
        self._pump.join(timeout=10)
        lines = []
        while not self._lines.empty():
            lines.append(self._lines.get())
        return "".join(lines)

    def kill(self) -> None:
        """SIGKILL by PID and reap (idempotent)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM by PID; the exit code of the clean stop."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """Kill if still running, reap, close the pipe."""
        self.kill()
        self._pump.join(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextmanager
def start_source(
    log_dir: Path, credentials: Path, prefix: str, *args: str
) -> Iterator[SourceProcess]:
    """Run ``fxstream-source <args>`` with the Kafka credentials file and topic prefix in its
    environment (never a secret on its command line); always stopped by PID on exit."""
    log = log_dir / f"source-{args[0]}-{time.monotonic_ns()}.log"
    env = {
        **os.environ,
        "FXSTREAM_KAFKA_CREDENTIALS": str(credentials),
        "FXSTREAM_TOPIC_PREFIX": prefix,
    }
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "fxstream.connectors.source_cli", *args, "--verbose"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    running = SourceProcess(process, log)
    try:
        yield running
    finally:
        running.stop()


def read_events(kafka: KafkaConnection, topic: str, *, timeout: float = 20.0) -> list[Event]:
    """Every committed event on ``topic`` now (``read_committed``), in partition order."""
    consumer = Consumer(
        {
            **kafka.confluent(),
            "group.id": "unused-test-reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "log_level": 2,
        }
    )
    events: list[Event] = []
    try:
        partitions = consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        open_partitions = set(partitions)
        deadline = time.monotonic() + timeout
        while open_partitions:
            assert time.monotonic() < deadline, f"reading {topic} took over {timeout} s"
            for message in consumer.consume(500, timeout=0.5):
                error = message.error()
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    open_partitions.discard(message.partition())
                    continue
                event = decode(message.value(), Event)
                assert message.key() == event.event_key.encode()
                events.append(event)
    finally:
        consumer.close()
    return events


def wait_for_events(
    kafka: KafkaConnection,
    topic: str,
    done: Callable[[list[Event]], bool],
    *,
    timeout: float = 20.0,
) -> list[Event]:
    """The topic's events once ``done(events)`` holds (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(kafka, topic)
        if done(events):
            return events
        assert time.monotonic() < deadline, (
            f"{topic} did not get the expected events within {timeout} s; it has "
            f"{[e.event_key for e in events]}"
        )
        time.sleep(0.2)


class Runnable(Protocol):
    """A source or sink: ``run(stop)`` until the event is set."""

    def run(self, stop: threading.Event) -> None: ...


@contextmanager
def running(component: Runnable) -> Iterator[threading.Event]:
    """Run ``component`` in a thread; on exit set its stop event and join it (re-raising
    what it raised)."""
    stop = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            component.run(stop)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="trigger-test-component", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the component did not stop within 30 s"
    if failure:
        raise failure[0]
