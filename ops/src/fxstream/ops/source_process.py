"""An ``fxstream-source`` command (a file watcher, the Parquet sink, ...) as a process of ours.

``./fx bench trigger`` and ``./fx demo beamline`` both run connectors next to a platform
as their own processes, the way an operator would: :func:`start_source_process` starts
``fxstream-source <command> ...`` with the platform's Kafka (a credentials file through the
environment on the secure platform, never on the command line; ``--bootstrap`` on the
insecure one) and its topic prefix, tied to the caller (it dies with it), logging to a
file, and returns once the process printed its ready line. The caller stops it by PID
(:meth:`~fxstream.ops.process.ManagedProcess.stop`: SIGTERM, which makes a source commit
what it took and the sink flush and commit, then SIGKILL after a grace).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from fxstream.connectors.source_cli import READY_LINE
from fxstream.ops.process import ManagedProcess, ProcessStartError, tail
from fxstream.ops.services import KAFKA_CREDENTIALS_ENV
from fxstream.topics import KafkaConnection

__all__ = ["READY_S", "start_source_process"]

READY_S: Final = 60.0
"""How long a source command may take to print its ready line."""


def start_source_process(
    name: str,
    command: Sequence[str],
    *,
    kafka: KafkaConnection,
    credentials_file: Path | None,
    prefix: str,
    run_dir: Path,
    ready_s: float = READY_S,
) -> ManagedProcess:
    """Start ``fxstream-source <command>`` (e.g. ``["watch", DIR, "--source", S]``) and
    wait for its ready line.

    On a secure ``kafka`` the process gets ``credentials_file`` (a 0600 Kafka credentials
    file: its principal is the one the process acts as) through
    ``FXSTREAM_KAFKA_CREDENTIALS``; on an insecure one, ``--bootstrap``. Its PID file and
    log are ``run_dir/<name>.pid`` and ``.log`` (``name`` without spaces). Raises
    :class:`~fxstream.ops.process.ProcessStartError` with the log's tail if it exits or is
    not ready within ``ready_s`` (it is stopped first).
    """
    argv = [sys.executable, "-m", "fxstream.connectors.source_cli", *command, "--prefix", prefix]
    env = dict(os.environ)
    env.pop(KAFKA_CREDENTIALS_ENV, None)
    if kafka.secure:
        if credentials_file is None:
            raise ValueError(f"{name}: the secure platform's Kafka needs a credentials file")
        env[KAFKA_CREDENTIALS_ENV] = str(credentials_file)
    else:
        argv += ["--bootstrap", kafka.bootstrap]
    key = name.replace(" ", "-")
    process = ManagedProcess(
        name=name,
        argv=argv,
        pid_file=run_dir / f"{key}.pid",
        log_file=run_dir / f"{key}.log",
        env=env,
        die_with_parent=True,
    )
    # The log is appended to: look for the ready line only in what this start writes.
    offset = process.log_file.stat().st_size if process.log_file.exists() else 0
    process.start()
    deadline = time.monotonic() + ready_s
    while True:
        with process.log_file.open("rb") as log:
            log.seek(offset)
            if READY_LINE.encode() in log.read():
                return process
        if not process.is_running():
            raise ProcessStartError(
                f"{name} exited during start-up; last lines of {process.log_file}:\n"
                f"{tail(process.log_file)}"
            )
        if time.monotonic() > deadline:
            process.stop()
            raise ProcessStartError(
                f"{name} was not ready within {ready_s:.0f} s; last lines of "
                f"{process.log_file}:\n{tail(process.log_file)}"
            )
        time.sleep(0.1)
