"""Client settings from FXSTREAM_* variables and the credentials file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxstream.sdk import DEFAULT_MAX_INLINE_BYTES, Client, ClientSettings, ConfigurationError

FULL = {
    "service_url": "http://svc:19180",
    "bootstrap_servers": "kafka:9092",
    "topic_prefix": "prod.",
    "user_id": "u-1",
    "token": "secret",
}


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
        bootstrap_servers="b:2",
        topic_prefix="fx.",
        user_id="u-2",
        token="t",
        max_inline_bytes=4096,
    )


def test_the_credentials_file_and_variables_overriding_it(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps(FULL))
    from_file = ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})
    assert from_file == ClientSettings(**FULL, max_inline_bytes=DEFAULT_MAX_INLINE_BYTES)

    overridden = ClientSettings.from_environment(
        {"FXSTREAM_CREDENTIALS": str(path), "FXSTREAM_TOKEN": "newer", "FXSTREAM_BOOTSTRAP": ""}
    )
    assert overridden.token == "newer"
    assert overridden.bootstrap_servers == "kafka:9092"  # an empty variable does not override


def test_client_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps(FULL))
    with Client.from_environment({"FXSTREAM_CREDENTIALS": str(path)}) as client:
        assert client.service_url == "http://svc:19180"
        assert client.bootstrap_servers == "kafka:9092"
        assert client.catalogue.prefix == "prod."
        assert client.user_id == "u-1"
        assert client.catalogue.results(client.user_id) == "prod.results.u-1"


def test_missing_settings_are_named() -> None:
    with pytest.raises(ConfigurationError) as caught:
        ClientSettings.from_environment({"FXSTREAM_SERVICE_URL": "http://a:1"})
    assert "FXSTREAM_BOOTSTRAP" in str(caught.value)
    assert "FXSTREAM_CREDENTIALS" in str(caught.value)
    with pytest.raises(ConfigurationError, match="FXSTREAM_SERVICE_URL"):
        ClientSettings.from_environment({})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({**FULL, "pasword": "x"}), "unknown keys"),
        (json.dumps({**FULL, "max_inline_bytes": "lots"}), "positive number of bytes"),
    ],
)
def test_bad_credentials_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "credentials.json"
    path.write_text(content)
    with pytest.raises(ConfigurationError, match=message):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(path)})


def test_an_unreadable_credentials_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigurationError, match=r"nope\.json"):
        ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(missing)})
