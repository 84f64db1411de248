"""The routing keys reach the router and the ingress as a 0600 file, and nothing starts
without one; the remedy each refusal names works (real processes, real broker)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxstream.service.routing_keys import RoutingKeysUnavailable, routing_keys_for
from fxstream.topics import ROUTING_KEYS_ENV, Catalogue, KafkaConnection, read_routing_keys
from tests.conftest import RunningPlatform, write_kafka_credentials

SERVICE = Path(sys.executable).parent / "fxstream-service"
START_S = 60.0


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SERVICE), *args], capture_output=True, text=True, env=env, timeout=120
    )


def _worker_env(credentials: Path, keys: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ROUTING_KEYS_ENV}
    env["FXSTREAM_KAFKA_CREDENTIALS"] = str(credentials)
    if keys is not None:
        env[ROUTING_KEYS_ENV] = str(keys)
    return env


def test_the_roles_without_keys_never_open_the_file(tmp_path: Path) -> None:
    assert routing_keys_for(("task-state", "liveness"), tmp_path / "missing.json") is None
    with pytest.raises(RoutingKeysUnavailable, match="--routing-keys FILE or \\$FXSTREAM_"):
        routing_keys_for(("router",), None)


def test_the_keys_command_makes_rotates_and_retires_showing_only_key_ids(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "routing-keys.json"
    made = _run("routing-keys", str(path))
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = read_routing_keys(path)
    assert f"signing key {first.signing.key_id}; also accepted: none" in made.stdout
    assert _run("routing-keys", str(path)).stdout == made.stdout  # kept, not replaced

    rotated = _run("routing-keys", str(path), "--rotate")
    assert rotated.returncode == 0, rotated.stderr
    keys = read_routing_keys(path)
    assert keys.retired == (first.signing,)
    assert f"also accepted: {first.signing.key_id}" in rotated.stdout
    refused = _run("routing-keys", str(path), "--retire", keys.signing.key_id)
    assert refused.returncode == 1 and "rotate first" in refused.stdout + refused.stderr
    retired = _run("routing-keys", str(path), "--retire", first.signing.key_id)
    assert retired.returncode == 0, retired.stderr
    assert read_routing_keys(path).key_ids == (keys.signing.key_id,)
    # The secrets are in the file only: never printed.
    for run in (made, rotated, retired):
        for key in (first.signing, keys.signing):
            assert key.secret.hex() not in run.stdout + run.stderr
            encoded = json.loads(path.read_text())["keys"].get(key.key_id, "never-printed")
            assert encoded not in run.stdout + run.stderr


def test_a_worker_without_readable_keys_stops_saying_what_to_do_and_the_remedy_works(
    kafka_platform: RunningPlatform, catalogue: Catalogue, tmp_path: Path
) -> None:
    kafka: KafkaConnection = kafka_platform.kafka
    credentials = write_kafka_credentials(kafka, tmp_path / "kafka.json")
    keys = tmp_path / "routing-keys.json"
    worker = ("worker", "--prefix", catalogue.prefix, "--only", "ingress")

    # No file named at all.
    nothing = _run(*worker, env=_worker_env(credentials, None))
    assert nothing.returncode == 1
    assert f"--routing-keys FILE or ${ROUTING_KEYS_ENV}" in nothing.stdout + nothing.stderr
    # A file named that does not exist: the message says how to make one.
    missing = _run(*worker, env=_worker_env(credentials, keys))
    said = missing.stdout + missing.stderr
    assert missing.returncode == 1, said
    assert f"no credentials file at {keys}" in said
    assert "fxstream-service routing-keys FILE" in said
    # The same for the processors' own entry point (tests and development run it).
    module = subprocess.run(
        [sys.executable, "-m", "fxstream.service.processors", "--prefix", catalogue.prefix],
        capture_output=True,
        text=True,
        env=_worker_env(credentials, keys),
        timeout=120,
    )
    assert module.returncode == 2 and "fxstream-service routing-keys FILE" in module.stderr

    # The remedy: make the file as the message says.
    assert _run("routing-keys", str(keys)).returncode == 0
    # Readable by others: refused with the chmod to run.
    keys.chmod(0o640)
    loose = _run(*worker, env=_worker_env(credentials, keys))
    assert loose.returncode == 1 and f"chmod 600 {keys}" in loose.stdout + loose.stderr
    keys.chmod(0o600)

    # Now it starts, and says which key it accepts (its id, never the key).
    log_path = tmp_path / "ingress.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(SERVICE), *worker],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_worker_env(credentials, keys),
        )
    try:
        loaded = read_routing_keys(keys)
        deadline = time.monotonic() + START_S
        while f"accepting routing stamps of keys {loaded.signing.key_id}" not in (
            log_path.read_text(errors="replace")
        ):
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        # No key on its command line or in its environment: a path only.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        secret = json.loads(keys.read_text())["keys"][loaded.signing.key_id].encode()
        assert secret not in cmdline and secret not in environ
        assert loaded.signing.secret.hex() not in log_path.read_text(errors="replace")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, log_path.read_text(errors="replace")[-3000:]
