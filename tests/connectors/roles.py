"""The other process in the connector tests: a stream writer or reader, a connector client.

Run as a script (``python roles.py <role> ...``) by the tests, which start it with
:func:`start_role`, read its JSON-lines reports from stdout, and stop it by PID. Each
role reports what it did as one JSON object per line, so the test can assert on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fxstream.connectors.adios import Adios2Connector, Adios2Key
from fxstream.connectors.adios_stream import Adios2Stream
from fxstream.connectors.file_stream import FileStreamReader, FileStreamWriter
from fxstream.connectors.liveness import StreamAborted

ROLES = Path(__file__).resolve()


def report(**fields: Any) -> None:
    """One JSON line on stdout, flushed at once (the test waits for it)."""
    print(json.dumps(fields), flush=True)


def chunk_bytes(index: int, size: int) -> bytes:
    """The deterministic content of chunk ``index``: the reader can check every byte."""
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def stream_array(index: int, elements: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The deterministic array of step ``index``."""
    return np.arange(elements, dtype=np.float64) + index


def _wait_for(gate: str | None) -> None:
    if gate is None:
        return
    deadline = time.monotonic() + 30
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.01)


def _then(then: str) -> None:
    """What a writer does after its items: hang (to be killed) or raise (to abort)."""
    if then == "hang":
        report(hanging=True)
        while True:
            time.sleep(3600)
    if then == "raise":
        raise RuntimeError("the producer failed on purpose")


def adios_write(args: argparse.Namespace) -> None:
    stream: Adios2Stream = pickle.loads(Path(args.stream).read_bytes())
    with stream.writer() as writer:
        report(opened=True)
        for index in range(args.items):
            writer.send(stream_array(index, args.elements), index=index, label=f"step-{index}")
            report(sent=index)
            if index == 0:
                _wait_for(args.gate)
        _then(args.then)
    report(closed=True, described=list(writer.describe()))


def adios_read(args: argparse.Namespace) -> None:
    stream: Adios2Stream = pickle.loads(Path(args.stream).read_bytes())
    try:
        with stream.reader() as reader:
            for step in reader:
                expected = stream_array(step.seq, step.array.size)
                report(
                    seq=step.seq,
                    intact=bool(np.array_equal(step.array, expected)),
                    attributes=step.attributes,
                )
    except StreamAborted as aborted:
        report(aborted=aborted.reason)
        return
    report(end=True)


def file_write(args: argparse.Namespace) -> None:
    with FileStreamWriter(args.path, tier=args.tier) as writer:
        for index in range(args.chunks):
            writer.write(chunk_bytes(index, args.size))
            report(sent=index)
            if index == 0:
                _wait_for(args.gate)
        if args.then == "partial":
            # A frame header promising 1000 bytes and only 10 of them (see file_stream's
            # layout), then hang: the writer dies in the middle of a chunk.
            with open(args.path, "ab", buffering=0) as raw:
                raw.write((1).to_bytes(1, "little") + (1000).to_bytes(8, "little") + b"x" * 10)
            args.then = "hang"
        _then(args.then)
    report(closed=True)


def file_read(args: argparse.Namespace) -> None:
    try:
        with FileStreamReader(args.path) as reader:
            for chunk in reader:
                index = int.from_bytes(chunk[:4], "little")
                report(index=index, intact=bytes(chunk) == chunk_bytes(index, len(chunk)))
    except StreamAborted as aborted:
        report(aborted=aborted.reason)
        return
    report(end=True)


def connector_get(args: argparse.Namespace) -> None:
    connector = Adios2Connector.from_config(json.loads(args.config))
    for key in json.loads(args.keys):
        data = connector.get(Adios2Key(*key))
        if data is None:
            report(key=key, missing=True)
        else:
            report(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def connector_put(args: argparse.Namespace) -> None:
    connector = Adios2Connector.from_config(json.loads(args.config))
    for index in range(args.count):
        data = chunk_bytes(index + args.offset, args.size)
        key = connector.put(data)
        report(key=list(key), sha256=hashlib.sha256(data).hexdigest())


def proxy_resolve(args: argparse.Namespace) -> None:
    proxy = pickle.loads(Path(args.proxy).read_bytes())
    array = np.asarray(proxy)
    report(shape=list(array.shape), sha256=hashlib.sha256(array.tobytes()).hexdigest())


def main() -> None:
    parser = argparse.ArgumentParser()
    roles = parser.add_subparsers(dest="role", required=True)
    role = roles.add_parser("adios-write")
    role.add_argument("--stream", required=True)
    role.add_argument("--items", type=int, required=True)
    role.add_argument("--elements", type=int, default=1000)
    role.add_argument("--gate")
    role.add_argument("--then", choices=["close", "hang", "raise"], default="close")
    role.set_defaults(run=adios_write)
    role = roles.add_parser("adios-read")
    role.add_argument("--stream", required=True)
    role.set_defaults(run=adios_read)
    role = roles.add_parser("file-write")
    role.add_argument("--path", required=True)
    role.add_argument("--chunks", type=int, required=True)
    role.add_argument("--size", type=int, default=4096)
    role.add_argument("--tier", default="durable")
    role.add_argument("--gate")
    role.add_argument("--then", choices=["close", "hang", "raise", "partial"], default="close")
    role.set_defaults(run=file_write)
    role = roles.add_parser("file-read")
    role.add_argument("--path", required=True)
    role.set_defaults(run=file_read)
    role = roles.add_parser("connector-get")
    role.add_argument("--config", required=True)
    role.add_argument("--keys", required=True)
    role.set_defaults(run=connector_get)
    role = roles.add_parser("connector-put")
    role.add_argument("--config", required=True)
    role.add_argument("--count", type=int, required=True)
    role.add_argument("--size", type=int, required=True)
    role.add_argument("--offset", type=int, default=0)
    role.set_defaults(run=connector_put)
    role = roles.add_parser("proxy-resolve")
    role.add_argument("--proxy", required=True)
    role.set_defaults(run=proxy_resolve)
    args = parser.parse_args()
    args.run(args)


class Role:
    """A running role process: its reports (read by a thread), and a stop by PID."""

    def __init__(self, process: subprocess.Popen[str], log: Path) -> None:
        self.process = process
        self.log = log
        self._lines: queue.Queue[str] = queue.Queue()
        # A thread, not select(): a buffered text pipe may hold several lines at once.
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

    def next_report(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next JSON line the role printed (fails with its log if none comes in time)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"role {self.process.args} reported nothing within {timeout:.1f} s "
                f"(exit {self.process.poll()}); its stderr:\n{self.log.read_text()[-4000:]}"
            ) from None
        report: dict[str, Any] = json.loads(line)
        return report

    def reports_until(self, *keys: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Every report up to and including the first one that has one of ``keys``."""
        seen = []
        deadline = time.monotonic() + timeout
        while True:
            seen.append(self.next_report(max(0.1, deadline - time.monotonic())))
            if any(key in seen[-1] for key in keys):
                return seen

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for a normal exit; the exit code."""
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the role by PID and reap it (idempotent)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """Kill if still running, reap, close pipes."""
        if self.process.poll() is None:
            self.kill()
        self.process.wait(timeout=30)
        self._pump.join(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextmanager
def start_role(log_dir: Path, *args: str) -> Iterator[Role]:
    """Run ``roles.py <args>``; always stopped by PID on exit."""
    log = log_dir / f"{args[0]}-{time.monotonic_ns()}.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(ROLES), *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    role = Role(process, log)
    try:
        yield role
    finally:
        role.stop()


if __name__ == "__main__":
    main()
