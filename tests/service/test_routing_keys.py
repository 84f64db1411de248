"""The routing keys reach the router and the ingress as a 0600 file, and nothing starts
without one; the remedy each refusal names works (real processes, real broker). A running
router or ingress re-reads the file when it changes (``RoutingKeyFile``, real files on
disk): a rotation is picked up within about a second, and a bad new file keeps the last
good keys and is logged."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxstream.service.routing_keys import (
    CHECK_INTERVAL_S,
    RoutingKeyFile,
    RoutingKeysUnavailable,
    routing_keys_for,
)
from fxstream.topics import (
    ROUTING_KEYS_ENV,
    Catalogue,
    KafkaConnection,
    RoutingKeys,
    ensure_routing_keys,
    read_routing_keys,
    write_routing_keys,
    write_secret_file,
)
from tests.conftest import RunningPlatform, write_kafka_credentials

SERVICE = Path(sys.executable).parent / "fxstream-service"
START_S = 60.0


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SERVICE), *args], capture_output=True, text=True, env=env, timeout=120
    )


def write_loose(path: Path, keys: RoutingKeys) -> None:
    """Replace ``path`` (by rename, as the keys command does) with ``keys`` in a file that
    group and others may read."""
    temp = path.with_name(f".{path.name}.loose")
    temp.write_text(keys.to_json())
    temp.chmod(0o644)
    os.replace(temp, path)


def after_a_look(keys_file: RoutingKeyFile) -> RoutingKeys:
    """The keys once the rate limit lets ``keys_file`` look at its file again."""
    time.sleep(CHECK_INTERVAL_S + 0.05)
    return keys_file.current()


def secrets_of(*rings: RoutingKeys) -> list[str]:
    """Every way a key of ``rings`` could be written: hex, and the file's base64url."""
    return [
        text
        for ring in rings
        for key in (ring.signing, *ring.retired)
        for text in (key.secret.hex(), base64.urlsafe_b64encode(key.secret).decode())
    ]


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


def test_a_rotation_is_picked_up_within_a_second_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "routing-keys.json"
    old = ensure_routing_keys(path)
    caplog.set_level(logging.INFO, logger="fxstream.service.routing_keys")
    began = time.monotonic()
    keys_file = RoutingKeyFile(path)
    assert keys_file.current() == old
    rotated = old.rotated()
    write_routing_keys(path, rotated)  # what `routing-keys --rotate` does
    seen = keys_file.current()
    if time.monotonic() - began < CHECK_INTERVAL_S:
        assert seen == old  # looked at most once a second: not yet
    written = time.monotonic()
    while keys_file.current() != rotated:
        assert time.monotonic() - written < CHECK_INTERVAL_S + 2, "the rotation was not read"
        time.sleep(0.02)
    assert keys_file.keys.signing == rotated.signing  # the router signs with the new key
    assert keys_file.keys.key_ids == (rotated.signing.key_id, old.signing.key_id)
    assert (
        f"routing keys re-read from {path}: signing key {rotated.signing.key_id}; "
        f"also accepted: {old.signing.key_id}"
    ) in caplog.text

    # The keys command itself, as an operator runs it: picked up the same way.
    again = _run("routing-keys", str(path), "--rotate")
    assert again.returncode == 0, again.stderr
    latest = read_routing_keys(path)
    assert after_a_look(keys_file) == latest and latest.signing != rotated.signing
    assert not any(secret in caplog.text for secret in secrets_of(old, latest))


def test_a_broken_loose_or_missing_new_file_keeps_the_last_good_keys_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "routing-keys.json"
    good = ensure_routing_keys(path)
    keys_file = RoutingKeyFile(path)
    caplog.set_level(logging.INFO, logger="fxstream.service.routing_keys")
    still = f"still using the last good keys (signing {good.signing.key_id}"

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]

    # Not JSON.
    write_secret_file(path, b'{"signing": "k1", "keys": ')
    assert after_a_look(keys_file) == good
    assert len(errors()) == 1 and "is not a JSON credentials file" in errors()[0], errors()
    assert still in errors()[0]
    assert after_a_look(keys_file) == good
    assert len(errors()) == 1, "an unchanged bad file is logged once, not every second"

    # JSON, but not a keys file (no keys).
    write_secret_file(path, json.dumps({"signing": "nope", "keys": {}}).encode())
    assert after_a_look(keys_file) == good
    assert "is not a routing keys file" in errors()[-1] and still in errors()[-1]

    # A valid ring, but readable by others: refused as at start, its keys never used.
    loose = RoutingKeys.generate()
    write_loose(path, loose)
    assert after_a_look(keys_file) == good
    assert f"run `chmod 600 {path}`" in errors()[-1] and still in errors()[-1]

    # Gone.
    path.unlink()
    assert after_a_look(keys_file) == good
    assert f"cannot stat {path}" in errors()[-1] and still in errors()[-1]
    assert len(errors()) == 4

    # Fixed: the new good file is read, and says so.
    fixed = good.rotated()
    write_routing_keys(path, fixed)
    assert after_a_look(keys_file) == fixed
    assert f"signing key {fixed.signing.key_id}" in caplog.text
    assert len(errors()) == 4
    assert not any(secret in caplog.text for secret in secrets_of(good, loose, fixed))


def test_routing_keys_for_names_a_file_that_is_re_read(tmp_path: Path) -> None:
    path = tmp_path / "routing-keys.json"
    made = ensure_routing_keys(path)
    keys_file = routing_keys_for(("router", "task-state"), path)
    assert isinstance(keys_file, RoutingKeyFile) and keys_file.path == path
    assert keys_file.current() == made
    write_routing_keys(path, RoutingKeys(made.rotated().signing))
    assert after_a_look(keys_file).key_ids != made.key_ids
