"""Where the broker's CPU goes: a Java Flight Recorder recording of the broker's JVM over a
bench's measured window, summarised (``./fx bench profile --broker-jfr``).

JFR is part of the JDK that runs the broker: ``jcmd <pid> JFR.start`` starts a recording
(the ``profile`` settings: each running Java thread's stack sampled every 10 ms),
``JFR.stop`` writes it, and ``jfr print`` reads it back. ``jcmd`` reaches the JVM through
the attach API, which only the OS user running the broker may use. The summary counts
samples: by thread group (network processors, request handlers, ...), by the Kafka API
whose handler is on the stack (``KafkaApis.handleFetchRequest``, ...), by area of the code
anywhere on the stack (TLS, the log, authorisation, ...), and the methods on top of the
stack (self time). Only threads running Java code are sampled; time in system calls (a
socket's write, ``epoll``) is not in these counts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["BrokerRecording", "summarise_jfr_text"]

_NAME = "fxstream-bench"
_TOP = 12
# A frame as `jfr print` writes it: "package.Class.method(args) line: N".
_FRAME = re.compile(r"^\s{4}(?P<method>[^\s(]+)\(")
_THREAD = re.compile(r'^\s{2}sampledThread = "(?P<name>[^"]*)"')
_HANDLER = re.compile(r"^kafka\.server\.KafkaApis\.handle(?P<api>\w+?)(?:Request)?$")
# An area is counted once per sample when any frame's method starts with one of its
# prefixes (a sample may count in several areas).
_AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TLS", ("sun.security.ssl.", "javax.net.ssl.")),
    ("ciphers (AES-GCM, SHA)", ("com.sun.crypto.", "sun.security.provider.", "javax.crypto.")),
    ("authorisation (ACLs)", ("kafka.server.AuthHelper", "org.apache.kafka.metadata.authorizer.")),
    ("the log (append, read)", ("org.apache.kafka.storage.internals.log.", "kafka.log.")),
    ("record validation", ("org.apache.kafka.storage.internals.log.LogValidator",)),
    (
        "transactions",
        ("org.apache.kafka.coordinator.transaction.", "kafka.coordinator.transaction."),
    ),
    ("group coordinator", ("org.apache.kafka.coordinator.group.", "kafka.coordinator.group.")),
    ("replica manager", ("kafka.server.ReplicaManager",)),
    ("network I/O", ("org.apache.kafka.common.network.", "sun.nio.")),
    ("metrics", ("org.apache.kafka.common.metrics.", "com.yammer.metrics.")),
    ("Scala collections", ("scala.collection.",)),
)
_THREAD_GROUPS: tuple[tuple[str, str], ...] = (
    ("data-plane-kafka-request-handler", "request handlers"),
    ("data-plane-kafka-network-thread", "network threads"),
    ("data-plane", "data plane, other"),
    ("TxnMarkerSenderThread", "transaction markers"),
    ("group-coordinator", "group coordinator"),
    ("transaction-coordinator", "transaction coordinator"),
    ("controller", "controller"),
    ("kafka-", "other kafka threads"),
)


def _thread_group(name: str) -> str:
    for prefix, group in _THREAD_GROUPS:
        if name.startswith(prefix):
            return group
    return "other"


def _shares(counts: Counter[str], total: int, top: int | None = None) -> dict[str, float]:
    return {name: round(100.0 * n / total, 1) for name, n in counts.most_common(top)}


def summarise_jfr_text(text: str) -> dict[str, Any]:
    """Sample counts of ``jfr print --events jdk.ExecutionSample`` output, as shares (%)
    of all samples: ``threads``, ``apis`` (whose ``KafkaApis`` handler is on the stack),
    ``areas`` (anywhere on the stack), ``top_self`` (the method on top)."""
    threads: Counter[str] = Counter()
    apis: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    top_self: Counter[str] = Counter()
    samples = 0
    thread = ""
    frames: list[str] = []

    def finish() -> None:
        nonlocal samples
        if not frames:
            return
        samples += 1
        threads[_thread_group(thread)] += 1
        top_self[frames[0]] += 1
        for method in frames:
            found = _HANDLER.match(method)
            if found is not None and found.group("api") not in ("", "Request"):
                apis[found.group("api")] += 1
                break
        for area, prefixes in _AREAS:
            if any(method.startswith(prefixes) for method in frames):
                areas[area] += 1

    for line in text.splitlines():
        if line.startswith("jdk.ExecutionSample"):
            finish()
            thread, frames = "", []
            continue
        named = _THREAD.match(line)
        if named is not None:
            thread = named.group("name")
            continue
        frame = _FRAME.match(line)
        if frame is not None:
            frames.append(frame.group("method"))
    finish()
    total = max(samples, 1)
    return {
        "samples": samples,
        "threads": _shares(threads, total),
        "apis": _shares(apis, total),
        "areas": _shares(areas, total),
        "top_self": _shares(top_self, total, _TOP),
    }


class BrokerRecording:
    """A JFR recording of one broker JVM, from :meth:`start` to :meth:`stop`."""

    def __init__(self, broker_pid: int, path: Path) -> None:
        """``path``: where the recording is written (kept: open it in JDK Mission
        Control for more than the summary). Raises RuntimeError if ``jcmd`` is missing."""
        jcmd, jfr = shutil.which("jcmd"), shutil.which("jfr")
        if jcmd is None or jfr is None:
            raise RuntimeError("the JDK's `jcmd` and `jfr` are needed on PATH for --broker-jfr")
        self._jcmd, self._jfr = jcmd, jfr
        self._pid = broker_pid
        self.path = path

    def _command(self, *args: str) -> None:
        done = subprocess.run(
            [self._jcmd, str(self._pid), *args], capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0 or "Could not" in done.stdout:
            raise RuntimeError(f"jcmd {' '.join(args)}: {(done.stdout + done.stderr).strip()}")

    def start(self) -> None:
        """Start sampling (the ``profile`` settings)."""
        self._command("JFR.start", f"name={_NAME}", "settings=profile")

    def stop(self) -> dict[str, Any]:
        """Stop, write the recording to :attr:`path` and return its summary."""
        self._command("JFR.stop", f"name={_NAME}", f"filename={self.path}")
        path = str(self.path)
        printed = subprocess.run(
            [self._jfr, "print", "--events", "jdk.ExecutionSample", "--stack-depth", "64", path],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return summarise_jfr_text(printed.stdout)
