"""How ops hands Kafka principals to the processes it starts: files named in the
environment, never a secret on a command line (no broker needed)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from fxstream.ops.private import private_config
from fxstream.ops.services import KAFKA_CREDENTIALS_ENV, Credentials, ServiceSet
from fxstream.sdk import ClientSettings
from fxstream.topics import ROUTING_KEYS_ENV, KafkaConnection, write_secret_file


def _secure(tmp_path: Path, username: str) -> KafkaConnection:
    ca = tmp_path / "ca.pem"
    ca.write_text("the platform's CA certificate (only its path is used here)\n")
    return KafkaConnection("127.0.0.1:9", username, f"{username}-password", ca)


def test_service_processes_are_named_their_credentials_file_not_given_the_secret(
    tmp_path: Path,
) -> None:
    services = ServiceSet(private_config(tmp_path / "home"))
    named = {
        child.key: child.env.get(KAFKA_CREDENTIALS_ENV)
        for child in services.supervisor_spec().children
    }
    # The processors act as fxstream-service; the API manages accounts, as the admin.
    for role in ("router", "task-state", "liveness", "ingress", "trigger", "dependencies"):
        assert named[role] == str(services.service_credentials_file)
    assert named["api"] == str(services.api_credentials_file)
    text = json.dumps([(c.argv, c.env) for c in services.supervisor_spec().children])
    # The API is given the admin token's file by path (--admin-token-file), never a token.
    assert "password" not in text and "token" not in text.replace("--admin-token-file", "")


def test_the_users_credentials_file_holds_the_sdk_keys_owner_only(tmp_path: Path) -> None:
    kafka = _secure(tmp_path, "u.u-1")
    credentials = Credentials("http://svc:1", kafka, "fx.", "u-1", "token", "redis://r:1")
    # Neither secret is in a repr, so neither reaches a log line.
    assert "'token'" not in repr(credentials) and "u.u-1-password" not in repr(credentials)
    path = tmp_path / "credentials.json"
    credentials.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Credentials.load(path) == credentials
    settings = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})
    assert settings.kafka == kafka and settings.token == "token"


def test_a_credentials_file_of_the_older_layout_is_still_loaded(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    old = {
        "service_url": "http://svc:1",
        "bootstrap_servers": "k:1",
        "topic_prefix": "fx.",
        "user_id": "u-1",
        "token": "token",
        "store_url": None,
    }
    write_secret_file(path, json.dumps(old).encode())
    loaded = Credentials.load(path)
    assert loaded is not None and loaded.kafka == KafkaConnection("k:1")


def test_only_the_router_and_the_ingress_are_named_the_routing_keys_file(tmp_path: Path) -> None:
    services = ServiceSet(private_config(tmp_path / "home"))
    named = {
        child.key: child.env.get(ROUTING_KEYS_ENV) for child in services.supervisor_spec().children
    }
    assert services.routing_keys_file == tmp_path / "home" / "credentials" / "routing-keys.json"
    for role in ("router", "ingress"):
        assert named[role] == str(services.routing_keys_file)
    for key in ("api", "endpoint", "task-state", "liveness", "trigger", "dependencies"):
        assert named[key] is None, key
