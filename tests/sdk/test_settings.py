"""Client settings from FXSTREAM_* variables and the credentials file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from fxstream.sdk import (
    DEFAULT_MAX_INLINE_BYTES,
    Client,
    ClientSettings,
    ConfigurationError,
    Executor,
)
from fxstream.topics import KafkaConnection, write_secret_file

FULL = {
    "service_url": "http://svc:19180",
    "bootstrap": "kafka:9092",
    "topic_prefix": "prod.",
    "user_id": "u-1",
    "token": "secret",
}


def _write(path: Path, fields: Mapping[str, object] | str) -> Path:
    """A credentials file as fxstream writes it: readable by its owner only."""
    text = fields if isinstance(fields, str) else json.dumps(fields)
    write_secret_file(path, text.encode())
    return path


def test_variables_alone() -> None:
    settings = ClientSettings.from_environment(
        {
            "FXSTREAM_SERVICE_URL": "http://a:1",
            "FXSTREAM_BOOTSTRAP": "b:2",
            "FXSTREAM_USER_ID": "u-2",
            "FXSTREAM_TOKEN": "t",
            "FXSTREAM_MAX_INLINE_BYTES": "4096",
        }
    )
    assert settings == ClientSettings(
        service_url="http://a:1",
        kafka=KafkaConnection("b:2"),
        topic_prefix="fx.",
        user_id="u-2",
        token="t",
        max_inline_bytes=4096,
    )


def test_the_credentials_file_and_variables_overriding_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "credentials.json", FULL)
    from_file = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})
    assert from_file == ClientSettings(
        service_url="http://svc:19180",
        kafka=KafkaConnection("kafka:9092"),
        topic_prefix="prod.",
        user_id="u-1",
        token="secret",
        max_inline_bytes=DEFAULT_MAX_INLINE_BYTES,
    )

    overridden = ClientSettings.from_environment(
        {"FXSTREAM_CREDENTIALS": str(path), "FXSTREAM_TOKEN": "newer", "FXSTREAM_BOOTSTRAP": ""}
    )
    assert overridden.token == "newer"
    assert overridden.kafka.bootstrap == "kafka:9092"  # an empty variable does not override


def test_the_kafka_principal_comes_from_the_credentials_file(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("the platform's CA certificate (only its path is used here)\n")
    secure = {
        **FULL,
        "kafka_username": "u.u-1",
        "kafka_password": "kafka-secret",
        "kafka_ca_file": str(ca),
    }
    path = _write(tmp_path / "credentials.json", secure)
    settings = ClientSettings.from_environment(
        {"FXSTREAM_CREDENTIALS": str(path), "FXSTREAM_BOOTSTRAP": "other:9093"}
    )
    assert settings.kafka == KafkaConnection("other:9093", "u.u-1", "kafka-secret", ca)
    config = settings.kafka.confluent()
    assert config["security.protocol"] == "SASL_SSL"
    assert config["sasl.username"] == "u.u-1"
    assert "kafka-secret" not in repr(settings)  # never in a repr, so never in a log line
    with Client.from_settings(settings) as client:
        assert "kafka-secret" not in repr(client)
    # A username without its password or CA is refused, naming what is missing.
    _write(path, {**FULL, "kafka_username": "u.u-1"})
    with pytest.raises(ConfigurationError, match="kafka_password"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})
    _write(path, {**secure, "kafka_ca_file": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigurationError, match="kafka_ca_file"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})


def test_a_credentials_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "credentials.json", FULL)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match=f"chmod 600 {path}"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})


def test_client_from_environment(tmp_path: Path) -> None:
    path = _write(tmp_path / "credentials.json", FULL)
    with Client.from_environment({"FXSTREAM_CREDENTIALS": str(path)}) as client:
        assert client.service_url == "http://svc:19180"
        assert client.kafka == KafkaConnection("kafka:9092")
        assert client.catalogue.prefix == "prod."
        assert client.user_id == "u-1"
        assert client.catalogue.results(client.user_id) == "prod.results.u-1"


def test_missing_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        ClientSettings.from_environment({"FXSTREAM_SERVICE_URL": "http://a:1"})
    assert "FXSTREAM_BOOTSTRAP" in str(caught.value)
    assert "FXSTREAM_CREDENTIALS" in str(caught.value)
    # No platform home with credentials in it: the error names where `./fx up` puts them.
    empty = {"FXSTREAM_HOME": str(tmp_path / "no-platform")}
    with pytest.raises(ConfigurationError, match="FXSTREAM_SERVICE_URL") as caught:
        ClientSettings.from_environment(empty)
    assert str(tmp_path / "no-platform" / "credentials.json") in str(caught.value)


def test_the_credentials_fx_up_wrote_are_found_without_any_setting(tmp_path: Path) -> None:
    # ./fx up writes <home>/credentials.json; home is FXSTREAM_HOME, else
    # $XDG_STATE_HOME/fxstream (else ~/.local/state/fxstream).
    _write(tmp_path / "state" / "fxstream" / "credentials.json", FULL)
    found = ClientSettings.from_environment({"XDG_STATE_HOME": str(tmp_path / "state")})
    assert found.service_url == FULL["service_url"] and found.user_id == "u-1"
    _write(tmp_path / "home" / "credentials.json", {**FULL, "user_id": "u-2"})
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "FXSTREAM_HOME": str(tmp_path / "home")}
    assert ClientSettings.from_environment(env).user_id == "u-2"
    # Configured by variables: the file is not mixed in.
    with pytest.raises(ConfigurationError, match="FXSTREAM_BOOTSTRAP"):
        ClientSettings.from_environment({**env, "FXSTREAM_SERVICE_URL": "http://other:1"})


def test_client_and_executor_without_arguments_find_the_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in [v for v in os.environ if v.startswith("FXSTREAM_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("FXSTREAM_HOME", str(tmp_path))
    _write(tmp_path / "credentials.json", FULL)
    with Client() as client:  # Globus Compute's Client(): nothing to pass
        assert client.service_url == FULL["service_url"]
        assert client.kafka == KafkaConnection("kafka:9092")
        assert client.catalogue.prefix == "prod." and client.user_id == "u-1"
    executor = Executor("ep-1")
    try:
        assert executor.client.service_url == FULL["service_url"]
    finally:
        executor.shutdown()
    with pytest.raises(ConfigurationError, match="both service_url and kafka, or neither"):
        Client("http://svc:1")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not a JSON credentials file"),
        ("[1, 2]", "JSON object"),
        (json.dumps({**FULL, "pasword": "x"}), "unknown keys"),
        (json.dumps({**FULL, "max_inline_bytes": "lots"}), "positive number of bytes"),
    ],
)
def test_bad_credentials_files(tmp_path: Path, content: str, message: str) -> None:
    path = _write(tmp_path / "credentials.json", content)
    with pytest.raises(ConfigurationError, match=message):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})


def test_a_file_of_the_older_layout_says_what_changed(tmp_path: Path) -> None:
    old = {**{k: v for k, v in FULL.items() if k != "bootstrap"}, "bootstrap_servers": "k:1"}
    path = _write(tmp_path / "credentials.json", old)
    with pytest.raises(ConfigurationError, match="'bootstrap_servers' is now 'bootstrap'"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})


def test_an_unreadable_credentials_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigurationError, match=r"nope\.json"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(missing)})
